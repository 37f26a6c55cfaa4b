"""What every type family's decoders share: the column kind, the conversion options, and vectorised
helpers over a column's values (a list of bytes from the stream, or an Arrow binary array from the
snapshot's COPY).

A column's value bytes are gathered into one Arrow array and parsed with vectorised Arrow casts or NumPy
views of fixed-width binary values, or by the optional C module (``_columns``) where Arrow has no kernel;
Python runs per value only where neither exists or for the rare value a fast path defers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from pgcdc.errors import UnconvertibleValue
from pgcdc.native import optional_extension
from pgcdc.pgoutput.messages import TupleData

Values = Sequence[bytes | memoryview | None]
INT32_MAX: int = 2**31 - 1
INT32_MIN: int = -(2**31)
INT64_MAX: int = 2**63 - 1
INT64_MIN: int = -(2**63)

# optional C paths for what Arrow has no kernel for; each returns None when a value needs the exact path
accelerator = optional_extension("pgcdc.types._columns")
if accelerator is not None:
    accelerator.configure_rows(TupleData, TupleData.__dict__["kinds"], TupleData.__dict__["values"])


def accelerated(name: str, values: Values | pa.Array, *args: object) -> tuple | None:
    """The C function ``name`` over a list of values or an Arrow binary/string array (read in place), or None
    (not built, another input, a value off the fast path)."""
    if accelerator is None:
        return None
    if not isinstance(values, list):
        values = packed(values)
        if values is None:
            return None
    return getattr(accelerator, name)(values, *args)


def packed(values: object) -> tuple | None:
    """An Arrow binary or string array as the C module reads it: (count, first, validity, offsets, offset
    width, data)."""
    if not isinstance(values, pa.Array):
        return None
    if pa.types.is_large_binary(values.type) or pa.types.is_large_string(values.type):
        width = 8
    elif pa.types.is_binary(values.type) or pa.types.is_string(values.type):
        width = 4
    else:
        return None
    validity, offsets, data = values.buffers()
    return len(values), values.offset, validity, offsets, width, b"" if data is None else data


def as_list(values: Values | pa.Array) -> Values:
    """Values one by one, for the paths that take them so (an Arrow array becomes a list of bytes)."""
    return values.to_pylist() if isinstance(values, pa.Array) else values


def columnar(decoder: Callable[[Values], pa.Array]) -> Callable[[Values], pa.Array]:
    """Marks a decoder that also takes an Arrow binary array as is (the snapshot's COPY columns, the stream's
    gathered ones): the others get a list of bytes."""
    decoder.columnar = True  # type: ignore[attr-defined]
    return decoder


def validity_bitmap(flags: bytes) -> pa.Buffer:
    """One byte per value (1 = present) as Arrow's validity bitmap."""
    return pa.py_buffer(np.packbits(np.frombuffer(flags, dtype=np.uint8), bitorder="little"))


@dataclass(frozen=True)
class ConversionOptions:
    """``numeric``: 'string' (default) or 'decimal38' for unconstrained numeric; ``infinity``: 'clamp' or 'error'."""

    numeric: str = "string"
    numeric_scale: int = 18
    infinity: str = "clamp"

    def __post_init__(self) -> None:
        if self.numeric not in ("string", "decimal38"):
            raise ValueError(f"numeric policy {self.numeric!r} must be 'string' or 'decimal38'")
        if self.infinity not in ("clamp", "error"):
            raise ValueError(f"infinity policy {self.infinity!r} must be 'clamp' or 'error'")
        if not 0 <= self.numeric_scale <= 38:
            raise ValueError("numeric_scale must be between 0 and 38")


@dataclass(frozen=True)
class ColumnKind:
    """How one column converts: its Arrow type and its decoders for text and binary values."""

    type_name: str
    arrow_type: pa.DataType
    text: Callable[[Values], pa.Array]
    binary: Callable[[Values], pa.Array] | None  # None: no binary decoder, ask the server for text



KindFactory = Callable[[int, ConversionOptions], ColumnKind]


class ColumnKinds:
    """Type names to how their columns convert, each type registered once with its text and binary decoders
    (as psycopg's adapters map registers a loader per type and format). An entry is a :class:`ColumnKind`, or
    a factory of one (typmod, options) for types whose column depends on them (numeric(p, s), the infinity
    policy)."""

    def __init__(self) -> None:
        self._entries: dict[str, ColumnKind | KindFactory] = {}

    def register(self, names: str | Iterable[str], entry: ColumnKind | KindFactory) -> None:
        for name in [names] if isinstance(names, str) else names:
            self._entries[name] = entry

    def get(self, name: str, typmod: int, options: ConversionOptions) -> ColumnKind | None:
        """The kind registered for type ``name`` (None: not registered), named after it."""
        entry = self._entries.get(name)
        if entry is None:
            return None
        kind = entry if isinstance(entry, ColumnKind) else entry(typmod, options)
        return kind if kind.type_name == name else dataclasses.replace(kind, type_name=name)


