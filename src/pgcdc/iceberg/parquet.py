"""Parquet files in an Iceberg table's layout, written and read by pgcdc itself outside Spark's writer: each
column's field id and Iceberg's stored type (from the table schema's JSON), the dictionary chosen per column, the
footer Iceberg's column metrics are read from. Used by the initial copy's tasks and the row-delta writer."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from typing import Any

import pyarrow as pa

# An Iceberg column as the Parquet writer needs it: (field id, Arrow type with the ids of nested fields).
FieldLayout = tuple[int, Any]


def field_layout(field: Mapping[str, Any]) -> FieldLayout:
    """A field of an Iceberg schema's JSON as its Parquet column: its id, and its Arrow type."""
    return int(field["id"]), _arrow_type(field["type"])


_PRIMITIVES = {"boolean": "bool_", "int": "int32", "long": "int64", "float": "float32", "double": "float64",
               "date": "date32", "string": "string", "binary": "binary"}
_DECIMAL = re.compile(r"decimal\((\d+),\s*(\d+)\)")


def _arrow_type(iceberg_type: Any) -> Any:
    """The Arrow type of an Iceberg type as its JSON writes it (a name, or an object for nested types)."""
    import pyarrow as pa

    if isinstance(iceberg_type, dict):
        kind = iceberg_type["type"]
        if kind == "struct":
            return pa.struct([_arrow_field(f) for f in iceberg_type["fields"]])
        if kind == "list":
            element = pa.field("element", _arrow_type(iceberg_type["element"]),
                               nullable=not iceberg_type["element-required"],
                               metadata={b"PARQUET:field_id": str(iceberg_type["element-id"]).encode()})
            return pa.list_(element)
        if kind == "map":
            key = pa.field("key", _arrow_type(iceberg_type["key"]), nullable=False,
                           metadata={b"PARQUET:field_id": str(iceberg_type["key-id"]).encode()})
            value = pa.field("value", _arrow_type(iceberg_type["value"]), nullable=not iceberg_type["value-required"],
                             metadata={b"PARQUET:field_id": str(iceberg_type["value-id"]).encode()})
            return pa.map_(key, value)
        raise NotImplementedError(f"no Parquet layout for Iceberg type {kind}")
    name = str(iceberg_type)
    decimal = _DECIMAL.fullmatch(name)
    if decimal:
        return pa.decimal128(int(decimal.group(1)), int(decimal.group(2)))
    if name in ("timestamp", "timestamptz"):
        return pa.timestamp("us", tz="UTC" if name == "timestamptz" else None)
    if name == "time":
        return pa.time64("us")
    if name not in _PRIMITIVES:
        raise NotImplementedError(f"no Parquet layout for Iceberg type {name}")
    return getattr(pa, _PRIMITIVES[name])()


def _arrow_field(field: Mapping[str, Any]) -> Any:
    import pyarrow as pa

    field_id, arrow_type = field_layout(field)
    return pa.field(str(field["name"]), arrow_type, nullable=not field["required"],
                    metadata={b"PARQUET:field_id": str(field_id).encode()})


DICTIONARY_SAMPLE_ROWS = 8192


def dictionary_columns(rows: Any) -> list[str]:
    """The top-level columns of ``rows`` (an Arrow table or batch) worth a Parquet dictionary: those whose
    values repeat (at most half of them distinct). Parquet writers otherwise build a dictionary for every
    column and fall back to plain pages only once it outgrows a page: for a column of distinct values (keys,
    uuids, timestamps, names) that is work thrown away, and the fallback file is larger. Measured on a
    10-column table: a file written in half the CPU, and 15% smaller. ``rows`` is a sample (a copy's first
    batch, a batch's whole file), of which the first ``DICTIONARY_SAMPLE_ROWS`` are counted; nested columns
    get no dictionary."""
    import pyarrow as pa
    import pyarrow.compute as pc

    chosen = []
    rows = rows.slice(0, DICTIONARY_SAMPLE_ROWS)  # counting distinct values costs a tenth of a copy's work at 65,536
    for field, column in zip(rows.schema, rows.columns, strict=True):
        if pa.types.is_nested(field.type) or pa.types.is_boolean(field.type):
            continue
        present = len(column) - column.null_count
        if present and pc.count_distinct(column, mode="only_valid").as_py() * 2 <= present:
            chosen.append(field.name)
    return chosen


