"""Apply one source table's changes of a micro-batch to its Iceberg mirror, in one atomic commit.

Input is an Arrow change table (see :mod:`pgcdc.change_table`), not replication objects. The steps:

1. skip changes at or below the mirror's ``pgcdc.lsn`` (:mod:`pgcdc.checkpoint`'s rule 2);
2. order by (commit LSN, ordinal); keep only what follows the last TRUNCATE, which empties the mirror;
3. resolve unchanged TOAST values from earlier changes of the batch (following key changes back),
   leaving for the mirror only what the batch cannot know;
4. reduce to the last change per key (Iceberg's MERGE refuses two source rows per key), an UPDATE that
   changes the key becoming a DELETE of the old key and a write of the new one;
5. one commit carrying ``pgcdc.lsn`` in its snapshot summary, made by one of two writers:

   - ``delta`` (:mod:`pgcdc.spark.delta`): the reduction in Arrow, then a data file of the new rows and an
     equality-delete file of the keys they replace or remove, committed as one Iceberg row delta (after a
     TRUNCATE, one overwrite) — no Spark query, except to read the mirror's values of unchanged TOAST
     columns the batch cannot know;
   - ``merge``: the reduction in Spark and one ``MERGE INTO`` (after a TRUNCATE, one overwrite).

   A mirror the delta writer cannot write (partitioned, format v1, rows matched on nested columns) is
   applied by the MERGE writer, with a log line that says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.change_table import COPIED
from pgcdc.change_table import ChangeColumns as C
from pgcdc.checkpoint import first_unapplied
from pgcdc.lsn import Lsn
from pgcdc.spark.arrow import arrow_to_dataframe, from_plain_rows, from_plain_values, plain_rows, plain_values
from pgcdc.spark.delta import DeltaTable
from pgcdc.spark.iceberg import with_commit_properties
from pgcdc.spark.mirror import (
    ORDINAL_PROPERTY,
    POSITION_PROPERTY,
    RECORD_PROPERTY,
    MirrorTable,
    TableSpec,
    cannot_widen,
    ddl_type,
    position_record,
    quote,
    sql_string,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger("pgcdc.spark.apply")

WRITERS = ("delta", "merge")


@dataclass(frozen=True)
class AppliedChanges:
    """What an apply put into a mirror: the changes it did not already hold, and their transactions' commit
    LSNs (a replay after a reconnection or a crash applies, and counts, only what the mirror lacked)."""

    changes: int = 0
    commit_lsns: frozenset[int] = frozenset()


def apply_changes(spark: SparkSession, mirror: MirrorTable, changes: pa.Table, *, lsn: Lsn,
                  changelog: bool = False, writer: str = "delta",
                  before_merge: Callable[[], None] | None = None) -> AppliedChanges:
    """Apply ``changes`` to ``mirror`` and record ``lsn`` as its position; returns what was applied.

    ``lsn`` is the commit LSN of the last transaction ``changes`` holds whole. Nothing is committed when
    every change is already in the mirror. ``writer``: "delta" or "merge" (see the module). The row-delta
    writer sets the mirror's ``pgcdc.position`` property in its commit; ``before_merge`` is called before a
    commit of the MERGE writer, which cannot.
    """
    if writer not in WRITERS:
        raise ValueError(f"apply writer {writer!r} must be one of {', '.join(WRITERS)}")
    ordered = _sorted(changes)
    if changelog:  # first: the change log's own position makes a replay after a crash here harmless
        _append_changelog(spark, mirror, _after_position(ordered, mirror.changelog_position), lsn)
    changes = _after_position(ordered, mirror.position)
    if changes.num_rows == 0:
        return AppliedChanges()
    applied = AppliedChanges(changes.num_rows, frozenset(pc.unique(changes.column(C.LSN)).to_pylist()))
    ops = changes.column(C.OP)
    truncates = pc.indices_nonzero(pc.equal(ops, "T")).to_pylist()
    truncated = bool(truncates)
    if truncated:
        changes = changes.slice(truncates[-1] + 1)
    spec = mirror.spec
    target = _delta_target(spark, mirror) if writer == "delta" else None
    if target is None and before_merge is not None:
        before_merge()
    if target is not None:
        _apply_delta(spark, mirror, target, changes, lsn, truncated)
    elif spec.key_columns:
        _apply_keyed(spark, mirror, changes, lsn, truncated)
    elif spec.append_only:
        _write_rows(spark, mirror, _source_frame(spark, mirror, _inserts(spec, changes)), lsn, overwrite=truncated)
    else:
        _apply_keyless(spark, mirror, changes, lsn, truncated)
    mirror.position = lsn
    return applied


# -- ordering and filtering ------------------------------------------------------------------


def _after_position(changes: pa.Table, position: Lsn | None) -> pa.Table:
    if position is None or changes.num_rows == 0:
        return changes
    return changes.filter(pc.greater_equal(changes.column(C.LSN), first_unapplied(position)))


def _sorted(changes: pa.Table) -> pa.Table:
    if changes.num_rows == 0:
        return changes
    order = pc.sort_indices(changes, sort_keys=[(C.LSN, "ascending"), (C.ORDINAL, "ascending")])
    return changes.take(order)


def _source_names(mirror: MirrorTable) -> list[str]:
    return list(mirror.spec.spark_schema.names)


def _inserts(spec: TableSpec, changes: pa.Table) -> pa.Table:
    """The inserts of an append-only mirror's changes (see :attr:`TableSpec.append_only`)."""
    inserts = changes.filter(pc.equal(changes.column(C.OP), "I"))
    if inserts.num_rows != changes.num_rows:  # only a publication that does not publish them lets them happen
        log.warning("%s has no replica identity: %d updates/deletes cannot be mirrored", spec.source,
                    changes.num_rows - inserts.num_rows)
    return inserts


