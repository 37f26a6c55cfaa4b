"""A key index's runs on disk: written in chunks, searched through their fence exactly as a sorted array is,
never trusted when their files do not match the manifest, and their directories held by one process."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgcdc.index import disk_runs
from pgcdc.index.disk_runs import (
    DamagedIndex,
    DiskRun,
    IndexDirectory,
    IndexInUse,
    Manifest,
    RunWriter,
    prune_unused,
)


def written(directory, k1: np.ndarray, *, hashed: bool, chunks: int = 3, loc: np.ndarray | None = None) -> DiskRun:
    writer = RunWriter(directory, hashed=hashed)
    k2 = np.arange(len(k1), dtype=np.uint64) << np.uint64(32) if hashed else None
    loc = np.arange(len(k1), dtype=np.int64) * 3 if loc is None else loc
    for part in np.array_split(np.arange(len(k1)), chunks):
        writer.append(k1[part], None if k2 is None else k2[part], loc[part])
    return DiskRun(directory, writer.finish())


@contextlib.contextmanager
def packed_bits(bits: int) -> Iterator[None]:
    saved = disk_runs.PACKED_BITS
    disk_runs.PACKED_BITS = bits
    try:
        yield
    finally:
        disk_runs.PACKED_BITS = saved


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-50, 50), max_size=200), queries=st.lists(st.integers(-60, 60), max_size=40),
       block=st.sampled_from([1, 2, 3, 7, 512]), hashed=st.booleans())
def test_a_run_is_searched_through_its_fence_as_the_sorted_array_it_holds(tmp_path_factory, values, queries, block,
                                                                         hashed):
    saved = disk_runs.BLOCK
    disk_runs.BLOCK = block
    try:
        dtype = np.uint64 if hashed else np.int64
        k1 = np.sort(np.array([v + 60 for v in values] if hashed else values, dtype=dtype))
        run = written(tmp_path_factory.mktemp("run"), k1, hashed=hashed)
        asked = np.array([q + 60 for q in queries] if hashed else queries, dtype=dtype)
        for side in ("left", "right"):
            assert run.search(asked, side).tolist() == np.searchsorted(k1, asked, side).tolist()
        assert run.k1.tolist() == k1.tolist() and run.loc[:].tolist() == (np.arange(len(k1)) * 3).tolist()
        run.verify()
        run.close()
    finally:
        disk_runs.BLOCK = saved


MAX_POSITION = (1 << 32) - 1
file_ids = st.sampled_from([0, 1, 2, 5, 17, 1000, 2**22 - 1, 2**22, 2**22 + 3, 2**31 - 1])
positions = st.sampled_from([0, 1, 2, 3, 255, 256, 2**19, 2**31 - 1, 2**31, MAX_POSITION]) | st.integers(0, 40)


@settings(max_examples=150, deadline=None)
@given(entries=st.lists(st.tuples(file_ids, positions), max_size=60), bits=st.sampled_from([0, 3, 6, 32]),
       hashed=st.booleans(), chunks=st.integers(1, 4), block=st.sampled_from([1, 3, 512]))
def test_locations_read_back_exactly_packed_or_wide(tmp_path_factory, entries, bits, hashed, chunks, block):
    """Whatever file ids and positions a run holds, readers get back exactly the ``file id << 32 | position``
    written, by a slice or by slots: packed in 32 bits when the run-local file numbers and positions fit the
    limit, in 40 bits (a byte more) when they fit 8 bits more, in 8 bytes otherwise (the limit lowered here so that
    every width comes up with few entries, the bits above it in the extra byte), packed a few entries at a time."""
    saved = disk_runs.BLOCK, disk_runs._PACK_CHUNK
    disk_runs.BLOCK, disk_runs._PACK_CHUNK = block, 7
    try:
        with packed_bits(bits):
            loc = np.array([(f << 32) | p for f, p in entries], np.int64)
            k1 = np.arange(len(loc), dtype=np.uint64 if hashed else np.int64)
            directory = tmp_path_factory.mktemp("run")
            run = written(directory, k1, hashed=hashed, chunks=chunks, loc=loc)
            present = sorted({f for f, _ in entries})
            needed = max(0, len(present) - 1).bit_length() + max([p for _, p in entries], default=0).bit_length()
            assert run.info.packed == (bool(entries) and needed <= bits + disk_runs.HIGH_BITS)
            assert run.info.split == (bits if run.info.packed and needed > bits else None)
            assert run.loc[:].tolist() == loc.tolist()
            slots = np.arange(len(loc))[::-1]
            assert run.loc[slots].tolist() == loc[slots].tolist()
            if hashed:
                assert run.k2 is not None and run.k2[:].tolist() == (k1 << np.uint64(32)).tolist()
            width = (4 if run.info.split is None else 5) if run.info.packed else 8
            high = 0 if run.info.split is None else 1
            assert (directory / f"{run.info.name}.loc").stat().st_size == (width - high) * len(loc)
            assert run.disk_bytes == len(loc) * (8 + (4 if hashed else 0) + width) + run.fence.nbytes + \
                (8 * len(present) if run.info.packed else 0)
            assert not (directory / f"{run.info.name}.wide").exists()
            run.verify()
            reread = DiskRun(directory, disk_runs.RunInfo.decode(json.loads(json.dumps(run.info.encode()))))
            assert reread.loc[:].tolist() == loc.tolist()
            reread.close()
            run.close()
    finally:
        disk_runs.BLOCK, disk_runs._PACK_CHUNK = saved


@pytest.mark.parametrize(("key", "bytes_per_row", "files"), [("bigint", 12, 20), ("text", 16, 20),
                                                           ("bigint", 13, 1000), ("text", 17, 1000)])
def test_an_entry_takes_12_or_16_bytes_on_disk_while_its_locations_pack(tmp_path, key, bytes_per_row, files):
    """Locations of 32 bits or less take 4 bytes; a mirror holding a large file and many small ones (here 1,000
    files and a position of 2^27: 37 bits) takes 5; the key 8 bytes, a hashed one 12."""
    rows = 100_000
    per_file = rows // files
    loc = (np.arange(rows, dtype=np.int64) // per_file + 7) << 32 | np.arange(rows, dtype=np.int64) % per_file
    if files > 20:
        loc[0] |= (1 << 27) - 1  # the last row of a file of 2^27 rows
    run = written(tmp_path, np.arange(rows, dtype=np.int64 if key == "bigint" else np.uint64), hashed=key == "text",
                  loc=loc)
    assert run.info.packed and run.info.files == files
    assert bytes_per_row * rows < run.disk_bytes < (bytes_per_row + 0.1) * rows  # the fence, 8 bytes a file id
    run.close()


def test_second_words_with_low_bits_are_refused(tmp_path):
    """A run on disk keeps 96 bits of a hashed code: a second word it cannot keep whole is never written."""
    writer = RunWriter(tmp_path, hashed=True)
    with pytest.raises(ValueError, match="96-bit"):
        writer.append(np.array([1], np.uint64), np.array([(7 << 32) | 1], np.uint64), np.array([0]))
    writer.abandon()
    assert list(tmp_path.iterdir()) == []


def test_chunks_out_of_order_are_refused(tmp_path):
    writer = RunWriter(tmp_path, hashed=False)
    writer.append(np.array([5, 6]), None, np.array([0, 1]))
    with pytest.raises(ValueError, match="code order"):
        writer.append(np.array([1]), None, np.array([2]))
    writer.abandon()
    assert list(tmp_path.iterdir()) == []


# a run of 8-byte locations has no file ids beside it, a byte more (hi) only a run of 40-bit locations
@pytest.mark.parametrize(("width", "column"), [(width, column) for width in ("packed", "40 bits", "wide")
                                               for column in ("k1", "k2", "loc", "hi", "ids")
                                               if not (column == "ids" and width == "wide")
                                               and not (column == "hi" and width != "40 bits")])
@pytest.mark.parametrize("damage", ["flipped byte", "short file", "missing fence", "missing column"])
def test_a_run_whose_files_do_not_match_its_manifest_is_never_trusted(tmp_path, damage, column, width):
    loc = (np.arange(5000, dtype=np.int64) % 7) << 32 | np.arange(5000, dtype=np.int64)
    with packed_bits({"packed": 32, "40 bits": 10, "wide": 4}[width]):  # the locations take 3 + 13 bits
        run = written(tmp_path, np.arange(5000, dtype=np.uint64), hashed=True, loc=loc)
    info = run.info
    assert info.packed == (width != "wide") and (info.split is not None) == (width == "40 bits")
    run.close()
    path = tmp_path / f"{info.name}.{column}"
    if damage == "flipped byte":
        with open(path, "r+b") as file:
            at = min(4096, path.stat().st_size - 1)
            file.seek(at)
            byte = file.read(1)
            file.seek(at)
            file.write(bytes([byte[0] ^ 1]))
    elif damage == "short file":
        os.truncate(path, path.stat().st_size - 4)
    elif damage == "missing fence":
        (tmp_path / f"{info.name}.fence").unlink()
    else:
        path.unlink()
    with pytest.raises(DamagedIndex):
        DiskRun(tmp_path, info).verify()


def test_file_ids_out_of_order_are_damage_even_before_the_checksums(tmp_path):
    loc = np.arange(10, dtype=np.int64) << 32
    run = written(tmp_path, np.arange(10, dtype=np.int64), hashed=False, loc=loc)
    info = run.info
    run.close()
    ids = tmp_path / f"{info.name}.ids"
    ids.write_bytes(np.fromfile(ids, "<i8")[::-1].tobytes())
    with pytest.raises(DamagedIndex, match="packed locations"):
        DiskRun(tmp_path, info)


def test_the_manifest_is_replaced_whole_and_garbage_is_damage(tmp_path):
    directory = IndexDirectory(tmp_path / "t")
    assert directory.read_manifest() is None
    run = written(directory.path, np.arange(10, dtype=np.int64), hashed=False)
    manifest = Manifest(42, False, [1], run.info, ["a.parquet", None, "c.parquet"])
    directory.write_manifest(manifest)
    assert directory.read_manifest() == manifest
    assert sorted(p.name for p in directory.path.iterdir() if p.name.startswith("index.json")) == ["index.json"]
    (directory.path / "index.json").write_text('{"format": 2, "snapshot_id": ')
    with pytest.raises(DamagedIndex):
        directory.read_manifest()
    directory.close()


def test_a_manifest_of_format_2_is_read_as_it_is(tmp_path):
    """Format 3 only added 40-bit locations: an index saved in format 2 (32-bit or 8-byte ones) is opened, not built
    again."""
    directory = IndexDirectory(tmp_path / "t")
    loc = (np.arange(100, dtype=np.int64) % 3) << 32 | np.arange(100, dtype=np.int64)
    run = written(directory.path, np.arange(100, dtype=np.int64), hashed=False, loc=loc)
    run.close()
    saved = json.loads(Manifest(7, False, [1], run.info, ["a", "b", "c"]).encode())
    saved["format"] = 2
    del saved["run"]["split"]
    (directory.path / "index.json").write_text(json.dumps(saved))
    manifest = directory.read_manifest()
    assert manifest is not None and manifest.run == run.info
    reopened = DiskRun(directory.path, manifest.run)
    reopened.verify()
    assert reopened.loc[:].tolist() == loc.tolist()
    reopened.close()
    directory.close()


def test_a_manifest_of_another_format_is_not_trusted_and_the_index_is_built_again(tmp_path):
    """Format 1 (128-bit codes, 8-byte locations) is never read as today's: the mirror's index is built again."""
    from pgcdc.index.mirror_index import MirrorIndex

    directory = IndexDirectory(tmp_path / "t")
    run = written(directory.path, np.arange(10, dtype=np.int64), hashed=False)
    manifest = json.loads(Manifest(42, False, [1], run.info, ["a.parquet"]).encode())
    directory.write_manifest(Manifest(42, False, [1], run.info, ["a.parquet"]))
    assert directory.read_manifest() is not None
    (directory.path / "index.json").write_text(json.dumps({**manifest, "format": 1}))
    with pytest.raises(DamagedIndex, match="format 1"):
        directory.read_manifest()

    class Table:
        def name(self) -> str:
            return "db.t"

    index = MirrorIndex(["id"], pa.schema([pa.field("id", pa.int64(), metadata={"PARQUET:field_id": "1"})]),
                        multiset=False, disk=directory)
    assert index.open_saved(Table(), files=None) is False  # type: ignore[arg-type]
    directory.close()


def test_leftovers_of_a_kill_are_removed_and_the_named_run_kept(tmp_path):
    directory = IndexDirectory(tmp_path / "t")
    kept = written(directory.path, np.arange(10, dtype=np.int64), hashed=False)
    stray = written(directory.path, np.arange(10, dtype=np.uint64), hashed=True)
    (directory.path / "index.json.1234abcd").write_text("half")
    (directory.path / "run-0123456789ab.wide").write_text("locations of a run killed before it was packed")
    directory.remove_except({kept.info.name})
    names = {p.name for p in directory.path.iterdir()}
    assert names == {"lock", *(p.name for p in kept.files())}
    assert not any(p.exists() for p in stray.files())
    directory.close()


def test_one_process_holds_an_index_directory(tmp_path):
    held = IndexDirectory(tmp_path / "t")
    with pytest.raises(IndexInUse):
        IndexDirectory(tmp_path / "t")
    held.close()
    IndexDirectory(tmp_path / "t").close()


def test_directories_nobody_opened_for_long_are_pruned_and_held_or_recent_ones_kept(tmp_path):
    old, held, recent = (IndexDirectory(tmp_path / name) for name in ("old", "held", "recent"))
    old.close()
    recent.close()
    long_ago = time.time() - 40 * 86400
    for name in ("old", "held"):
        os.utime(tmp_path / name / "lock", (long_ago, long_ago))
    (tmp_path / "stray-file").write_text("not an index")
    assert prune_unused(tmp_path, older_than_seconds=30 * 86400) == [tmp_path / "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["held", "recent", "stray-file"]
    held.close()
