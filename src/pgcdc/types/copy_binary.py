"""``COPY ... TO STDOUT (FORMAT binary)`` output split into one Arrow binary array per column.

Each array holds the column's values in PostgreSQL's binary format (a null where the field is -1), ready
for :meth:`TableConverter.convert_columns` with ``binary=True``. The split runs in C where the optional
``_columns`` module is built, else in Python (same result, slower). Malformed input raises
:class:`~pgcdc.errors.ConversionError` naming the row and byte.
"""

from __future__ import annotations

import struct

import pyarrow as pa

from pgcdc.errors import ConversionError
from pgcdc.types import decoding

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"


def split_copy_binary(data: bytes | memoryview | pa.Buffer, width: int, *, source: str = "COPY") -> list[pa.Array]:
    """The ``width`` columns of a whole COPY binary output (header, rows, trailer) as binary arrays
    (large_binary for a column of more than 2 GB).
    ``source`` names what was copied in errors."""
    try:
        if decoding.accelerator is not None:
            rows, columns = decoding.accelerator.copy_binary_columns(data, width)
        else:
            rows, columns = _split_in_python(memoryview(data), width)
    except ValueError as exc:
        raise ConversionError(f"{source}: {exc}") from None
    return [pa.Array.from_buffers(pa.large_binary() if offset_width == 8 else pa.binary(), rows,
                                  [pa.py_buffer(validity) if nulls else None, pa.py_buffer(offsets),
                                   pa.py_buffer(values)], null_count=nulls)
            for offsets, offset_width, values, validity, nulls in columns]


def _split_in_python(data: memoryview, width: int) -> tuple[int, list[tuple[bytes, int, bytes, bytes, int]]]:
    size = len(data)
    if size < 19 or bytes(data[:11]) != SIGNATURE:
        raise ValueError("COPY binary data: no PGCOPY signature (row 0, byte 0)")
    flags, extension = struct.unpack_from(">II", data, 11)
    if flags & 0xFFFF0000:
        raise ValueError("COPY binary data: unsupported header flags (row 0, byte 11)")
    if extension > size - 19:
        raise ValueError("COPY binary data: header extension past the end (row 0, byte 15)")
    position = 19 + extension
    offsets: list[list[int]] = [[0] for _ in range(width)]
    values: list[list[bytes]] = [[] for _ in range(width)]
    present: list[list[bool]] = [[] for _ in range(width)]
    rows = 0
    while True:
        if position + 2 > size:
            raise ValueError(f"COPY binary data: no trailer (row {rows}, byte {position})")
        (fields,) = struct.unpack_from(">h", data, position)
        position += 2
        if fields == -1:
            if position != size:
                raise ValueError(f"COPY binary data: data after the trailer (row {rows}, byte {position})")
            break
        if fields != width:
            raise ValueError(f"COPY binary data: row {rows} has {fields} fields, {width} expected")
        for column in range(width):
            if position + 4 > size:
                raise ValueError(f"COPY binary data: row truncated (row {rows}, byte {position})")
            (length,) = struct.unpack_from(">i", data, position)
            position += 4
            if length == -1:
                present[column].append(False)
                length = 0
            elif length < 0 or length > size - position:
                problem = "negative field length" if length < 0 else "field past the end"
                raise ValueError(f"COPY binary data: {problem} (row {rows}, byte {position - 4})")
            else:
                values[column].append(bytes(data[position:position + length]))
                position += length
                present[column].append(True)
            offsets[column].append(offsets[column][-1] + length)
        rows += 1
    columns = []
    for column in range(width):
        validity = pa.array(present[column], pa.bool_()).buffers()[1] if rows else pa.py_buffer(b"")
        width_code, offset_width = ("q", 8) if offsets[column][-1] > 2**31 - 1 else ("i", 4)  # as the C split
        columns.append((struct.pack(f"<{rows + 1}{width_code}", *offsets[column]), offset_width,
                        b"".join(values[column]), validity.to_pybytes(), present[column].count(False)))
    return rows, columns