# -- vectorised helpers -------------------------------------------------------------------------


@columnar
def as_strings(values: Values | pa.Array) -> pa.Array:
    if isinstance(values, pa.Array):  # already columnar (the snapshot's CSV reader)
        return values if pa.types.is_string(values.type) else values.cast(pa.string())
    return pa.array(values, pa.binary()).cast(pa.string())


def fixed_width(values: Values | pa.Array, width: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-width big-endian binary values as a native NumPy array and a null mask (no Python per value:
    Arrow gathers the bytes into one buffer, NumPy swaps them)."""
    if isinstance(values, pa.Array):
        return _fixed_columnar(values, width, dtype)
    try:
        gathered = pa.array(values, pa.binary(width))
    except pa.ArrowInvalid:
        raise UnconvertibleValue(f"binary values of {width} bytes expected") from None
    mask = gathered.is_null().to_numpy(zero_copy_only=False)
    big_endian = np.dtype(dtype).newbyteorder(">")
    raw = np.frombuffer(gathered.buffers()[1], dtype=big_endian, count=len(gathered) * width // big_endian.itemsize)
    return raw.astype(dtype), mask


def _fixed_columnar(values: pa.Array, width: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``fixed_width`` over an Arrow binary array: its present values lie back to back in its data buffer."""
    buffers = packed(values)
    if buffers is None:
        raise UnconvertibleValue(f"binary values of {width} bytes expected, not {values.type}")
    count, first, _, offset_buffer, offset_width, data = buffers
    offsets = np.frombuffer(offset_buffer, dtype=f"i{offset_width}", count=first + count + 1)[first:]
    mask = values.is_null().to_numpy(zero_copy_only=False)
    lengths = np.diff(offsets)
    if (lengths[~mask] != width).any() or lengths[mask].any():
        raise UnconvertibleValue(f"binary values of {width} bytes expected")
    native = np.dtype(dtype)
    per_value = width // native.itemsize
    raw = np.frombuffer(data, dtype=np.uint8, count=int(offsets[-1]))[offsets[0]:]
    present = raw.view(native.newbyteorder(">")).astype(native)
    if not mask.any():
        return present, mask
    out = np.zeros((count, per_value), dtype=native)
    out[~mask] = present.reshape(-1, per_value)
    return out.ravel(), mask


def fixed_from_c(values: Values | pa.Array, kind: str, target: pa.DataType) -> pa.Array | None:
    """Integers and timestamps parsed from text in C, or None (not built, a value off its path)."""
    fast = accelerated("fixed_text", values, kind)
    if fast is None:
        return None
    data, valid = fast
    return pa.Array.from_buffers(target, len(values), [validity_bitmap(valid), pa.py_buffer(data)])


def cast_text(target: pa.DataType, fallback: Callable[[str], object] | None = None, c_kind: str | None = None
               ) -> Callable[[Values], pa.Array]:
    @columnar
    def decode(values: Values) -> pa.Array:
        if c_kind is not None:
            fast = fixed_from_c(values, c_kind, target)
            if fast is not None:
                return fast
        strings = as_strings(values)
        try:
            return strings.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            if fallback is None:
                raise UnconvertibleValue(str(exc)) from None
        return pa.array([None if s is None else fallback(s) for s in strings.to_pylist()], target)

    return decode


def fixed_binary(width: int, dtype: str, target: pa.DataType) -> Callable[[Values], pa.Array]:
    @columnar
    def decode(values: Values) -> pa.Array:
        data, mask = fixed_width(values, width, dtype)
        return pa.array(data, target, mask=mask)

    return decode


@functools.cache
def psycopg_loader(oid: int, *, binary: bool) -> Callable[[Any], Any]:
    """psycopg's own (C) loader of a built-in type, for values no Arrow kernel parses. Looked up at run time
    (and cached per process), never captured: converters travel to Spark executors by pickling."""
    from psycopg.adapt import Transformer
    from psycopg.pq import Format

    return Transformer().get_loader(oid, Format.BINARY if binary else Format.TEXT).load

