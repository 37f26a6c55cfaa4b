"""Text-like types, bool, bytea, uuid and jsonb; and the text form of every type without a decoder of its own."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.errors import UnconvertibleValue
from pgcdc.types.decoding import (
    ColumnKind,
    ColumnKinds,
    Values,
    accelerated,
    as_list,
    as_strings,
    columnar,
    fixed_width,
    validity_bitmap,
)


@columnar
def _bool_text(values: Values) -> pa.Array:
    strings = as_strings(values)
    bad = pc.and_(pc.not_equal(strings, "t"), pc.not_equal(strings, "f"))
    if pc.any(bad).as_py():
        raise UnconvertibleValue(f"not a boolean: {strings.filter(bad)[0]}")
    return pc.equal(strings, "t")


@columnar
def _bool_binary(values: Values) -> pa.Array:
    data, mask = fixed_width(values, 1, "u1")
    return pa.array(data != 0, pa.bool_(), mask=mask)


@columnar
def string_binary(values: Values) -> pa.Array:
    return as_strings(values)


@columnar
def _jsonb_binary(values: Values) -> pa.Array:
    fast = accelerated("jsonb_binary", values)
    if fast is not None:
        offsets, text, valid = fast
        return pa.Array.from_buffers(pa.string(), len(values), [validity_bitmap(valid), pa.py_buffer(offsets),
                                                                pa.py_buffer(text)])

    def body(v: bytes | memoryview) -> bytes:
        raw = bytes(v)
        if not raw or raw[0] != 1:
            raise UnconvertibleValue(f"unknown jsonb binary version {raw[:1]!r}")
        return raw[1:]

    return as_strings([None if v is None else body(v) for v in as_list(values)])


def _char_binary(values: Values) -> pa.Array:
    """``"char"``: one byte, 0 for the empty value; PostgreSQL prints a byte above 127 as its octal escape
    ``\\ooo``."""
    def text(v: bytes | memoryview) -> str:
        raw = bytes(v)
        if len(raw) > 1:
            raise UnconvertibleValue(f'"char" binary value of {len(raw)} bytes')
        return "" if not raw or raw[0] == 0 else chr(raw[0]) if raw[0] < 128 else f"\\{raw[0]:03o}"

    return pa.array([None if v is None else text(v) for v in as_list(values)], pa.string())


@columnar
def _bytea_text(values: Values) -> pa.Array:
    def unhex(text: str) -> bytes:
        if not text.startswith("\\x"):
            raise UnconvertibleValue("bytea text is not in hex format (set bytea_output = hex)")
        return bytes.fromhex(text[2:])

    return pa.array([None if s is None else unhex(s) for s in as_strings(values).to_pylist()], pa.binary())


@columnar
def _bytes_binary(values: Values) -> pa.Array:
    if isinstance(values, pa.Array):
        return values.cast(pa.binary())
    return pa.array([None if v is None else bytes(v) for v in values], pa.binary())


@columnar
def _uuid_text(values: Values) -> pa.Array:
    return as_strings(values)


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype="S1")
_UUID_DASHES = (8, 12, 16, 20)


@columnar
def _uuid_binary(values: Values) -> pa.Array:
    """16-byte uuids to their canonical text (in C, or with NumPy over all values at once)."""
    fast = accelerated("uuid_binary", values)
    if fast is not None:
        text, valid = fast
        offsets = np.arange(0, 36 * (len(values) + 1), 36, dtype=np.int32)
        return pa.Array.from_buffers(pa.string(), len(values), [validity_bitmap(valid), pa.py_buffer(offsets),
                                                                pa.py_buffer(text)])
    data, mask = fixed_width(values, 16, "u1") if len(values) else (np.empty(0, "u1"), np.empty(0, bool))
    octets = data.reshape(-1, 16)
    digits = np.empty((len(octets), 32), dtype="S1")
    digits[:, 0::2] = _HEX_DIGITS[octets >> 4]
    digits[:, 1::2] = _HEX_DIGITS[octets & 0x0F]
    parts = np.split(digits, _UUID_DASHES, axis=1)
    dash = np.full((len(octets), 1), b"-", dtype="S1")
    text = np.concatenate([parts[0], dash, parts[1], dash, parts[2], dash, parts[3], dash, parts[4]], axis=1)
    strings = text.view("S36").ravel()
    return pa.array(strings, pa.binary(36), mask=mask).cast(pa.string())


def text_form(name: str) -> ColumnKind:
    """A type read as PostgreSQL's text output, with no binary decoder (money, inet, ranges, composites, ...):
    in binary mode its tables are streamed in text."""
    return ColumnKind(name, pa.string(), as_strings, None)


def enum_kind(name: str) -> ColumnKind:
    """An enum: its label, in either format."""
    return ColumnKind(name, pa.string(), as_strings, string_binary)


def register(kinds: ColumnKinds) -> None:
    kinds.register("bool", ColumnKind("bool", pa.bool_(), _bool_text, _bool_binary))
    for name in ("text", "varchar", "bpchar", "name", "json", "xml", "citext"):
        kinds.register(name, ColumnKind(name, pa.string(), as_strings, string_binary))
    kinds.register('"char"', ColumnKind('"char"', pa.string(), as_strings, _char_binary))
    kinds.register("jsonb", ColumnKind("jsonb", pa.string(), as_strings, _jsonb_binary))
    kinds.register("uuid", ColumnKind("uuid", pa.string(), _uuid_text, _uuid_binary))
    kinds.register("bytea", ColumnKind("bytea", pa.binary(), _bytea_text, _bytes_binary))
