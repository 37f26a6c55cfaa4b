"""What only the mirror knows about a batch: read between the reduction (:mod:`.reduce`) and the write.

- The values of unchanged TOAST columns the batch never saw: the server leaves out a large value an UPDATE did
  not touch, and when no earlier change of the batch carried it, the mirror's row holds it — under the row's
  key, or under the key it had before the batch when its key changed in it. One bounded read of just those keys.
- How many identical copies of a keyless row the mirror holds: a DELETE of one of them removes that one alone,
  but a match on every column finds them all, so they all go and the ones that stay are written again.

Deleting by position (the default), both come from the mirror's key index (:mod:`pgcdc.index.mirror_index`) and the data
files it points into, read with Arrow (:func:`positioned`): no Spark query. Deleting by equality, from Spark
queries of the mirror (:func:`completed`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.apply.reduce import COPIES_GONE, KEYED, KEYLESS, Reduction
from pgcdc.change_table import ChangeColumns as C
from pgcdc.iceberg.parquet import in_layout
from pgcdc.index.key_index import Located
from pgcdc.mirrors.catalog import MirrorTable, quote
from pgcdc.spark.arrow import (
    arrow_to_dataframe,
    from_plain_rows,
    from_plain_values,
    plain_rows,
    plain_values,
    temporary_view,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.apply.row_delta import PositionDeletes
    from pgcdc.index.mirror_index import MirrorIndex


def completed(spark: SparkSession, mirror: MirrorTable, reduction: Reduction) -> tuple[pa.Table, pa.Table | None]:
    """(the rows to write, whole, in the mirror's columns; what they replace or remove: keys, or whole keyless
    rows) of a reduced batch, with what only the mirror knows read from it."""
    names = list(mirror.spec.spark_schema.names)
    if reduction.kind == KEYED:
        rows = reduction.rows
        if not reduction.truncated:
            rows = _fill_unchanged(spark, mirror, rows, list(reduction.keys))
        return rows.select(names), reduction.removed
    if reduction.kind == KEYLESS and reduction.removed is not None and reduction.removed.num_rows:
        deleted = reduction.removed.select(names)
        held = _copies_held(spark, mirror, deleted)
        gone = reduction.removed.column(COPIES_GONE).to_pylist()
        staying = [row for index, row in enumerate(plain_rows(deleted))
                   for _ in range(held.get(index, 0) - gone[index])]
        return pa.concat_tables([reduction.rows, from_plain_rows(staying, deleted.schema)]), deleted
    removed = None if reduction.removed is None else reduction.removed.select(names)
    return reduction.rows, removed


def _fill_unchanged(spark: SparkSession, mirror: MirrorTable, rows: pa.Table, keys: list[str]) -> pa.Table:
    """Unchanged TOAST values the batch cannot know, read from the mirror: under the row's key, or under the key
    it had before the batch when its key changed in it."""
    unchanged = rows.column(C.UNCHANGED).to_pylist()
    wanted = [i for i, columns in enumerate(unchanged) if columns]
    if not wanted:
        return rows
    fill = plain_values(rows.column(C.FILL_KEY))
    own = list(zip(*(plain_values(rows.column(k)) for k in keys), strict=True))
    lookup = {i: tuple(fill[i][k] for k in keys) if fill[i] is not None else own[i] for i in wanted}
    key_schema = pa.schema([rows.schema.field(k) for k in keys])
    key_table = from_plain_rows([dict(zip(keys, key, strict=True)) for key in set(lookup.values())], key_schema)
    found = rows_by_key(spark, mirror, key_table, keys)
    at = {key: row for row, key in enumerate(zip(*(plain_values(found.column(k)) for k in keys), strict=True))}
    positions = pa.array([at.get(lookup[i]) if i in lookup else None for i in range(rows.num_rows)], pa.int64())
    for name in sorted({c for i in wanted for c in unchanged[i]}):
        keep = pa.array([name in (columns or ()) for columns in unchanged], pa.bool_())
        index = rows.schema.get_field_index(name)
        mirrored = found.column(name).take(positions).cast(rows.schema.field(name).type)
        rows = rows.set_column(index, rows.schema.field(name), pc.if_else(keep, mirrored, rows.column(name)))
    return rows


def key_ranges(keys_table: pa.Table, keys: list[str], alias: str = "t") -> list[str]:
    """``t.k BETWEEN lo AND hi`` for each integer key column, lo and hi the table's own extremes: it changes no
    match (every key lies in the range) but lets Iceberg skip the mirror's data files whose key statistics fall
    outside it, so a read or a MERGE touches the part of the mirror the batch touches, not all of it."""
    ranges = []
    for key in keys:
        column = keys_table.column(key)
        if not pa.types.is_integer(column.type) or column.null_count == len(column):
            continue
        extremes = pc.min_max(column)
        ranges.append(f"{alias}.{quote(key)} BETWEEN {int(extremes['min'].as_py())} AND "
                      f"{int(extremes['max'].as_py())}")
    return ranges


def rows_by_key(spark: SparkSession, mirror: MirrorTable, keys_table: pa.Table, keys: list[str]) -> pa.Table:
    """The mirror's rows under ``keys_table``'s keys, as Arrow (no trip through Python values: dates and
    timestamps beyond Python's range come back whole)."""
    from pyspark.sql.types import StructType

    names = list(mirror.spec.spark_schema.names)
    key_frame = arrow_to_dataframe(spark, keys_table, StructType([mirror.spec.spark_schema[k] for k in keys]))
    mirror_frame = spark.table(mirror.identifier).alias("t")
    ranges = key_ranges(keys_table, keys)
    if ranges:  # lets Iceberg skip the data files outside the keys' range
        mirror_frame = mirror_frame.where(" AND ".join(ranges))
    found = mirror_frame.join(key_frame, on=keys, how="left_semi").select(*names)
    batches = found._collect_as_arrow()
    if not batches:  # none of the keys is in the mirror: every value looked up is NULL
        return pa.table({name: pa.nulls(0, keys_table.schema.field(name).type if name in keys else pa.null())
                         for name in names})
    return pa.Table.from_batches(batches)


def whole_row_match(names: list[str]) -> str:
    """Mirror row ``t`` equals source row ``s`` on every column, NULL matching NULL."""
    return " AND ".join(f"t.{quote(n)} <=> s.{quote(n)}" for n in names)


def _copies_held(spark: SparkSession, mirror: MirrorTable, rows: pa.Table) -> dict[int, int]:
    """How many rows of the mirror equal each row of ``rows`` (by its index; NULL matches NULL)."""
    from pyspark.sql.types import IntegerType, StructField, StructType

    names = list(mirror.spec.spark_schema.names)
    indexed = rows.append_column("_pgcdc_row", pa.array(range(rows.num_rows), pa.int32()))
    schema = StructType([*mirror.spec.spark_schema.fields, StructField("_pgcdc_row", IntegerType())])
    deleted = temporary_view(arrow_to_dataframe(spark, indexed, schema), "deleted")
    try:
        counted = spark.sql(f"SELECT s._pgcdc_row, count(*) AS n FROM {mirror.identifier} t JOIN {deleted} s "
                            f"ON {whole_row_match(names)} GROUP BY s._pgcdc_row").collect()
    finally:
        spark.catalog.dropTempView(deleted)
    return {row[0]: row[1] for row in counted}


def positioned(mirror: MirrorTable, reduction: Reduction, index: MirrorIndex, layout: pa.Schema
               ) -> tuple[pa.Table, Located | None]:
    """(the rows to write, whole, in the mirror's columns; the index's entries of the rows they replace or remove)
    of a reduced batch, read from the mirror's key index: the places of the rows a batch replaces or deletes, the
    copies of a keyless row it deletes, and from the data files there the values of unchanged TOAST columns the
    batch never saw. No Spark query."""
    names = list(mirror.spec.spark_schema.names)
    if reduction.kind == KEYED:
        keys = list(reduction.keys)
        rows = reduction.rows
        if not reduction.truncated:
            rows = _fill_unchanged_from_files(rows, keys, index, layout)
        if reduction.truncated or reduction.removed is None:
            return rows.select(names), None
        # every key the batch touches: the row under it is replaced or removed
        touched = in_layout(pa.concat_tables([reduction.removed, rows.select(keys)]), _fields(layout, keys))
        return rows.select(names), index.keys.find(touched)
    if reduction.kind == KEYLESS and reduction.removed is not None and reduction.removed.num_rows:
        deleted = in_layout(reduction.removed.select(names), layout)
        return reduction.rows, index.keys.take(deleted, reduction.removed.column(COPIES_GONE).to_numpy())
    return reduction.rows, None


def _fields(layout: pa.Schema, names: list[str]) -> pa.Schema:
    return pa.schema([layout.field(name) for name in names])


def position_deletes(index: MirrorIndex, located: Located | None) -> PositionDeletes:
    """The rows at ``located`` (those found: a key the mirror did not hold has none), per data file of the index,
    each once (a key a batch both removes and writes again is looked up twice)."""
    from pgcdc.apply.row_delta import PositionDeletes

    if located is None:
        return PositionDeletes({}, index.partitions_of([]))
    present = located.file_ids >= 0
    if not present.any():
        return PositionDeletes({}, index.partitions_of([]))
    places = np.unique((located.file_ids[present].astype(np.int64) << 32) | located.positions[present])
    ids, positions = places >> 32, places & 0xFFFFFFFF
    files: dict[str, np.ndarray] = {}
    bounds = np.flatnonzero(np.diff(ids)) + 1
    for chunk_ids, chunk_positions in zip(np.split(ids, bounds), np.split(positions, bounds), strict=True):
        files[index.keys.path(int(chunk_ids[0]))] = chunk_positions
    return PositionDeletes(files, index.partitions_of(list(files)))


def _fill_unchanged_from_files(rows: pa.Table, keys: list[str], index: MirrorIndex, layout: pa.Schema) -> pa.Table:
    """Unchanged TOAST values the batch cannot know, read from the data files holding the rows: under the row's
    key, or under the key it had before the batch when its key changed in it."""
    unchanged = rows.column(C.UNCHANGED).to_pylist()
    wanted = [i for i, columns in enumerate(unchanged) if columns]
    if not wanted:
        return rows
    fill = plain_values(rows.column(C.FILL_KEY))
    own = plain_rows(rows.select(keys))
    lookup_rows = [fill[i] if fill[i] is not None else own[i] for i in wanted]
    lookup = in_layout(from_plain_rows(lookup_rows, pa.schema([rows.schema.field(k) for k in keys])),
                       _fields(layout, keys))
    located = index.keys.find(lookup)
    columns = sorted({c for i in wanted for c in unchanged[i]})
    fields = [layout.field(name) for name in columns]
    values = {name: [None] * len(wanted) for name in columns}  # per wanted row, as plain Python values
    for file_id in sorted(set(located.file_ids[located.file_ids >= 0].tolist())):
        at = np.flatnonzero(located.file_ids == file_id)
        read = index.files.read_columns(index.keys.path(file_id), fields, layout, rows=located.positions[at])
        for name in columns:
            for slot, value in zip(at.tolist(), plain_values(read.column(name)), strict=True):
                values[name][slot] = value
    for name in columns:
        keep = pa.array([name in (columns_ or ()) for columns_ in unchanged], pa.bool_())
        filled: list[Any] = [None] * rows.num_rows
        for slot, row in enumerate(wanted):
            filled[row] = values[name][slot]
        field = rows.schema.field(name)
        mirrored = from_plain_values(filled, layout.field(name).type).cast(field.type)
        rows = rows.set_column(rows.schema.get_field_index(name), field, pc.if_else(keep, mirrored, rows.column(name)))
    return rows
