"""A key index's runs on disk: written in chunks, searched through their fence exactly as a sorted array is,
never trusted when their files do not match the manifest, and their directories held by one process."""

from __future__ import annotations

import os
import time

import numpy as np
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


def written(directory, k1: np.ndarray, *, hashed: bool, chunks: int = 3) -> DiskRun:
    writer = RunWriter(directory, hashed=hashed)
    k2 = np.arange(len(k1), dtype=np.uint64) if hashed else None
    loc = np.arange(len(k1), dtype=np.int64) * 3
    for part in np.array_split(np.arange(len(k1)), chunks):
        writer.append(k1[part], None if k2 is None else k2[part], loc[part])
    return DiskRun(directory, writer.finish())


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
        assert run.k1.tolist() == k1.tolist() and run.loc.tolist() == (np.arange(len(k1)) * 3).tolist()
        run.verify()
        run.close()
    finally:
        disk_runs.BLOCK = saved


def test_chunks_out_of_order_are_refused(tmp_path):
    writer = RunWriter(tmp_path, hashed=False)
    writer.append(np.array([5, 6]), None, np.array([0, 1]))
    with pytest.raises(ValueError, match="code order"):
        writer.append(np.array([1]), None, np.array([2]))
    writer.abandon()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("damage", ["flipped byte", "short file", "missing fence", "missing column"])
def test_a_run_whose_files_do_not_match_its_manifest_is_never_trusted(tmp_path, damage):
    run = written(tmp_path, np.arange(5000, dtype=np.int64), hashed=False)
    info = run.info
    run.close()
    loc = tmp_path / f"{info.name}.loc"
    if damage == "flipped byte":
        with open(loc, "r+b") as file:
            file.seek(4096)
            byte = file.read(1)
            file.seek(4096)
            file.write(bytes([byte[0] ^ 1]))
    elif damage == "short file":
        os.truncate(loc, loc.stat().st_size - 8)
    elif damage == "missing fence":
        (tmp_path / f"{info.name}.fence").unlink()
    else:
        loc.unlink()
    with pytest.raises(DamagedIndex):
        DiskRun(tmp_path, info).verify()


def test_the_manifest_is_replaced_whole_and_garbage_is_damage(tmp_path):
    directory = IndexDirectory(tmp_path / "t")
    assert directory.read_manifest() is None
    run = written(directory.path, np.arange(10, dtype=np.int64), hashed=False)
    manifest = Manifest(42, False, [1], run.info, ["a.parquet", None, "c.parquet"])
    directory.write_manifest(manifest)
    assert directory.read_manifest() == manifest
    assert sorted(p.name for p in directory.path.iterdir() if p.name.startswith("index.json")) == ["index.json"]
    (directory.path / "index.json").write_text('{"format": 1, "snapshot_id": ')
    with pytest.raises(DamagedIndex):
        directory.read_manifest()
    directory.close()


def test_leftovers_of_a_kill_are_removed_and_the_named_run_kept(tmp_path):
    directory = IndexDirectory(tmp_path / "t")
    kept = written(directory.path, np.arange(10, dtype=np.int64), hashed=False)
    stray = written(directory.path, np.arange(10, dtype=np.int64), hashed=True)
    (directory.path / "index.json.1234abcd").write_text("half")
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