# -- keyed tables ----------------------------------------------------------------------------


def _apply_keyed(spark: SparkSession, mirror: MirrorTable, changes: pa.Table, lsn: Lsn, truncated: bool) -> None:
    keys = list(mirror.spec.key_columns)
    changes, fill_keys = _resolve_unchanged(changes, keys, _source_names(mirror))
    events = _with_old_key_deletes(changes, keys, fill_keys)
    frame = arrow_to_dataframe(spark, events, _event_schema(mirror, events))
    frame.createOrReplaceTempView("_pgcdc_events")
    names = _source_names(mirror)
    key_list = ", ".join(quote(k) for k in keys)
    # Last event per key wins: Iceberg's MERGE allows one source row per target row.
    reduced = spark.sql(
        f"SELECT * FROM (SELECT *, row_number() OVER (PARTITION BY {key_list} ORDER BY {C.SEQ} DESC) AS _pgcdc_rank"
        f" FROM _pgcdc_events) WHERE _pgcdc_rank = 1")
    if fill_keys is not None and not truncated:
        reduced = _fill_from_mirror(spark, mirror, reduced, keys, names)
    reduced.createOrReplaceTempView("_pgcdc_source")
    if truncated:
        rows = spark.sql(f"SELECT {', '.join(quote(n) for n in names)} FROM _pgcdc_source WHERE {C.OP} <> 'D'")
        _write_rows(spark, mirror, rows, lsn, overwrite=True)
        return
    maybe_unchanged = _columns_ever_unchanged(changes)
    assignments = ", ".join(
        f"{quote(n)} = CASE WHEN array_contains(s.{C.UNCHANGED}, {sql_string(n)}) THEN t.{quote(n)} "
        f"ELSE s.{quote(n)} END" if n in maybe_unchanged else f"{quote(n)} = s.{quote(n)}"
        for n in names)
    on = " AND ".join([f"t.{quote(k)} = s.{quote(k)}" for k in keys] + _key_ranges(events, keys))
    statement = (
        f"MERGE INTO {mirror.identifier} t USING _pgcdc_source s ON {on} "
        f"WHEN MATCHED AND s.{C.OP} = 'D' THEN DELETE "
        f"WHEN MATCHED THEN UPDATE SET {assignments} "
        f"WHEN NOT MATCHED AND s.{C.OP} <> 'D' THEN INSERT ({', '.join(quote(n) for n in names)}) "
        f"VALUES ({', '.join('s.' + quote(n) for n in names)})")
    with_commit_properties(spark, {POSITION_PROPERTY: str(lsn)}, lambda: spark.sql(statement))


