"""One streaming run: a replication connection read into batches, applied, and confirmed.

:class:`StreamRun` is what :meth:`pgcdc.pipeline.Pipeline.run` starts for each connection to the slot. Its
loop, read top to bottom: committed transactions from the slot (:class:`pgcdc.transactions.TransactionReader`)
are added to a batch (:mod:`.batcher`); a batch full or old enough is handed to the apply thread
(:mod:`.applier`) while the next one fills; what an applied batch made durable is confirmed to the server
(:mod:`pgcdc.checkpoint`'s rules). While the loop waits for an apply or copies a table, the connection is kept
alive (:meth:`pgcdc.replication.LogicalReplicationStream.kept_alive`): the server's ``wal_sender_timeout``
would otherwise end it, and every confirmation made meanwhile would be lost.

A stop asked for (:mod:`.signals`) ends the run in bounded time: the batch being applied finishes and is
confirmed; the batch still being collected is not applied (the server sends it again at the next start); a
maintenance in flight is cancelled (a step cut short changes nothing). Then the slot's position as the server
records it is read back: the position reported is the one the server acknowledged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pgcdc.checkpoint import Checkpoint
from pgcdc.lsn import Lsn
from pgcdc.pipeline.applier import Applier
from pgcdc.pipeline.batcher import Batch, Batcher
from pgcdc.pipeline.config import PipelineConfig, Progress
from pgcdc.pipeline.snapshotter import Snapshotter
from pgcdc.pipeline.spark_on_demand import SparkOnDemand
from pgcdc.pipeline.tables import SourceTables
from pgcdc.replication import LogicalReplicationStream, SlotManager, SlotStatus, SourceWatch
from pgcdc.transactions import Tick, Transaction, TransactionReader

log = logging.getLogger("pgcdc.pipeline")

# after the batch being applied, how long a stop may still take: a maintenance in flight is cancelled and waited
# for this long at most (docs/usage.md, "Stopping: Ctrl-C and SIGTERM")
STOP_BOUND_SECONDS = 30.0
# how long the server may take to record the last confirmation once the stream is closed
_ACKNOWLEDGE_SECONDS = 5.0
# between two steps on received messages (an apply done, a batch old enough, maintenance, the slot's status): a
# step per message would cost the stream thread more than decoding the message does
_STEP_SECONDS = 0.005


def hand_over_due(*, full: bool, age: float, applying: bool, config: PipelineConfig, caught_up: bool = False
                  ) -> bool:
    """Whether a batch (``full``: holding ``batch_max_rows`` changes, or ``batch_max_bytes`` of them), begun ``age``
    seconds ago (when the one before it was handed over), goes to the apply thread now. Never while a batch
    applies: the batch grows meanwhile, and goes the moment the apply thread is free — under load, batches are as
    large as the apply's own time makes them, and no transaction waits for a clock tick besides. With the apply
    thread free, a batch goes once it is full, once the batch clock (``batch_max_seconds``) has run since the last
    hand-over — which bounds the commits a mirror takes per second while its fixed cost is small beside the wait —
    or, running until caught up, once the stream has gone quiet."""
    if applying:
        return False
    return full or age >= config.batch_max_seconds or caught_up


class StreamRun:
    """The loop over one replication connection; :meth:`run` returns when stopped, caught up, or failed."""

    def __init__(self, config: PipelineConfig, *, stream: LogicalReplicationStream, reader: TransactionReader,
                 checkpoint: Checkpoint, target: Lsn | None, tables: SourceTables, batcher: Batcher,
                 snapshotter: Snapshotter, spark: SparkOnDemand, progress: Progress,
                 emit: Callable[[], None], stop: threading.Event) -> None:
        self.config = config
        self.stream = stream
        self.reader = reader
        self.checkpoint = checkpoint
        self.target = target  # --until-caught-up: the server's WAL position at start
        self.tables = tables
        self.batcher = batcher
        self.snapshotter = snapshotter
        self._spark = spark
        self.progress = progress
        self._emit = emit
        self._stop = stop
        self._seen_status: SlotStatus | None = None
        self._last_heartbeat = 0.0

    def run(self) -> None:
        config = self.config
        batch = Batch()
        items = iter(self.reader)
        stepped = 0.0
        # One batch applies on the apply thread while the next one is read, decoded and converted here: the
        # stream never waits for an apply unless a full batch is ready before the one before it is applied.
        with SourceWatch(config.dsn, config.slot) as watch, \
                Applier(self.tables, self._spark, self.progress, self._emit, changelog=config.changelog,
                        writer=config.apply_writer, deletes=config.deletes,
                        index_memory_bytes=config.index_memory_bytes, index_dir=config.index_dir,
                        maintenance=config.maintenance,
                        consistent_seconds=config.consistent_seconds,
                        apply_workers=config.mirror_workers, batch_seconds=config.batch_max_seconds) as applier:
            applier.settle_tags(self.checkpoint.confirmed)
            stopped_in_order = interrupted = False
            try:
                for item in items:
                    if isinstance(item, Transaction):
                        self._spark.start_soon()  # its batch needs Spark: it starts while the batch fills
                        self.batcher.add(batch, item)
                        self.progress.received_lsn = item.end_lsn
                        continue
                    if item is Tick.RECONNECTED:  # the server resends everything after the confirmed position
                        self.progress.reconnections += 1
                        batch = Batch()
                        continue
                    if self._stop.is_set():
                        self._finish_applying(applier)
                        applier.move_tags(now=True)
                        stopped_in_order = True
                        break
                    if item is Tick.RECEIVED and not batch.full(config.batch_max_rows, config.batch_max_bytes):
                        now = time.monotonic()
                        if now - stepped < _STEP_SECONDS:
                            continue
                        stepped = now
                    if self._step(applier, batch, watch, idle=item is Tick.IDLE):
                        batch = Batch()
                    if self._caught_up(applier, batch, idle=item is Tick.IDLE):
                        applier.move_tags(now=True)
                        break
            except KeyboardInterrupt:  # a second signal: stop at once, the slot sends again what was not confirmed
                interrupted = True
                raise
            except BaseException:
                if applier.busy:  # the loop failed: the batch applying finishes, and counts if it worked
                    try:
                        self._finish_applying(applier)
                    except Exception as exc:
                        log.error("the batch being applied failed too: %s", exc)
                raise
            finally:
                if batch and not stopped_in_order:
                    log.warning("stopping with %d unapplied transactions; they will be replayed", batch.transactions)
                applier.stop_maintenance(timeout=0.0 if interrupted else STOP_BOUND_SECONDS)
                applier.finish_tag_move(timeout=0.0 if interrupted else STOP_BOUND_SECONDS)
                self.stream.close()
                self.tables.close()
                items.close()  # drops what the assembler held (spill files too): the server resends it
        self._report_acknowledged()

    def _step(self, applier: Applier, batch: Batch, watch: SourceWatch, *, idle: bool) -> bool:
        """What the loop does between two messages: collect an applied batch, hand over the next one, maintain,
        confirm a quiet slot, watch the source. True when ``batch`` was handed over (a new one starts)."""
        config = self.config
        handed = False
        # a full batch waits for the one applying: memory stays bounded by two batches
        full = batch.full(config.batch_max_rows, config.batch_max_bytes)
        if applier.busy and (applier.done() or full):
            self._finish_applying(applier)
        due = bool(batch) and hand_over_due(full=full, age=time.monotonic() - batch.started,
                                            applying=applier.busy, config=config,
                                            caught_up=self.target is not None and idle)
        # maintenance beside the applies; a table's rewrites that must not run beside one (position deletes name
        # files a compaction replaces) get a gap between two applies, a batch due first
        applier.maintain(batch_due=due)
        applier.move_tags()  # when the interval has passed since the last move (beside the applies)
        if due:
            self._hand_off(applier, batch)
            handed = True
        if idle:
            unapplied = (bool(batch) and not handed) or applier.busy
            self._confirm(self.checkpoint.quiet_flush(self.stream.server_wal_end, unapplied=unapplied,
                                                      held=self.reader.oldest_pending_lsn()))
        self._watch(watch, idle)
        return handed

    def _caught_up(self, applier: Applier, batch: Batch, *, idle: bool) -> bool:
        """--until-caught-up: everything up to the server's position at start is applied. A prepared transaction
        still held is not committed: caught up without it (the slot stays at its PREPARE; it is applied once
        committed)."""
        if self.target is None or not idle or batch or applier.busy:
            return False
        return (self.stream.server_wal_end or Lsn(0)) >= self.target

    def _hand_off(self, applier: Applier, batch: Batch) -> None:
        """``batch`` to the apply thread, after the copies it calls for: tables whose rows changed without the
        stream sending them, tables without a mirror. Copies take long: the connection is kept alive."""
        with self.stream.kept_alive():
            self.batcher.finish(batch)
            self.tables.look_ahead(batch.relations())
            # before anything evolves a mirror to the batch's table versions: they tell what must be copied
            self.snapshotter.copy_rewritten(batch.versions(lambda relation: self.tables.held_position(
                relation.namespace, relation.name, changelog=self.config.changelog)))
            self.snapshotter.copy_again(batch.incomplete_inserts, "a row moved into a publication's row filter came "
                                        "without the TOAST values it did not change, which only the table holds")
            self.snapshotter.copy_unmirrored(batch.relations())
        assert batch.last_end_lsn is not None
        applier.start(batch, self.checkpoint.batch_flush(batch.last_end_lsn, self.reader.oldest_pending_lsn()))

    def _finish_applying(self, applier: Applier) -> None:
        """Wait for the batch applying (if any), then confirm what it made durable."""
        if applier.busy:
            with self.stream.kept_alive():
                applier.collect(self._confirm)

    def _confirm(self, lsn: Lsn | None) -> None:
        if self.checkpoint.advance(lsn):
            assert lsn is not None
            self.stream.confirm(lsn)

    def _watch(self, watch: SourceWatch, idle: bool) -> None:
        """The slot's status from the watch thread into the progress; a heartbeat when idle, if asked for."""
        status = watch.latest()
        if status is not self._seen_status and status is not None:
            self._seen_status = status
            self.progress.server_lsn = status.server_lsn
            self.progress.wal_retained_bytes = status.wal_retained_bytes
            self.progress.wal_status = status.wal_status
            if status.confirmed_flush_lsn is not None:
                self.progress.confirmed_lsn = status.confirmed_flush_lsn
            self._emit()
        now = time.monotonic()
        if idle and self.config.heartbeat_seconds and now - self._last_heartbeat >= self.config.heartbeat_seconds:
            watch.heartbeat()
            self._last_heartbeat = now

    def _report_acknowledged(self) -> None:
        """The slot's confirmed position as the server records it, once it has taken the last confirmation sent
        (a moment after the stream closed), into the progress: what is reported is what the server holds."""
        sent = self.checkpoint.confirmed
        slots = SlotManager(self.config.dsn)
        deadline = time.monotonic() + _ACKNOWLEDGE_SECONDS
        try:
            while True:
                slot = slots.get(self.config.slot)
                recorded = slot.confirmed_flush_lsn if slot is not None else None
                if recorded is None or recorded >= sent or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except Exception as exc:  # the source is gone (a restart): the position stays as last read
            log.warning("could not read back the slot's confirmed position: %s", " ".join(str(exc).split()))
            return
        if recorded is not None and recorded < sent:
            log.warning("the server records slot %s confirmed at %s, not at %s: the last confirmations did not "
                        "reach it (the connection was gone); what lies between is sent again at the next start "
                        "and skipped by the mirrors that hold it", self.config.slot, recorded, sent)
        self.progress.confirmed_lsn = recorded
        self._emit()
