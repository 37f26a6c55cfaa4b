"""Reading a slot: the walsender stream (START_REPLICATION) and the SQL interface, one decoder for both.

The stream reports to the server only what its caller confirmed (``confirm``): the flush
position never runs ahead of what is durable downstream. Keepalives are answered inside
``read_message``; connection loss (server restart, terminated backend, network cut) reconnects
with backoff and resumes from the confirmed position, after a event with ``reconnected`` set that tells
the caller to drop what it had not confirmed (the server sends it again).
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import psycopg
import psycopg2
import psycopg2.errors

from pgcdc.errors import ConfigError, InProgressDecodingFailed, SlotBusyError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput import AnyMessage, MessageDecoder
from pgcdc.replication.options import ReplicationOptions, with_session_settings
from pgcdc.replication.slots import deadline, replication_connection

log = logging.getLogger("pgcdc.replication")

_INTERNAL_ERROR = "XX000"
# how often kept_alive reports to the server: well inside any wal_sender_timeout (60 s by default; tests go low)
KEEPALIVE_SECONDS = 1.0  # SQLSTATE of an error inside the server (its decoder's, for a walsender)


def _connection_lost(exc: BaseException) -> bool:
    """A lost connection (retried) rather than an error the server reported about the request (raised): libpq
    reports a broken COPY stream as a bare DatabaseError without SQLSTATE."""
    if isinstance(exc, psycopg2.OperationalError | psycopg2.InterfaceError | OSError | SlotBusyError):
        return True
    return isinstance(exc, psycopg2.DatabaseError) and getattr(exc, "pgcode", None) is None


class ReplicationEvent(NamedTuple):
    """A decoded message with its XLogData envelope; ``message`` is None for an idle tick."""

    message: AnyMessage | None
    data_start: Lsn
    wal_end: Lsn
    reconnected: bool = False


_event = tuple.__new__
_lsn = int.__new__


class LogicalReplicationStream:
    """``for event in stream.events(): ...`` over a logical slot with pgoutput; see the module docstring."""

    def __init__(self, dsn: str, *, slot: str, options: ReplicationOptions, start_lsn: Lsn | None = None,
                 status_interval: float = 10.0, max_backoff: float = 30.0, max_retries: int | None = None,
                 slot_busy_timeout: float = 180.0, receive_timeout: float = 60.0, raw_changes: bool = False) -> None:
        """``raw_changes``: Inserts, Updates and Deletes come as :class:`~pgcdc.pgoutput.messages.RawChange`
        (checked, their tuple data left as the bytes sent), for a reader that stores them column by column."""
        self.dsn = dsn
        self.raw_changes = raw_changes
        self.slot = slot
        self.options = options
        self.status_interval = status_interval
        self.max_backoff = max_backoff
        self.max_retries = max_retries
        self.slot_busy_timeout = slot_busy_timeout
        self.receive_timeout = receive_timeout
        self._confirmed = start_lsn or Lsn(0)
        self._connection: psycopg2.extensions.connection | None = None
        self._cursor = None
        self._negotiated: dict[str, str] = {}  # the options of the running stream
        self._closed = False
        self.proto_version = 1
        self.server_wal_end: Lsn | None = None
        self._feedback_lock = threading.Lock()  # kept_alive's thread and the caller's confirm may both send

    # -- caller interface ------------------------------------------------------------------------
    @property
    def confirmed(self) -> Lsn:
        return self._confirmed

    def confirm(self, flush_lsn: Lsn) -> None:
        """Everything up to ``flush_lsn`` is durable downstream: tell the server (never goes backwards)."""
        if flush_lsn <= self._confirmed:
            return
        self._confirmed = flush_lsn
        try:
            self._send_feedback(force=True)
        except psycopg2.DatabaseError as exc:
            # the connection is gone: the reader notices and reconnects, starting from this position
            log.debug("feedback not sent (%s); it goes with the reconnection", exc)

    @contextlib.contextmanager
    def kept_alive(self, interval: float = KEEPALIVE_SECONDS) -> Iterator[None]:
        """``with stream.kept_alive():`` around work that keeps the caller from reading the stream for long
        (waiting for a batch to apply, copying a table): a thread of its own sends a standby status update every
        ``interval`` seconds meanwhile, so the server's ``wal_sender_timeout`` never ends a connection whose
        reader is only busy (the server then sends everything after the confirmed position again, and a
        confirmation made meanwhile is lost). The caller must not read the stream inside."""
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    self._send_feedback(force=True)
                except (psycopg2.Error, OSError) as exc:  # the connection is gone: the next read reconnects
                    log.debug("standby status update not sent while busy: %s", exc)
                    return

        thread = threading.Thread(target=beat, name="pgcdc-keepalive", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def close(self) -> None:
        """Send the final flush position and close."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(psycopg2.Error, OSError):
            self._send_feedback(force=True)
        self._disconnect()

    def events(self, idle_timeout: float = 1.0) -> Iterator[ReplicationEvent]:
        """Decoded messages as they arrive, and an idle tick (``message=None``) whenever ``idle_timeout``
        seconds pass without one."""
        failures = 0
        lost_at: float | None = None
        while not self._closed:
            try:
                self._start()
                failures = 0
                lost_at = None
                yield from self._read(idle_timeout)
            except (psycopg2.DatabaseError, psycopg2.InterfaceError, OSError, SlotBusyError) as exc:
                if self._closed:
                    return
                if not _connection_lost(exc):
                    if (getattr(exc, "pgcode", None) == _INTERNAL_ERROR and self._cursor is not None
                            and self._negotiated.get("streaming", "off") != "off"):
                        raise InProgressDecodingFailed(
                            f"the server failed to decode slot {self.slot!r} while streaming transactions in "
                            f"progress: {' '.join(str(exc).split())}") from exc
                    raise
                # After a lost connection the server keeps the old walsender (and the slot) until it notices
                # too (wal_sender_timeout); only then is the slot free again. On a first start it is really
                # another consumer.
                if isinstance(exc, SlotBusyError) and (
                        lost_at is None or time.monotonic() - lost_at > self.slot_busy_timeout):
                    raise
                lost_at = lost_at or time.monotonic()
                failures += 1
                if self.max_retries is not None and failures > self.max_retries:
                    raise
                delay = min(self.max_backoff, 0.5 * 2 ** (failures - 1))
                log.warning("replication connection lost (%s); reconnecting in %.1fs from %s",
                            " ".join(str(exc).split()) or type(exc).__name__, delay, self._confirmed)
                self._disconnect()
                time.sleep(delay)
                yield ReplicationEvent(None, self._confirmed, self._confirmed, reconnected=True)

    # -- internals -------------------------------------------------------------------------------
    def _start(self) -> None:
        connection = replication_connection(self.dsn)
        self._connection = connection
        options = self.options.negotiate(connection.server_version)
        self._negotiated = options
        self.proto_version = int(options["proto_version"])
        cursor = connection.cursor()
        try:
            with deadline(connection.fileno(), max(30.0, self.receive_timeout), what="starting replication"):
                cursor.start_replication(slot_name=self.slot, decode=False, start_lsn=int(self._confirmed),
                                         options=options, status_interval=self.status_interval)
        except psycopg2.errors.UndefinedObject as exc:
            raise ConfigError(f"{' '.join(str(exc).split())}: create the slot (pgcdc slot create {self.slot}) or "
                              "the publication") from None
        except psycopg2.errors.ObjectInUse as exc:
            raise SlotBusyError(f"replication slot {self.slot!r} is active for another process "
                                f"({' '.join(str(exc).split())}): stop the other consumer (only one may read a "
                                "slot)") from None
        except (psycopg2.errors.ObjectNotInPrerequisiteState, psycopg2.errors.FeatureNotSupported,
                psycopg2.errors.InvalidParameterValue) as exc:
            text = " ".join(str(exc).split())
            hint = (" The slot was invalidated: its WAL is gone. Copy the tables again with --resnapshot (it drops "
                    "the slot and creates a new one)." if "invalidated" in text or "no longer" in text else "")
            raise ConfigError(f"cannot stream slot {self.slot!r}: {text}.{hint}") from None
        self._cursor = cursor
        log.info("streaming slot %s from %s (protocol %d, options %s)", self.slot, self._confirmed,
                 self.proto_version, options)

    def _read(self, idle_timeout: float) -> Iterator[ReplicationEvent]:
        cursor = self._cursor
        assert cursor is not None
        decode = MessageDecoder(self.proto_version, raw_changes=self.raw_changes).decode
        last = time.monotonic()
        # Wall-clock seconds, as psycopg2's own timestamps: when the server was last heard from.
        heard = time.time()
        pinged_at: float | None = None
        received = False
        read_message = cursor.read_message
        while not self._closed:
            message = read_message()
            if message is None:
                wal_end = getattr(cursor, "wal_end", 0)
                if wal_end:
                    self.server_wal_end = Lsn(wal_end)
                now = time.monotonic()
                # A silent partition (no FIN, no RST, a proxy that stopped forwarding) shows only as silence.
                # Keepalives are consumed inside read_message: one shows as io_timestamp passing
                # feedback_timestamp (sending feedback sets both to the same instant).
                wall = time.time()
                if received:
                    heard, received = wall, False
                else:
                    io = cursor.io_timestamp.timestamp()
                    if io > cursor.feedback_timestamp.timestamp():
                        heard = max(heard, io)
                silence = wall - heard
                if silence < self.receive_timeout / 3:
                    pinged_at = None
                elif pinged_at is None:
                    cursor.send_feedback(reply=True)  # the server answers at once with a keepalive
                    pinged_at = wall
                # the consumer may have held this generator for a long time: the server gets a fair while to
                # answer the request before the silence counts
                elif silence > self.receive_timeout and wall - pinged_at > self.receive_timeout / 3:
                    raise psycopg2.OperationalError(
                        f"nothing received from the server for {silence:.0f}s (receive timeout "
                        f"{self.receive_timeout:.0f}s), not even an answer to a keepalive request")
                if now - last >= idle_timeout:
                    last = now
                    yield ReplicationEvent(None, self._confirmed, self.server_wal_end or self._confirmed)
                    continue
                select.select([cursor], [], [], max(0.0, idle_timeout - (now - last)))
                continue
            received = True
            # the per-message path: positions from the server are 64-bit by construction, and the event is built
            # without the named tuple's keyword handling
            yield _event(ReplicationEvent, (decode(message.payload), _lsn(Lsn, message.data_start),
                                            _lsn(Lsn, message.wal_end), False))

    def _send_feedback(self, *, force: bool) -> None:
        with self._feedback_lock:
            cursor = self._cursor
            if cursor is None:
                return
            lsn = int(self._confirmed)
            cursor.send_feedback(write_lsn=lsn, flush_lsn=lsn, apply_lsn=lsn, force=force)

    def _disconnect(self) -> None:
        with self._feedback_lock:
            if self._connection is not None:
                with contextlib.suppress(psycopg2.Error):
                    self._connection.close()
            self._connection = None
            self._cursor = None