def _key_ranges(events: pa.Table, keys: list[str]) -> list[str]:
    """``t.k BETWEEN lo AND hi`` for each integer key column, lo and hi the batch's own extremes: it changes no
    match (every event's key lies in the range) but lets Iceberg skip the mirror's data files whose key
    statistics fall outside it, so a MERGE reads the part of the mirror the batch touches, not all of it."""
    ranges = []
    for key in keys:
        column = events.column(key)
        if not pa.types.is_integer(column.type) or column.null_count == len(column):
            continue
        extremes = pc.min_max(column)
        ranges.append(f"t.{quote(key)} BETWEEN {int(extremes['min'].as_py())} AND {int(extremes['max'].as_py())}")
    return ranges


def _with_old_key_deletes(changes: pa.Table, keys: list[str], fill_keys: pa.Array | None) -> pa.Table:
    """Each change is one event; an UPDATE that changed the key is preceded by a DELETE of the old key."""
    count = changes.num_rows
    seq = pa.array([2 * i + 1 for i in range(count)], pa.int64())
    events = changes.append_column(C.SEQ, seq)
    events = events.append_column(C.FILL_KEY, fill_keys if fill_keys is not None
                                  else pa.nulls(count, changes.schema.field(C.OLD_KEY).type))
    moved = pc.indices_nonzero(pc.is_valid(changes.column(C.OLD_KEY))).to_pylist()
    if not moved:
        return events
    deletes = events.take(moved)
    old_keys = deletes.column(C.OLD_KEY).combine_chunks()
    columns = []
    for field in deletes.schema:
        if field.name in keys:
            columns.append(old_keys.field(field.name))
        elif field.name == C.OP:
            columns.append(pa.array(["D"] * len(moved), pa.string()))
        elif field.name == C.SEQ:
            columns.append(pa.array([2 * i for i in moved], pa.int64()))
        elif field.name in (C.LSN, C.ORDINAL, C.XID, C.COMMIT_TS, C.ORIGIN):
            columns.append(deletes.column(field.name))
        elif field.name == C.UNCHANGED:
            columns.append(pa.array([[] for _ in moved], field.type))
        else:
            columns.append(pa.nulls(len(moved), field.type))
    return pa.concat_tables([events, pa.Table.from_arrays(columns, schema=deletes.schema)])


def _columns_ever_unchanged(changes: pa.Table) -> set[str]:
    flat = pc.list_flatten(changes.column(C.UNCHANGED))
    return set(pc.unique(flat).to_pylist()) if len(flat) else set()


def _resolve_unchanged(changes: pa.Table, keys: list[str], names: list[str]
                       ) -> tuple[pa.Table, pa.Array | None]:
    """Fill unchanged TOAST values from earlier changes of the same row in this batch.

    A row is followed back through key-changing updates. What the batch cannot tell is left
    unchanged for the MERGE to keep from the mirror — under the row's own key, or, when its key
    changed in this batch, under the key it had before the batch (returned as fill keys).
    """
    unchanged = changes.column(C.UNCHANGED).to_pylist()
    wanted = [i for i, cols in enumerate(unchanged) if cols]
    if not wanted:
        return changes, None
    ops = changes.column(C.OP).to_pylist()
    key_rows = list(zip(*(plain_values(changes.column(k)) for k in keys), strict=True))
    old_keys: list[tuple[Any, ...] | None] = [None if k is None else tuple(k[name] for name in keys)
                for k in plain_values(changes.column(C.OLD_KEY))]
    by_key: dict[tuple, list[int]] = {}
    for index, key in enumerate(key_rows):
        by_key.setdefault(key, []).append(index)
    affected = sorted({c for i in wanted for c in unchanged[i]})
    values = {name: plain_values(changes.column(name)) for name in affected}
    fill: list[dict[str, Any] | None] = [None] * changes.num_rows

    for row in wanted:
        missing = list(unchanged[row])
        search_key: tuple[Any, ...] = old_keys[row] or key_rows[row]
        limit = row
        while missing:
            earlier = [j for j in by_key.get(search_key, ()) if j < limit]
            if not earlier:
                break
            j = earlier[-1]
            if ops[j] == "D":
                missing = []  # the row did not exist before: nothing to keep
                break
            for name in list(missing):
                if name not in unchanged[j]:
                    values[name][row] = values[name][j]
                    missing.remove(name)
            previous_key = old_keys[j]
            if previous_key is not None:
                search_key = previous_key
            limit = j
        unchanged[row] = missing
        if missing and search_key != key_rows[row]:
            fill[row] = dict(zip(keys, search_key, strict=True))

    columns = {name: from_plain_values(values[name], changes.schema.field(name).type) for name in affected}
    columns[C.UNCHANGED] = pa.array(unchanged, changes.schema.field(C.UNCHANGED).type)
    resolved = changes
    for name, array in columns.items():
        resolved = resolved.set_column(resolved.schema.get_field_index(name), name, array)
    fill_type = changes.schema.field(C.OLD_KEY).type
    fill_keys = from_plain_values(fill, fill_type) if any(f is not None for f in fill) else None
    return resolved, fill_keys


