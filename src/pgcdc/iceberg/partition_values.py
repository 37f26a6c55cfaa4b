"""The partition of each row a writer adds to a partitioned Iceberg table, computed as the Iceberg spec defines each
transform ("Partition Transforms", "Bucket Transform Details", "Truncate Transform Details").

A writer of a partitioned table must put each row in the data file of its partition, and label that file with the
partition's values: readers skip files by those values, so a row in a file of the wrong partition is a row that a
filtered read never finds. Java's ``PartitionKey`` would compute them a row at a time over py4j; here a batch's
rows are transformed as Arrow columns, grouped, and each partition's values handed to Java once, in Iceberg's
single-value binary form (:func:`single_value_bytes`).

- ``identity``: the value. ``void``: NULL.
- ``year``, ``month``, ``day``, ``hour`` of a date or timestamp: whole years, months, days or hours since
  1970-01-01 (UTC for ``timestamptz``), rounded down (a time before 1970 is in a negative partition).
- ``bucket[N]``: ``(murmur3_x86_32(v) & 0x7fffffff) % N`` over the value's bytes: an int, long, date, time or
  timestamp as an 8-byte little-endian long, a string as UTF-8, binary as is, a decimal as its unscaled value's
  shortest two's-complement big-endian bytes.
- ``truncate[W]``: an int or long rounded down to a multiple of W, a string cut to W code points, binary to W
  bytes, a decimal's unscaled value rounded down to a multiple of W.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.iceberg.partition_specs import PartitionField, UnsupportedPartitioning

# -- the partition of each row --------------------------------------------------------------------------------


def transformed(field: PartitionField, values: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The partition values of ``values`` (the source column, in its stored Arrow type) under ``field``'s
    transform, as an Arrow array of the result's physical type (int32 for int and date, int64 for long, time and
    timestamps)."""
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks() if values.num_chunks != 1 else values.chunk(0)
    transform = field.transform
    if transform == "identity":
        return _physical(values)
    if transform == "void":
        return pa.nulls(len(values), _physical(values).type)
    if transform in ("year", "month", "day", "hour"):
        return _temporal(transform, values)
    if transform.startswith("bucket["):
        return _bucket(int(transform[7:-1]), values)
    if transform.startswith("truncate["):
        return _truncate(int(transform[9:-1]), values)
    raise UnsupportedPartitioning(f"partition transform {transform}")


def _physical(values: pa.Array) -> pa.Array:
    """Dates as int32 days, times and timestamps as int64 microseconds (what Iceberg's partition values hold)."""
    if pa.types.is_date32(values.type):
        return values.cast(pa.int32())
    if pa.types.is_timestamp(values.type) or pa.types.is_time64(values.type):
        return values.cast(pa.int64())
    if pa.types.is_large_string(values.type):
        return values.cast(pa.string())
    if pa.types.is_large_binary(values.type):
        return values.cast(pa.binary())
    return values


def _with_nulls(result: np.ndarray, values: pa.Array, arrow_type: pa.DataType) -> pa.Array:
    mask = None if values.null_count == 0 else np.asarray(values.is_null())
    return pa.array(result, arrow_type, mask=mask)


def _temporal(transform: str, values: pa.Array) -> pa.Array:
    if pa.types.is_date32(values.type):
        days = np.asarray(values.cast(pa.int32()).fill_null(0), np.int64)
        if transform == "hour":
            raise UnsupportedPartitioning("hour of a date column")
        if transform == "day":
            return _with_nulls(days.astype(np.int32), values, pa.int32())
        moments = days.astype("datetime64[D]")
    elif pa.types.is_timestamp(values.type):
        micros = np.asarray(values.cast(pa.int64()).fill_null(0), np.int64)
        if transform == "hour":
            return _with_nulls(np.floor_divide(micros, 3_600_000_000).astype(np.int32), values, pa.int32())
        if transform == "day":
            return _with_nulls(np.floor_divide(micros, 86_400_000_000).astype(np.int32), values, pa.int32())
        moments = np.floor_divide(micros, 86_400_000_000).astype("datetime64[D]")
    else:
        raise UnsupportedPartitioning(f"{transform} of a {values.type} column")
    unit = "M" if transform == "month" else "Y"
    # numpy's conversion to a coarser unit rounds down, before 1970 too
    counted = moments.astype(f"datetime64[{unit}]").astype(np.int64)
    return _with_nulls(counted.astype(np.int32), values, pa.int32())


_C1, _C2 = np.uint32(0xCC9E2D51), np.uint32(0x1B873593)


def _rotl(value: np.ndarray, bits: int) -> np.ndarray:
    return (value << np.uint32(bits)) | (value >> np.uint32(32 - bits))


def murmur3_of_longs(values: np.ndarray) -> np.ndarray:
    """murmur3_x86_32 (seed 0) of each int64 as 8 little-endian bytes, as uint32: the hash Iceberg buckets an
    int, long, date, time or timestamp by."""
    words = np.ascontiguousarray(values, dtype="<i8").view("<u4").reshape(-1, 2)
    with np.errstate(over="ignore"):
        h = np.zeros(len(values), np.uint32)
        for block in (words[:, 0].astype(np.uint32), words[:, 1].astype(np.uint32)):
            k = _rotl(block * _C1, 15) * _C2
            h = _rotl(h ^ k, 13) * np.uint32(5) + np.uint32(0xE6546B64)
        h ^= np.uint32(8)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x85EBCA6B)
        h ^= h >> np.uint32(13)
        h *= np.uint32(0xC2B2AE35)
        h ^= h >> np.uint32(16)
    return h


