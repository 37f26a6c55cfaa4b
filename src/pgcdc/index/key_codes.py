"""Key codes: each row of a mirror's key columns (for a keyless mirror, its whole row) as one fixed-size code
that the key index sorts and searches, computed in bulk from Arrow arrays.

A code has one of two forms, chosen once per index from the key columns' types (:meth:`KeyCoder.for_schema`):

* **integer**: a keyed mirror whose key is one integer-like column (int8..int64, uint8..uint32, and the
  temporal types Arrow stores as integers: date32/64, timestamp, time, duration). The code is the value as
  int64: exact, nothing to hash, 8 bytes.
* **hash**: everything else (text, binary, decimal, uuid, floats, booleans, several columns, nested types,
  whole rows with NULLs). The code is a 128-bit hash, MurmurHash3_x64_128, as two uint64 arrays ``(h1, h2)``.
  128 bits because a collision means deleting the wrong row: among 10^10 keys the expected number of
  colliding pairs is about 10^-19, where 64 bits would expect about three.

Equal values get equal codes, the way PostgreSQL's btree equality sees them as the mirror stores them:
NULL equals NULL and differs from every value; float -0.0 equals 0.0 and every NaN equals every NaN. Integer
widths and string/binary offset widths do not change a code (int16 5 and int64 5 agree; string and
large_string agree), so a widened column keeps its codes. Each column is hashed on its own and the column
hashes are then hashed in order, so ("ab", "c") and ("a", "bc") differ.

The hash runs over the Arrow buffers in C (``_keyhash``, optional like pgcdc's other extensions) or, where it
is not built, in numpy, which computes exactly the same numbers (rows of one length at a time). Nested values
(lists, structs, maps, intervals) take an exact Python path: the ``repr`` of each value, made canonical
(dates and timestamps as integers, -0.0 as 0.0), hashed as bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.native import optional_extension
from pgcdc.spark.arrow import plain_values

# MurmurHash3 over Arrow buffers in C; numpy computes the same numbers without it
accelerator = optional_extension("pgcdc.index._keyhash")

# The code of NULL (the same constants are in _keyhash.c): a value hashes to it with probability 2**-128.
NULL_CODE = (0x9E3779B97F4A7C15, 0xD1B54A32D192ED03)

_C1, _C2 = np.uint64(0x87C37B91114253D5), np.uint64(0x4CF5AD432745937F)
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_ADD1, _ADD2, _FIVE = np.uint64(0x52DCE729), np.uint64(0x38495AB5), np.uint64(5)
# bytes of a variable-length group gathered at once by the numpy path (its index matrix is 8x this)
_GATHER_BYTES = 1 << 22

Codes = tuple[np.ndarray, np.ndarray | None]
"""(k1, k2): int64 values and None (integer form), or uint64 h1 and h2 (hash form)."""


@dataclass(frozen=True)
class KeyCoder:
    """Turns key tables of one shape into codes. ``kinds`` names each column's family (what must stay the same
    from one call to the next); ``integer`` says which form the codes take."""

    kinds: tuple[str, ...]
    integer: bool

    @classmethod
    def for_schema(cls, schema: pa.Schema, *, integer_allowed: bool) -> KeyCoder:
        """The coder for key tables of ``schema``. ``integer_allowed``: a keyed mirror, whose key columns hold no
        NULL (PostgreSQL's replica identity columns are NOT NULL) and may use the exact integer form."""
        if len(schema) == 0:
            raise ValueError("a key needs at least one column")
        kinds = tuple(column_kind(field.type) for field in schema)
        first = schema.field(0).type
        if pa.types.is_dictionary(first):
            first = first.value_type
        return cls(kinds, integer_allowed and len(kinds) == 1 and _is_integer_like(first))

    def check(self, schema: pa.Schema) -> None:
        """Refuses key tables whose columns are not of the kinds this coder was made for."""
        kinds = tuple(column_kind(field.type) for field in schema)
        if kinds != self.kinds:
            raise ValueError(f"key columns {schema.names} are of kinds {list(kinds)}, but this index holds keys "
                             f"of kinds {list(self.kinds)}; cast them to the mirror's stored types first")

    def codes(self, keys: pa.Table) -> Codes:
        """The code of every row of ``keys`` (row order kept)."""
        self.check(keys.schema)
        if self.integer:
            return integer_codes(keys.column(0)), None
        hashes = [hash_column(column) for column in keys.columns]
        return hashes[0] if len(hashes) == 1 else combine(hashes)


def column_kind(data_type: pa.DataType) -> str:
    """A column's family as far as codes go: types that give the same codes for the same values share one."""
    if pa.types.is_dictionary(data_type):
        return column_kind(data_type.value_type)
    if pa.types.is_boolean(data_type):
        return "boolean"
    if pa.types.is_integer(data_type):
        return "uint64" if pa.types.is_uint64(data_type) else "integer"
    if pa.types.is_timestamp(data_type):
        return f"timestamp[{data_type.unit}]"
    if pa.types.is_date(data_type) or pa.types.is_time(data_type) or pa.types.is_duration(data_type):
        return str(data_type)
    if pa.types.is_floating(data_type):
        return "float"
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type) or pa.types.is_string_view(data_type):
        return "string"
    if pa.types.is_binary(data_type) or pa.types.is_large_binary(data_type) or pa.types.is_binary_view(data_type):
        return "binary"
    if pa.types.is_decimal(data_type) or pa.types.is_fixed_size_binary(data_type):
        return str(data_type)
    if pa.types.is_null(data_type):
        return "null"
    return "nested"