def _fill_from_mirror(spark: SparkSession, mirror: MirrorTable, reduced: DataFrame, keys: list[str],
                      names: list[str]) -> DataFrame:
    """Unchanged values of rows whose key changed in this batch, from the mirror row under the old key."""
    reduced.createOrReplaceTempView("_pgcdc_reduced")
    on = " AND ".join(f"f.{quote(k)} = s.{C.FILL_KEY}.{quote(k)}" for k in keys)
    columns = ", ".join(
        f"CASE WHEN s.{C.FILL_KEY} IS NOT NULL AND array_contains(s.{C.UNCHANGED}, {sql_string(n)}) "
        f"THEN f.{quote(n)} ELSE s.{quote(n)} END AS {quote(n)}" for n in names)
    others = ", ".join(f"s.{c}" for c in (C.OP, C.LSN, C.ORDINAL, C.XID, C.COMMIT_TS, C.ORIGIN, C.SEQ))
    return spark.sql(
        f"SELECT {columns}, {others}, CASE WHEN s.{C.FILL_KEY} IS NOT NULL THEN array() "
        f"ELSE s.{C.UNCHANGED} END AS {C.UNCHANGED} FROM _pgcdc_reduced s "
        f"LEFT JOIN {mirror.identifier} f ON s.{C.FILL_KEY} IS NOT NULL AND {on}")


# -- tables without a key --------------------------------------------------------------------


def _keyless_effect(changes: pa.Table, names: list[str]) -> tuple[list[tuple[dict, int]], list[dict]]:
    """(whole rows to delete from the mirror, each with how many of its identical copies go; rows to insert)
    of a table without a key: within the batch a delete first cancels an identical row inserted earlier in it."""
    after = plain_rows(changes.select(names))
    before = plain_values(changes.column(C.BEFORE))
    unchanged = changes.column(C.UNCHANGED).to_pylist()
    pending: dict[str, list[dict]] = {}
    deletes: dict[str, tuple[dict, int]] = {}
    for op, new, old, kept in zip(changes.column(C.OP).to_pylist(), after, before, unchanged, strict=True):
        if op in ("U", "D") and old is not None:
            image = repr(tuple(old[n] for n in names))
            if pending.get(image):
                pending[image].pop()
            else:
                deletes[image] = (old, deletes[image][1] + 1 if image in deletes else 1)
        if op in ("I", "U"):
            if kept and old is not None:  # the old image (FULL) carries the value an unchanged column kept
                new = {**new, **{n: old[n] for n in kept}}
            pending.setdefault(repr(tuple(new[n] for n in names)), []).append(new)
    return list(deletes.values()), [row for rows in pending.values() for row in rows]


def _keyless_changes(spark: SparkSession, mirror: MirrorTable, changes: pa.Table,
                     truncated: bool) -> tuple[pa.Table, pa.Table]:
    """(whole rows to delete from the mirror, rows to insert) of a table without a key. A table without a key
    may hold identical rows, and a DELETE of one of them removes that one alone; a match on every column
    finds them all. So each deleted row goes with all its copies, and the copies that stay are inserted
    again: the mirror is read for how many it holds."""
    names = _source_names(mirror)
    schema = pa.schema([changes.schema.field(n) for n in names])
    deleted, inserts = _keyless_effect(changes, names)
    if truncated or not deleted:
        return from_plain_rows([], schema), from_plain_rows(inserts, schema)
    deleted_rows = from_plain_rows([row for row, _ in deleted], schema)
    held = _copies_held(spark, mirror, deleted_rows)
    staying = [row for index, (row, gone) in enumerate(deleted) for _ in range(held.get(index, 0) - gone)]
    return deleted_rows, from_plain_rows(inserts + staying, schema)


