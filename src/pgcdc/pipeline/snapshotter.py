"""Snapshots: each published table copied into its mirror at a consistent point of the slot's history.

The first run creates the slot with an exported snapshot and copies every table in it; the copy's
overwrite carries the slot's consistent point as the mirror's position, so the stream's replay below it
is skipped (:mod:`pgcdc.checkpoint`, rule 2). A table without a mirror position later (added to the
publication, or a copy interrupted) is copied at a fresh consistent point of a temporary slot.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pgcdc.checkpoint import refuse_lost_slot, refuse_positions_ahead
from pgcdc.errors import ConfigError, ConversionError
from pgcdc.faults import injection_point
from pgcdc.lsn import Lsn
from pgcdc.mirrors.status import namespace_positions, slot_mirrors_of
from pgcdc.pgoutput.messages import Relation
from pgcdc.pipeline.config import PipelineConfig, Progress, source_table
from pgcdc.pipeline.copy_reasons import CopyReason
from pgcdc.pipeline.spark_on_demand import SparkOnDemand
from pgcdc.pipeline.tables import SourceTables
from pgcdc.pipeline.workers import DaemonThreads
from pgcdc.replication import SlotManager, source_connection
from pgcdc.replication.published import PublishedTable, published_tables, server_lsn, two_phase_by_default
from pgcdc.types import SESSION_SETTINGS

log = logging.getLogger("pgcdc.pipeline")


class Snapshotter:
    def __init__(self, config: PipelineConfig, tables: SourceTables, spark: SparkOnDemand,
                 progress: Progress, set_phase: Callable[[str], None], emit: Callable[[], None]) -> None:
        self.config = config
        self.tables = tables
        self._spark = spark
        self.progress = progress
        self._set_phase = set_phase
        self._emit = emit
        self._told_unpublished: set[str] = set()  # mirrors whose unpublished table was warned of
        # what the tables copied side by side share: the source tables' converters and mirrors, the progress
        self._shared = threading.RLock()

    def snapshot(self) -> dict[str, int]:
        """Create the slot and copy every published table consistently with it (if not done yet)."""
        config = self.config
        with source_connection(config.dsn, 120.0) as conn:
            tables = published_tables(conn, config.publication)
            self.tables.registry.load_from_server(conn)
            two_phase = config.two_phase if config.two_phase is not None else two_phase_by_default(conn)
        refuse_unpublished_partitioning(config, tables)
        slots = SlotManager(config.dsn)
        existing = slots.get(config.slot)
        slots.refuse_busy(existing)
        if existing is not None and config.resnapshot:
            log.warning("resnapshot: dropping slot %s and copying every table again", config.slot)
            slots.drop(config.slot)
            existing = None
        if existing is None:
            if not config.resnapshot:
                # only this publication's mirrors: a namespace may also hold the mirrors of other pgcdc runs
                # (other publications, other slots) writing the same warehouse
                published = {(t.schema, t.name) for t in tables}
                refuse_lost_slot(config.slot, config.destination.namespace, {
                    name: lsn for name, lsn in self.tables.read_mirrors(namespace_positions).items()
                    if name in published})
            self._spark.start_soon()  # while the slot is created
            self._set_phase("snapshot")
            copied: dict[str, int] = {}  # committed copies: the JVM may be past asking after an interrupt
            with slots.dropped_on_failure(config.slot, backs_mirrors=lambda: bool(copied)), \
                    slots.create(config.slot, two_phase=two_phase, export_snapshot=True) as created:
                return self._copy(tables, created.exported_snapshot, created.consistent_point, copied)
        return self.copy_missing(tables)

    def check_positions(self) -> None:
        """Before streaming: no mirror of this publication's tables may hold a position beyond the server's WAL
        (the namespace may hold other runs' mirrors too, of other sources); the mirrors this slot streamed into
        whose tables the publication no longer has are named once."""
        positions = self.tables.read_mirrors(namespace_positions)
        if positions:
            with source_connection(self.config.dsn, 120.0) as conn:
                published = {(t.schema, t.name) for t in published_tables(conn, self.config.publication)}
                refuse_positions_ahead({name: lsn for name, lsn in positions.items() if name in published},
                                       server_lsn(conn))
            unpublished = {name: lsn for name, lsn in positions.items() if name not in published}
            if unpublished:
                self._tell_unpublished(unpublished)

    def _tell_unpublished(self, unpublished: dict[tuple[str, str], Lsn]) -> None:
        """Warn of each mirror of this slot among ``unpublished`` (source table: the position its mirror holds): no
        change of it comes any more, so the mirror stays as it was, which nothing else would tell (a table dropped,
        renamed or moved to another schema gets no message in the stream; a renamed or moved one is copied under
        its new name)."""
        slot = self.config.slot
        for schema, table, identifier in self.tables.read_mirrors(lambda m: slot_mirrors_of(m, slot, unpublished)):
            if identifier in self._told_unpublished:
                continue
            self._told_unpublished.add(identifier)
            log.warning("%s.%s is no longer in publication %s (dropped, renamed, moved to another schema or taken "
                        "out of it): its mirror %s keeps the rows it held at %s and is no longer written. Drop the "
                        "mirror if it is not wanted; if the table is published under that name again, it is copied "
                        "again", schema, table, self.config.publication, identifier, unpublished[(schema, table)])

    def copy_missing(self, tables: list[PublishedTable]) -> dict[str, int]:
        """Copy published tables that have no mirror position yet at a fresh consistent point of a temporary
        slot; the stream's replay below that point is skipped per table by rule 2."""
        positions = self.tables.read_mirrors(namespace_positions)
        missing = [t for t in tables if (t.schema, t.name) not in positions]
        if not missing:
            return {}
        self._spark.start_soon()  # while the temporary slot is created
        self._set_phase("snapshot")
        with SlotManager(self.config.dsn).create_temporary_snapshot() as temporary:
            return self._copy(missing, temporary.exported_snapshot, temporary.consistent_point)

    def copy_unmirrored(self, relations: list[Relation]) -> None:
        """Tables the stream started sending without a mirror (added to the publication while running) are
        copied first; rule 2 then skips the batch's changes that the copy already holds."""
        missing = [r for r in relations if not self.tables.has_position(r)]
        if missing:
            with source_connection(self.config.dsn, 120.0) as conn:
                tables = [t for t in published_tables(conn, self.config.publication)
                          if any(t.relation.relation_id == r.relation_id for r in missing)]
            self.copy_missing(tables)
            self._set_phase("streaming")

    def copy_rewritten(self, versions: list[Relation]) -> dict[tuple[str, str], CopyReason]:
        """Tables whose mirror's rows hold values that a change of the table's schema changed without logical
        decoding sending them, or that are keyed otherwise now (:meth:`SourceTables.copy_reason`), are copied
        again at a fresh consistent point of a temporary slot; rule 2 then skips the batch's changes that the copy
        already holds. Returns each table copied again with its reason."""
        if not versions:
            return {}
        started = time.monotonic()
        storage = self.tables.storage_of(versions)
        self.progress.catalog_checks += 1
        self.progress.catalog_check_seconds += time.monotonic() - started
        reasons: dict[tuple[str, str], CopyReason] = {}
        for relation in versions:
            name = (relation.namespace, relation.name)
            if name in reasons or not self.tables.has_position(relation):
                continue
            table_storage = storage.get(relation.relation_id)
            facts = self.tables.mirror_facts(relation)  # read once for both questions
            reason = self.tables.copy_reason(relation, table_storage, facts=facts)
            if reason is not None:
                reasons[name] = reason
            else:
                self.tables.record_refreshed_shape(relation, table_storage, facts=facts)
        for text in sorted({reason.text for reason in reasons.values()}):
            self.copy_again({name for name, reason in reasons.items() if reason.text == text}, text)
        for (schema, table), reason in reasons.items():
            self.progress.copies_again.append((f"{schema}.{table}", reason.why.name, reason.text))
        return reasons

    def copy_again(self, names: set[tuple[str, str]], why: str) -> None:
        """Copy the tables ``names`` (schema, table) again at a fresh consistent point of a temporary slot, for
        the reason ``why``; rule 2 then skips the batch's changes that the copy already holds."""
        if not names:
            return
        log.warning("copying %s again: %s", ", ".join(f"{s}.{t}" for s, t in sorted(names)), why)
        with source_connection(self.config.dsn, 120.0) as conn:
            tables = [t for t in published_tables(conn, self.config.publication) if (t.schema, t.name) in names]
        self._set_phase("snapshot")
        with SlotManager(self.config.dsn).create_temporary_snapshot() as temporary:
            self._copy(tables, temporary.exported_snapshot, temporary.consistent_point)
        self._set_phase("streaming")

    def _copy(self, tables: list[PublishedTable], snapshot_name: str, consistent_lsn: Lsn,
              copied: dict[str, int] | None = None) -> dict[str, int]:
        """Copy ``tables`` at ``consistent_lsn`` (``snapshot_name`` exports it), one commit each, up to
        ``copy_workers`` side by side (each task imports the snapshot, so every table is read at the same moment);
        returns the rows of each. A table a value of which stops its copy (``--on-conversion-error stop``) does not
        stop the others: they are copied, then one error names it and says which tables were copied and which were
        not. Any other failure, or an interrupt, starts no further table and waits for the copies under way (a
        table whose rows are all written commits, whole; the others commit nothing), so that ``copied`` says what
        the mirrors hold when this returns or raises."""
        copied = {} if copied is None else copied
        for table in tables:  # every total is known before the first copy starts: progress shows what is left
            self.progress.snapshot_estimates[f"{table.schema}.{table.name}"] = table.estimated_rows
        stopped: dict[str, ConversionError] = {}
        halted = threading.Event()

        def copy(table: PublishedTable) -> None:
            if halted.is_set():
                return
            label = f"{table.schema}.{table.name}"
            try:
                rows = self._copy_table(table, snapshot_name, consistent_lsn)
            except ConversionError as exc:
                log.error("%s", exc)
                stopped[label] = exc
            except BaseException:
                halted.set()  # no further table starts
                raise
            else:
                copied[label] = rows

        workers = min(self.config.copy_workers, len(tables))
        # which mirrors exist already, those that do loaded (side by side): once each, for their copies
        looked = [(table.schema, table.name) for table in tables]
        if workers <= 1:
            self.tables.mirrors.look_at(looked)
            for table in tables:
                copy(table)
        else:
            # the catalog and the namespaces of the mirrors made side by side: made first, once
            mirrors = self.tables.mirrors
            for schema in sorted({table.schema for table in tables}):
                mirrors.ensure_namespace(schema)
            # the largest first: a large table's parallel tasks start at once, the small ones fill the cores between
            ordered = sorted(tables, key=lambda t: -max(t.estimated_rows or 0, 0))
            pool = DaemonThreads("pgcdc-copy", workers)
            try:  # an interrupt: no further table; the copies under way end (Spark's jobs cancelled)
                mirrors.look_at(looked, pool.run_all)
                pool.run_all(copy, ordered)
            finally:
                pool.shutdown()
        if stopped:
            done_labels = sorted(label for label in copied if label not in stopped)
            first = next(iter(stopped.values()))
            raise ConversionError(
                f"{first} — copied: {', '.join(done_labels) or 'none'}; not copied: {', '.join(sorted(stopped))} "
                "(each is copied at the next run, the others stream from where their copy ended)")
        return copied

    def _copy_table(self, table: PublishedTable, snapshot_name: str, consistent_lsn: Lsn) -> int:
        """One table's copy, committed with ``consistent_lsn`` as its mirror's position (and, under quarantine, the
        rows it set aside committed before it); returns the rows copied."""
        from pgcdc.apply.rejects import replace_copied_rejects
        from pgcdc.change_table import copied_rejects
        from pgcdc.spark.orphans import remove_unreferenced_files
        from pgcdc.spark.schema import spark_schema
        from pgcdc.spark.snapshot import SetAside, copy_table

        with self._shared:
            converter = self.tables.converter_for(table.relation)
        # the copy replaces every row: a mirror keyed otherwise is made again with the table's key (the mirrors of
        # the tables copied side by side are made side by side: each is its own table, in a namespace made before)
        mirror = self.tables.mirror_for(table.relation, replacing_rows=True, storage=table.storage)
        if mirror.position is None:  # files of an interrupted copy of this table, never committed
            remove_unreferenced_files(self._spark(), mirror.identifier, mirror.iceberg_table)
        label = f"{table.schema}.{table.name}"
        injection_point("snapshot.copy")

        def report(p, label=label):
            with self._shared:
                self.progress.snapshot_rows[label] = p.rows
                self._emit()

        def set_aside(rows: list[SetAside]) -> None:
            position = replace_copied_rejects(self._spark(), mirror, copied_rejects(
                [(row.error, row.values) for row in rows], consistent_lsn))
            if position is not None:
                mirror.rejects_position = position
            injection_point("snapshot.rejects")
            if rows:
                with self._shared:
                    self.progress.rows_rejected += len(rows)
                log.warning("%s: %d rows set aside in its __rejects table (first: %s)", label, len(rows),
                            rows[0].error)

        quarantine = self.config.on_conversion_error == "quarantine"
        # the position goes into the table's properties too, where snapshot expiry cannot remove it
        with self.tables.mirrors.positions.recording(mirror.identifier, before=mirror.position, upto=consistent_lsn,
                                           held=lambda: consistent_lsn, whole=not mirror.spec.key_columns) as recording:
            result = copy_table(
                self._spark(), dsn=self.config.dsn, source_schema=table.schema, source_table=table.name,
                columns=[c.name for c in table.relation.columns], converter=converter,
                spark_schema=spark_schema(converter.arrow_schema), target_identifier=mirror.identifier,
                snapshot_name=snapshot_name, consistent_lsn=consistent_lsn,
                session_settings=dict(SESSION_SETTINGS), progress=report, writer=self.config.snapshot_writer,
                target_rows_per_task=self.config.snapshot_rows_per_task, row_filter=table.row_filter,
                set_aside=set_aside if quarantine else None, table=mirror.iceberg_table,
            )
            if result.recorded:
                recording.written_by_commit()
        mirror.position = consistent_lsn
        with self._shared:
            if mirror.spec.shape is not None and mirror.shape != mirror.spec.shape:  # the rows are the new shape's
                self.tables.mirrors.record_shape(table.schema, table.name, mirror.spec.shape)
            self.progress.snapshot_rows[label] = result.rows
        log.info("copied %s: %d rows in %.1fs at %s", label, result.rows, result.seconds, consistent_lsn,
                 extra={"event": "snapshot.copied", "table": label, "rows": result.rows,
                        "lsn": str(consistent_lsn), "seconds": round(result.seconds, 3)})
        return result.rows


def refuse_unpublished_partitioning(config: PipelineConfig, tables: list[PublishedTable]) -> None:
    """A --partition-by naming a table the publication does not publish is a mistake that would otherwise show only
    as a mirror made without its partitioning: refused, naming what is published."""
    published = {(t.schema, t.name) for t in tables}
    unknown = [name for name in config.partition_by if source_table(name) not in published]
    if unknown:
        names = ", ".join(sorted(f"{schema}.{table}" for schema, table in published)[:20]) or "no table"
        raise ConfigError(f"--partition-by names {', '.join(unknown)}, which publication {config.publication} does "
                          f"not publish (it publishes {names}); name each table with its schema, as PostgreSQL "
                          "does (double quotes around a name with capitals or dots)")
