"""Arrays of any supported type, as Arrow lists of the element's type.

Multi-dimensional arrays are flattened in row-major order and lower bounds other than 1 are not kept (see
docs/types.md). Integer arrays are parsed in C; arrays of other simple built-in types by psycopg's C
loaders; the rest element by element with the element type's own decoders.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pyarrow as pa

from pgcdc.errors import UnconvertibleValue
from pgcdc.types.decoding import (
    ColumnKind,
    Values,
    accelerated,
    as_list,
    as_strings,
    columnar,
    psycopg_loader,
    validity_bitmap,
)

# the blanks array_out may print around elements and array_in skips (its array_isspace, not str.isspace: an
# unquoted element may hold any other space, U+001F or U+00A0 among them)
_ARRAY_SPACE = " \t\n\r\v\f"


def _parse_text_array(text: str, delimiter: str = ",") -> list[str | None]:
    """The elements of an array's text form, flattened row-major; dimension decorations are skipped.
    ``delimiter``: the element type's (``;`` for box, ``,`` for every other built-in type)."""
    if text.startswith("["):
        text = text[text.index("=") + 1:]
    elements: list[str | None] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "{}" or ch == delimiter:
            i += 1
        elif ch == '"':
            i += 1
            chars = []
            while i < n and text[i] != '"':
                if text[i] == "\\":
                    i += 1
                chars.append(text[i])
                i += 1
            if i >= n:
                raise UnconvertibleValue(f"unterminated quoted array element in {text!r}")
            i += 1
            elements.append("".join(chars))
        elif ch in _ARRAY_SPACE:
            i += 1
        else:
            start = i
            while i < n and text[i] != delimiter and text[i] != "}":
                i += 1
            token = text[start:i].strip(_ARRAY_SPACE)
            elements.append(None if token == "NULL" else token)
    return elements


def _parse_binary_array(raw: bytes) -> list[bytes | None]:
    if len(raw) < 12:
        raise UnconvertibleValue("array binary value shorter than its header")
    ndim, _flags, _element_oid = struct.unpack_from(">iiI", raw)
    if ndim == 0:
        return []
    offset = 12 + 8 * ndim
    if ndim < 0 or len(raw) < offset:
        raise UnconvertibleValue("array binary header is truncated")
    count = 1
    for d in range(ndim):
        count *= struct.unpack_from(">i", raw, 12 + 8 * d)[0]
    elements: list[bytes | None] = []
    for _ in range(count):
        if offset + 4 > len(raw):
            raise UnconvertibleValue("array binary element is truncated")
        (size,) = struct.unpack_from(">i", raw, offset)
        offset += 4
        if size < 0:
            elements.append(None)
            continue
        if offset + size > len(raw):
            raise UnconvertibleValue("array binary element is truncated")
        elements.append(raw[offset:offset + size])
        offset += size
    return elements


def _array_decoders(element: ColumnKind) -> tuple[Callable, Callable | None]:
    def build(per_row: list[list | None], decode_elements: Callable[[Values], pa.Array]) -> pa.Array:
        offsets = [0]
        flat: list = []
        mask = []
        for row in per_row:
            mask.append(row is None)
            if row is not None:
                flat.extend(row)
            offsets.append(len(flat))
        values = decode_elements(flat) if flat else pa.array([], element.arrow_type)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, mask=pa.array(mask))

    delimiter = ";" if element.type_name == "box" else ","  # pg_type.typdelim of the built-in types

    @columnar
    def text(values: Values) -> pa.Array:
        rows = [None if s is None else [None if e is None else e.encode() for e in _parse_text_array(s, delimiter)]
                for s in as_strings(values).to_pylist()]
        return build(rows, element.text)

    if element.binary is None:
        return text, None
    element_binary = element.binary

    def binary(values: Values) -> pa.Array:
        rows = [None if v is None else _parse_binary_array(bytes(v)) for v in values]
        return build(rows, element_binary)

    return text, binary


# Arrays whose elements psycopg's C loaders produce as values Arrow takes as they are.
_NATIVE_ARRAY_ELEMENTS = frozenset({"int2", "int4", "int8", "float4", "float8", "text", "varchar", "bpchar",
                                    "name", "bool"})


def _flatten(value: list) -> list:
    if any(isinstance(e, list) for e in value):
        return [x for e in value for x in (_flatten(e) if isinstance(e, list) else [e])]
    return value


def _native_array(array_oid: int, arrow_type: pa.DataType, binary: bool, fallback: Callable) -> Callable:
    def decode(values: Values) -> pa.Array:
        load = psycopg_loader(array_oid, binary=binary)
        try:
            lists = [None if v is None else _flatten(load(v)) for v in values]
            return pa.array(lists, arrow_type)
        except (ValueError, TypeError, pa.ArrowInvalid, OverflowError):
            return fallback(values)  # a value psycopg will not load as is: the exact parser says why

    return decode


_INT_WIDTHS = {"int2": 2, "int4": 4, "int8": 8}


def _int_array(element: ColumnKind, binary: bool, fallback: Callable) -> Callable:
    """Integer arrays parsed in C into list buffers; anything off that path goes to ``fallback``."""
    width = _INT_WIDTHS[element.type_name]
    name = "int_array_binary" if binary else "int_array_text"

    @columnar
    def decode(values: Values) -> pa.Array:
        fast = accelerated(name, values, width)
        if fast is None:
            return fallback(as_list(values))
        offsets, list_valid, items, item_valid = fast
        elements = pa.Array.from_buffers(element.arrow_type, len(item_valid),
                                         [validity_bitmap(item_valid), pa.py_buffer(items)])
        return pa.Array.from_buffers(pa.list_(element.arrow_type), len(values),
                                     [validity_bitmap(list_valid), pa.py_buffer(offsets)], children=[elements])

    return decode


def array_kind(element: ColumnKind, array_oid: int, *, built_in: bool) -> ColumnKind:
    """The kind of an array of ``element``; ``built_in``: the array type is one of PostgreSQL's own, which
    psycopg has loaders for."""
    text, binary = _array_decoders(element)
    arrow_type = pa.list_(element.arrow_type)
    if built_in and element.type_name in _NATIVE_ARRAY_ELEMENTS:
        text = _native_array(array_oid, arrow_type, False, text)
        if binary is not None:
            binary = _native_array(array_oid, arrow_type, True, binary)
    if built_in and element.type_name in _INT_WIDTHS:
        text = _int_array(element, False, text)
        if binary is not None:
            binary = _int_array(element, True, binary)
    return ColumnKind(f"{element.type_name}[]", arrow_type, text, binary)
