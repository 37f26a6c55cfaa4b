"""The snapshot's COPY (FORMAT binary) reader: real server output split into columns, and hostile bytes."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgcdc.errors import ConversionError
from pgcdc.types import decoding
from pgcdc.types.copy_binary import split_copy_binary


@pytest.fixture(params=["C", "python"])
def splitter(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(decoding, "accelerator", None)
    elif decoding.accelerator is None:
        pytest.skip("the C column paths are not built here")
    return request.param


def copy_out(pg, query: str) -> bytes:
    data = bytearray()
    with pg.connect() as conn, conn.cursor().copy(query) as copy:
        for chunk in copy:
            data += chunk
    return bytes(data)


@pytest.fixture
def sample(pg) -> bytes:
    pg.execute("CREATE TABLE t (id int, s text, b bytea)")
    pg.execute("INSERT INTO t VALUES (1, 'héllo', '\\x00ff'), (2, NULL, ''), (NULL, '', NULL)")
    return copy_out(pg, "COPY (SELECT * FROM t ORDER BY id NULLS LAST) TO STDOUT (FORMAT binary)")


def test_columns_hold_each_fields_binary_value_and_nulls(pg, splitter, sample):
    ids, texts, blobs = split_copy_binary(sample, 3)
    assert ids.to_pylist() == [b"\x00\x00\x00\x01", b"\x00\x00\x00\x02", None]
    assert texts.to_pylist() == ["héllo".encode(), None, b""]
    assert blobs.to_pylist() == [b"\x00\xff", b"", None]
    assert [a.null_count for a in (ids, texts, blobs)] == [1, 1, 1]


def test_an_empty_result_has_no_rows(pg, splitter):
    pg.execute("CREATE TABLE t (id int, s text)")
    columns = split_copy_binary(copy_out(pg, "COPY t TO STDOUT (FORMAT binary)"), 2)
    assert [len(c) for c in columns] == [0, 0]


def test_many_rows_and_a_wide_table(pg, splitter):
    width = 40
    pg.execute("CREATE TABLE t (" + ", ".join(f"c{i} int8" for i in range(width)) + ")")
    pg.execute("INSERT INTO t SELECT " + ", ".join(f"CASE WHEN g % {i + 2} = 0 THEN NULL ELSE g * {i} END"
                                                   for i in range(width)) + " FROM generate_series(1, 3000) g")
    columns = split_copy_binary(copy_out(pg, "COPY t TO STDOUT (FORMAT binary)"), width)
    server = pg.execute("SELECT * FROM t")
    for i, column in enumerate(columns):
        expected = [None if row[i] is None else row[i].to_bytes(8, "big", signed=True) for row in server]
        assert column.to_pylist() == expected


def test_every_truncation_and_a_wrong_width_are_named(splitter, sample):
    for end in range(len(sample)):
        with pytest.raises(ConversionError, match=r"^t: COPY binary data: .*\(row \d+, byte \d+\)$"):
            split_copy_binary(sample[:end], 3, source="t")
    with pytest.raises(ConversionError, match="row 0 has 3 fields, 2 expected"):
        split_copy_binary(sample, 2, source="t")
    with pytest.raises(ConversionError, match="data after the trailer"):
        split_copy_binary(sample + b"\x00", 3, source="t")
    with pytest.raises(ConversionError, match="unsupported header flags"):
        split_copy_binary(sample[:11] + b"\x00\x01\x00\x00" + sample[15:], 3, source="t")  # OIDs included


@settings(max_examples=300)
@given(data=st.data())
def test_hostile_bytes_raise_conversion_error_and_both_splitters_agree(sample, monkeypatch, data):
    """Mutated real output: each splitter either returns well-formed columns or raises ConversionError, and
    the C and Python splitters return the same columns or the same error."""
    mutated = bytearray(sample)
    for _ in range(data.draw(st.integers(1, 4))):
        mutated[data.draw(st.integers(0, len(mutated) - 1))] = data.draw(st.integers(0, 255))
    mutated = bytes(mutated[:data.draw(st.integers(0, len(mutated)))] if data.draw(st.booleans()) else mutated)

    def split() -> list | str:
        try:
            return [column.to_pylist() for column in split_copy_binary(mutated, 3)]
        except ConversionError as exc:
            return str(exc)

    in_c = split() if decoding.accelerator is not None else None
    with monkeypatch.context() as patch:
        patch.setattr(decoding, "accelerator", None)
        in_python = split()
    assert in_c is None or in_c == in_python


def test_sliced_columns_convert_like_whole_ones(pg, sample):
    """The converter reads Arrow arrays in place: a slice (the snapshot's batches) must start at its offset."""
    from pgcdc.replication.published import published_tables
    from pgcdc.types import TableConverter, TypeRegistry

    pg.execute("CREATE PUBLICATION pub FOR TABLE t")
    pg.execute("ALTER TABLE t REPLICA IDENTITY FULL")
    with pg.connect() as conn:
        relation = published_tables(conn, "pub")[0].relation
    converter = TableConverter(relation, TypeRegistry())
    columns = split_copy_binary(sample, 3)
    whole = pa.Table.from_batches([converter.convert_columns(columns, binary=True).batch])
    parts = [converter.convert_columns([c.slice(i, 1) for c in columns], binary=True).batch for i in range(3)]
    assert pa.Table.from_batches(parts).equals(whole)
    assert whole.to_pylist()[0] == {"id": 1, "s": "héllo", "b": b"\x00\xff"}
