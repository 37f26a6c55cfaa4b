"""Replication slots, server facts, and the checks that say what is wrong with a source and how to fix it."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import psycopg
import psycopg2
import psycopg2.extensions
import psycopg2.extras

from pgcdc.errors import ConfigError, ProtocolError
from pgcdc.lsn import Lsn
from pgcdc.replication.options import CLIENT_ENCODING, quote_ident, with_session_settings

log = logging.getLogger(__name__)
T = TypeVar("T")
_temporary_names = itertools.count(1)


@dataclass(frozen=True)
class SlotInfo:
    name: str
    plugin: str | None
    database: str | None
    active: bool
    active_pid: int | None
    restart_lsn: Lsn | None
    confirmed_flush_lsn: Lsn | None
    wal_status: str | None
    two_phase: bool
    invalidation_reason: str | None

    @property
    def invalidated(self) -> bool:
        return self.wal_status == "lost" or self.invalidation_reason is not None


@dataclass(frozen=True)
class CreatedSlot:
    """A slot just created; ``snapshot_name`` is usable (SET TRANSACTION SNAPSHOT) while the context is open."""

    name: str
    consistent_point: Lsn
    snapshot_name: str | None

    @property
    def exported_snapshot(self) -> str:
        """The exported snapshot's name; only slots created with ``export_snapshot`` have one."""
        if self.snapshot_name is None:
            raise ProtocolError(f"slot {self.name} was created without an exported snapshot")
        return self.snapshot_name


@dataclass(frozen=True)
class SourceProblem:
    what: str
    fix: str
    warning: bool = False  # worth knowing, but pgcdc works: the source is ready all the same


@dataclass(frozen=True)
class ServerInfo:
    version_num: int
    wal_level: str
    system_identifier: str
    current_lsn: Lsn
    database: str
    user: str


_SLOT_NAME_CHARACTERS = set("abcdefghijklmnopqrstuvwxyz0123456789_")


def slot_name_problem(name: str) -> str | None:
    """Why PostgreSQL would refuse ``name`` for a replication slot, or None: checked before any connection."""
    if not name or not set(name) <= _SLOT_NAME_CHARACTERS or len(name) > 63:
        return f"slot {name!r}: replication slot names are 1-63 lower-case letters, digits and _"
    return None


def _lsn(text: str | None) -> Lsn | None:
    return Lsn.parse(text) if text else None


def server_info(dsn: str) -> ServerInfo:
    with psycopg.connect(dsn, autocommit=True, application_name="pgcdc",
                         client_encoding=CLIENT_ENCODING) as conn:
        row = conn.execute(
            "SELECT current_setting('server_version_num')::int, current_setting('wal_level'), "
            "(SELECT system_identifier::text FROM pg_control_system()), pg_current_wal_lsn()::text, "
            "current_database(), current_user").fetchone()
    assert row is not None
    return ServerInfo(row[0], row[1], row[2], Lsn.parse(row[3]), row[4], row[5])


# A replication connection must notice a silent network partition (no FIN, no RST) on its own: without
# these, a read waits forever while the slot's WAL piles up. Set in the DSN to override.
LIVENESS_DEFAULTS = {"connect_timeout": "10", "keepalives": "1", "keepalives_idle": "10",
                     "keepalives_interval": "5", "keepalives_count": "3", "tcp_user_timeout": "30000"}


@contextlib.contextmanager
def deadline(fileno: int, seconds: float, *, what: str) -> Iterator[None]:
    """Bound everything done on an open connection by ``seconds``. ``connect_timeout`` covers only the
    connect, and TCP keepalives see nothing wrong when a middlebox stops forwarding (its own kernel answers):
    a query sent just before such a silent partition would wait forever. When the time is up the socket is
    shut down, so the blocked call fails at once with a connection error."""
    lock = threading.Lock()
    done = False

    def cut() -> None:
        with lock:
            if done:
                return
            with contextlib.suppress(OSError):
                sock = socket.socket(fileno=os.dup(fileno))
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                finally:
                    sock.close()  # closes the duplicate only; the connection's own descriptor stays valid
            log.warning("%s took longer than %.0fs: connection cut", what, seconds)

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:  # after this the descriptor may be closed and reused: the timer must never touch it
            done = True
        timer.cancel()


