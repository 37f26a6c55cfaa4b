"""One source table's changes of a batch into its Iceberg mirror, in one atomic commit: reduce, write, commit.

Input is an Arrow change table (:mod:`pgcdc.change_table`), not replication objects. A batch flows down once:

1. :mod:`.changelog` (with ``--changelog``): every change appended to ``<table>__changes`` first, in a commit of
   its own carrying its own position;
2. :mod:`.reduce`: what the mirror must become (pure Arrow): the changes it does not hold yet, the last one per
   key, key changes, unchanged TOAST values, TRUNCATE;
3. :mod:`.mirror_reads`: what only the mirror knows (unchanged values the batch never saw, copies of keyless
   rows);
4. a writer makes it durable in one commit that carries the position (``pgcdc.lsn``): :mod:`.row_delta` (the
   default: Arrow-written files, one Iceberg row delta, no Spark query) or :mod:`.merge_writer` (``--apply merge``,
   and mirrors the row-delta writer cannot write: partitioned, format v1, rows matched on nested columns — with
   a log line that says why).

:func:`apply_changes` returns the positions it committed; its caller records them (:mod:`pgcdc.pipeline.applier`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pgcdc.apply.changelog import append_changelog
from pgcdc.apply.fold import Fold, SmallFiles
from pgcdc.apply.merge_writer import merge
from pgcdc.apply.mirror_reads import completed, position_deletes, positioned
from pgcdc.apply.reduce import KEYED, Reduction, after_position, ordered, reduce_changes
from pgcdc.apply.row_delta import Committed, PositionDeletes, RowDeltaWriter
from pgcdc.apply.steps import StepClock
from pgcdc.errors import Unindexable
from pgcdc.iceberg.parquet import in_layout
from pgcdc.index.mirror_index import IndexBudget, MirrorIndex, index_for
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import MirrorTable
from pgcdc.positions import commit_properties
from pgcdc.spark.iceberg_java import TableState, load_table, refreshed_state

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("pgcdc.apply.batch")

WRITERS = ("delta", "merge")
DELETES = ("position", "equality")  # how the row-delta writer removes rows (docs/pipeline.md, "The commit protocol")


@dataclass(frozen=True)
class AppliedChanges:
    """What an apply put into a mirror: the changes it did not already hold and their transactions' commit LSNs (a
    replay after a reconnection or a crash applies, and counts, only what the mirror lacked); the position the
    mirror holds after it, and its change log's (None: unchanged)."""

    changes: int = 0
    commit_lsns: frozenset[int] = frozenset()
    position: Lsn | None = None
    changelog_position: Lsn | None = None
    # the commit set the mirror's pgcdc.position property itself, in its own metadata commit (the row-delta writer):
    # nothing is left for the caller to record
    recorded: bool = False
    seconds: Mapping[str, float] = field(default_factory=dict)  # wall time of each step (:mod:`.steps`)


def apply_changes(spark: SparkSession, mirror: MirrorTable, changes: pa.Table, *, lsn: Lsn,
                  changelog: bool = False, writer: str = "delta", deletes: str = "position",
                  budget: IndexBudget | None = None, before_merge: Callable[[], None] | None = None
                  ) -> AppliedChanges:
    """Apply ``changes`` to ``mirror`` and record ``lsn`` as its position, in one commit; returns what was applied.

    ``lsn`` is the commit LSN of the last transaction ``changes`` holds whole. Nothing is committed when every
    change is already in the mirror. ``writer``: "delta" or "merge" (see the module); ``deletes``: how the
    row-delta writer removes rows, "position" (from the mirror's key index, within ``budget``) or "equality".
    The row-delta writer sets the mirror's ``pgcdc.position`` property in its commit; ``before_merge`` is called
    before a commit of the MERGE writer, which cannot."""
    if writer not in WRITERS:
        raise ValueError(f"apply writer {writer!r} must be one of {', '.join(WRITERS)}")
    if deletes not in DELETES:
        raise ValueError(f"deletes {deletes!r} must be one of {', '.join(DELETES)}")
    clock = StepClock()
    changes = ordered(changes)
    changelog_position = None
    if changelog:  # first: the change log's own position makes a replay after a crash here harmless
        changelog_position = append_changelog(spark, mirror, after_position(changes, mirror.changelog_position), lsn)
        clock.lap("changelog")
    spec = mirror.spec
    reduction = reduce_changes(changes, list(spec.spark_schema.names), spec.key_columns,
                               append_only=spec.append_only, position=mirror.position)
    clock.lap("reduce")
    if reduction is None:
        return AppliedChanges(changelog_position=changelog_position, seconds=clock.seconds)
    if reduction.unmatched:  # only a publication that does not publish them lets them happen
        log.warning("%s has no replica identity: %d updates/deletes cannot be mirrored", spec.source,
                    reduction.unmatched)
    target = _row_delta_target(spark, mirror, deletes) if writer == "delta" else None
    clock.lap("table")
    index = _index(mirror, target, budget) if target is not None and deletes == "position" else None
    if index is None and target is not None and mirror.deletes == "equality":  # its index could not be had
        target = _row_delta_target(spark, mirror, "equality")
    clock.lap("index")
    if index is not None and target is not None:
        _commit_by_position(mirror, reduction, lsn, target, index, clock)
    else:
        _commit(spark, mirror, reduction, lsn, target, before_merge, clock)
    return AppliedChanges(reduction.changes, reduction.commit_lsns, lsn, changelog_position,
                          recorded=target is not None, seconds=clock.seconds)