class SqlInterfaceReader:
    """The same messages through ``pg_logical_slot_peek_binary_changes`` / ``..._get_binary_changes``:
    for places where a replication connection is not allowed."""

    def __init__(self, dsn: str, *, slot: str, options: ReplicationOptions) -> None:
        self.dsn = dsn
        self.slot = slot
        self.options = options

    def messages(self, *, consume: bool = False, limit: int | None = None, upto_lsn: Lsn | None = None
                 ) -> Iterator[tuple[Lsn, AnyMessage]]:
        """(LSN, message) pairs; ``consume`` advances the slot past what is returned."""
        function = "pg_logical_slot_get_binary_changes" if consume else "pg_logical_slot_peek_binary_changes"
        with psycopg.connect(with_session_settings(self.dsn), autocommit=True) as conn:
            options = self.options.negotiate(conn.info.server_version)
            decoder = MessageDecoder(int(options["proto_version"]))
            arguments = [value for pair in options.items() for value in pair]
            placeholders = ", ".join(["%s"] * len(arguments))
            try:
                cursor = conn.execute(
                    f"SELECT lsn::text, data FROM {function}(%s, %s, %s, {placeholders})",
                    (self.slot, None if upto_lsn is None else str(upto_lsn), limit, *arguments))
            except psycopg.errors.UndefinedObject as exc:
                raise ConfigError(f"{' '.join(str(exc).split())}: check --slot and --publication") from None
            except psycopg.errors.ObjectInUse:
                raise ConfigError(f"slot {self.slot!r} is being streamed by another process; the SQL interface "
                                  "cannot read an active slot") from None
            for lsn_text, data in cursor:
                yield Lsn.parse(lsn_text), decoder.decode(data)