@contextlib.contextmanager
def source_connection(dsn: str, timeout: float = 120.0) -> Iterator[psycopg.Connection]:
    """An ordinary connection for catalog and status queries, its whole use bounded by ``timeout`` seconds:
    a server behind a silent partition must not stall its caller forever. It has pgcdc's session settings:
    values the catalog gives as text (a column's default for existing rows) read as the stream's do."""
    with _connect(dsn, timeout) as conn, deadline(conn.fileno(), timeout, what="a query to the source"):
        yield conn


def _connect(dsn: str, timeout: float) -> psycopg.Connection:
    params = psycopg.conninfo.conninfo_to_dict(with_session_settings(dsn))
    if "PGCONNECT_TIMEOUT" not in os.environ:  # the operator's bound (pgcdc --connect-timeout) wins
        params.setdefault("connect_timeout", max(1, min(10, int(timeout))))
    return psycopg.connect(psycopg.conninfo.make_conninfo("", **params), autocommit=True)


class KeptConnection:
    """An ordinary connection kept open for a query asked again and again (the catalog read before every batch):
    one opened per query cost the server a backend's start, and the stream that waits for it the handshake, every
    time. Each use is bounded as :func:`source_connection`'s whole use is; a connection found broken (the server
    restarted since its last use) is opened again within the same bound."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.Connection | None = None

    def run(self, query: Callable[[psycopg.Connection], T], timeout: float) -> T:
        started = time.monotonic()
        while True:
            fresh = self._conn is None
            if self._conn is None:
                self._conn = _connect(self._dsn, timeout)
            conn = self._conn
            try:
                with deadline(conn.fileno(), max(0.1, timeout - (time.monotonic() - started)),
                              what="a query to the source"):
                    return query(conn)
            except psycopg.OperationalError:
                self.close()
                if fresh or time.monotonic() - started >= timeout / 2:
                    raise

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


def replication_connection(dsn: str) -> psycopg2.extras.LogicalReplicationConnection:
    """A walsender connection in database mode, with pgcdc's session settings and liveness defaults."""
    given = psycopg.conninfo.conninfo_to_dict(dsn)
    liveness = {k: v for k, v in LIVENESS_DEFAULTS.items() if k not in given}
    if "PGCONNECT_TIMEOUT" in os.environ:  # the operator's bound (pgcdc --connect-timeout) wins
        liveness.pop("connect_timeout", None)
    if str(given.get("host", "")).startswith("/") or (not given.get("host") and not given.get("hostaddr")):
        liveness = {k: v for k, v in liveness.items() if k == "connect_timeout"}  # Unix sockets: no TCP options
    try:
        return psycopg2.connect(with_session_settings(dsn, **liveness),
                                connection_factory=psycopg2.extras.LogicalReplicationConnection)
    except psycopg2.OperationalError as exc:
        refused = _refused_replication(exc)
        if refused is None:
            raise
        raise refused from None


def _refused_replication(exc: psycopg2.OperationalError) -> ConfigError | None:
    """A replication connection refused for a reason a DSN does not fix, told apart from a bad DSN."""
    message = " ".join(str(exc).split())
    lowered = message.lower()
    if "max_wal_senders" in lowered or "wal senders" in lowered:
        return ConfigError(f"every WAL sender of the server is in use ({message}); stop a replication consumer, or "
                           "raise max_wal_senders and restart PostgreSQL")
    if "replication" in lowered and ("pg_hba" in lowered or "permission" in lowered or "must be" in lowered):
        return ConfigError(f"the server refused a replication connection ({message}); grant it: ALTER ROLE "
                           "<user> REPLICATION, and allow 'replication' for this database in pg_hba.conf")
    return None