def _commit_by_position(mirror: MirrorTable, reduction: Reduction, lsn: Lsn, target: RowDeltaWriter,
                        index: MirrorIndex, clock: StepClock) -> None:
    """The reduced batch in one row delta whose deletes name the rows they remove by file and position, resolved
    against the snapshot the index describes, the mirror's small files folded in (apply/fold.py); the index
    follows the commit."""
    rows, located = positioned(mirror, reduction, index, target.schema)
    deletes = position_deletes(index, located)
    clock.lap("positions")
    summary, properties = commit_properties(lsn)
    indexed = index.snapshot_id
    if mirror.small_files is None:  # this process's first batch to the mirror: the last commit's small files
        mirror.small_files = SmallFiles()
        files = getattr(index, "files", None)
        if not target.partitioned and files is not None:
            mirror.small_files.recover(target.table, indexed, files, target.schema)
    small = mirror.small_files
    if reduction.truncated:  # every row replaced: nothing to fold (committed() below starts the small files over)
        fold = None
        committed = target.commit(rows, deletes, summary, table_properties=properties, replace_all=True,
                                  validate_from=indexed, clock=clock)
    else:
        # a partitioned mirror's batch writes a file per partition: maintenance compacts them, nothing is folded
        fold = small.plan(rows, deletes.files, built_on=None if target.partitioned else indexed,
                          equality_deletes=target.equality_deletes)
        clock.lap("fold")
        committed = target.commit(fold.rows, PositionDeletes(fold.deletes, deletes.partitions), summary,
                                  table_properties=properties, validate_from=indexed, removed=fold.remove_data,
                                  removed_deletes=fold.remove_deletes, clock=clock)
    _follow_commit(index, indexed, committed, located, rows, target, truncated=reduction.truncated, fold=fold)
    small.committed(committed, fold)
    clock.lap("index follows")


def _follow_commit(index: MirrorIndex, indexed: int | None, committed: Committed, located: Any, rows: pa.Table,
                   target: RowDeltaWriter, *, truncated: bool, fold: Fold | None) -> None:
    """The index, which described snapshot ``indexed``, brought to the batch's own commit: the batch's ``rows`` at
    the start of its data file, the rows ``fold`` moved there after them."""
    if committed.parent_id != indexed:
        # Iceberg committed the batch on top of someone else's commit made meanwhile (validated: it removed no file
        # the deletes name): the index follows that one too, then the batch's own, from the table's metadata
        index.refresh(target.table, index.files)
        return
    key_layout = pa.schema([target.schema.field(n) for n in index.key_names])
    keys = in_layout(rows.select(index.key_names), key_layout)
    # each data file holds the batch's rows it was given, in that order (all of them, unpartitioned)
    written = [(file.path, keys.take(pa.array(file.rows[file.rows < rows.num_rows])), file.data_file)
               for file in committed.written]
    with index.following():
        if truncated:
            index.replaced(committed.snapshot_id, written)
        else:
            index.committed(committed.snapshot_id, located, written)
        if fold is not None and fold.folded_path is not None:  # added first: each key keeps its slot, then moves
            if committed.data_path is not None and fold.folded is not None and fold.folded.num_rows:
                index.add_file(committed.data_path, in_layout(fold.folded.select(index.key_names), key_layout),
                               committed.data_file, positions=np.arange(rows.num_rows,
                                                                        rows.num_rows + fold.folded.num_rows,
                                                                        dtype=np.int64))
            index.drop_file(fold.folded_path)


