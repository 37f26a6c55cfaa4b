"""Changes of one relation version held as their row images' wire bytes, and gathered column by column.

A :class:`TupleStore` is what a transaction keeps of its Inserts, Updates and Deletes to one table (one schema
version): per change only its op, ordinal, subtransaction and which row images it carries; the images themselves
as the TupleData bytes the server sent. :func:`gather` turns a selection of changes from several stores into
one sequence of values per column (the row after each change, and the row before it), ready to become Arrow
arrays: from the wire to columns with no Python object per value. The C module (``_tuple``) does both; this
module is the same in Python, used where it is not built (and by the tests, for both paths).

>>> store = new_store(2)
>>> store.add("I", TupleData("tn", (b"1", None)), None, None, 0, -1)
>>> len(store), store.change(0)[0]
(1, 'I')
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pgcdc.errors import DecodeError
from pgcdc.native import optional_extension
from pgcdc.pgoutput.messages import TupleData

accelerator = optional_extension("pgcdc.pgoutput._tuple")  # optional: the Python store below does the same, slower

_NO_ROW = -1  # a change's subtransaction, or image, when it has none


def new_store(width: int) -> Any:
    """An empty store for rows of ``width`` columns: the C one where it is built."""
    if accelerator is not None:
        return accelerator.TupleStore(width)
    return PythonTupleStore(width)


def _width_error(width: int, found: int) -> ValueError:
    return ValueError(f"a row has {found} columns where the Relation message before it has {width}")


class PythonTupleStore:
    """The C ``TupleStore`` in Python: the same methods, the images kept as TupleData objects."""

    def __init__(self, width: int) -> None:
        if not 0 <= width <= 1664:
            raise ValueError("width must be 0..1664")
        self.width = width
        self.unchanged_insert = False
        self.nbytes = 0
        # (op, ordinal, subxid, new, old, key)
        self._changes: list[tuple[str, int, int, TupleData | None, TupleData | None, TupleData | None]] = []

    def __len__(self) -> int:
        return len(self._changes)

    def add_wire(self, data: bytes, in_stream: bool, ordinal: int, subxid: int) -> bool:
        """An Insert, Update or Delete as the server sent it; False when its bytes are malformed."""
        from pgcdc.pgoutput.decode import decode
        from pgcdc.pgoutput.messages import Delete, Insert, Update

        try:
            message = decode(data, proto_version=2 if in_stream else 1, in_stream=in_stream)
        except DecodeError:
            return False
        if isinstance(message, Insert):
            self.add("I", message.new, None, None, ordinal, subxid)
        elif isinstance(message, Update):
            self.add("U", message.new, message.old, message.key, ordinal, subxid)
        elif isinstance(message, Delete):
            self.add("D", None, message.old, message.key, ordinal, subxid)
        else:
            return False
        return True

    def add(self, op: str, new: TupleData | None, old: TupleData | None, key: TupleData | None, ordinal: int,
            subxid: int) -> None:
        """A change from its row images (a TRUNCATE, op 'T', has none)."""
        if op not in ("I", "U", "D", "T"):
            raise ValueError(f"op must be I, U, D or T, not {op}")
        if op == "T":
            new = old = key = None
        elif op == "D":
            new = None
        if old is not None:
            key = None
        for image in (old if old is not None else key, new):
            if image is not None:
                if len(image.kinds) != self.width:
                    raise _width_error(self.width, len(image.kinds))
                self.nbytes += 2 + sum(5 + len(v) if v is not None else 1 for v in image.values)
        if op == "I" and new is not None and "u" in new.kinds:
            self.unchanged_insert = True
        self._changes.append((op, ordinal, subxid, new, old, key))
        self.nbytes += 40

    def change(self, index: int) -> tuple[str, int, int | None, TupleData | None, TupleData | None,
                                          TupleData | None]:
        """(op, ordinal, subxid or None, new, old, key) of change ``index``."""
        op, ordinal, subxid, new, old, key = self._changes[index]
        return op, ordinal, None if subxid < 0 else subxid, new, old, key

    def ordinals(self) -> bytes:
        return struct.pack(f"={len(self._changes)}q", *(c[1] for c in self._changes))

    def subxids(self) -> bytes:
        return struct.pack(f"={len(self._changes)}q", *(c[2] for c in self._changes))


@dataclass(frozen=True)
class GatheredColumn:
    """One column of gathered row images: ``kinds`` holds a byte per row ('t', 'b', 'n' or 'u'); the values are
    either ``buffers`` — (offsets, offset width 4 or 8, value bytes, validity bitmap, null count), the parts of an
    Arrow binary array, gathered in C — or ``values``, one bytes object or None per row, gathered in Python."""

    kinds: bytes
    values: list[bytes | memoryview | None] | None = None
    buffers: tuple[bytes, int, bytes, bytes, int] | None = None


@dataclass(frozen=True)
class Gathered:
    """Changes gathered from stores (:func:`gather`): per change its op, whether it carries an old row (an UPDATE or
    DELETE with an old row or key), whether an UPDATE changed the key; per column the row after each change
    (``after``: its new row; the old one for a DELETE; none for a TRUNCATE) and the row before it (``before``)."""

    ops: bytes
    has_before: bytes
    key_changed: bytes
    after: list[GatheredColumn]
    before: list[GatheredColumn]


def gather(pieces: Sequence[tuple[Any, Any]], width: int, key_index: Sequence[int]) -> Gathered:
    """The changes of ``pieces`` — (store, selection): the indices (int64 buffer) of the changes to take, None for
    all — in that order, column by column; ``key_index`` the key's columns, by which a changed key is told."""
    if accelerator is not None and all(type(store) is accelerator.TupleStore for store, _ in pieces):
        ops, has_before, key_changed, after, before = accelerator.gather(pieces, width, tuple(key_index))
        return Gathered(ops, has_before, key_changed,
                        [GatheredColumn(kinds, buffers=rest) for kinds, *rest in after],
                        [GatheredColumn(kinds, buffers=rest) for kinds, *rest in before])
    return _gather_in_python(pieces, width, key_index)


def _gather_in_python(pieces: Sequence[tuple[Any, Any]], width: int, key_index: Sequence[int]) -> Gathered:
    null_row = TupleData("n" * width, (None,) * width)
    ops, has_before, key_changed = bytearray(), bytearray(), bytearray()
    after_rows: list[TupleData] = []
    before_rows: list[TupleData] = []
    for store, selection in pieces:
        if store.width != width:
            raise ValueError("a store of another width")
        indices = range(len(store)) if selection is None else memoryview(selection).cast("B").cast("q").tolist()
        for index in indices:
            op, _, _, new, old, key = store.change(index)
            old = old if old is not None else key
            after = null_row if op == "T" else (old if op == "D" else new) or null_row
            before = null_row if op == "T" or old is None else old
            after_rows.append(after)
            before_rows.append(before)
            ops.append(ord(op))
            has_before.append(op in ("U", "D") and old is not None)
            key_changed.append(op == "U" and old is not None and any(
                old.kinds[i] != "u" and (old.kinds[i], old.values[i]) != (after.kinds[i], after.values[i])
                for i in key_index))
    return Gathered(bytes(ops), bytes(has_before), bytes(key_changed), _columns(after_rows, width),
                    _columns(before_rows, width))


def _columns(rows: list[TupleData], width: int) -> list[GatheredColumn]:
    kinds = "".join([row.kinds for row in rows]).encode("ascii")
    values = [value for row in rows for value in row.values]
    return [GatheredColumn(kinds[i::width], values=values[i::width]) for i in range(width)]