class SlotManager:
    """Create, inspect and drop logical replication slots using pgoutput."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    @contextlib.contextmanager
    def create(self, name: str, *, two_phase: bool = False, failover: bool = False,
               export_snapshot: bool = True, temporary: bool = False) -> Iterator[CreatedSlot]:
        """Create slot ``name``; with ``export_snapshot`` the context keeps the snapshot usable by other
        sessions until it exits (the creating connection stays open and idle)."""
        conn = replication_connection(self.dsn)
        try:
            version = conn.server_version
            options = [f"SNAPSHOT '{'export' if export_snapshot else 'nothing'}'"]
            if two_phase:
                if version < 150000:
                    raise ConfigError("two-phase decoding needs PostgreSQL 15+; run without two_phase")
                options.append("TWO_PHASE true")
            if failover:
                if version < 170000:
                    raise ConfigError("failover slots need PostgreSQL 17+; run without failover")
                options.append("FAILOVER true")
            if version < 150000:  # the older syntax
                legacy = {"export": "EXPORT_SNAPSHOT", "nothing": "NOEXPORT_SNAPSHOT"}
                option_text = legacy["export" if export_snapshot else "nothing"]
            else:
                option_text = "(" + ", ".join(options) + ")"
            cursor = conn.cursor()
            try:
                cursor.execute(f"CREATE_REPLICATION_SLOT {psycopg2.extensions.quote_ident(name, cursor)} "
                               f"{'TEMPORARY ' if temporary else ''}LOGICAL pgoutput {option_text}")
            except psycopg2.errors.DuplicateObject:
                raise ConfigError(f"replication slot {name!r} already exists; use it, or drop it with "
                                  f"pgcdc slot drop {name}") from None
            except psycopg2.errors.ConfigurationLimitExceeded as exc:
                raise ConfigError(f"cannot create slot {name!r}: {' '.join(str(exc).split())}; drop a slot nothing "
                                  "reads any more (pgcdc slot drop NAME), or raise max_replication_slots and "
                                  "restart PostgreSQL") from None
            except psycopg2.errors.ObjectNotInPrerequisiteState as exc:
                raise ConfigError(f"cannot create slot {name!r}: {' '.join(str(exc).split())}; set "
                                  "wal_level = logical and restart PostgreSQL") from None
            row = cursor.fetchone()
            yield CreatedSlot(row[0], Lsn.parse(row[1]), row[2])
        finally:
            conn.close()

    def create_temporary_snapshot(self) -> contextlib.AbstractContextManager[CreatedSlot]:
        """A temporary slot with an exported snapshot: a consistent point for copying tables added later."""
        name = f"pgcdc_copy_{os.getpid()}_{next(_temporary_names)}"
        return self.create(name, export_snapshot=True, temporary=True)

    def get(self, name: str) -> SlotInfo | None:
        slots = [s for s in self.list() if s.name == name]
        return slots[0] if slots else None

    def list(self) -> list[SlotInfo]:
        with psycopg.connect(self.dsn, autocommit=True, application_name="pgcdc",
                             client_encoding=CLIENT_ENCODING) as conn:
            version = conn.info.server_version
            reason = "invalidation_reason" if version >= 170000 else (
                "CASE WHEN conflicting THEN 'conflicting' END" if version >= 160000 else "NULL")
            two_phase = "two_phase" if version >= 140000 else "false"
            wal_status = "wal_status" if version >= 130000 else "NULL"
            rows = conn.execute(
                f"SELECT slot_name, plugin, database, active, active_pid, restart_lsn::text, "
                f"confirmed_flush_lsn::text, {wal_status}, {two_phase}, {reason} "
                "FROM pg_replication_slots WHERE slot_type = 'logical' ORDER BY slot_name").fetchall()
        return [SlotInfo(r[0], r[1], r[2], bool(r[3]), r[4], _lsn(r[5]), _lsn(r[6]), r[7], bool(r[8]), r[9])
                for r in rows]

    def advance(self, name: str, lsn: Lsn) -> Lsn:
        """Confirm slot ``name`` at ``lsn``: the server frees what lies before it and never sends it again."""
        with source_connection(self.dsn) as conn:
            try:
                row = conn.execute("SELECT end_lsn::text FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
                                   (name, str(lsn))).fetchone()
            except psycopg.errors.ObjectInUse:
                raise ConfigError(f"replication slot {name!r} is in use by another connection; stop that "
                                  "consumer first") from None
        assert row is not None
        return Lsn.parse(row[0])

    def drop(self, name: str, *, wait_seconds: float = 0.0) -> None:
        """Drop slot ``name``; ``wait_seconds`` lets a connection that used it (one just closed: its walsender
        ends a moment later) release it first."""
        give_up = time.monotonic() + wait_seconds
        with psycopg.connect(self.dsn, autocommit=True, application_name="pgcdc",
                             client_encoding=CLIENT_ENCODING) as conn:
            while True:
                try:
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
                    return
                except psycopg.errors.UndefinedObject:
                    raise ConfigError(f"replication slot {name!r} does not exist") from None
                except psycopg.errors.ObjectInUse:
                    if time.monotonic() >= give_up:
                        raise ConfigError(f"replication slot {name!r} is in use by another connection; stop "
                                          "that consumer first") from None
                time.sleep(0.1)

    @contextlib.contextmanager
    def dropped_on_failure(self, name: str, *, backs_mirrors: Callable[[], bool]) -> Iterator[None]:
        """Around the first use of a slot this run creates: when that use fails before any mirror holds a
        position in the slot, drop it again. Left behind, it would hold the server's WAL from here on for a
        mirror that does not exist (the next run creates a new one)."""
        try:
            yield
        except BaseException:
            try:
                needed = backs_mirrors()
            except Exception as exc:  # the failure may be the warehouse's itself: then say how to clean up
                log.warning("slot %s, created by this run, is kept: whether a mirror already streams from it "
                            "cannot be told (%s); if none does, drop it with: pgcdc slot drop %s",
                            name, " ".join(str(exc).split())[:200], name)
                raise
            if not needed:
                try:
                    self.drop(name, wait_seconds=10.0)
                    log.warning("dropped slot %s again: this run created it and failed before any mirror was "
                                "written", name)
                except (ConfigError, psycopg.Error) as exc:
                    log.warning("slot %s, created by this run before it failed, could not be dropped (%s): drop "
                                "it with: pgcdc slot drop %s", name, " ".join(str(exc).split()), name)
            raise

    def refuse_busy(self, slot: SlotInfo | None) -> None:
        """Stop before any work when ``slot`` is streamed by another process: a second run would copy its
        tables, then fail at the stream."""
        if slot is not None and slot.active:
            raise ConfigError(
                f"replication slot {slot.name!r} is in use by another process (pid {slot.active_pid}): another "
                f"pgcdc run or consumer streams it, and only one may; stop that one first, or give this run its "
                f"own --slot")


def _capacity_problems(conn: psycopg.Connection, settings: dict[str, str], slot: str | None
                       ) -> list[SourceProblem]:
    """A full set of replication slots (pgcdc needs one of its own, plus a temporary one to copy tables added
    later) or of WAL senders (one per streaming consumer) makes a run fail at its first connection, with an
    error that reads like a bad DSN: say so here."""
    problems = []
    row = conn.execute(
        "SELECT count(*), count(*) FILTER (WHERE slot_name = %s), "
        "string_agg(slot_name || CASE WHEN active THEN ' (active)' ELSE '' END, ', ' ORDER BY slot_name), "
        "(SELECT count(*) FROM pg_stat_replication) FROM pg_replication_slots", (slot,)).fetchone()
    assert row is not None
    used, own, names, senders = row
    limit = int(settings.get("max_replication_slots", "0"))
    if limit and used + (0 if own else 1) > limit:
        problems.append(SourceProblem(
            f"all {limit} replication slots are taken ({names}); pgcdc cannot create its slot.",
            "drop a slot nothing reads any more (pgcdc slot drop NAME --dsn ...), or raise "
            f"max_replication_slots above {limit} and restart PostgreSQL."))
    senders_limit = int(settings.get("max_wal_senders", "0"))
    if senders_limit and senders >= senders_limit:
        problems.append(SourceProblem(
            f"all {senders_limit} WAL senders are in use; pgcdc's replication connection would be refused.",
            f"stop a replication consumer, or raise max_wal_senders above {senders_limit} and restart "
            "PostgreSQL."))
    return problems


def check_source(dsn: str, *, publication: str, slot: str | None = None) -> list[SourceProblem]:
    """Everything that would stop pgcdc on this source, each with its fix (and what is only worth a warning,
    marked so); nothing that stops it: ready. ``slot`` is the slot pgcdc streams: when it exists already, a full
    set of slots is no problem."""
    problems: list[SourceProblem] = []
    with psycopg.connect(dsn, autocommit=True, application_name="pgcdc check",
                         client_encoding=CLIENT_ENCODING) as conn:
        settings: dict[str, str] = dict(conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('wal_level', 'max_replication_slots', 'max_wal_senders')").fetchall())
        if settings.get("wal_level") != "logical":
            problems.append(SourceProblem(
                f"wal_level is {settings.get('wal_level')!r}; logical decoding needs 'logical'.",
                "ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL."))
        for setting in ("max_replication_slots", "max_wal_senders"):
            if int(settings.get(setting, "0")) == 0:
                problems.append(SourceProblem(f"{setting} is 0.",
                                              f"ALTER SYSTEM SET {setting} = 10; then restart PostgreSQL."))
        problems.extend(_capacity_problems(conn, settings, slot))
        role = conn.execute("SELECT current_user, rolreplication OR rolsuper FROM pg_roles "
                            "WHERE rolname = current_user").fetchone()
        if role is not None and not role[1]:
            problems.append(SourceProblem(f"role {role[0]} lacks the REPLICATION attribute.",
                                          f"ALTER ROLE {quote_ident(role[0])} REPLICATION;"))
        pub = conn.execute("SELECT pubupdate, pubdelete FROM pg_publication WHERE pubname = %s",
                           (publication,)).fetchone()
        if pub is None:
            problems.append(SourceProblem(
                f"publication {publication!r} does not exist in database {conn.info.dbname!r}.",
                f"CREATE PUBLICATION {quote_ident(publication)} FOR TABLE <tables>;  (or FOR ALL TABLES)"))
            return problems
        tables = conn.execute(
            "SELECT n.nspname, c.relname, c.relreplident::text, "
            "EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary), "
            "has_table_privilege(c.oid, 'SELECT') "
            "FROM pg_publication_tables pt JOIN pg_namespace n ON n.nspname = pt.schemaname "
            "JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename "
            "WHERE pt.pubname = %s ORDER BY 1, 2", (publication,)).fetchall()
        if not tables:
            problems.append(SourceProblem(f"publication {publication!r} publishes no tables.",
                                          f"ALTER PUBLICATION {quote_ident(publication)} ADD TABLE <tables>;"))
        for schema, table, identity, has_primary_key, readable in tables:
            qualified = f"{quote_ident(schema)}.{quote_ident(table)}"
            no_identity = identity == "n" or (identity == "d" and not has_primary_key)
            if no_identity and (pub[0] or pub[1]):
                # PostgreSQL publishes such a table and refuses UPDATE and DELETE on it, which an insert-only table
                # (a log, events, an audit trail) never runs: its mirror is append-only
                problems.append(SourceProblem(
                    f"table {schema}.{table} has no replica identity (REPLICA IDENTITY "
                    f"{'NOTHING' if identity == 'n' else 'DEFAULT without a primary key'}): pgcdc mirrors it "
                    "append-only, and PostgreSQL refuses UPDATE and DELETE on it while the publication publishes "
                    "them.",
                    f"nothing, if it is insert-only; otherwise ALTER TABLE {qualified} ADD PRIMARY KEY (...); or "
                    f"ALTER TABLE {qualified} REPLICA IDENTITY FULL; (pgcdc then keys its mirror again by itself)",
                    warning=True))
            if not readable:
                problems.append(SourceProblem(f"the initial copy cannot read {schema}.{table}.",
                                              f"GRANT SELECT ON {qualified} TO {quote_ident(role[0])};"
                                              if role else f"GRANT SELECT ON {qualified} TO <pgcdc's role>;"))
    return problems