def _whole_row_match(names: list[str]) -> str:
    """Mirror row ``t`` equals source row ``s`` on every column, NULL matching NULL."""
    return " AND ".join(f"t.{quote(n)} <=> s.{quote(n)}" for n in names)


def _copies_held(spark: SparkSession, mirror: MirrorTable, rows: pa.Table) -> dict[int, int]:
    """How many rows of the mirror equal each row of ``rows`` (by its index; NULL matches NULL)."""
    from pyspark.sql.types import IntegerType, StructField, StructType

    names = _source_names(mirror)
    indexed = rows.append_column("_pgcdc_row", pa.array(range(rows.num_rows), pa.int32()))
    schema = StructType([*mirror.spec.spark_schema.fields, StructField("_pgcdc_row", IntegerType())])
    arrow_to_dataframe(spark, indexed, schema).createOrReplaceTempView("_pgcdc_deleted")
    counted = spark.sql(f"SELECT s._pgcdc_row, count(*) AS n FROM {mirror.identifier} t JOIN _pgcdc_deleted s "
                        f"ON {_whole_row_match(names)} GROUP BY s._pgcdc_row").collect()
    return {row[0]: row[1] for row in counted}


def _apply_keyless(spark: SparkSession, mirror: MirrorTable, changes: pa.Table, lsn: Lsn, truncated: bool) -> None:
    """REPLICA IDENTITY FULL without a key: rows match on every column, as one MERGE."""
    names = _source_names(mirror)
    deleted, inserts = _keyless_changes(spark, mirror, changes, truncated)
    if truncated:
        _write_rows(spark, mirror, arrow_to_dataframe(spark, inserts, mirror.spec.spark_schema), lsn, overwrite=True)
        return
    marked = pa.concat_tables([deleted.append_column(C.OP, pa.array(["D"] * deleted.num_rows, pa.string())),
                               inserts.append_column(C.OP, pa.array(["I"] * inserts.num_rows, pa.string()))])
    from pyspark.sql.types import StringType, StructField, StructType

    frame_schema = StructType([*mirror.spec.spark_schema.fields, StructField(C.OP, StringType())])
    arrow_to_dataframe(spark, marked, frame_schema).createOrReplaceTempView("_pgcdc_source")
    statement = (
        f"MERGE INTO {mirror.identifier} t USING _pgcdc_source s ON s.{C.OP} = 'D' AND {_whole_row_match(names)} "
        f"WHEN MATCHED THEN DELETE "
        f"WHEN NOT MATCHED AND s.{C.OP} = 'I' THEN INSERT ({', '.join(quote(n) for n in names)}) "
        f"VALUES ({', '.join('s.' + quote(n) for n in names)})")
    with_commit_properties(spark, {POSITION_PROPERTY: str(lsn)}, lambda: spark.sql(statement))


# -- the row-delta writer --------------------------------------------------------------------


def _delta_target(spark: SparkSession, mirror: MirrorTable) -> DeltaTable | None:
    """The mirror as the row-delta writer writes it in this batch; None (the MERGE writer applies the batch)
    when it cannot, with the reason logged."""
    target = DeltaTable(spark, mirror.identifier)
    matched_on = list(mirror.spec.key_columns) or (
        [] if mirror.spec.append_only else _source_names(mirror))
    reason = target.unwritable(matched_on)
    if reason is not None:
        log.info("%s: the MERGE writer applies this batch to %s: %s", mirror.spec.source, mirror.identifier, reason)
        return None
    return target


