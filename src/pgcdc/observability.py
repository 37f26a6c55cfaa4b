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


LOG_FIELDS = ("event", "table", "rows", "lsn", "seconds", "error", "exit_code")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in LOG_FIELDS:  # given with extra={...}: keys of their own, for tools to filter on
            if hasattr(record, key):
                value = getattr(record, key)
                entry[key] = redact(value) if isinstance(value, str) else value
        if record.exc_info:
            entry["exception"] = redact(self.formatException(record.exc_info))
        return json.dumps(entry, default=str)


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
    # other libraries' warnings (py4j logs through the root logger) in the same format, never in the
    # default one that an unconfigured root logger falls back to; a Ctrl-C they report is pgcdc's to tell
    foreign = logging.StreamHandler(sys.stderr)
    foreign.setFormatter(handler.formatter)
    foreign.addFilter(_RedactingFilter())
    foreign.addFilter(_not_an_interrupt)
    logging.getLogger().handlers[:] = [foreign]
    logging.getLogger().setLevel(logging.WARNING)


def _not_an_interrupt(record: logging.LogRecord) -> bool:
    return not (record.exc_info and isinstance(record.exc_info[1], KeyboardInterrupt))


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1024 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def status_text(progress: Progress, rows_per_s: float | None = None) -> str:
    if progress.phase == "snapshot":
        return snapshot_text(progress, rows_per_s or 0.0)
    return (f"{progress.phase}: {progress.rows_applied:,} changes applied, {progress.rows_per_s:,.0f} rows/s, "
            f"batch LSN {progress.applied_lsn or '-'}, lag {_bytes(progress.lag_bytes)}, "
            f"WAL retained {_bytes(progress.wal_retained_bytes)}"
            + (f" ({progress.wal_status})" if progress.wal_status not in (None, "reserved") else ""))


def snapshot_text(progress: Progress, rows_per_s: float) -> str:
    """The initial copy: rows copied of the estimated total (``pg_class.reltuples``), rate, time left, and the
    table being copied. An estimate of 0 (a table never analyzed) leaves the total unknown."""
    estimates = progress.snapshot_estimates
    if not estimates:
        return "snapshot: preparing the initial copy"
    copied = sum(progress.snapshot_rows.values())
    known = all(estimates.values())
    total = sum(max(estimates[t], progress.snapshot_rows.get(t, 0)) for t in estimates) if known else None
    text = f"snapshot: {copied:,}"
    if total:
        text += f" of ~{total:,} rows ({min(100.0, 100.0 * copied / total):.0f}%)"
    else:
        text += " rows"
    text += f", {len(estimates)} tables, {rows_per_s:,.0f} rows/s"
    if total and rows_per_s > 0:
        text += f", about {_duration(max(0, total - copied) / rows_per_s)} left"
    current = next((t for t in reversed(list(progress.snapshot_rows)) if t in estimates), None)
    if current is not None:
        estimate = estimates[current]
        text += f"; {current} {progress.snapshot_rows[current]:,}" + (f" of ~{estimate:,}" if estimate else "")
    return text


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class _Rate:
    """Rows per second over the last half minute of samples."""

    def __init__(self) -> None:
        self._samples: list[tuple[float, int]] = []

    def add(self, rows: int) -> float:
        now = time.monotonic()
        self._samples.append((now, rows))
        while len(self._samples) > 2 and now - self._samples[0][0] > 30:
            self._samples.pop(0)
        (start, first), (end, last) = self._samples[0], self._samples[-1]
        return (last - first) / (end - start) if end > start else 0.0


class StatusLine:
    """A live status line on a terminal; otherwise a log line at each change of phase and periodically."""

    def __init__(self, console: Console, every_seconds: float = 10.0) -> None:
        self.console = console
        self.every = every_seconds
        self._live: Any = None
        self._last = 0.0
        self._stage: tuple[str, int] | None = None
        self._copy_rate = _Rate()

    def __enter__(self) -> StatusLine:
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live("starting", console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def update(self, progress: Progress) -> None:
        rate = self._copy_rate.add(sum(progress.snapshot_rows.values())) if progress.phase == "snapshot" else None
        text = status_text(progress, rate)
        stage = (progress.phase, len(progress.snapshot_estimates))  # a new phase, or the copy's totals now known
        if self._live is not None:
            self._live.update(text)
        elif stage != self._stage or time.monotonic() - self._last >= self.every:
            self._last = time.monotonic()
            self._stage = stage
            logging.getLogger("pgcdc.status").info(text)

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)


class SnapshotProgress:
    """One progress bar per table being copied, with its estimated total, and a line for the whole copy."""

    def __init__(self, console: Console) -> None:
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

        self._bars = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                              TextColumn("{task.completed:,} of ~{task.fields[estimate]} rows"),
                              TimeRemainingColumn(), console=console, transient=False)
        self._tasks: dict[str, Any] = {}

    def __enter__(self) -> SnapshotProgress:
        self._bars.__enter__()
        return self

    def update(self, progress: Progress) -> None:
        tables = {**dict.fromkeys(progress.snapshot_estimates, 0), **progress.snapshot_rows}
        for table, rows in tables.items():
            estimate = progress.snapshot_estimates.get(table) or None
            if table not in self._tasks:
                self._tasks[table] = self._bars.add_task(table, total=None, estimate="?")
            total = max(estimate, rows) if estimate else None
            self._bars.update(self._tasks[table], completed=rows, total=total,
                              estimate=f"{total:,}" if total else "?")
        if len(progress.snapshot_estimates) > 1:
            estimates = progress.snapshot_estimates
            known = all(estimates.values())
            total_rows = sum(max(estimates[t], tables.get(t, 0)) for t in estimates) if known else None
            if _TOTAL not in self._tasks:
                self._tasks[_TOTAL] = self._bars.add_task("all tables", total=None, estimate="?")
            self._bars.update(self._tasks[_TOTAL], completed=sum(tables.values()), total=total_rows,
                              estimate=f"{total_rows:,}" if total_rows else "?")

    def __exit__(self, *exc: object) -> None:
        self._bars.__exit__(None, None, None)


_TOTAL = "\0total"


class MetricsServer:
    """Prometheus metrics of a running pipeline on ``http://0.0.0.0:<port>/metrics``."""

    def __init__(self, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.rows = Counter("pgcdc_rows_applied", "Changes applied to the mirrors", registry=self.registry)
        self.batches = Counter("pgcdc_batches_applied", "Micro-batches applied", registry=self.registry)
        self.rejected = Counter("pgcdc_rows_rejected", "Changes set aside in <table>__rejects (values that cannot "
                                "be converted, --on-conversion-error quarantine)", registry=self.registry)
        self.reconnections = Counter("pgcdc_reconnections", "Replication connections lost and re-established",
                                     registry=self.registry)
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
        self._seen_reconnections = 0
        self._seen_rejected = 0
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
        self.reconnections.inc(progress.reconnections - self._seen_reconnections)
        self.rejected.inc(progress.rows_rejected - self._seen_rejected)
        self._seen_rejected = progress.rows_rejected
        self._seen_rows, self._seen_batches, self._seen_reconnections = (
            progress.rows_applied, progress.batches_applied, progress.reconnections)
        if progress.lag_bytes is not None:
            self.lag.set(progress.lag_bytes)
        if progress.wal_retained_bytes is not None:
            self.retained.set(progress.wal_retained_bytes)
        if progress.applied_lsn is not None:
            self.applied.set(int(progress.applied_lsn))
        if progress.received_lsn is not None:
            self.received.set(int(progress.received_lsn))
