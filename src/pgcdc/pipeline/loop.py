"""The pipeline: a replication slot mirrored into Iceberg tables, exactly once.

The one place that knows every room. Read it top to bottom: :meth:`Pipeline.run` snapshots what is not
mirrored yet (:mod:`.snapshotter`), then :meth:`Pipeline._stream` reads committed transactions from the
slot (:class:`pgcdc.transactions.TransactionReader`), collects them into batches of Arrow change tables
(:mod:`.batcher`), merges each batch into the mirrors on the apply thread (:mod:`.applier`) and confirms
to the server what the mirrors hold. Every position decision — what a batch may confirm, what a mirror
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
from pgcdc.pipeline.applier import Applier
from pgcdc.pipeline.batcher import Batch, Batcher
from pgcdc.pipeline.config import PipelineConfig, Progress
from pgcdc.pipeline.signals import stop_on_signals
from pgcdc.pipeline.snapshotter import Snapshotter
from pgcdc.pipeline.tables import SourceTables
from pgcdc.replication import (
    LogicalReplicationStream,
    ReplicationOptions,
    SlotManager,
    SlotStatus,
    SourceWatch,
    check_source,
    source_connection,
)
from pgcdc.replication.published import server_lsn
from pgcdc.runtime import streaming_gc
from pgcdc.transactions import Tick, Transaction, TransactionReader
from pgcdc.types import TableConverter

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.pgoutput.messages import Relation
    from pgcdc.spark.mirror import MirrorCatalog

log = logging.getLogger("pgcdc.pipeline")


class Pipeline:
    """Mirror a publication's tables into Iceberg with Spark; see :class:`PipelineConfig`.

    >>> pipeline = Pipeline(PipelineConfig(dsn="dbname=shop", publication="shop", warehouse="/data/wh"))  # doctest: +SKIP
    >>> pipeline.run(until_caught_up=True)                                                              # doctest: +SKIP
    """

    def __init__(self, config: PipelineConfig, *, spark: SparkSession | None = None,
                 on_progress: Callable[[Progress], None] | None = None) -> None:
        self.config = config
        if spark is not None:  # a session the caller built: it must hold the catalog the config names
            from pgcdc.spark.session import attach_catalog

            attach_catalog(spark, config.warehouse, config.catalog, config.spark_conf,
                           catalog_type=config.catalog_type, catalog_uri=config.catalog_uri)
        self._spark = spark
        self._on_progress = on_progress
        self.progress = Progress()
        self._stop = threading.Event()
        self._tables = SourceTables(config, lambda: self.spark)
        self._snapshotter = Snapshotter(config, self._tables, lambda: self.spark, self.progress,
                                        self._set_phase, self._emit)
        self._batcher = Batcher(self._tables)
        self._last_heartbeat = 0.0
        self._seen_status: SlotStatus | None = None
        self._text_values_only = False  # set once a column that binary values cannot carry reached the stream
        self._whole_transactions_only = False  # set once the server failed to decode a transaction in progress

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            from pgcdc.spark.session import spark_session

            self._spark = spark_session(self.config.warehouse, self.config.catalog,
                                        master=self.config.spark_master, conf=self.config.spark_conf,
                                        catalog_type=self.config.catalog_type, catalog_uri=self.config.catalog_uri)
        return self._spark

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
        problems = check_source(self.config.dsn, publication=self.config.publication, slot=self.config.slot)
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
        config = self.config
        checkpoint = Checkpoint(resume_from=self._resume_position())
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
                                          receive_timeout=config.receive_timeout_seconds)
        # short idle ticks: a batch that finished applying while the stream is quiet is confirmed soon
        reader = TransactionReader(stream.events(idle_timeout=min(0.25, config.batch_max_seconds)),
                                   memory_limit_bytes=config.memory_limit_bytes, spill_dir=config.spill_dir,
                                   on_type=self._tables.observe_type)

        def confirm(lsn: Lsn | None) -> None:
            if checkpoint.advance(lsn):
                assert lsn is not None
                stream.confirm(lsn)

        def hand_off(batch: Batch) -> None:
            self._batcher.finish(batch)
            # before anything evolves a mirror to the batch's table versions: they tell what must be copied
            self._snapshotter.copy_rewritten(batch.versions(lambda relation: self._tables.mirrors.held_position(
                relation.namespace, relation.name, changelog=config.changelog)))
            self._snapshotter.copy_again(batch.incomplete_inserts, "a row moved into a publication's row filter came "
                                         "without the TOAST values it did not change, which only the table holds")
            self._snapshotter.copy_unmirrored(batch.relations())
            assert batch.last_end_lsn is not None
            applier.start(batch, checkpoint.batch_flush(batch.last_end_lsn, reader.oldest_pending_lsn()))

        self._set_phase("streaming")
        batch = Batch()
        items = iter(reader)
        # One batch applies on the apply thread while the next one is read, decoded and converted here: the
        # stream never waits for a MERGE unless a full batch is ready before the one before it is applied.
        with SourceWatch(config.dsn, config.slot) as watch, \
                Applier(self._tables, lambda: self.spark, self.progress, self._emit,
                        changelog=config.changelog, writer=config.apply_writer,
                        maintenance=config.maintenance) as applier:
            try:
                for item in items:
                    if isinstance(item, Transaction):
                        self._batcher.add(batch, item)
                        self.progress.received_lsn = item.end_lsn
                        continue
                    if item is Tick.RECONNECTED:  # the server resends everything after the confirmed position
                        self.progress.reconnections += 1
                        batch = Batch()
                        continue
                    if self._stop.is_set():
                        applier.collect(confirm)
                        if batch:
                            hand_off(batch)
                            applier.collect(confirm)
                        batch = Batch()
                        break
                    idle = item is Tick.IDLE
                    # a full batch waits for the one applying: memory stays bounded by two batches
                    if applier.busy and (applier.done() or batch.rows >= config.batch_max_rows):
                        applier.collect(confirm)
                    if not applier.busy and batch and (
                            batch.rows >= config.batch_max_rows
                            or time.monotonic() - batch.started >= config.batch_max_seconds
                            or (target is not None and idle)):
                        hand_off(batch)
                        batch = Batch()
                    applier.maintain()  # between applies, when a mirror is due: compaction, expiry
                    held = reader.oldest_pending_lsn()
                    unapplied = bool(batch) or applier.busy
                    if idle:
                        confirm(checkpoint.quiet_flush(stream.server_wal_end, unapplied=unapplied, held=held))
                    self._watch(watch, idle)
                    # a prepared transaction still held is not committed: caught up without it (the slot
                    # stays at its PREPARE, and it is applied once committed)
                    caught_up = idle and not unapplied
                    if caught_up and target is not None and (stream.server_wal_end or Lsn(0)) >= target:
                        break
            finally:
                if applier.busy:  # the loop failed: the batch applying finishes, and counts if it worked
                    try:
                        applier.collect(confirm)
                    except Exception as exc:
                        log.error("the batch being applied failed too: %s", exc)
                if batch and not self._stop.is_set():
                    log.warning("stopping with %d unapplied transactions; they will be replayed", batch.transactions)
                stream.close()
                items.close()  # drops what the assembler held (spill files too): the server resends it
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

    def _watch(self, watch: SourceWatch, idle: bool) -> None:
        """The slot's status from the watch thread into the progress; a heartbeat when idle, if asked for."""
        status = watch.latest()
        if status is not self._seen_status and status is not None:
            self._seen_status = status
            self.progress.server_lsn = status.server_lsn
            self.progress.wal_retained_bytes = status.wal_retained_bytes
            self.progress.wal_status = status.wal_status
            self._emit()
        now = time.monotonic()
        if idle and self.config.heartbeat_seconds and now - self._last_heartbeat >= self.config.heartbeat_seconds:
            watch.heartbeat()
            self._last_heartbeat = now

    def _set_phase(self, phase: str) -> None:
        self.progress.phase = phase
        self._emit()

    def _emit(self) -> None:
        if self._on_progress is not None:
            self._on_progress(self.progress)