def _apply_delta(spark: SparkSession, mirror: MirrorTable, target: DeltaTable, changes: pa.Table, lsn: Lsn,
                 truncated: bool) -> None:
    """One commit of the batch's new rows and of equality deletes of what they replace or remove."""
    spec = mirror.spec
    names = _source_names(mirror)
    properties = {POSITION_PROPERTY: str(lsn)}
    recorded = {RECORD_PROPERTY: position_record(lsn)}
    if spec.key_columns:
        keys = list(spec.key_columns)
        resolved, fill_keys = _resolve_unchanged(changes, keys, names)
        last = _last_per_key(_with_old_key_deletes(resolved, keys, fill_keys), keys)
        rows = last.filter(pc.not_equal(last.column(C.OP), "D"))
        if not truncated:
            rows = _fill_from_mirror_rows(spark, mirror, rows, keys)
        # every key the batch touches: an older row under it is replaced or removed; the batch's own new row
        # shares the commit's sequence number, which equality deletes do not reach
        target.commit(rows.select(names), None if truncated else last.select(keys), properties,
                      table_properties=recorded, replace_all=truncated)
    elif spec.append_only:
        target.commit(_inserts(spec, changes).select(names), None, properties, table_properties=recorded, replace_all=truncated)
    else:
        deleted, inserts = _keyless_changes(spark, mirror, changes, truncated)
        # an equality delete on every column removes every identical older row (NULL matches NULL), as the
        # MERGE's null-safe match does; the copies that stay are among the commit's new rows
        target.commit(inserts, None if truncated else deleted, properties, table_properties=recorded,
                      replace_all=truncated)


def _last_per_key(events: pa.Table, keys: list[str]) -> pa.Table:
    """The last event (highest ``_pgcdc_seq``) of each key, in key order (tighter column bounds per file)."""
    if events.num_rows == 0:
        return events
    last = events.select([*keys, C.SEQ]).group_by(keys, use_threads=False).aggregate([(C.SEQ, "max")])
    kept = events.filter(pc.is_in(events.column(C.SEQ), value_set=last.column(f"{C.SEQ}_max")))
    return kept.take(pc.sort_indices(kept, sort_keys=[(k, "ascending") for k in keys]))


def _fill_from_mirror_rows(spark: SparkSession, mirror: MirrorTable, rows: pa.Table, keys: list[str]) -> pa.Table:
    """Unchanged TOAST values the batch cannot know, read from the mirror: under the row's key, or under the key
    it had before the batch when its key changed in it. One bounded read of just those keys."""
    unchanged = rows.column(C.UNCHANGED).to_pylist()
    wanted = [i for i, columns in enumerate(unchanged) if columns]
    if not wanted:
        return rows
    fill = plain_values(rows.column(C.FILL_KEY))
    own = list(zip(*(plain_values(rows.column(k)) for k in keys), strict=True))
    lookup = {i: tuple(fill[i][k] for k in keys) if fill[i] is not None else own[i] for i in wanted}
    key_schema = pa.schema([rows.schema.field(k) for k in keys])
    key_table = from_plain_rows([dict(zip(keys, key, strict=True)) for key in set(lookup.values())], key_schema)
    found = _mirror_rows_by_key(spark, mirror, key_table, keys)
    at = {key: row for row, key in enumerate(zip(*(plain_values(found.column(k)) for k in keys), strict=True))}
    positions = pa.array([at.get(lookup[i]) if i in lookup else None for i in range(rows.num_rows)], pa.int64())
    for name in sorted({c for i in wanted for c in unchanged[i]}):
        keep = pa.array([name in (columns or ()) for columns in unchanged], pa.bool_())
        index = rows.schema.get_field_index(name)
        mirrored = found.column(name).take(positions).cast(rows.schema.field(name).type)
        rows = rows.set_column(index, rows.schema.field(name), pc.if_else(keep, mirrored, rows.column(name)))
    return rows


def _mirror_rows_by_key(spark: SparkSession, mirror: MirrorTable, keys_table: pa.Table, keys: list[str]) -> pa.Table:
    """The mirror's rows under ``keys_table``'s keys, as Arrow (no trip through Python values: dates and
    timestamps beyond Python's range come back whole)."""
    from pyspark.sql.types import StructType

    key_frame = arrow_to_dataframe(spark, keys_table, StructType([mirror.spec.spark_schema[k] for k in keys]))
    mirror_frame = spark.table(mirror.identifier).alias("t")
    ranges = _key_ranges(keys_table, keys)
    if ranges:  # lets Iceberg skip the data files outside the keys' range
        mirror_frame = mirror_frame.where(" AND ".join(ranges))
    found = mirror_frame.join(key_frame, on=keys, how="left_semi").select(*_source_names(mirror))
    batches = found._collect_as_arrow()
    if not batches:  # none of the keys is in the mirror: every value looked up is NULL
        return pa.table({name: pa.nulls(0, keys_table.schema.field(name).type if name in keys else pa.null())
                         for name in _source_names(mirror)})
    return pa.Table.from_batches(batches)