def layout_schema(layout: list[tuple[str, FieldLayout]]) -> pa.Schema:
    """The Arrow schema of an Iceberg table's Parquet layout (:func:`pgcdc.spark.iceberg_java.parquet_layout`): field
    ids on every column and nested field, Iceberg's types."""
    return pa.schema([pa.field(name, arrow_type, metadata={b"PARQUET:field_id": str(field_id).encode()})
                      for name, (field_id, arrow_type) in layout])


def in_layout(rows: pa.Table | list[pa.RecordBatch], schema: pa.Schema) -> pa.Table:
    """``rows`` by name in ``schema``'s order and types (Iceberg's: e.g. smallint stored as int, nested field
    ids attached); a column the rows lack is NULL."""
    table = rows if isinstance(rows, pa.Table) else (
        pa.Table.from_batches(rows) if rows else schema.empty_table())
    return pa.Table.from_arrays(
        [table.column(field.name).cast(field.type) if field.name in table.column_names
         else pa.nulls(table.num_rows, field.type) for field in schema], schema=schema)


ROW_GROUP_BYTES = 96 << 20  # Arrow bytes buffered per Parquet row group (Iceberg's default group: 128 MB)


def write_parquet(batches: Iterable[pa.RecordBatch], sink: Any, schema: pa.Schema,
                  compression: tuple[str, int | None]) -> int:
    """``batches`` as one Parquet file on ``sink`` (a path or an output stream) in ``schema`` (field ids, Iceberg's
    types), with the table's codec; returns the rows written. A dictionary only for the columns whose values
    repeat in the first batch (:func:`pgcdc.iceberg.parquet.dictionary_columns`); row groups of about
    :data:`ROW_GROUP_BYTES`."""
    import pyarrow.parquet as pq

    codec, level = compression
    batches = iter(batches)
    first = next(batches, None)
    dictionary = dictionary_columns(first) if first is not None else []
    rows = 0
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    with pq.ParquetWriter(sink, schema, compression=codec, compression_level=level,
                          use_dictionary=dictionary or False, use_compliant_nested_type=True) as writer:
        for batch in itertools.chain([first] if first is not None else [], batches):
            pending.append(batch)
            pending_bytes += batch.nbytes
            rows += batch.num_rows
            if pending_bytes >= ROW_GROUP_BYTES:
                writer.write_table(in_layout(pending, schema), row_group_size=1 << 30)
                pending, pending_bytes = [], 0
        if pending or rows == 0:
            writer.write_table(in_layout(pending, schema), row_group_size=1 << 30)
    return rows


PARQUET_MAGIC = b"PAR1"
FOOTER_READ_BYTES = 64 << 10  # one read of a file's end holds the footer of any file pgcdc writes


def parquet_footer(file: Any, size: int) -> bytes:
    """The footer of the Parquet ``file`` (seekable: a local file, an object store's input file, a buffer) of
    ``size`` bytes: its metadata, Thrift-encoded, as stored before the footer's length and the closing magic.
    Iceberg's column metrics are read from it (:func:`pgcdc.spark.iceberg_java.data_file`), without opening the file
    again in the JVM."""
    if size < 12:
        raise ValueError(f"a Parquet file of {size} bytes has no footer")
    tail_size = min(size, FOOTER_READ_BYTES)
    file.seek(size - tail_size)
    tail = bytes(file.read(tail_size))
    length = int.from_bytes(tail[-8:-4], "little")
    if tail[-4:] != PARQUET_MAGIC or length + 12 > size:
        raise ValueError("not a Parquet file with a plain footer (an encrypted footer ends in PARE)")
    if length + 8 <= tail_size:
        return tail[tail_size - 8 - length:tail_size - 8]
    file.seek(size - 8 - length)
    return bytes(file.read(length))
