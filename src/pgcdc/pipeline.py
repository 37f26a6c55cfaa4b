"""The pipeline: a replication slot mirrored into Iceberg tables, exactly once.

This is the one module that knows every room: replication gives messages,
transactions turns them into committed transactions, types converts tuple data
to Arrow, and spark applies Arrow change tables to the Iceberg mirrors.

Exactly once, in three rules:

1. A mirror's Iceberg commit carries ``pgcdc.lsn``, the commit LSN of the last
   transaction it holds, in the same atomic commit as the data.
2. Replayed changes at or below a mirror's ``pgcdc.lsn`` are skipped, so a
   restart from any earlier slot position applies nothing twice.
3. The slot's flush position moves only after every mirror a batch touched has
   committed, and never past a transaction still held (streamed, prepared).

>>> Pipeline(PipelineConfig(dsn="host=... dbname=shop", publication="shop")).run(until_caught_up=True)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.errors import ConfigError, PositionCorruptError
from pgcdc.faults import injection_point
from pgcdc.lsn import ZERO, Lsn
from pgcdc.pgoutput.messages import PG_EPOCH_UNIX_MICROS, Relation, TupleData, Type
from pgcdc.replication import (
    LogicalReplicationStream,
    ReplicationOptions,
    SlotManager,
    SlotStatus,
    SourceWatch,
    check_source,
    slot_name_problem,
    source_connection,
)
from pgcdc.replication.published import PublishedTable, published_tables
from pgcdc.runtime import streaming_gc
from pgcdc.secrets import parse_dsn
from pgcdc.transactions import Change, Transaction, TransactionAssembler
from pgcdc.types import SESSION_SETTINGS, ConversionOptions, TableConverter, TypeRegistry

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.spark.mirror import MirrorCatalog, MirrorTable

log = logging.getLogger("pgcdc.pipeline")



@dataclass
class PipelineConfig:
    """Everything a pipeline needs; validated before anything touches a server or the JVM.

    ``dsn`` is a libpq connection string or URI for the source database (TLS
    settings such as ``sslmode`` pass through). ``spark_conf`` overrides any
    Spark or Iceberg catalog setting (``spark.sql.catalog.<catalog>.*``).
    """

    dsn: str
    publication: str
    slot: str = "pgcdc"
    catalog: str = "pgcdc"
    namespace: str = "mirror"
    warehouse: str | None = "warehouse"
    spark_master: str | None = None
    spark_conf: Mapping[str, str] = field(default_factory=dict)
    batch_max_rows: int = 200_000
    batch_max_seconds: float = 5.0
    changelog: bool = False
    snapshot: bool = True
    binary: bool = False
    proto_version: int | None = None
    streaming: str | None = None
    two_phase: bool | None = None
    origin: str | None = None
    numeric: str = "string"
    memory_limit_bytes: int = 256 << 20
    heartbeat_seconds: float | None = None
    spill_dir: str | None = None
    resnapshot: bool = False
    receive_timeout_seconds: float = 60.0
    snapshot_writer: str = "auto"

    def __post_init__(self) -> None:
        problems = []
        try:
            parse_dsn(self.dsn)
        except ConfigError as exc:
            problems.append(str(exc))
        if not self.publication or "\0" in self.publication or len(self.publication.encode()) > 63:
            problems.append(f"publication {self.publication!r} must be a PostgreSQL name: 1-63 bytes, no NUL")
        if slot_name_problem(self.slot):
            problems.append(str(slot_name_problem(self.slot)))
        if self.batch_max_rows < 1:
            problems.append("batch_max_rows must be at least 1")
        if self.batch_max_seconds <= 0:
            problems.append("batch_max_seconds must be positive")
        if self.receive_timeout_seconds <= 0:
            problems.append("receive_timeout_seconds must be positive")
        if self.heartbeat_seconds is not None and self.heartbeat_seconds <= 0:
            problems.append("heartbeat_seconds must be positive")
        if self.proto_version is not None and self.proto_version not in (1, 2, 3, 4):
            problems.append(f"proto_version {self.proto_version} is not one of 1, 2, 3, 4")
        if self.streaming not in (None, "off", "on", "parallel"):
            problems.append(f"streaming {self.streaming!r} must be off, on or parallel")
        if self.origin not in (None, "any", "none"):
            problems.append(f"origin {self.origin!r} must be any or none")
        if self.numeric not in ("string", "decimal38"):
            problems.append(f"numeric policy {self.numeric!r} must be string or decimal38")
        if self.snapshot_writer not in ("auto", "arrow", "spark"):
            problems.append(f"snapshot writer {self.snapshot_writer!r} must be auto, arrow or spark")
        if problems:
            raise ConfigError("; ".join(problems))


@dataclass
class Progress:
    """A snapshot of what the pipeline has done, for status lines and metrics."""

    phase: str = "starting"
    rows_applied: int = 0
    transactions_applied: int = 0
    batches_applied: int = 0
    applied_lsn: Lsn | None = None
    confirmed_lsn: Lsn | None = None
    received_lsn: Lsn | None = None  # end of the last whole transaction received
    applying_rows: int = 0  # changes of the batch being merged now (0: none)
    server_lsn: Lsn | None = None
    wal_retained_bytes: int | None = None
    wal_status: str | None = None
    rows_per_s: float = 0.0
    last_batch_seconds: float = 0.0
    snapshot_rows: dict[str, int] = field(default_factory=dict)
    snapshot_estimates: dict[str, int] = field(default_factory=dict)  # pg_class.reltuples of each table to copy
    errors: int = 0  # replication connections lost (and re-established)

    @property
    def lag_bytes(self) -> int | None:
        if self.server_lsn is None or self.applied_lsn is None:
            return None
        return max(0, int(self.server_lsn) - int(self.applied_lsn))


_CHUNK_ROWS = 20_000


@dataclass
class _Segment:
    """A run of one table's changes under one schema version, converted to Arrow chunk by chunk so that a
    batch holding a million-row transaction costs its Arrow size, not a million Python objects."""

    relation: Relation
    pending: list[tuple[Transaction, Change]] = field(default_factory=list)
    chunks: list[pa.Table] = field(default_factory=list)
    first_lsn: Lsn = ZERO
    last_lsn: Lsn = ZERO
    previous_lsn: Lsn = ZERO  # the greatest commit LSN below last_lsn held by this segment

    def note(self, commit_lsn: Lsn) -> None:
        if not self.first_lsn:
            self.first_lsn = commit_lsn
        if commit_lsn != self.last_lsn:
            if self.last_lsn:
                self.previous_lsn = self.last_lsn
            self.last_lsn = commit_lsn


@dataclass
class _Batch:
    """Whole transactions waiting to be applied, per source table (relation id)."""

    tables: dict[int, list[_Segment]] = field(default_factory=dict)
    rows: int = 0
    transactions: int = 0
    last_commit_lsn: Lsn | None = None
    last_end_lsn: Lsn | None = None
    started: float = field(default_factory=time.monotonic)

    def __bool__(self) -> bool:
        return self.transactions > 0


@dataclass
class _Applying:
    """A batch on the apply thread, and the position its success makes safe to confirm."""

    batch: _Batch
    flush: Lsn
    future: Future[float]


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

            attach_catalog(spark, config.warehouse, config.catalog, config.spark_conf)
        self._spark = spark
        self._on_progress = on_progress
        self.progress = Progress()
        self._stop = threading.Event()
        self._registry = TypeRegistry()
        self._converters: dict[tuple, TableConverter] = {}
        self._mirror_keys: dict[int, tuple[str, ...]] = {}
        self._mirrors: MirrorCatalog | None = None
        self._rate_window: list[tuple[float, int]] = []
        self._mirrored: set[tuple[str, str]] = set()

    # -- public -------------------------------------------------------------------
    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            from pgcdc.spark.session import spark_session

            self._spark = spark_session(self.config.warehouse, self.config.catalog,
                                        master=self.config.spark_master, conf=self.config.spark_conf)
        return self._spark

    @property
    def mirrors(self) -> MirrorCatalog:
        if self._mirrors is None:
            from pgcdc.spark.mirror import MirrorCatalog

            self._mirrors = MirrorCatalog(self.spark, catalog=self.config.catalog, namespace=self.config.namespace)
        return self._mirrors

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
        with self._source() as conn:
            tables = published_tables(conn, self.config.publication)
            self._registry.load_from_server(conn)
        slots = SlotManager(self.config.dsn)
        existing = slots.get(self.config.slot)
        slots.refuse_busy(existing)
        if existing is not None and self.config.resnapshot:
            log.warning("resnapshot: dropping slot %s and copying every table again", self.config.slot)
            slots.drop(self.config.slot)
            existing = None
        if existing is None:
            self._refuse_lost_slot()
            self._set_phase("snapshot")
            copied: dict[str, int] = {}  # committed copies: the JVM may be past asking after an interrupt
            with slots.dropped_on_failure(self.config.slot, backs_mirrors=lambda: bool(copied)), \
                    slots.create(self.config.slot, two_phase=self._two_phase_wanted(),
                                 export_snapshot=True) as created:
                return self._copy_tables(tables, created.exported_snapshot, created.consistent_point, copied)
        return self._snapshot_missing(tables)

    def run(self, *, until_caught_up: bool = False, handle_signals: bool = True) -> Progress:
        """Snapshot if needed, then stream into the mirrors until stopped (or caught up)."""
        with self._signals(handle_signals), streaming_gc():
            if self.config.snapshot:
                self.snapshot()
            else:
                self.check()
            return self._stream(until_caught_up=until_caught_up)

    # -- snapshot -----------------------------------------------------------------
    def _refuse_lost_slot(self) -> None:
        """The slot is missing but mirrors hold positions: it was dropped, or lost in a failover to a server it
        was not synchronized to. A new slot starts at today's WAL, so the changes between the mirrors' positions
        and now would be skipped without a word: stop, unless asked to copy every table again."""
        if self.config.resnapshot:
            return
        positions = self.mirrors.positions()
        if not positions:
            return
        newest = max(positions.values())
        raise ConfigError(
            f"replication slot {self.config.slot!r} does not exist, but {len(positions)} mirrors in namespace "
            f"{self.config.namespace!r} hold positions (up to {newest}). The slot was dropped, or lost in a "
            "failover to a server it was not synchronized to; the changes made since those positions are no "
            "longer in any slot, and recreating it would skip them silently. Copy every table again at a fresh "
            "consistent point with --resnapshot (pgcdc run --resnapshot), or point pgcdc at the right server/slot")

    def _check_positions(self) -> None:
        """A mirror position beyond the server's WAL is impossible for this source: a mirror written from
        another server, a source restored from an older backup, or a corrupt position. Never trusted."""
        positions = self.mirrors.positions()
        if not positions:
            return
        server = self._server_lsn()
        ahead = {f"{schema}.{table}": lsn for (schema, table), lsn in positions.items() if lsn > server}
        if ahead:
            listed = ", ".join(f"{name} at {lsn}" for name, lsn in sorted(ahead.items()))
            raise PositionCorruptError(
                f"mirrors hold positions beyond the source server's current WAL position {server}: {listed}. They "
                "were not written from this server's history (another server, a source restored from an older "
                "backup, or an altered position), so pgcdc cannot know what they hold. Copy them again: run "
                "with --resnapshot, or drop those mirrors in Spark and run pgcdc")

    def _snapshot_missing(self, tables: list[PublishedTable]) -> dict[str, int]:
        """Copy published tables that have no mirror yet (added to the publication later, or a copy that was
        interrupted) at a fresh consistent point of a temporary slot; the stream's replay below that point
        is skipped per table by rule 2."""
        positions = self.mirrors.positions()
        missing = [t for t in tables if (t.schema, t.name) not in positions]
        if not missing:
            return {}
        self._set_phase("snapshot")
        slots = SlotManager(self.config.dsn)
        with slots.create_temporary_snapshot() as temporary:
            return self._copy_tables(missing, temporary.exported_snapshot, temporary.consistent_point)

    def _copy_tables(self, tables: list[PublishedTable], snapshot_name: str, consistent_lsn: Lsn,
                     copied: dict[str, int] | None = None) -> dict[str, int]:
        from pgcdc.spark.orphans import remove_unreferenced_files
        from pgcdc.spark.snapshot import copy_table

        copied = {} if copied is None else copied
        for table in tables:  # every total is known before the first copy starts: progress shows what is left
            self.progress.snapshot_estimates[f"{table.schema}.{table.name}"] = table.estimated_rows
        for table in tables:
            converter = self.converter_for(table.relation)
            mirror = self._ensure_mirror(table.relation, converter)
            if mirror.position is None:  # files of an interrupted copy of this table, never committed
                remove_unreferenced_files(self.spark, mirror.identifier)
            label = f"{table.schema}.{table.name}"
            injection_point("snapshot.copy")

            def report(p, label=label):
                self.progress.snapshot_rows[label] = p.rows
                self._emit()

            result = copy_table(
                self.spark, dsn=self.config.dsn, source_schema=table.schema, source_table=table.name,
                columns=[c.name for c in table.relation.columns], converter=converter,
                spark_schema=converter.spark_schema, target_identifier=mirror.identifier,
                snapshot_name=snapshot_name, consistent_lsn=consistent_lsn,
                session_settings=dict(SESSION_SETTINGS), progress=report, writer=self.config.snapshot_writer,
            )
            copied[label] = result.rows
            mirror.position = consistent_lsn
            self.progress.snapshot_rows[label] = result.rows
            log.info("copied %s: %d rows in %.1fs at %s", label, result.rows, result.seconds, consistent_lsn,
                     extra={"event": "snapshot.copied", "table": label, "rows": result.rows,
                            "lsn": str(consistent_lsn), "seconds": round(result.seconds, 3)})
        return copied

    # -- streaming ----------------------------------------------------------------
    def _stream(self, *, until_caught_up: bool) -> Progress:
        config = self.config
        slot = SlotManager(config.dsn).get(config.slot)
        if slot is None:
            raise ConfigError(f"replication slot {config.slot!r} does not exist; run with snapshot enabled "
                              f"(pgcdc snapshot) or create it with: pgcdc slot create {config.slot}")
        self._check_positions()
        if slot.invalidated:
            reason = slot.invalidation_reason or slot.wal_status
            raise ConfigError(f"replication slot {config.slot!r} was invalidated ({reason}): the WAL it needed is "
                              "gone, so the changes since the mirrors' positions cannot be streamed. Copy every "
                              "table again with --resnapshot (it drops the slot and creates a new one); to keep "
                              "this from recurring, raise max_slot_wal_keep_size or keep pgcdc running")
        with self._source() as conn:
            self._registry.load_from_server(conn)
            tables = published_tables(conn, config.publication)
        binary = config.binary
        text_only = [t.relation.qualified_name for t in tables if self.converter_for(t.relation).requires_text_mode]
        if binary and text_only:
            log.warning("binary values requested, but %s have types without a binary decoder: streaming text",
                        ", ".join(text_only))
            binary = False
        target = self._server_lsn() if until_caught_up else None
        options = ReplicationOptions(publication=config.publication, proto_version=config.proto_version,
                                     streaming=config.streaming, two_phase=config.two_phase,
                                     binary=binary, messages=True, origin=config.origin)
        stream = LogicalReplicationStream(config.dsn, slot=config.slot, options=options,
                                          start_lsn=slot.confirmed_flush_lsn,
                                          receive_timeout=config.receive_timeout_seconds)
        assembler = TransactionAssembler(memory_limit_bytes=config.memory_limit_bytes, spill_dir=config.spill_dir)
        self._set_phase("streaming")
        batch = _Batch()
        last_heartbeat = 0.0
        seen_status: SlotStatus | None = None
        # One batch applies on the apply thread while the next one is read, decoded and converted here: the
        # stream never waits for a MERGE unless a full batch is ready before the one before it is applied.
        with SourceWatch(config.dsn, config.slot) as watch, \
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="pgcdc-apply") as applier:
            applying: _Applying | None = None
            try:
                # short idle ticks: a batch that finished applying while the stream is quiet is confirmed soon
                for event in stream.events(idle_timeout=min(0.25, config.batch_max_seconds)):
                    if event.reconnected:  # the server resends everything after the confirmed position
                        self.progress.errors += 1
                        assembler.close()
                        assembler = TransactionAssembler(memory_limit_bytes=config.memory_limit_bytes,
                                                         spill_dir=config.spill_dir)
                        batch = _Batch()
                        continue
                    if event.message is not None:
                        for item in assembler.feed(event.message):
                            if isinstance(item, Transaction):
                                self._add(batch, item)
                                item.close()
                            elif isinstance(item, Type):
                                self._registry.observe(item)
                    if self._stop.is_set():
                        if applying is not None:
                            done, applying = applying, None
                            self._applied(done, stream)
                        if batch:
                            self._applied(self._start_apply(applier, batch, assembler), stream)
                        batch = _Batch()
                        break
                    idle = event.message is None
                    # a full batch waits for the one applying: memory stays bounded by two batches
                    if applying is not None and (applying.future.done() or batch.rows >= config.batch_max_rows):
                        done, applying = applying, None
                        self._applied(done, stream)
                    if applying is None and batch and (
                            batch.rows >= config.batch_max_rows
                            or time.monotonic() - batch.started >= config.batch_max_seconds
                            or (target is not None and idle)):
                        applying = self._start_apply(applier, batch, assembler)
                        batch = _Batch()
                    caught_up = idle and not batch and applying is None and assembler.oldest_pending_lsn() is None
                    if caught_up and stream.server_wal_end:
                        # a quiet slot: everything received is applied, so the server's position is safe to
                        # confirm and WAL does not pile up behind the slot
                        stream.confirm(stream.server_wal_end)
                    status = watch.latest()
                    if status is not seen_status and status is not None:
                        seen_status = status
                        self.progress.server_lsn = status.server_lsn
                        self.progress.wal_retained_bytes = status.wal_retained_bytes
                        self.progress.wal_status = status.wal_status
                        self._emit()
                    now = time.monotonic()
                    if idle and config.heartbeat_seconds and now - last_heartbeat >= config.heartbeat_seconds:
                        watch.heartbeat()
                        last_heartbeat = now
                    if caught_up and target is not None and (stream.server_wal_end or Lsn(0)) >= target:
                        break
            finally:
                if applying is not None:  # the loop failed: the batch applying finishes, and counts if it worked
                    try:
                        self._applied(applying, stream)
                    except Exception as exc:
                        log.error("the batch being applied failed too: %s", exc)
                if batch and not self._stop.is_set():
                    log.warning("stopping with %d unapplied transactions; they will be replayed", batch.transactions)
                stream.close()
            assembler.close()
        self._set_phase("stopped")
        return self.progress

    def _start_apply(self, applier: ThreadPoolExecutor, batch: _Batch,
                     assembler: TransactionAssembler) -> _Applying:
        """Hand ``batch`` to the apply thread; nothing else may be applying."""
        for segments in batch.tables.values():
            for segment in segments:
                self._convert_pending(segment)
        self._snapshot_unmirrored(batch)
        assert batch.last_end_lsn is not None
        # an unfinished (streamed or prepared) transaction began before the batch's end: the server must
        # resend it after a restart, so the confirmed position stays before its start
        held = assembler.oldest_pending_lsn()
        flush = held if held is not None and held < batch.last_end_lsn else batch.last_end_lsn
        self.progress.applying_rows = batch.rows
        return _Applying(batch, flush, applier.submit(self._apply, batch))

    def _apply(self, batch: _Batch) -> float:
        """Merge every segment of ``batch`` into its mirror (on the apply thread); returns the seconds taken."""
        from pgcdc.spark.apply import apply_changes

        started = time.monotonic()
        applied = 0
        for segments in batch.tables.values():
            for index, segment in enumerate(segments):
                # A schema change inside a transaction splits it over two segments: the first must not claim
                # that transaction, or rule 2 would skip its rest after a crash between the two commits.
                following = segments[index + 1] if index + 1 < len(segments) else None
                splits_transaction = following is not None and following.first_lsn == segment.last_lsn
                mirror = self._ensure_mirror(segment.relation, self.converter_for(segment.relation))
                # a position never moves backwards, even when the segment holds nothing but a split transaction
                position = (max(segment.previous_lsn, mirror.position or ZERO) if splits_transaction
                            else segment.last_lsn)
                if applied:
                    injection_point("apply.between-mirrors")
                injection_point("apply.merge")
                apply_changes(self.spark, mirror, pa.concat_tables(segment.chunks), lsn=position,
                              changelog=self.config.changelog)
                applied += 1
        injection_point("apply.before-confirm")
        return time.monotonic() - started

    def _applied(self, applying: _Applying, stream: LogicalReplicationStream) -> None:
        """Wait for ``applying`` (raising its error), then confirm what it made durable and count it."""
        elapsed = applying.future.result()
        batch = applying.batch
        stream.confirm(applying.flush)
        progress = self.progress
        progress.rows_applied += batch.rows
        progress.transactions_applied += batch.transactions
        progress.batches_applied += 1
        progress.applied_lsn = batch.last_end_lsn
        progress.confirmed_lsn = applying.flush
        progress.last_batch_seconds = elapsed
        progress.applying_rows = 0
        self._rate_window.append((time.monotonic(), progress.rows_applied))
        self._rate_window = self._rate_window[-20:]
        (t0, r0), (t1, r1) = self._rate_window[0], self._rate_window[-1]
        progress.rows_per_s = (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0
        log.info("applied %d rows of %d transactions up to %s in %.2fs", batch.rows, batch.transactions,
                 batch.last_commit_lsn, elapsed)
        self._emit()

    def _snapshot_unmirrored(self, batch: _Batch) -> None:
        """Tables the stream started sending without a mirror (added to the publication while running) are
        copied first; rule 2 then skips the batch's changes that the copy already holds."""
        relations = [segments[0].relation for segments in batch.tables.values()]
        missing = [r for r in relations if not self._has_mirror(r)]
        if missing:
            with self._source() as conn:
                tables = [t for t in published_tables(conn, self.config.publication)
                          if any(t.relation.relation_id == r.relation_id for r in missing)]
            self._snapshot_missing(tables)
            self._set_phase("streaming")

    def _has_mirror(self, relation: Relation) -> bool:
        key = (relation.namespace, relation.name)
        if key not in self._mirrored:
            mirror = self._ensure_mirror(relation, self.converter_for(relation))
            if mirror.position is None:
                return False
            self._mirrored.add(key)
        return True

    def _add(self, batch: _Batch, txn: Transaction) -> None:
        for change in txn.changes():
            targets: tuple[Relation, ...]
            if change.op == "T":
                targets = change.truncate_relations
            elif change.op in ("I", "U", "D") and change.relation is not None:
                targets = (change.relation,)
            else:  # transactional logical messages are not table data
                continue
            for relation in targets:
                segments = batch.tables.setdefault(relation.relation_id, [])
                if not segments or not _same_schema(segments[-1].relation, relation):
                    if segments:
                        self._convert_pending(segments[-1])
                    segments.append(_Segment(relation))
                segment = segments[-1]
                segment.pending.append((txn, change))
                segment.note(txn.commit_lsn)
                if len(segment.pending) >= _CHUNK_ROWS:
                    self._convert_pending(segment)
            batch.rows += 1
        batch.transactions += 1
        batch.last_commit_lsn = txn.commit_lsn
        batch.last_end_lsn = txn.end_lsn
        self.progress.received_lsn = txn.end_lsn

    def _convert_pending(self, segment: _Segment) -> None:
        if segment.pending:
            relation = segment.relation
            segment.chunks.append(build_change_table(segment.pending, self.converter_for(relation),
                                                     self._key_columns(relation)))
            segment.pending = []

    # -- helpers ------------------------------------------------------------------
    def converter_for(self, relation: Relation) -> TableConverter:
        """The converter of a relation version (one per distinct schema, reused)."""
        signature = _schema_signature(relation)
        converter = self._converters.get(signature)
        if converter is None:
            converter = TableConverter(relation, self._registry, ConversionOptions(numeric=self.config.numeric))
            self._converters[signature] = converter
        return converter

    def _key_columns(self, relation: Relation) -> tuple[str, ...]:
        """The mirror's key: the primary key when there is one (also under REPLICA IDENTITY FULL, where
        pgoutput flags every column), else the replica identity index, else none."""
        keys = self._mirror_keys.get(relation.relation_id)
        if keys is None:
            with self._source() as conn:
                row = conn.execute(
                    "SELECT array_agg(a.attname ORDER BY array_position(i.indkey, a.attnum)) "
                    "FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
                    "WHERE i.indrelid = %s AND i.indisprimary", (relation.relation_id,)).fetchone()
            primary = tuple(row[0]) if row and row[0] else ()
            names = {c.name for c in relation.columns}
            if primary and set(primary) <= names:
                keys = primary
            elif relation.replica_identity in ("d", "i"):
                keys = tuple(c.name for c in relation.key_columns)
            else:
                keys = ()
            self._mirror_keys[relation.relation_id] = keys
        return keys

    def _ensure_mirror(self, relation: Relation, converter: TableConverter) -> MirrorTable:
        from pgcdc.spark.mirror import TableSpec

        if relation.replica_identity == "n":
            log.warning("%s has REPLICA IDENTITY NOTHING: its mirror is insert-only (updates and deletes cannot "
                        "be matched); fix with ALTER TABLE %s REPLICA IDENTITY FULL or add a primary key",
                        relation.qualified_name, relation.qualified_name)
        spec = TableSpec(source_schema=relation.namespace, source_table=relation.name,
                         spark_schema=converter.spark_schema, key_columns=self._key_columns(relation),
                         replica_identity=relation.replica_identity)
        return self.mirrors.ensure(spec)

    def _two_phase_wanted(self) -> bool:
        if self.config.two_phase is not None:
            return self.config.two_phase
        with self._source() as conn:
            return conn.info.server_version >= 150000

    def _source(self, timeout: float = 120.0) -> contextlib.AbstractContextManager[psycopg.Connection]:
        return source_connection(self.config.dsn, timeout)

    def _server_lsn(self) -> Lsn:
        with self._source() as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
            assert row is not None
            return Lsn.parse(row[0])

    def _set_phase(self, phase: str) -> None:
        self.progress.phase = phase
        self._emit()

    def _emit(self) -> None:
        if self._on_progress is not None:
            self._on_progress(self.progress)

    @contextlib.contextmanager
    def _signals(self, enabled: bool) -> Iterator[None]:
        if not enabled or threading.current_thread() is not threading.main_thread():
            yield
            return

        def request_stop(signum: int, frame: Any) -> None:
            if self._stop.is_set():  # a second signal: stop now, the slot replays what was not confirmed
                raise KeyboardInterrupt
            log.info("stopping after the current batch (signal %d)", signum)
            self._stop.set()

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _schema_signature(relation: Relation) -> tuple:
    # Relation messages inside a stream carry an xid: two versions are the same schema without it.
    return (relation.relation_id, relation.namespace, relation.name, relation.replica_identity, relation.columns)