# -- writes ----------------------------------------------------------------------------------


def _source_frame(spark: SparkSession, mirror: MirrorTable, changes: pa.Table) -> DataFrame:
    return arrow_to_dataframe(spark, changes.select(_source_names(mirror)), mirror.spec.spark_schema)


def _write_rows(spark: SparkSession, mirror: MirrorTable, rows: DataFrame, lsn: Lsn, *, overwrite: bool) -> None:
    from pyspark.sql.functions import lit

    writer = (rows.writeTo(mirror.identifier).option(f"snapshot-property.{POSITION_PROPERTY}", str(lsn))
              # key columns are required in the mirror; the rows carry them, typed nullable by Arrow
              .option("check-nullability", "false"))
    if overwrite:
        writer.overwrite(lit(True))
    else:
        writer.append()


def _event_schema(mirror: MirrorTable, events: pa.Table) -> StructType:
    from pyspark.sql.types import LongType, StructField, StructType

    key_fields = [f for f in mirror.spec.spark_schema.fields if f.name in mirror.spec.key_columns]
    key_struct = StructType([StructField(f.name, f.dataType, True) for f in key_fields])
    return StructType([
        *mirror.spec.spark_schema.fields,
        *_spark_fields(events.schema, (C.OP, C.LSN, C.ORDINAL, C.UNCHANGED, C.XID, C.COMMIT_TS, C.ORIGIN)),
        StructField(C.SEQ, LongType()),
        StructField(C.FILL_KEY, key_struct),
    ])


def _spark_fields(schema: pa.Schema, names: tuple[str, ...]) -> list:
    """Spark fields for plain (non-source) columns of ``schema``, typed from the change table's Arrow types."""
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField

    return [StructField(name, from_arrow_type(schema.field(name).type)) for name in names]


# -- change log ------------------------------------------------------------------------------


def _append_changelog(spark: SparkSession, mirror: MirrorTable, changes: pa.Table, lsn: Lsn) -> None:
    """Every change as one row of ``<mirror>__changes``: op, position, transaction, before and after images."""
    if changes.num_rows == 0:
        return
    names = _source_names(mirror)
    after_type = pa.struct([changes.schema.field(n) for n in names])
    after = pa.StructArray.from_arrays([changes.column(n).combine_chunks() for n in names], fields=list(after_type),
                                       mask=pc.equal(changes.column(C.OP), "T").combine_chunks())
    log_table = pa.table({
        "op": changes.column(C.OP),
        "commit_lsn": pa.array([str(Lsn(v)) for v in changes.column(C.LSN).to_pylist()], pa.string()),
        "commit_lsn_value": changes.column(C.LSN),
        "ordinal": changes.column(C.ORDINAL),
        "commit_ts": changes.column(C.COMMIT_TS),
        "xid": changes.column(C.XID),
        "origin": changes.column(C.ORIGIN),
        "unchanged_toast": changes.column(C.UNCHANGED),
        "before": changes.column(C.BEFORE),
        "after": after,
    })
    from pyspark.sql.types import StructField, StructType

    image = StructType(list(mirror.spec.spark_schema.fields))
    plain = tuple(name for name in log_table.column_names if name not in ("before", "after"))
    schema = StructType([*_spark_fields(log_table.schema, plain),
                         StructField("before", image), StructField("after", image)])
    frame = arrow_to_dataframe(spark, log_table, schema)
    writer = (frame.writeTo(mirror.changelog_identifier)
              .option(f"snapshot-property.{POSITION_PROPERTY}", str(lsn))
              .option("merge-schema", "true"))
    if spark.catalog.tableExists(mirror.changelog_identifier):
        if mirror.changelog_image != image:
            _keep_older_images(spark, mirror.changelog_identifier, image)
        writer.append()
    else:
        (writer.using("iceberg").tableProperty("format-version", "2")
         .tableProperty("write.spark.accept-any-schema", "true").create())
    mirror.changelog_position = lsn
    mirror.changelog_image = image


