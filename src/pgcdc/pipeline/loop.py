"""The pipeline: a replication slot mirrored into Iceberg tables, exactly once.

The one place that knows every room. Read it top to bottom: :meth:`Pipeline.run` snapshots what is not
mirrored yet (:mod:`.snapshotter`), then streams (:class:`.streaming.StreamRun`, once per connection): committed
transactions from the slot (:class:`pgcdc.transactions.TransactionReader`) are collected into batches of Arrow
change tables (:mod:`.batcher`), applied to the mirrors on the apply thread (:mod:`.applier`), and what the
mirrors hold is confirmed to the server. Every position decision — what a batch may confirm, what a mirror
records, what a restart resumes from — is :mod:`pgcdc.checkpoint`'s, and its rules are written there.

>>> Pipeline(PipelineConfig(dsn="host=... dbname=shop", publication="shop")).run(until_caught_up=True)  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg

from pgcdc.checkpoint import Checkpoint, resume_position
from pgcdc.errors import ConfigError, InProgressDecodingFailed, TextValuesRequired
from pgcdc.lsn import Lsn
from pgcdc.pipeline.batcher import Batcher
from pgcdc.pipeline.config import PipelineConfig, Progress
from pgcdc.pipeline.signals import stop_on_signals
from pgcdc.pipeline.snapshotter import Snapshotter
from pgcdc.pipeline.spark_on_demand import SparkOnDemand
from pgcdc.pipeline.streaming import StreamRun
from pgcdc.pipeline.tables import SourceTables
from pgcdc.replication import (
    LogicalReplicationStream,
    ReplicationOptions,
    SlotManager,
    check_source,
    source_connection,
)
from pgcdc.replication.published import server_lsn
from pgcdc.runtime import streaming_gc
from pgcdc.transactions import TransactionReader
from pgcdc.types import TableConverter

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.mirrors.catalog import MirrorCatalog
    from pgcdc.pgoutput.messages import Relation

log = logging.getLogger("pgcdc.pipeline")


class Pipeline:
    """Mirror a publication's tables into Iceberg with Spark; see :class:`PipelineConfig`.

    >>> pipeline = Pipeline(PipelineConfig(dsn="dbname=shop", publication="shop",
    ...                                    destination=Destination(warehouse="/data/wh")))  # doctest: +SKIP
    >>> pipeline.run(until_caught_up=True)                                                              # doctest: +SKIP
    """

    def __init__(self, config: PipelineConfig, *, spark: SparkSession | None = None,
                 on_progress: Callable[[Progress], None] | None = None) -> None:
        self.config = config
        if spark is not None:  # a session the caller built: it must hold the catalog the config names
            from pgcdc.spark.session import attach_catalog

            attach_catalog(spark, config.destination)
        # Spark starts when a copy, a batch or a maintenance needs it; until then the mirrors are read from their
        # metadata, unless the caller's session (which may see the catalog otherwise) is there to read them
        self._spark = SparkOnDemand(config.destination, spark)
        self._on_progress = on_progress
        self.progress = Progress()
        self._stop = threading.Event()
        self._tables = SourceTables(config, self._spark, session_ready=None if spark is not None else self._spark.ready)
        self._snapshotter = Snapshotter(config, self._tables, self._spark, self.progress, self._set_phase, self._emit)
        self._batcher = Batcher(self._tables)
        self._text_values_only = False  # set once a column that binary values cannot carry reached the stream
        self._whole_transactions_only = False  # set once the server failed to decode a transaction in progress

    @property
    def spark(self) -> SparkSession:
        """The pipeline's Spark session (started now if it is not yet)."""
        return self._spark()

    @property
    def mirrors(self) -> MirrorCatalog:
        return self._tables.mirrors

    def converter_for(self, relation: Relation) -> TableConverter:
        """The converter of a relation version (one per distinct schema, reused)."""
        return self._tables.converter_for(relation)

    def load_types(self, conn: psycopg.Connection) -> None:
        """Read the source's own types (enums, domains, arrays of them) before converters are made from the
        catalog's relations, so that they convert as the mirrors hold them."""
        self._tables.registry.load_from_server(conn)

    def stop(self) -> None:
        """Ask a running pipeline to finish its current batch, confirm it and return."""
        self._stop.set()

    def check(self) -> None:
        """Raise ConfigError listing every problem of the source set-up, each with its fix."""
        found = check_source(self.config.dsn, publication=self.config.publication, slot=self.config.slot)
        for warning in (p for p in found if p.warning):
            log.warning("%s Fix: %s", warning.what, warning.fix)
        problems = [p for p in found if not p.warning]
        if problems:
            raise ConfigError("the source is not ready for pgcdc:\n" + "\n".join(
                f"  - {p.what} Fix: {p.fix}" for p in problems))

    def snapshot(self) -> dict[str, int]:
        """Create the slot and copy every published table consistently with it (if not done yet)."""
        self.check()
        return self._snapshotter.snapshot()

    def run(self, *, until_caught_up: bool = False, handle_signals: bool = True) -> Progress:
        """Snapshot if needed, then stream into the mirrors until stopped (or caught up)."""
        with stop_on_signals(self._stop, self.progress, enabled=handle_signals), streaming_gc():
            if self.config.snapshot:
                self.snapshot()
            else:
                self.check()
            lost = 0  # source connections lost in a row, with no change applied in between
            while True:
                applied = self.progress.applied_lsn
                try:
                    return self._stream(until_caught_up=until_caught_up)
                except psycopg.OperationalError as exc:
                    # a catalog or status query between batches met a server restarting, or a network cut: as
                    # the stream does for its own connection, start again from the slot's confirmed position
                    lost = 1 if self.progress.applied_lsn != applied else lost + 1
                    delay = min(30.0, 0.5 * 2 ** (lost - 1))
                    log.warning("connection to the source lost (%s); streaming again from the slot's confirmed "
                                "position in %.1fs", " ".join(str(exc).split()), delay)
                    self.progress.reconnections += 1
                    if self._stop.wait(delay):
                        self._set_phase("stopped")
                        return self.progress
                except TextValuesRequired as exc:
                    # a column of a type read only as text was added while streaming binary values: nothing
                    # past the mirrors' positions was applied, and the server sends it all again, as text
                    if self._text_values_only:
                        raise
                    log.warning("%s: streaming text values from here on", str(exc).split(";")[0])
                    self._text_values_only = True
                    self._wait_for_slot_release()
                except InProgressDecodingFailed as exc:
                    # a PostgreSQL decoder failure only in-progress streaming meets: the server sends the
                    # transaction again from the confirmed position, decoded whole at its commit
                    if self._whole_transactions_only:
                        raise
                    log.warning("%s; streaming again without in-progress transactions (--streaming off) for "
                                "this run", exc)
                    self._whole_transactions_only = True
                    self._wait_for_slot_release()

    # -- streaming ----------------------------------------------------------------
    def _stream(self, *, until_caught_up: bool) -> Progress:
        """One replication connection's run (:class:`.streaming.StreamRun`), from the slot's confirmed position."""
        try:
            checkpoint = Checkpoint(resume_from=self._resume_position())
            return self._stream_from(checkpoint, until_caught_up=until_caught_up)
        finally:
            self._tables.read_afresh()  # a next connection's start reads the mirrors as they are then

    def _stream_from(self, checkpoint: Checkpoint, *, until_caught_up: bool) -> Progress:
        config = self.config
        with source_connection(config.dsn, 120.0) as conn:
            self._tables.registry.load_from_server(conn)
            binary = self._tables.binary_possible(conn, config.publication,
                                                  wanted=config.binary and not self._text_values_only)
            target = server_lsn(conn) if until_caught_up else None
        options = ReplicationOptions(publication=config.publication, proto_version=config.proto_version,
                                     streaming="off" if self._whole_transactions_only else config.streaming,
                                     two_phase=config.two_phase,
                                     binary=binary, messages=True, origin=config.origin)
        stream = LogicalReplicationStream(config.dsn, slot=config.slot, options=options,
                                          start_lsn=checkpoint.confirmed,
                                          receive_timeout=config.receive_timeout_seconds, raw_changes=True)
        # short idle ticks: a batch that finished applying while the stream is quiet is confirmed, and the next one
        # handed over, within a fraction of the batch clock
        reader = TransactionReader(stream.events(idle_timeout=min(0.25, config.batch_max_seconds / 4)),
                                   memory_limit_bytes=config.memory_limit_bytes, spill_dir=config.spill_dir,
                                   on_type=self._tables.observe_type)
        self._set_phase("streaming")
        StreamRun(config, stream=stream, reader=reader, checkpoint=checkpoint, target=target, tables=self._tables,
                  batcher=self._batcher, snapshotter=self._snapshotter, spark=self._spark,
                  progress=self.progress, emit=self._emit, stop=self._stop).run()
        self._set_phase("stopped")
        return self.progress

    def _wait_for_slot_release(self, timeout: float = 30.0) -> None:
        """After closing the stream: its walsender ends a moment later, and the slot is busy until then."""
        slots = SlotManager(self.config.dsn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            slot = slots.get(self.config.slot)
            if slot is None or not slot.active:
                return
            time.sleep(0.1)

    def _resume_position(self) -> Lsn:
        slot = SlotManager(self.config.dsn).get(self.config.slot)
        if slot is None:
            raise ConfigError(f"replication slot {self.config.slot!r} does not exist; run with snapshot enabled "
                              f"(pgcdc snapshot) or create it with: pgcdc slot create {self.config.slot}")
        self._snapshotter.check_positions()
        invalidated = (slot.invalidation_reason or slot.wal_status) if slot.invalidated else None
        return resume_position(self.config.slot, slot.confirmed_flush_lsn, invalidated=invalidated)

    def _set_phase(self, phase: str) -> None:
        self.progress.phase = phase
        self._emit()

    def _emit(self) -> None:
        if self._on_progress is not None:
            self._on_progress(self.progress)