def _index(mirror: MirrorTable, target: RowDeltaWriter, budget: IndexBudget | None) -> MirrorIndex | None:
    """The mirror's key index, up to date with the table the writer loaded; None for a mirror that deletes by
    equality (append-only mirrors delete nothing; one whose index cannot be had says why, once)."""
    spec = mirror.spec
    if spec.append_only or mirror.deletes == "equality":
        return None
    key_names = list(spec.key_columns) or list(spec.spark_schema.names)
    try:
        mirror.index = index_for(mirror.index, target.table, key_names, target.schema,
                                 multiset=not spec.key_columns, budget=budget, state=target.state)
    except Unindexable as exc:
        log.warning("%s: its mirror deletes by equality (%s); PyIceberg cannot read it until it is compacted",
                    spec.source, exc)
        mirror.deletes, mirror.index = "equality", None
        return None
    return mirror.index


def _commit(spark: SparkSession, mirror: MirrorTable, reduction: Reduction, lsn: Lsn,
            target: RowDeltaWriter | None, before_merge: Callable[[], None] | None, clock: StepClock) -> None:
    """The reduced batch, with what the mirror knows, made durable in one commit carrying ``lsn``: a row delta
    with equality deletes, or a MERGE."""
    rows, removed = completed(spark, mirror, reduction)
    clock.lap("positions")
    if target is None:
        if before_merge is not None:
            before_merge()
        merge(spark, mirror, reduction.kind, rows, removed, lsn, keys=reduction.keys,
              replace_all=reduction.truncated)
        # a commit made through Spark: the table handle kept for the row-delta writer is read again next time
        clock.lap("merge")
        return
    summary, properties = commit_properties(lsn)
    if reduction.kind == KEYED and removed is not None:
        # every key the batch touches: an older row under it is replaced or removed; the batch's own new row
        # shares the commit's sequence number, which equality deletes do not reach
        removed = pa.concat_tables([removed, rows.select(list(reduction.keys))])
    # keyless: an equality delete on every column removes every identical older row (NULL matches NULL), as the
    # MERGE's null-safe match does; the copies that stay are among the commit's new rows
    target.commit(rows, removed, summary, table_properties=properties, replace_all=reduction.truncated, clock=clock)


def _row_delta_target(spark: SparkSession, mirror: MirrorTable, deletes: str) -> RowDeltaWriter | None:
    """The mirror as the row-delta writer writes it in this batch; None (the MERGE writer applies the batch)
    when it cannot, with the reason logged."""
    table, state = _current_table(spark, mirror)
    target = RowDeltaWriter(spark, table, mirror.writer_layout, state)
    mirror.writer_layout = target.layout
    by_equality = deletes == "equality" or mirror.deletes == "equality"
    matched_on = [] if mirror.spec.append_only or not by_equality else (
        list(mirror.spec.key_columns) or list(mirror.spec.spark_schema.names))
    reason = target.unwritable(matched_on)
    if reason is not None:
        log.info("%s: the MERGE writer applies this batch to %s: %s", mirror.spec.source, mirror.identifier, reason)
        return None
    return target


def _current_table(spark: SparkSession, mirror: MirrorTable) -> tuple[Any, TableState | None]:
    """The mirror's Iceberg table as it stands now, and what the batch asks of it first (None without pgcdc's jar):
    the handle kept from its last batch, refreshed — one read of the catalog's pointer, and of the metadata only
    when someone committed since (pgcdc's own commit, its maintenance, the MERGE writer, anyone's compaction) — or
    loaded when there is none. Loading it afresh every batch, through Spark's catalog, parsed its identifier and
    its whole metadata every time."""
    table = mirror.iceberg_table
    if table is not None:
        try:
            return table, refreshed_state(table)
        except Exception as exc:  # dropped and made again under its name, say: loaded afresh below
            log.info("%s: its table is loaded again (%s)", mirror.identifier, str(exc).splitlines()[0][:200])
    mirror.iceberg_table = table = load_table(spark, mirror.identifier)
    return table, refreshed_state(table)