def _same_schema(a: Relation, b: Relation) -> bool:
    return _schema_signature(a) == _schema_signature(b)


def build_change_table(changes: Iterable[tuple[Transaction, Change]], converter: TableConverter,
                       key_columns: tuple[str, ...]) -> pa.Table:
    """Turn one table's changes into the Arrow change table :func:`pgcdc.spark.apply.apply_changes` takes."""
    from pgcdc.spark.apply import ChangeColumns as C

    relation = converter.relation
    width = len(relation.columns)
    names = [c.name for c in relation.columns]
    key_index = [names.index(k) for k in key_columns if k in names]
    null_row = TupleData("n" * width, (None,) * width)

    after: list[TupleData] = []
    before: list[TupleData] = []
    has_before: list[bool] = []
    key_changed: list[bool] = []
    ops: list[str] = []
    lsns: list[int] = []
    ordinals: list[int] = []
    xids: list[int] = []
    commit_ts: list[int] = []
    origins: list[str | None] = []
    for txn, change in changes:
        op = change.op
        old = change.old if change.old is not None else change.key
        if op == "T":
            new = null_row
        elif op == "D":
            new = _fit(old, width) if old is not None else null_row
        else:
            new = _fit(change.new, width)
        after.append(new)
        before.append(_fit(old, width) if old is not None else null_row)
        has_before.append(old is not None and op in ("U", "D"))
        key_changed.append(op == "U" and old is not None and bool(key_index) and any(
            old.kinds[i] != "u" and (old.kinds[i], old.values[i]) != (new.kinds[i], new.values[i])
            for i in key_index))
        ops.append(op)
        lsns.append(int(txn.commit_lsn))
        ordinals.append(change.ordinal)
        xids.append(txn.xid)
        commit_ts.append(txn.commit_ts)
        origins.append(txn.origin)

    lsn_for_errors = Lsn(max(lsns)) if lsns else None
    after_rows = converter.convert(after, lsn=lsn_for_errors)
    before_rows = converter.convert(before, lsn=lsn_for_errors)
    unchanged_lists: list[list[str]] = [[] for _ in after]
    for column, mask in after_rows.unchanged.items():
        for row, flag in enumerate(mask.to_pylist()):
            if flag:
                unchanged_lists[row].append(column)

    schema = converter.arrow_schema
    no_before = pa.array([not flag for flag in has_before], pa.bool_())
    before_struct = pa.StructArray.from_arrays(before_rows.batch.columns, fields=list(schema), mask=no_before)
    key_fields = [schema.field(k) for k in key_columns if k in names]
    if key_fields:
        old_key = pa.StructArray.from_arrays(
            [before_rows.batch.column(schema.get_field_index(f.name)) for f in key_fields], fields=key_fields,
            mask=pa.array([not flag for flag in key_changed], pa.bool_()))
    else:
        old_key = pa.nulls(len(after), pa.struct([]))

    columns = list(after_rows.batch.columns)
    fields = list(schema)
    extra = [
        (C.OP, pa.array(ops, pa.string())),
        (C.LSN, pa.array(lsns, pa.int64())),
        (C.ORDINAL, pa.array(ordinals, pa.int64())),
        (C.UNCHANGED, pa.array(unchanged_lists, pa.list_(pa.string()))),
        (C.OLD_KEY, old_key),
        (C.XID, pa.array(xids, pa.int64())),
        (C.COMMIT_TS, pc.add(pa.array(commit_ts, pa.int64()), PG_EPOCH_UNIX_MICROS).cast(pa.timestamp("us", tz="UTC"))),
        (C.ORIGIN, pa.array(origins, pa.string())),
        (C.BEFORE, before_struct),
    ]
    for name, array in extra:
        columns.append(array)
        fields.append(pa.field(name, array.type))
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


def _fit(tuple_data: TupleData | None, width: int) -> TupleData:
    if tuple_data is None:
        return TupleData("n" * width, (None,) * width)
    if len(tuple_data) != width:
        raise ConfigError(f"a row has {len(tuple_data)} columns where its relation has {width}")
    return tuple_data

