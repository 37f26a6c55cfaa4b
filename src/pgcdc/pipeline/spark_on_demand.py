"""Spark's session for a pipeline, started only when something needs it.

Starting Spark's JVM and session takes seconds (tens on a loaded machine), and a run that finds nothing to copy,
apply or maintain needs none of it: what it reads of the mirrors at start comes from their metadata
(:mod:`pgcdc.mirrors.metadata`). The session starts the first time a copy, a batch or a maintenance asks for
it — or sooner, on a thread of its own, once one is known to be coming (a table to copy, the first transaction
of a batch), so that the JVM starts while the slot is created or the batch fills.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.spark.destination import Destination

log = logging.getLogger("pgcdc.pipeline")


class SparkOnDemand:
    """``spark()`` is the session of ``destination``, started at the first call (or by :meth:`start_soon`); a
    session ``given`` by the caller is used as it is."""

    def __init__(self, destination: Destination, given: SparkSession | None = None) -> None:
        self._destination = destination
        self._session = given
        self.given = given is not None
        self._lock = threading.Lock()
        self._starting: Future[SparkSession] | None = None

    def __call__(self) -> SparkSession:
        session = self._session
        if session is not None:
            return session
        self._start(background=False)
        assert self._starting is not None
        return self._starting.result()

    def ready(self) -> bool:
        """Whether the session is up (not merely starting)."""
        return self._session is not None

    def start_soon(self) -> None:
        """Start the session on a thread of its own, unless it is up or starting: something will need it soon."""
        self._start(background=True)

    def _start(self, *, background: bool) -> None:
        with self._lock:
            if self._session is not None or self._starting is not None:
                return
            starting = self._starting = Future()
        if background:
            # PySpark's modules import each other in cycles: imported by the starting thread while this one imports
            # them for a copy or a batch, they deadlock (Python's _DeadlockError). This thread imports them first.
            import pyspark.sql  # noqa: F401

            import pgcdc.spark.session  # noqa: F401

            threading.Thread(target=self._run, args=(starting,), name="pgcdc-spark-start", daemon=True).start()
        else:
            self._run(starting)

    def _run(self, starting: Future[SparkSession]) -> None:
        from pgcdc.spark.session import spark_session

        started = time.monotonic()
        try:
            session = spark_session(self._destination)
        except BaseException as exc:  # raised to whoever waits for the session
            starting.set_exception(exc)
            return
        self._session = session
        log.debug("Spark session started in %.1fs", time.monotonic() - started)
        starting.set_result(session)