def _keep_older_images(spark: SparkSession, identifier: str, image: StructType) -> None:
    """A column whose type changed to one Iceberg cannot change in place (``int`` to ``text``, a smaller
    scale): its older values stay in the change log under ``<column>__<old type>`` in the before and after
    images, and the column is added again in its place with its new type."""
    from pyspark.sql.types import StructType

    current = spark.table(identifier).schema
    for side in ("before", "after"):
        held = current[side].dataType
        assert isinstance(held, StructType)
        for name in cannot_widen(held, image):
            kept = f"{name}__{held[name].dataType.simpleString()}"
            number = 1
            while kept in held.names:  # changed more than once
                number += 1
                kept = f"{name}__{held[name].dataType.simpleString()}_{number}"
            log.info("%s: %s.%s changed type; its older values are kept as %s.%s", identifier, side, name, side,
                     kept)
            spark.sql(f"ALTER TABLE {identifier} RENAME COLUMN {side}.{quote(name)} TO {quote(kept)}")
            # in the older one's place: a write's row image must list the columns in the table's order
            spark.sql(f"ALTER TABLE {identifier} ADD COLUMN {side}.{quote(name)} {ddl_type(image[name].dataType)} "
                      f"AFTER {quote(kept)}")


def append_rejects(spark: SparkSession, mirror: MirrorTable, rejects: pa.Table) -> AppliedChanges:
    """Append changes set aside (:data:`pgcdc.change_table.REJECTS_SCHEMA`) to ``<mirror>__rejects``, skipping
    those it holds already, in one commit that records the last one held (rule 2, by commit LSN and ordinal,
    since a transaction split by a schema change sets changes aside from two runs); returns what was added."""
    rejects = rejects.take(pc.sort_indices(rejects, sort_keys=[("commit_lsn_value", "ascending"),
                                                               ("ordinal", "ascending")]))
    if mirror.rejects_position is not None:
        held_lsn, held_ordinal = mirror.rejects_position
        lsns, ordinals = rejects.column("commit_lsn_value"), rejects.column("ordinal")
        rejects = rejects.filter(pc.or_(pc.greater(lsns, held_lsn),
                                        pc.and_(pc.equal(lsns, held_lsn), pc.greater(ordinals, held_ordinal))))
    if rejects.num_rows == 0:
        return AppliedChanges()
    _write_rejects(spark, mirror, rejects)
    return AppliedChanges(rejects.num_rows, frozenset(pc.unique(rejects.column("commit_lsn_value")).to_pylist()))


def replace_copied_rejects(spark: SparkSession, mirror: MirrorTable, rejects: pa.Table) -> None:
    """The rows a copy of ``mirror`` set aside (:func:`pgcdc.change_table.copied_rejects`, maybe none) into its
    ``__rejects`` table, committed before the copy. The rows an earlier copy set aside and never committed (their
    position is past the mirror's: a run stopped between that commit and its copy's) are deleted first, so a copy
    made again sets nothing aside twice."""
    identifier = mirror.rejects_identifier
    if spark.catalog.tableExists(identifier):
        held = -1 if mirror.position is None else int(mirror.position)
        spark.sql(f"DELETE FROM {identifier} WHERE op = {sql_string(COPIED)} AND commit_lsn_value > {held}")
    if rejects.num_rows:
        _write_rejects(spark, mirror, rejects)


def _write_rejects(spark: SparkSession, mirror: MirrorTable, rejects: pa.Table) -> None:
    """Append ``rejects`` (ordered) to the mirror's ``__rejects`` table, created if need be, in one commit that
    records the last one (``pgcdc.lsn`` and ``pgcdc.ordinal``)."""
    from pyspark.sql.types import StructType

    last_lsn, last_ordinal = rejects.column("commit_lsn_value")[-1].as_py(), rejects.column("ordinal")[-1].as_py()
    frame = arrow_to_dataframe(spark, rejects, StructType(_spark_fields(rejects.schema, tuple(rejects.column_names))))
    writer = (frame.writeTo(mirror.rejects_identifier)
              .option(f"snapshot-property.{POSITION_PROPERTY}", str(Lsn(last_lsn)))
              .option(f"snapshot-property.{ORDINAL_PROPERTY}", str(last_ordinal)))
    if spark.catalog.tableExists(mirror.rejects_identifier):
        writer.append()
    else:
        writer.using("iceberg").tableProperty("format-version", "2").create()
    mirror.rejects_position = (last_lsn, last_ordinal)
