"""What SIGINT and SIGTERM do to a running pipeline: a stop in order.

The first signal while streaming lets the batch being applied finish and be confirmed, then the pipeline
returns (``Progress.stop_signal`` says which signal asked; the CLI exits 130 for SIGINT, 0 for SIGTERM). A
second signal, or one during the initial copy (which has no batch to finish: it commits nothing until a
table is whole, and resumes at the next run), stops at once with ``KeyboardInterrupt``; the slot sends again
whatever was not confirmed. Spark's own SIGINT handler, which would cancel the running MERGE, is kept out
(:func:`pgcdc.spark.session.spark_session` puts the caller's handler back after starting a session).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from pgcdc.pipeline.config import Progress

log = logging.getLogger("pgcdc.pipeline")


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event, progress: Progress, *, enabled: bool = True) -> Iterator[None]:
    """While inside, SIGINT and SIGTERM set ``stop`` (see the module's text); the previous handlers come back
    after. Only the main thread can take signals: elsewhere, or when not ``enabled``, nothing changes."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum: int, frame: Any) -> None:
        progress.stop_signal = signum
        if stop.is_set() or progress.phase == "snapshot":
            stop.set()
            before = previous.get(signum)
            if callable(before):  # the caller's own interrupt (the CLI cancels Spark's running jobs)
                before(signum, frame)
            raise KeyboardInterrupt
        log.info("stopping after the current batch (signal %d)", signum)
        stop.set()

    previous: dict[int, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, request_stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