def _is_integer_like(data_type: pa.DataType) -> bool:
    """Integers and the temporal types Arrow stores as integers (not intervals: those are several fields)."""
    return (pa.types.is_integer(data_type) and not pa.types.is_uint64(data_type)) or pa.types.is_date(data_type) \
        or pa.types.is_time(data_type) or pa.types.is_timestamp(data_type) or pa.types.is_duration(data_type)


def _as_int64(array: pa.Array) -> pa.Array:
    """An integer-like array's values as int64 (temporal types by their stored integers, no conversion)."""
    data_type = array.type
    if pa.types.is_date32(data_type) or pa.types.is_time32(data_type):
        array = array.view(pa.int32())
    elif not pa.types.is_integer(data_type):
        array = array.view(pa.int64())
    return array.cast(pa.int64())


def _chunks(column: pa.Array | pa.ChunkedArray) -> list[pa.Array]:
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    return [chunk.dictionary_decode() if pa.types.is_dictionary(chunk.type) else chunk for chunk in chunks]


def integer_codes(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer-like key column's values as int64 (the integer form)."""
    if column.null_count:
        raise ValueError("a key column holds NULL; a keyed mirror's key columns are NOT NULL")
    parts = [_as_int64(chunk).to_numpy() for chunk in _chunks(column)]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


# -- MurmurHash3_x64_128 in numpy: the same numbers as _keyhash.c -------------------------------------------


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def _mix_k1(k1: np.ndarray) -> np.ndarray:
    return _rotl(k1 * _C1, 31) * _C2


def _mix_k2(k2: np.ndarray) -> np.ndarray:
    return _rotl(k2 * _C2, 33) * _C1


def _block(h1: np.ndarray, h2: np.ndarray, k1: np.ndarray, k2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One 16-byte block (two little-endian words per row) mixed into the running state."""
    h1 = h1 ^ _mix_k1(k1)
    h1 = (_rotl(h1, 27) + h2) * _FIVE + _ADD1
    h2 = h2 ^ _mix_k2(k2)
    h2 = (_rotl(h2, 31) + h1) * _FIVE + _ADD2
    return h1, h2


def _fmix(k: np.ndarray) -> np.ndarray:
    k = k ^ (k >> np.uint64(33))
    k = k * _M1
    k = k ^ (k >> np.uint64(33))
    k = k * _M2
    return k ^ (k >> np.uint64(33))


def _finish(h1: np.ndarray, h2: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    h1 = h1 ^ np.uint64(length)
    h2 = h2 ^ np.uint64(length)
    h1 = h1 + h2
    h2 = h2 + h1
    h1, h2 = _fmix(h1), _fmix(h2)
    h1 = h1 + h2
    return h1, h2 + h1


def murmur_rows(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """MurmurHash3_x64_128 (seed 0) of each row of an ``(n, length)`` uint8 matrix."""
    rows, length = matrix.shape
    blocks, rest = divmod(length, 16)
    padded_length = (blocks + (rest > 0)) * 16
    if padded_length != length or not matrix.flags.c_contiguous:
        padded = np.zeros((rows, max(padded_length, 16)), np.uint8)
        padded[:, :length] = matrix
        matrix = padded
    words = matrix.view("<u8")
    h1 = np.zeros(rows, np.uint64)
    h2 = np.zeros(rows, np.uint64)
    for block in range(blocks):
        h1, h2 = _block(h1, h2, words[:, 2 * block], words[:, 2 * block + 1])
    if rest > 8:
        h2 = h2 ^ _mix_k2(words[:, 2 * blocks + 1])
    if rest > 0:
        h1 = h1 ^ _mix_k1(words[:, 2 * blocks])
    return _finish(h1, h2, length)


def combine(columns: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The code of rows of several columns: MurmurHash3 of the concatenated 16-byte column hashes, in column
    order (shared by the C and numpy paths)."""
    rows = len(columns[0][0])
    h1 = np.zeros(rows, np.uint64)
    h2 = np.zeros(rows, np.uint64)
    for k1, k2 in columns:
        h1, h2 = _block(h1, h2, k1, k2)
    return _finish(h1, h2, 16 * len(columns))


# -- one column's hashes --------------------------------------------------------------------------------------


def hash_column(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(h1, h2) of every value of one column, NULL as :data:`NULL_CODE`."""
    parts = [_hash_array(chunk) for chunk in _chunks(column)]
    if not parts:
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    if len(parts) == 1:
        return parts[0]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _hash_array(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    data_type = array.type
    if not len(array):  # an empty array may come without data buffers
        return np.empty(0, np.uint64), np.empty(0, np.uint64)
    if pa.types.is_null(data_type):
        return _null_codes(len(array))
    if pa.types.is_boolean(data_type):
        return _hash_fixed(array.cast(pa.int64()), 8)
    if _is_integer_like(data_type):
        return _hash_fixed(_as_int64(array), 8)
    if pa.types.is_uint64(data_type):
        return _hash_fixed(array, 8)
    if pa.types.is_floating(data_type):
        return _hash_fixed(_canonical_floats(array), 8)
    if pa.types.is_decimal(data_type) or pa.types.is_fixed_size_binary(data_type):
        return _hash_fixed(array, data_type.byte_width)
    if pa.types.is_string_view(data_type):
        return _hash_binary(array.cast(pa.large_string()))
    if pa.types.is_binary_view(data_type):
        return _hash_binary(array.cast(pa.large_binary()))
    if pa.types.is_string(data_type) or pa.types.is_binary(data_type) or pa.types.is_large_string(data_type) \
            or pa.types.is_large_binary(data_type):
        return _hash_binary(array)
    return _hash_binary(_canonical_reprs(array))


def _null_codes(rows: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full(rows, NULL_CODE[0], np.uint64), np.full(rows, NULL_CODE[1], np.uint64)


def _canonical_floats(array: pa.Array) -> pa.Array:
    """Floats as float64 with one zero and one NaN: PostgreSQL's float equality has -0 = 0 and NaN = NaN."""
    values = pc.add(array.cast(pa.float64()), pa.scalar(0.0))  # -0.0 + 0.0 is +0.0
    return pc.if_else(pc.is_nan(values), pa.scalar(float("nan")), values)


def _canonical(value: Any) -> Any:
    if isinstance(value, float):
        return 0.0 if value == 0.0 else value  # every NaN's repr is 'nan' already
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_canonical(item) for item in value)
    if isinstance(value, dict):
        return {name: _canonical(item) for name, item in value.items()}
    return value


def _canonical_reprs(array: pa.Array) -> pa.Array:
    """Nested values (lists, structs, maps, ...) as the bytes of their canonical ``repr``: exact, and the same
    for the same value within a process; dates and timestamps as their integers (see ``plain_values``)."""
    return pa.array([None if value is None else repr(_canonical(value)).encode()
                     for value in plain_values(array)], pa.binary())


def _validity(array: pa.Array) -> pa.Buffer | None:
    return array.buffers()[0] if array.null_count else None


def _hash_fixed(array: pa.Array, width: int) -> tuple[np.ndarray, np.ndarray]:
    rows = len(array)
    data = array.buffers()[1]
    if accelerator is not None:
        h1 = np.empty(rows, np.uint64)
        h2 = np.empty(rows, np.uint64)
        accelerator.hash_fixed(rows, array.offset, _validity(array), data, width, h1, h2)
        return h1, h2
    values = np.frombuffer(data, np.uint8, rows * width, array.offset * width).reshape(rows, width)
    h1, h2 = murmur_rows(values)
    return _with_nulls(array, h1, h2)


def _hash_binary(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    rows = len(array)
    _, offsets_buffer, data_buffer = array.buffers()
    data = data_buffer if data_buffer is not None else pa.py_buffer(b"")
    offset_width = 8 if pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type) else 4
    if accelerator is not None:
        h1 = np.empty(rows, np.uint64)
        h2 = np.empty(rows, np.uint64)
        accelerator.hash_binary(rows, array.offset, _validity(array), offsets_buffer, offset_width, data, h1, h2)
        return h1, h2
    offsets = np.frombuffer(offsets_buffer, np.int32 if offset_width == 4 else np.int64, rows + 1,
                            array.offset * offset_width).astype(np.int64)
    values = np.frombuffer(data, np.uint8)
    lengths = np.diff(offsets)
    valid = ~array.is_null().to_numpy(zero_copy_only=False) if array.null_count else np.ones(rows, bool)
    h1 = np.empty(rows, np.uint64)
    h2 = np.empty(rows, np.uint64)
    if rows and valid.all() and (lengths == lengths[0]).all():  # one length (uuids, fixed formats): in place
        length = int(lengths[0])
        span = values[offsets[0]:offsets[0] + rows * length]
        h1[:], h2[:] = murmur_rows(span.reshape(rows, length))
        return h1, h2
    present = np.flatnonzero(valid)
    by_length = present[np.argsort(lengths[present], kind="stable")]
    group_starts = np.flatnonzero(np.diff(lengths[by_length])) + 1
    for group in np.split(by_length, group_starts):
        if not len(group):
            continue
        length = int(lengths[group[0]])
        step = max(1, _GATHER_BYTES // max(length, 1))
        for start in range(0, len(group), step):
            rows_here = group[start:start + step]
            matrix = values[offsets[rows_here][:, None] + np.arange(length)]
            h1[rows_here], h2[rows_here] = murmur_rows(matrix.reshape(len(rows_here), length))
    return _with_nulls(array, h1, h2)


def _with_nulls(array: pa.Array, h1: np.ndarray, h2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if array.null_count:
        null = array.is_null().to_numpy(zero_copy_only=False)
        h1[null] = NULL_CODE[0]
        h2[null] = NULL_CODE[1]
    return h1, h2
