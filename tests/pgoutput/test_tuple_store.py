"""Row changes kept as the bytes the server sent (RawChange, TupleStore) and gathered column by column, on the
captured messages of every protocol version: the same changes as the decoded messages, the same columns in C
as in Python, and malformed bytes refused as the decoder refuses them."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_codec import RECORDS, SAMPLES, decoded

from pgcdc.pgoutput import (
    DecodeError,
    Delete,
    Insert,
    Relation,
    TupleData,
    Update,
    decode,
    encode,
    tuple_store,
)
from pgcdc.pgoutput.decode import decode_raw
from pgcdc.pgoutput.messages import RawChange
from pgcdc.pgoutput.tuple_store import GatheredColumn, PythonTupleStore, gather, new_store

DECODER = sys.modules["pgcdc.pgoutput.decode"]
CHANGES = (Insert, Update, Delete)


@pytest.fixture(params=["C", "python"], autouse=True)
def store_kind(request, monkeypatch):
    """Every test runs with the C store and parser (where built) and with the pure-Python ones."""
    if request.param == "python":
        monkeypatch.setattr(DECODER, "_parse_change_c", None)
        monkeypatch.setattr(DECODER, "_parse_raw_c", None)
        monkeypatch.setattr(tuple_store, "accelerator", None)
    elif tuple_store.accelerator is None:
        pytest.skip("the C tuple store is not built here")
    return request.param


def _row_changes() -> list[tuple[bytes, bool, Insert | Update | Delete, Relation]]:
    """Every captured Insert, Update and Delete with its bytes, stream state and relation."""
    found = []
    for record in RECORDS:
        relations: dict[int, Relation] = {}
        for data, in_stream, message in decoded(record):
            if isinstance(message, Relation):
                relations[message.relation_id] = message
            elif isinstance(message, CHANGES):
                found.append((data, in_stream, message, relations[message.relation_id]))
    return found


ROW_CHANGES = _row_changes()


def _expected(message: Insert | Update | Delete, ordinal: int) -> tuple:
    op = "I" if isinstance(message, Insert) else "U" if isinstance(message, Update) else "D"
    return (op, ordinal, message.xid, *_images(message))


def _images(message: Insert | Update | Delete) -> tuple:
    """(new, old, key) of a row change."""
    return getattr(message, "new", None), getattr(message, "old", None), getattr(message, "key", None)


def test_captured_changes_cover_every_image_form():
    ops = {(type(m).__name__, None if isinstance(m, Insert) else m.key is not None,
            _images(m)[1] is not None) for _, _, m, _ in ROW_CHANGES}
    assert {("Insert", None, False), ("Update", False, False), ("Update", True, False), ("Update", False, True),
            ("Delete", True, False), ("Delete", False, True)} <= ops
    assert any(m.xid is not None for _, _, m, _ in ROW_CHANGES)  # streamed
    assert any("u" in getattr(m, "new", TupleData("", ())).kinds for _, _, m, _ in ROW_CHANGES)  # TOAST
    assert any("b" in next(i for i in _images(m) if i is not None).kinds for _, _, m, _ in ROW_CHANGES)  # binary


def test_raw_changes_are_the_messages_left_as_bytes():
    for data, in_stream, message, _ in ROW_CHANGES:
        raw = decode_raw(data, in_stream=in_stream)
        assert isinstance(raw, RawChange) and raw.data == data
        assert (raw.op, raw.xid, raw.relation_id) == (data[:1].decode(), message.xid, message.relation_id)
        assert raw.message() == message


@settings(max_examples=300)
@given(sample=st.sampled_from([s for s in SAMPLES if s[0][:1] in (b"I", b"U", b"D")]), cut=st.integers(0, 10_000),
       position=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_malformed_raw_changes_raise_the_decoders_error(sample, cut, position, byte):
    data, _, in_stream = sample
    for bad in (data[:cut % len(data)], bytes(data[:position % len(data)]) + bytes([byte]) +
                data[position % len(data) + 1:]):
        if bad[:1] not in (b"I", b"U", b"D"):  # what a reader hands to decode_raw
            continue
        try:
            expected = decode(bad, proto_version=4, in_stream=in_stream)
        except DecodeError as exc:
            with pytest.raises(DecodeError) as info:
                decode_raw(bad, in_stream=in_stream)
            assert str(info.value) == str(exc)
            continue
        if isinstance(expected, CHANGES):
            assert decode_raw(bad, in_stream=in_stream).message() == expected
            store = new_store(len(next(i for i in _images(expected) if i is not None).kinds))
            assert store.add_wire(bad, in_stream, 0, -1)


def test_a_store_holds_the_changes_it_was_given_as_bytes_or_as_messages():
    by_relation: dict[int, list] = {}
    for data, in_stream, message, relation in ROW_CHANGES:
        by_relation.setdefault(id(relation), []).append((data, in_stream, message, relation))
    for changes in by_relation.values():
        width = len(changes[0][3].columns)
        from_bytes, from_messages = new_store(width), new_store(width)
        for ordinal, (data, in_stream, message, _) in enumerate(changes):
            subxid = -1 if message.xid is None else message.xid
            assert from_bytes.add_wire(data, in_stream, ordinal, subxid)
            op = _expected(message, ordinal)[0]
            from_messages.add(op, *_images(message), ordinal, subxid)
        for store in (from_bytes, from_messages):
            assert len(store) == len(changes) and store.width == width
            assert [store.change(i) for i in range(len(store))] == [
                _expected(message, ordinal) for ordinal, (_, _, message, _) in enumerate(changes)]
            assert np.frombuffer(store.ordinals(), np.int64).tolist() == list(range(len(changes)))
            assert store.unchanged_insert == any(isinstance(m, Insert) and "u" in m.new.kinds
                                                 for _, _, m, _ in changes)
        assert from_bytes.nbytes > 0


def _values(column: GatheredColumn) -> list[bytes | None]:
    if column.values is not None:
        return [None if v is None else bytes(v) for v in column.values]
    assert column.buffers is not None
    offsets, width, data, _, _ = column.buffers
    ends = np.frombuffer(offsets, np.int32 if width == 4 else np.int64).tolist()
    return [data[ends[i]:ends[i + 1]] if kind in b"tb" else None for i, kind in enumerate(column.kinds)]


def test_gathered_columns_are_the_rows_after_and_before_each_change():
    """The columns gathered (in C where built) equal the rows of the decoded messages, and the Python gather's."""
    by_relation: dict[int, list] = {}
    for data, in_stream, message, relation in ROW_CHANGES:
        by_relation.setdefault(id(relation), []).append((data, in_stream, message, relation))
    gathered_any_key_change = False
    for changes in by_relation.values():
        relation = changes[0][3]
        width = len(relation.columns)
        key_index = [i for i, c in enumerate(relation.columns) if c.is_key]
        store = new_store(width)
        for ordinal, (data, in_stream, _, _) in enumerate(changes):
            assert store.add_wire(data, in_stream, ordinal, -1)
        store.add("T", None, None, None, len(changes), -1)
        # every other change, then all of them
        selection = np.arange(0, len(store), 2, dtype=np.int64)
        for pieces in ([(store, selection)], [(store, None)]):
            got = gather(pieces, width, key_index)
            python = tuple_store._gather_in_python(pieces, width, key_index)
            assert (got.ops, got.has_before, got.key_changed) == (python.ops, python.has_before, python.key_changed)
            for mine, theirs in zip(got.after + got.before, python.after + python.before, strict=True):
                assert mine.kinds == theirs.kinds and _values(mine) == _values(theirs)
            indices = range(len(store)) if pieces[0][1] is None else selection.tolist()
            after_values = [_values(column) for column in got.after]  # once per column, not per row
            for row, index in enumerate(indices):
                op, _, _, new, old, key = store.change(index)
                old = old or key
                after = None if op == "T" else old if op == "D" else new
                assert got.ops[row:row + 1] == op.encode()
                assert bool(got.has_before[row]) == (op in "UD" and old is not None)
                for c in range(width):
                    kind = after.kinds[c] if after is not None else "n"
                    assert got.after[c].kinds[row:row + 1] == kind.encode()
                    value = after.values[c] if after is not None else None
                    assert after_values[c][row] == (None if value is None else bytes(value))
            gathered_any_key_change |= any(got.key_changed)
    assert gathered_any_key_change


def test_a_row_of_another_width_is_refused():
    store = new_store(2)
    wire = encode(Insert(None, 1, TupleData.of([("t", b"1")])), proto_version=1, in_stream=False)
    with pytest.raises(ValueError, match="a row has 1 columns where the Relation message before it has 2"):
        store.add_wire(wire, False, 0, -1)
    with pytest.raises(ValueError, match="a row has 1 columns"):
        store.add("I", TupleData.of([("t", b"1")]), None, None, 0, -1)
    assert len(store) == 0


def test_the_python_store_is_the_fallback():
    assert isinstance(new_store(1), PythonTupleStore) == (tuple_store.accelerator is None)
