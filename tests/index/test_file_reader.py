"""Reading a mirror's data files for its key index: a few rows of a large file read only the row groups holding
them, and a large file's keys come in chunks (with their positions), so that memory stays bounded whatever a
file's size."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pgcdc.index import mirror_index
from pgcdc.index.mirror_index import DeleteFiles, FileReader


def field(name: str, kind: pa.DataType, field_id: int) -> pa.Field:
    return pa.field(name, kind, metadata={b"PARQUET:field_id": str(field_id).encode()})


ID, NOTE, ADDED = field("id", pa.int64(), 1), field("note", pa.string(), 2), field("added", pa.int32(), 3)


@pytest.fixture
def data_file(tmp_path) -> str:
    """A file of 1,000 rows in row groups of 64, as a mirror stores it (columns named by field id)."""
    table = pa.table({"id": pa.array(np.arange(1000, dtype=np.int64) * 3),
                      "note": pa.array([f"row {i}" for i in range(1000)])},
                     schema=pa.schema([ID, NOTE]))
    path = str(tmp_path / "00000-0-data.parquet")
    pq.write_table(table, path, row_group_size=64)
    assert pq.ParquetFile(path).num_row_groups == 16
    return path


def reader() -> FileReader:
    files = FileReader.__new__(FileReader)  # a local warehouse: no table needed to reach its files
    files._filesystem = None
    return files


def test_rows_of_a_file_come_from_the_row_groups_holding_them(data_file, monkeypatch):
    groups_read: list[list[int]] = []
    real = pq.ParquetFile.read_row_groups
    monkeypatch.setattr(pq.ParquetFile, "read_row_groups",
                        lambda self, groups, **k: groups_read.append(list(groups)) or real(self, groups, **k))
    rows = np.array([999, 0, 65, 64, 63, 700, 65, 128])
    read = reader().read_columns(f"file://{data_file}", [NOTE, ID, ADDED], pa.schema([ID, NOTE, ADDED]), rows=rows)
    assert read.column("id").to_pylist() == (rows * 3).tolist()
    assert read.column("note").to_pylist() == [f"row {i}" for i in rows]
    assert read.column("added").null_count == len(rows)  # a column the file predates
    assert groups_read == [[0, 1, 2, 10, 15]]
    assert reader().read_columns(data_file, [ID], pa.schema([ID]), rows=np.array([], np.int64)).num_rows == 0


@pytest.mark.parametrize("chunk_rows", [1000, 300, 64, 7])
def test_a_large_files_keys_come_in_chunks_with_their_positions(data_file, tmp_path, monkeypatch, chunk_rows):
    monkeypatch.setattr(mirror_index, "CHUNK_ROWS", chunk_rows)
    small = str(tmp_path / "small.parquet")
    pq.write_table(pa.table({"id": pa.array([5, 6], pa.int64())}, schema=pa.schema([ID])), small)
    files = reader()
    each = list(files.read_each([data_file, small, data_file], [ID], pa.schema([ID])))
    for chunks, expected in zip(each, [np.arange(1000) * 3, np.array([5, 6]), np.arange(1000) * 3], strict=True):
        offsets, values = [], []
        for offset, keys in chunks:
            assert keys.num_rows <= max(chunk_rows, 2)
            offsets.append(offset)
            values.extend(keys.column("id").to_pylist())
        assert values == expected.tolist()
        assert offsets == list(range(0, len(expected), chunk_rows if len(expected) > chunk_rows else len(expected)))


def test_position_deletes_apply_to_the_chunk_they_fall_in(data_file):
    files = reader()
    deletes = DeleteFiles(None, files)
    deletes._positions["d.parquet"] = {data_file: np.array([3, 64, 65, 999])}

    class Delete:
        def location(self) -> str:
            return "d.parquet"

        def content(self) -> str:
            return "POSITION_DELETES"

    keys = pa.table({"id": pa.array(np.arange(64, dtype=np.int64))})
    first = deletes.surviving(data_file, keys, [Delete()], 0)
    second = deletes.surviving(data_file, keys, [Delete()], 64)
    last = deletes.surviving(data_file, keys.slice(0, 40), [Delete()], 960)
    assert first is not None and np.flatnonzero(~first).tolist() == [3]
    assert second is not None and np.flatnonzero(~second).tolist() == [0, 1]
    assert last is not None and np.flatnonzero(~last).tolist() == [39]
