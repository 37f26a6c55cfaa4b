"""Logs, redaction, the live status line and Prometheus metrics."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from pgcdc.errors import ConfigError
from pgcdc.secrets import redact, redact_dsn

if TYPE_CHECKING:
    from rich.console import Console

    from pgcdc.pipeline import Progress

__all__ = ["configure_logging", "redact", "redact_dsn"]

class _RedactingFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage())
        record.args = ()
        return True


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry)


def configure_logging(log_format: str = "text", level: str = "INFO") -> None:
    """Human-readable lines, or JSON lines (``log_format='json'``), on stderr; passwords always redacted."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
    handler.addFilter(_RedactingFilter())
    root = logging.getLogger("pgcdc")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    logging.getLogger("py4j").setLevel(logging.ERROR)


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def status_text(progress: Progress) -> str:
    return (f"{progress.phase}: {progress.rows_applied:,} changes applied, {progress.rows_per_s:,.0f} rows/s, "
            f"batch LSN {progress.applied_lsn or '-'}, lag {_bytes(progress.lag_bytes)}, "
            f"WAL retained {_bytes(progress.wal_retained_bytes)}"
            + (f" ({progress.wal_status})" if progress.wal_status not in (None, "reserved") else ""))


class StatusLine:
    """A live status line on a terminal; periodic log lines otherwise."""

    def __init__(self, console: Console, every_seconds: float = 10.0) -> None:
        self.console = console
        self.every = every_seconds
        self._live: Any = None
        self._last = 0.0

    def __enter__(self) -> StatusLine:
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live("starting", console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def update(self, progress: Progress) -> None:
        text = status_text(progress)
        if self._live is not None:
            self._live.update(text)
        elif time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            logging.getLogger("pgcdc.status").info(text)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)


class SnapshotProgress:
    """One progress bar per table being copied."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self._bars = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,} rows"),
                              TimeRemainingColumn(), console=console, transient=False)
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> SnapshotProgress:
        self._bars.__enter__()
        return self

    def update(self, progress: Progress) -> None:
        for table, rows in progress.snapshot_rows.items():
            if table not in self._tasks:
                self._tasks[table] = self._bars.add_task(table, total=None)
            self._bars.update(self._tasks[table], completed=rows)

    def __exit__(self, *exc: object) -> None:
        self._bars.__exit__(None, None, None)


class MetricsServer:
    """Prometheus metrics of a running pipeline on ``http://0.0.0.0:<port>/metrics``."""

    def __init__(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.rows = Counter("pgcdc_rows_applied", "Changes applied to the mirrors", registry=self.registry)
        self.batches = Counter("pgcdc_batches_applied", "Micro-batches applied", registry=self.registry)
        self.errors = Counter("pgcdc_errors", "Errors seen", registry=self.registry)
        self.lag = Gauge("pgcdc_lag_bytes", "Server WAL position minus the applied position",
                         registry=self.registry)
        self.retained = Gauge("pgcdc_wal_retained_bytes", "WAL the slot keeps on the server", registry=self.registry)
        self.applied = Gauge("pgcdc_applied_lsn", "Last applied LSN (as a number)", registry=self.registry)
        self.received = Gauge("pgcdc_received_lsn", "End of the last whole transaction received (as a number)",
                              registry=self.registry)
        self.phase = Gauge("pgcdc_phase", "1 for the pipeline's current phase (snapshot, streaming, ...)", ["phase"],
                           registry=self.registry)
        self._phase: str | None = None
        self._seen_rows = 0
        self._seen_batches = 0
        self._seen_errors = 0
        try:
            start_http_server(port, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on port {port} ({exc.strerror}): another process (another "
                              "pgcdc run?) listens there; give this run another --metrics-port") from None

    def update(self, progress: Progress) -> None:
        if progress.phase != self._phase:
            if self._phase is not None:
                self.phase.labels(self._phase).set(0)
            self.phase.labels(progress.phase).set(1)
            self._phase = progress.phase
        self.rows.inc(progress.rows_applied - self._seen_rows)
        self.batches.inc(progress.batches_applied - self._seen_batches)
        self.errors.inc(progress.errors - self._seen_errors)
        self._seen_rows, self._seen_batches, self._seen_errors = (progress.rows_applied, progress.batches_applied,
                                                                  progress.errors)
        if progress.lag_bytes is not None:
            self.lag.set(progress.lag_bytes)
        if progress.wal_retained_bytes is not None:
            self.retained.set(progress.wal_retained_bytes)
        if progress.applied_lsn is not None:
            self.applied.set(int(progress.applied_lsn))
        if progress.received_lsn is not None:
            self.received.set(int(progress.received_lsn))