def _bucket(buckets: int, values: pa.Array) -> pa.Array:
    kind = values.type
    if pa.types.is_integer(kind) or pa.types.is_date32(kind) or pa.types.is_timestamp(kind) or \
            pa.types.is_time64(kind):
        longs = np.asarray(values.cast(pa.int64()).fill_null(0) if not pa.types.is_date32(kind)
                           else values.cast(pa.int32()).cast(pa.int64()).fill_null(0), np.int64)
        hashes = murmur3_of_longs(longs)
    else:
        import mmh3

        if pa.types.is_decimal(kind):
            scale = kind.scale

            def bytes_of(value: Any) -> bytes:
                return _decimal_bytes(_unscaled(value, scale))
        elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
            def bytes_of(value: Any) -> bytes:
                return str(value).encode()
        elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_fixed_size_binary(kind):
            def bytes_of(value: Any) -> bytes:
                return bytes(value)
        else:
            raise UnsupportedPartitioning(f"bucket of a {kind} column")
        # each distinct value hashed once
        encoded = pc.dictionary_encode(values)
        distinct = encoded.dictionary.to_pylist()
        hashed = np.array([mmh3.hash(bytes_of(value), 0, signed=False) for value in distinct] or [0], np.uint32)
        hashes = hashed[np.asarray(encoded.indices.fill_null(0), np.int64)]
    result = ((hashes & np.uint32(0x7FFFFFFF)) % np.uint32(buckets)).astype(np.int32)
    return _with_nulls(result, values, pa.int32())


def _truncate(width: int, values: pa.Array) -> pa.Array:
    kind = values.type
    if pa.types.is_int32(kind) or pa.types.is_int64(kind):
        dtype = np.int32 if pa.types.is_int32(kind) else np.int64
        numbers = np.asarray(values.fill_null(0), dtype)
        # rounded down (np.mod of a positive width is never negative), in the type's width as Java computes it
        with np.errstate(over="ignore"):
            result = numbers - np.mod(numbers, dtype(width))
        return _with_nulls(result, values, pa.int32() if dtype is np.int32 else pa.int64())
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return pc.utf8_slice_codeunits(values, 0, width).cast(pa.string())  # code points, as Iceberg cuts
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return pc.binary_slice(values, 0, width).cast(pa.binary())
    if pa.types.is_decimal(kind):
        scale = kind.scale
        cut: list[Decimal | None] = []
        for value in values.to_pylist():
            if value is None:
                cut.append(None)
                continue
            unscaled = _unscaled(value, scale)
            cut.append(Decimal(unscaled - unscaled % width).scaleb(-scale))
        return pa.array(cut, pa.decimal128(38, scale))  # rounded down past the column's precision, as Java may
    raise UnsupportedPartitioning(f"truncate of a {kind} column")


def _unscaled(value: Decimal, scale: int) -> int:
    return int(value.scaleb(scale).to_integral_value())


def _decimal_bytes(unscaled: int) -> bytes:
    # the fewest bytes that hold it with its sign (Java's BigInteger.toByteArray): -128 is one byte, 128 two
    return unscaled.to_bytes((unscaled + (unscaled < 0)).bit_length() // 8 + 1, "big", signed=True)


# -- a batch's rows, by partition -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RowGroup:
    """The rows of a batch in one partition: their row numbers (in batch order), and the partition's values, one
    per spec field, each as Iceberg's single-value bytes (None: NULL)."""

    rows: np.ndarray
    values: tuple[bytes | None, ...]


def partition_rows(rows: pa.Table, fields: list[PartitionField]) -> list[RowGroup]:
    """``rows`` grouped by their partition under ``fields``: one group per partition present."""
    if not rows.num_rows:
        return []
    if not fields:
        return [RowGroup(np.arange(rows.num_rows), ())]
    codes = np.zeros(rows.num_rows, np.int64)
    dictionaries = []
    scale = 1
    for field in fields:
        values = transformed(field, rows.column(field.source))
        encoded = pc.dictionary_encode(values, null_encoding="encode")  # NULL is a value of its own
        size = max(len(encoded.dictionary), 1)
        if scale * size > 2**62:  # more combinations than one code holds: number those seen so far densely
            codes = np.unique(codes, return_inverse=True)[1].astype(np.int64)
            scale = int(codes.max()) + 1
        codes += np.asarray(encoded.indices, np.int64) * scale
        scale *= size
        dictionaries.append((encoded, field))
    distinct, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=len(distinct)))[:-1]
    groups = []
    for members, row in zip(np.split(order, bounds), first.tolist(), strict=True):
        values = tuple(single_value_bytes(encoded.dictionary[encoded.indices[row].as_py()].as_py(), field.result_type)
                       for encoded, field in dictionaries)
        groups.append(RowGroup(members, values))
    return groups


def single_value_bytes(value: Any, iceberg_type: str) -> bytes | None:
    """A partition value in Iceberg's single-value binary serialization (the spec's appendix D); None for NULL.
    ``value`` is the physical Python value: days for a date, microseconds for a time or timestamp."""
    if value is None:
        return None
    if iceberg_type == "boolean":
        return b"\x01" if value else b"\x00"
    if iceberg_type in ("int", "date"):
        return struct.pack("<i", int(value))
    if iceberg_type in ("long", "time", "timestamp", "timestamptz"):
        return struct.pack("<q", int(value))
    if iceberg_type == "float":
        return struct.pack("<f", value)
    if iceberg_type == "double":
        return struct.pack("<d", value)
    if iceberg_type == "string":
        return str(value).encode()
    if iceberg_type == "binary" or iceberg_type == "uuid" or iceberg_type.startswith("fixed["):
        return bytes(value)
    decimal = re.fullmatch(r"decimal\((\d+),\s*(\d+)\)", iceberg_type)
    if decimal:
        return _decimal_bytes(_unscaled(value, int(decimal.group(2))))
    raise UnsupportedPartitioning(f"partition values of type {iceberg_type}")
