"""Queries on the source beside the stream: the slot's status and heartbeats, on a thread of their own.

They go over ordinary connections, which a slow or partitioned server can hold for as long as their
timeouts allow. On the stream's own loop that wait would repeat for every message still buffered from
before the partition, so the stream would take minutes to reach the silence that tells it the
connection is gone. Here they delay only themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import psycopg

from pgcdc.lsn import Lsn
from pgcdc.replication.slots import source_connection

log = logging.getLogger(__name__)

_STATUS_SQL = ("SELECT pg_current_wal_lsn()::text, pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,"
               " wal_status, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s")


@dataclass(frozen=True)
class SlotStatus:
    server_lsn: Lsn
    wal_retained_bytes: int | None
    wal_status: str | None
    confirmed_flush_lsn: Lsn | None = None  # what the server records as confirmed (not what was sent)


class SourceWatch:
    """Every ``interval`` seconds, the server's WAL position and what the slot retains (``latest()``);
    on request, a heartbeat (``heartbeat()``): a tiny non-transactional logical message, so that a slot
    whose tables are quiet still gets something to confirm while other databases write WAL."""

    def __init__(self, dsn: str, slot: str, *, interval: float = 5.0, query_timeout: float = 5.0) -> None:
        self._dsn = dsn
        self._slot = slot
        self._interval = interval
        self._query_timeout = query_timeout
        self._latest: SlotStatus | None = None
        self._wake = threading.Event()
        self._heartbeat_wanted = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pgcdc-source-watch", daemon=True)

    def __enter__(self) -> SourceWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        self._wake.set()
        # its queries are bounded by their timeouts; a daemon thread, so an exit never waits longer
        self._thread.join(timeout=2 * self._query_timeout + 1)

    def latest(self) -> SlotStatus | None:
        """The newest status read, or None before the first one (a new object each time it is read)."""
        return self._latest

    def heartbeat(self) -> None:
        """Ask for a heartbeat; returns at once."""
        self._heartbeat_wanted.set()
        self._wake.set()

    def _run(self) -> None:
        next_status = 0.0
        while not self._stopped.is_set():
            if time.monotonic() >= next_status:
                self._read_status()
                next_status = time.monotonic() + self._interval
            if self._heartbeat_wanted.is_set():
                self._heartbeat_wanted.clear()
                self._emit_heartbeat()
            self._wake.wait(max(0.0, next_status - time.monotonic()))
            self._wake.clear()

    def _read_status(self) -> None:
        try:
            with source_connection(self._dsn, self._query_timeout) as conn:
                row = conn.execute(_STATUS_SQL, (self._slot,)).fetchone()
        except (psycopg.Error, OSError) as exc:
            log.debug("status query failed: %s", exc)
            return
        if row is None:
            return
        status = SlotStatus(Lsn.parse(row[0]), row[1], row[2], Lsn.parse(row[3]) if row[3] else None)
        if status.wal_status in ("extended", "unreserved"):
            log.warning("slot %s has wal_status=%s: it retains %d bytes of WAL and may be invalidated; "
                        "let pgcdc catch up or raise max_slot_wal_keep_size", self._slot, status.wal_status,
                        status.wal_retained_bytes)
        self._latest = status

    def _emit_heartbeat(self) -> None:
        try:
            with source_connection(self._dsn, self._query_timeout) as conn:
                conn.execute("SELECT pg_logical_emit_message(false, 'pgcdc.heartbeat', '')")
        except (psycopg.Error, OSError) as exc:
            log.warning("heartbeat failed: %s", exc)
