"""Key index: what a mirror's key -> (data file, row position) index costs to build and to hold, and what a
batch of 50,000 keys costs against it, held in memory and kept on disk, side by side in one run.

The index is built the way a mirror builds it: each Parquet data file's key column read with pyarrow (the
next files read ahead in two threads), its rows added at positions 0..n-1, then placed (sorted). Data:
10,000,000 rows (--quick: 1,000,000) in files of 500,000 rows, with a bigint key in random order and a text
key 'user-<uuid>' (41 bytes). Text keys are hashed by the C module and, for comparison, by its numpy
fallback. Times are the median of several runs with their spread (the machine is shared); sizes are the
index's own count (memory_bytes) and the process's RSS growth.

On disk (``KeyIndex(disk=IndexDirectory(...), overlay_bytes=64 MiB)``, files in a temporary directory), for the
bigint key and the text key (C hash), beside the in-memory index as the peer: the build from the same files
read the same way (large adds spill sorted runs, merged when placed) and its first checkpoint (the run and
manifest written), peak and settled RSS growth, memory_bytes, bytes on disk per row (96-bit codes for the text
key, locations packed in 32 bits: 20 files' numbers and positions below 500,000 take 24); a reopen (closed, then
``KeyIndex.opened`` from the manifest, checksums verified) and RSS after it; batches of 50,000 keys drawn
uniformly from the rows of every file (over the whole key range, not recent keys): find, forget of what was
found, add of the keys as a new data file, a warm-up batch apart and then repeats, the same keys against the
in-memory index, the ratio printed; a forced checkpoint rewriting the run after those batches. The two
indexes' answers for the same keys after the same changes are compared (and again after a checkpoint and a
reopen). The peak RSS growth of each step is shown with its anonymous part apart (the rest is mostly pages of
the run's files mapped in from the page cache). From the per-row figures, what a 1,000,000,000-row mirror would
need (extrapolated). The run's files stay in the kernel's page cache (warm): a reopen or batch after a cold start
reads them from the device.
Last line: one JSON object of the figures.
The apply rate and lag with the index, beside the equality-delete writer in the same run: bench/pipeline.py
and bench/catchup.py.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from pgcdc.index import key_codes
from pgcdc.index.disk_runs import BLOCK, IndexDirectory
from pgcdc.index.key_index import KeyIndex, Located

ROWS_PER_FILE = 500_000
BATCH = 50_000
MIRROR_ROWS = 1_000_000_000
OVERLAY_BYTES = 64 << 20  # the on-disk index's memory share beside its run
POOL_KEYS = 1_000_000  # keys drawn from every file, which the whole-range batches draw from
CHECK_KEYS = 100_000  # keys whose answers the in-memory and on-disk indexes must agree on
REOPENS = 3
CHECKPOINTS = 3
HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def user_uuids(rng: np.random.Generator, rows: int) -> pa.Array:
    """'user-<uuid4>' strings built as one byte matrix (a Python uuid per row would take minutes)."""
    digits = HEX[rng.integers(0, 16, (rows, 32), dtype=np.uint8)]
    digits[:, 12] = ord("4")
    digits[:, 16] = HEX[8 + rng.integers(0, 4, rows)]
    text = np.empty((rows, 41), np.uint8)
    text[:, :5] = np.frombuffer(b"user-", np.uint8)
    for start, end, at in ((0, 8, 5), (8, 12, 14), (12, 16, 19), (16, 20, 24), (20, 32, 29)):
        text[:, at:at + end - start] = digits[:, start:end]
    text[:, [13, 18, 23, 28]] = ord("-")
    offsets = np.arange(0, 41 * (rows + 1), 41, dtype=np.int32)
    return pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(text.tobytes()))


def write_files(directory: Path, rows: int) -> list[str]:
    """Data files of a mirror: a unique bigint key in random order, a text key, and a payload column."""
    rng = np.random.default_rng(5)
    ids = rng.permutation(rows).astype(np.int64) * 7 + 1_000_000
    paths = []
    for number, start in enumerate(range(0, rows, ROWS_PER_FILE)):
        end = min(rows, start + ROWS_PER_FILE)
        table = pa.table({"id": ids[start:end], "key": user_uuids(rng, end - start),
                          "amount": rng.integers(0, 10**6, end - start)})
        path = directory / f"{number:05d}-0-data.parquet"
        pq.write_table(table, path, compression="zstd")
        paths.append(str(path))
    return paths


def rss() -> int:
    return psutil.Process().memory_info().rss


def settled_rss() -> int:
    """RSS once freed memory has gone back to the system: Arrow's pool and glibc's heap keep freed pages for
    reuse, which would count read buffers and sort temporaries as the index's."""
    gc.collect()
    pa.default_memory_pool().release_unused()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss()


@contextlib.contextmanager
def hashing_by(name: str) -> Iterator[None]:
    saved = key_codes.accelerator
    if name == "numpy":
        key_codes.accelerator = None
    try:
        yield
    finally:
        key_codes.accelerator = saved


def read_ahead(paths: list[str], column: str, depth: int = 2) -> Iterator[tuple[str, pa.Table]]:
    """Each file's key column, the next ``depth`` files read in other threads meanwhile (pyarrow and the C
    hash release the GIL)."""
    with ThreadPoolExecutor(depth) as pool:
        queued = [pool.submit(pq.read_table, path, columns=[column]) for path in paths[:depth]]
        for number, path in enumerate(paths):
            table = queued[number].result()
            if number + depth < len(paths):
                queued.append(pool.submit(pq.read_table, paths[number + depth], columns=[column]))
            queued[number] = None  # type: ignore[call-overload]
            yield path, table


def build(paths: list[str], column: str, disk: IndexDirectory | None = None) -> tuple[KeyIndex, dict[str, float]]:
    """One index from the files, added in this thread, then placed (``disk``: kept there, its adds spilling
    sorted runs that placing merges)."""
    started = time.perf_counter()
    adding = 0.0
    index = KeyIndex(multiset=False) if disk is None else KeyIndex(multiset=False, disk=disk,
                                                                   overlay_bytes=OVERLAY_BYTES)
    for path, table in read_ahead(paths, column):
        began = time.perf_counter()
        index.add(path, table)
        adding += time.perf_counter() - began
    read_done = time.perf_counter()
    index.rows  # noqa: B018 - placing the queued rows is part of the build
    finished = time.perf_counter()
    return index, {"total": finished - started, "read_and_hash": read_done - started, "codes": adding,
                   "sort": finished - read_done}


class PeakRss:
    """The highest RSS of this process while the block runs, sampled every 20 ms in a thread; and the highest
    growth of its anonymous part (RSS less file-backed pages: not the pages of an index's mapped files, which are
    the kernel's page cache mapped in)."""

    def __init__(self) -> None:
        self.highest = 0
        self.anonymous_growth = 0
        self._anonymous_before = 0
        self._running = False
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _sample(self) -> None:
        info = psutil.Process().memory_info()
        self.highest = max(self.highest, info.rss)
        self.anonymous_growth = max(self.anonymous_growth, info.rss - info.shared - self._anonymous_before)

    def _watch(self) -> None:
        while self._running:
            self._sample()
            time.sleep(0.02)

    def __enter__(self) -> PeakRss:
        info = psutil.Process().memory_info()
        self._anonymous_before = info.rss - info.shared
        self._running = True
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._running = False
        self._thread.join()
        self._sample()


def build_figures(held: int, times: dict[str, list[float]]) -> dict:
    """The figures of an index's builds: rows held, and the spread of each build step's time."""
    return {"rows": held, "build_s": spread(times["total"]), "read_and_hash_s": spread(times["read_and_hash"]),
            "codes_s": spread(times["codes"]), "sort_s": spread(times["sort"])}


def spread(values: list[float], scale: float = 1.0) -> dict[str, float]:
    return {"median": round(statistics.median(values) * scale, 3), "min": round(min(values) * scale, 3),
            "max": round(max(values) * scale, 3)}


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def whole_range_keys(paths: list[str], column: str, count: int) -> pa.Table:
    """``count`` distinct keys (every key when there are fewer rows) drawn uniformly from the rows of every file:
    over the whole key range, as a run sorted by key code sees them, not one file's or the recent ones."""
    sizes = np.array([pq.ParquetFile(path).metadata.num_rows for path in paths])
    starts = np.cumsum(sizes) - sizes
    total = int(sizes.sum())
    chosen = np.sort(np.random.default_rng(13).choice(total, min(count, total), replace=False))
    tables = []
    for path, start, size in zip(paths, starts, sizes, strict=True):
        rows = chosen[(chosen >= start) & (chosen < start + size)] - start
        if len(rows):
            tables.append(pq.read_table(path, columns=[column]).take(pa.array(rows)))
    return pa.concat_tables(tables).combine_chunks()


def absent_keys(column: str, count: int) -> pa.Table:
    """Keys no file holds (bigint keys of the files are 1,000,000 + 7k; text keys are random uuids)."""
    rng = np.random.default_rng(23)
    if column == "id":
        return pa.table({"id": pa.array(rng.integers(0, 2**40, count) * 7 + 1_000_003, pa.int64())})
    return pa.table({"key": user_uuids(rng, count)})


def whole_range_batches(index: KeyIndex, pool: pa.Table, repeats: int) -> dict[str, list[float]]:
    """A warm-up batch, then ``repeats`` batches, of 50,000 keys drawn from ``pool`` (the same keys whichever the
    index): find, forget of what was found, add of the keys as a new data file, placed. Seconds per step, the
    warm-up's first; ``missing``: keys the index did not find (it holds every one)."""
    rng = np.random.default_rng(17)
    times: dict[str, list[float]] = {"find": [], "forget": [], "add": [], "total": [], "missing": []}
    for number in range(1 + repeats):
        keys = pool.take(pa.array(rng.choice(pool.num_rows, min(BATCH, pool.num_rows), replace=False)))
        started = time.perf_counter()
        located = index.find(keys)
        found = time.perf_counter()
        index.forget(located)
        forgotten = time.perf_counter()
        index.add(f"whole-range-{number}.parquet", keys)
        index.rows  # noqa: B018 - placing the batch's rows is part of it
        done = time.perf_counter()
        for name, seconds in (("find", found - started), ("forget", forgotten - found), ("add", done - forgotten),
                              ("total", done - started)):
            times[name].append(seconds)
        times["missing"].append(int((located.file_ids < 0).sum()))
    return times


def answers(index: KeyIndex, keys: pa.Table) -> str:
    """A digest of where the index says each key is (data file path and row position, or nothing)."""
    located = index.find(keys)
    names = {int(file_id): index.path(int(file_id)) for file_id in np.unique(located.file_ids[located.file_ids >= 0])}
    digest = hashlib.sha256()
    for file_id, position in zip(located.file_ids.tolist(), located.positions.tolist(), strict=True):
        digest.update(f"{names.get(file_id, '-')}:{position}\n".encode())
    return digest.hexdigest()[:16]


def batch_figures(times: dict[str, list[float]], watched: PeakRss, before: int) -> dict[str, object]:
    """The warm-up batch apart, then median [min-max] of the repeats, per step, in ms; the peak RSS growth during
    the batches (``before``: the settled RSS before them)."""
    figures: dict[str, object] = {f"warmup_{name}_ms": round(times[name][0] * 1e3, 1)
                                  for name in ("find", "forget", "add", "total")}
    for name in ("find", "forget", "add", "total"):
        figures[f"{name}_ms"] = spread(times[name][1:], 1e3)
    figures["missing"] = sum(times["missing"])
    figures["peak_rss_bytes"] = watched.highest - before
    figures["peak_anonymous_bytes"] = watched.anonymous_growth
    return figures


def measure(paths: list[str], column: str, rows: int, builds: int, batches: int,
            whole_range: tuple[pa.Table, pa.Table] | None = None) -> dict:
    """Build ``builds`` times (figures of each), keep the last index, then time batches of 50,000 keys.
    ``whole_range``: (pool, check keys) of the whole-range batches, run first (the on-disk index's peer)."""
    times: dict[str, list[float]] = {"total": [], "read_and_hash": [], "codes": [], "sort": []}
    index = None
    growth = []
    peak = peak_anonymous = 0
    for _ in range(builds):
        index = None
        before = settled_rss()
        with PeakRss() as watched:
            index, figures = build(paths, column)
        peak = max(peak, watched.highest - before)
        peak_anonymous = max(peak_anonymous, watched.anonymous_growth)
        growth.append(settled_rss() - before)
        for name, seconds in figures.items():
            times[name].append(seconds)
    assert index is not None
    held = index.rows
    index_bytes = index.memory_bytes
    peer: dict[str, object] = {}
    if whole_range is not None:
        pool, checks = whole_range
        before = settled_rss()
        with PeakRss() as watched:
            batch_times = whole_range_batches(index, pool, batches)
        peer = batch_figures(batch_times, watched, before)
        peer["answers"] = answers(index, checks)
    # batches: keys of rows spread over every file, as a stream's changes are
    rng = np.random.default_rng(11)
    sample_files = [paths[i] for i in rng.choice(len(paths), min(len(paths), 4), replace=False)]
    pool = pa.concat_tables([pq.read_table(p, columns=[column]) for p in sample_files]).combine_chunks()
    find_s, forget_s, add_s, scan_s, new_s = [], [], [], [], []
    for number in range(batches):
        keys = pool.take(pa.array(rng.choice(pool.num_rows, BATCH, replace=False)))
        started = time.perf_counter()
        located = index.find(keys)
        find_s.append(time.perf_counter() - started)
        forget_s.append(timed(lambda located=located: index.forget(located)))
        # the same keys written again as a new data file (their slots come back to life)
        add_s.append(timed(lambda keys=keys, number=number: (index.add(f"update-{number}.parquet", keys),
                                                              index.rows)))
    for number in range(max(2, batches // 2)):  # forget from a Located whose entries moved: a scan
        keys = pool.take(pa.array(rng.choice(pool.num_rows, BATCH, replace=False)))
        located = index.find(keys)
        stale = Located(located.file_ids, located.positions)  # no slots: as if entries had moved
        scan_s.append(timed(lambda stale=stale: index.forget(stale)))
        index.add(f"rescan-{number}.parquet", keys)
    for number in range(3 * batches):  # new keys: the delta grows and is merged into the main run now and then
        if column == "id":
            fresh = pa.table({"id": pa.array(rng.integers(2**40, 2**62, BATCH), pa.int64())})
        else:
            fresh = pa.table({"key": user_uuids(rng, BATCH)})
        new_s.append(timed(lambda fresh=fresh, number=number: (index.add(f"insert-{number}.parquet", fresh),
                                                                index.rows)))
    hashed = column != "id"
    return {
        **build_figures(held, times),
        "bytes_per_row": round(index_bytes / held, 2) if held else None,
        "rss_bytes_per_row": round(statistics.median(growth) / held, 2) if held else None,
        "peak_rss_bytes_per_row": round(peak / held, 1) if held else None,
        "peak_anonymous_bytes": peak_anonymous,
        "find_ms": spread(find_s, 1e3),
        "forget_ms": spread(forget_s, 1e3),
        "add_ms": spread(add_s, 1e3),
        "forget_scan_ms": spread(scan_s, 1e3),
        "insert_new_ms": spread(new_s, 1e3),
        "hashed": hashed,
        "whole_range": peer,
    }


def measure_disk(paths: list[str], column: str, builds: int, batches: int, pool: pa.Table, checks: pa.Table
                 ) -> dict:
    """The index kept on disk (files in a temporary directory, removed after): built ``builds`` times and
    checkpointed, then reopened, the whole-range batches, forced checkpoints (see the module)."""
    times: dict[str, list[float]] = {"total": [], "read_and_hash": [], "codes": [], "sort": [], "save": []}
    growth: list[int] = []
    peak = peak_anonymous = 0
    with tempfile.TemporaryDirectory(prefix="pgcdc-index-disk-") as scratch:
        where = Path(scratch) / "index"
        index: KeyIndex | None = None
        directory: IndexDirectory | None = None
        baseline = 0
        for _ in range(builds):
            if index is not None and directory is not None:
                index.close()
                directory.close()
                index = directory = None
                shutil.rmtree(where)
            baseline = settled_rss()
            directory = IndexDirectory(where)
            with PeakRss() as watched:
                index, figures = build(paths, column, directory)
                started = time.perf_counter()
                index.checkpoint(1, [1], force=True)  # the first manifest: what a restart opens
                figures["save"] = time.perf_counter() - started
            peak = max(peak, watched.highest - baseline)
            peak_anonymous = max(peak_anonymous, watched.anonymous_growth)
            growth.append(settled_rss() - baseline)
            for name, seconds in figures.items():
                times[name].append(seconds)
        assert index is not None and directory is not None
        held = index.rows
        built_memory, built_disk = index.memory_bytes, index.disk_bytes
        # a restart: closed, then opened from its manifest (checksums verified)
        reopen_s = []
        reopen_peak = reopen_peak_anonymous = 0
        for _ in range(REOPENS):
            index.close()
            directory.close()
            before = settled_rss()
            with PeakRss() as watched:
                started = time.perf_counter()
                directory = IndexDirectory(where)
                manifest = directory.read_manifest()
                assert manifest is not None
                index = KeyIndex.opened(directory, manifest, pool.schema, overlay_bytes=OVERLAY_BYTES)
                reopen_s.append(time.perf_counter() - started)
            reopen_peak = max(reopen_peak, watched.highest - before)
            reopen_peak_anonymous = max(reopen_peak_anonymous, watched.anonymous_growth)
        reopened_rss = settled_rss() - baseline
        reopened_memory = index.memory_bytes
        before = settled_rss()
        with PeakRss() as watched:
            batch_times = whole_range_batches(index, pool, batches)
        batch = batch_figures(batch_times, watched, before)
        batch["answers"] = answers(index, checks)
        after_batches_memory = index.memory_bytes
        after_batches_rss = settled_rss() - baseline
        # forced checkpoints rewriting the run: the first after all the batches, then each after one more
        checkpoint_s, checkpoint_peak, checkpoint_peak_anonymous = [], 0, 0
        rng = np.random.default_rng(19)
        for number in range(CHECKPOINTS):
            if number:
                keys = pool.take(pa.array(rng.choice(pool.num_rows, min(BATCH, pool.num_rows), replace=False)))
                index.forget(index.find(keys))
                index.add(f"before-checkpoint-{number}.parquet", keys)
                index.rows  # noqa: B018 - placed before the checkpoint, not by it
            before = settled_rss()
            with PeakRss() as watched:
                started = time.perf_counter()
                index.checkpoint(2 + number, [1], force=True)
                checkpoint_s.append(time.perf_counter() - started)
            checkpoint_peak = max(checkpoint_peak, watched.highest - before)
            checkpoint_peak_anonymous = max(checkpoint_peak_anonymous, watched.anonymous_growth)
            if not number:  # the state the batches left, saved: the same answers, and after a reopen
                after_checkpoint = answers(index, checks)
                index.close()
                directory.close()
                directory = IndexDirectory(where)
                manifest = directory.read_manifest()
                assert manifest is not None
                index = KeyIndex.opened(directory, manifest, pool.schema, overlay_bytes=OVERLAY_BYTES)
                after_reopen = answers(index, checks)
        final_disk = index.disk_bytes
        index.close()
        directory.close()
    return {
        **build_figures(held, times),
        "save_s": spread(times["save"]),
        "build_and_save_s": spread([a + b for a, b in zip(times["total"], times["save"], strict=True)]),
        "memory_bytes": built_memory,
        "rss_growth_bytes": int(statistics.median(growth)),
        "peak_rss_bytes_per_row": round(peak / held, 1) if held else None,
        "peak_anonymous_bytes": peak_anonymous,
        "disk_bytes_per_row": round(built_disk / held, 2) if held else None,
        "reopen_ms": spread(reopen_s, 1e3),
        "reopen_rss_bytes": reopened_rss,
        "reopen_peak_rss_bytes": reopen_peak,
        "reopen_peak_anonymous_bytes": reopen_peak_anonymous,
        "reopen_memory_bytes": reopened_memory,
        "after_batches_memory_bytes": after_batches_memory,
        "after_batches_rss_bytes": after_batches_rss,
        "checkpoint_s": spread(checkpoint_s),
        "checkpoint_peak_rss_bytes": checkpoint_peak,
        "checkpoint_peak_anonymous_bytes": checkpoint_peak_anonymous,
        "final_disk_bytes_per_row": round(final_disk / held, 2) if held else None,
        "whole_range": batch,
        "answers_after_checkpoint": after_checkpoint,
        "answers_after_reopen": after_reopen,
    }


def report_disk(rows: int, runs: dict[str, dict], disk: dict[str, dict], batches: int) -> dict[str, object]:
    """Prints the on-disk index beside its in-memory peer; returns their figures for the JSON line."""
    mib = 2**20

    def cell(figure: dict, width: int, digits: int = 2) -> str:
        return f"{figure['median']:.{digits}f} [{figure['min']:.{digits}f}-{figure['max']:.{digits}f}]".rjust(width)

    print(f"\non disk (overlay {OVERLAY_BYTES // mib} MiB) beside in memory (the peer, same run, same files and keys); "
          "median [min-max]")
    print(f"{'key':<11} {'where':<6} {'build s':>18} {'save s':>6} {'peak B/row':>10} {'index MiB':>9} "
          f"{'RSS MiB':>7} {'disk B/row':>10} {'reopen ms':>18} {'RSS MiB after':>13}")
    figures: dict[str, object] = {"disk_overlay_bytes": OVERLAY_BYTES}
    for name, run in disk.items():
        peer = runs[name]
        print(f"{name:<11} {'memory':<6} {cell(peer['build_s'], 18)} {'-':>6} {peer['peak_rss_bytes_per_row']:>10.0f} "
              f"{peer['bytes_per_row'] * rows / mib:>9.1f} {peer['rss_bytes_per_row'] * rows / mib:>7.1f} {'-':>10} "
              f"{'(a rebuild)':>18} {'-':>13}")
        print(f"{'':<11} {'disk':<6} {cell(run['build_s'], 18)} {run['save_s']['median']:>6.2f} "
              f"{run['peak_rss_bytes_per_row']:>10.0f} {run['memory_bytes'] / mib:>9.2f} "
              f"{run['rss_growth_bytes'] / mib:>7.1f} {run['disk_bytes_per_row']:>10.2f} "
              f"{cell(run['reopen_ms'], 18, 1)} {run['reopen_rss_bytes'] / mib:>13.1f}")
        ratio = run["build_and_save_s"]["median"] / peer["build_s"]["median"]
        print(f"{'':<11} disk/memory: build and save {ratio:.2f}x; restart: reopen {run['reopen_ms']['median']:.1f} ms "
              f"against a rebuild of {peer['build_s']['median']:.2f} s")
        figures.update({
            f"{name}_disk_build_s": run["build_s"]["median"], f"{name}_disk_build_s_min": run["build_s"]["min"],
            f"{name}_disk_build_s_max": run["build_s"]["max"], f"{name}_disk_codes_s": run["codes_s"]["median"],
            f"{name}_disk_sort_s": run["sort_s"]["median"], f"{name}_disk_save_s": run["save_s"]["median"],
            f"{name}_disk_build_and_save_s": run["build_and_save_s"]["median"],
            f"{name}_ratio_build_disk_vs_memory": round(ratio, 2),
            f"{name}_disk_memory_bytes": run["memory_bytes"], f"{name}_disk_rss_growth_bytes": run["rss_growth_bytes"],
            f"{name}_disk_peak_rss_bytes_per_row": run["peak_rss_bytes_per_row"],
            f"{name}_disk_bytes_per_row": run["disk_bytes_per_row"],
            f"{name}_disk_reopen_ms": run["reopen_ms"]["median"], f"{name}_disk_reopen_ms_min": run["reopen_ms"]["min"],
            f"{name}_disk_reopen_ms_max": run["reopen_ms"]["max"],
            f"{name}_disk_reopen_rss_bytes": run["reopen_rss_bytes"],
            f"{name}_disk_reopen_memory_bytes": run["reopen_memory_bytes"],
        })
    print("  build: until placed (on disk: adds spill sorted runs of the queue, placing merges them into the run); "
          "save: the first checkpoint (run and manifest);\n"
          "  index MiB: memory_bytes after the build (on disk: fence, overlay, path table); RSS: growth once settled; "
          "peak: highest RSS growth during a build and save;\n"
          f"  reopen: closed, then opened from the manifest, checksums verified (median of {REOPENS}; the run's "
          "files in the page cache, as they are right after writing)")

    print(f"\nbatches of {BATCH:,} keys drawn uniformly from the rows of every file (the whole key range): find, "
          f"forget, add as a new file; warm-up apart, then median [min-max] of {batches}")
    print(f"{'key':<11} {'where':<6} {'warm-up ms':>10} {'find ms':>17} {'forget ms':>17} {'add ms':>17} "
          f"{'batch ms':>17} {'missing':>7}")
    for name, run in disk.items():
        for where, batch in (("memory", runs[name]["whole_range"]), ("disk", run["whole_range"])):
            print(f"{name if where == 'memory' else '':<11} {where:<6} {batch['warmup_total_ms']:>10.1f} "
                  f"{cell(batch['find_ms'], 17, 1)} {cell(batch['forget_ms'], 17, 1)} {cell(batch['add_ms'], 17, 1)} "
                  f"{cell(batch['total_ms'], 17, 1)} {batch['missing']:>7}")
            prefix = f"{name}_{where}_whole_range"
            figures[f"{prefix}_warmup_ms"] = batch["warmup_total_ms"]
            for step in ("find", "forget", "add", "total"):
                figures[f"{prefix}_{step}_ms"] = batch[f"{step}_ms"]["median"]  # type: ignore[index]
            figures[f"{prefix}_total_ms_min"] = batch["total_ms"]["min"]  # type: ignore[index]
            figures[f"{prefix}_total_ms_max"] = batch["total_ms"]["max"]  # type: ignore[index]
            figures[f"{prefix}_missing"] = batch["missing"]
        memory_batch, disk_batch = runs[name]["whole_range"], run["whole_range"]
        ratios = {step: disk_batch[f"{step}_ms"]["median"] / memory_batch[f"{step}_ms"]["median"]
                  for step in ("total", "find", "forget", "add")}
        print(f"{'':<11} disk/memory: batch {ratios['total']:.2f}x (find {ratios['find']:.2f}x, forget "
              f"{ratios['forget']:.2f}x, add {ratios['add']:.2f}x)")
        for step, value in ratios.items():
            figures[f"{name}_ratio_{'batch' if step == 'total' else step}_disk_vs_memory"] = round(value, 2)
        figures[f"{name}_disk_after_batches_memory_bytes"] = run["after_batches_memory_bytes"]
        figures[f"{name}_disk_after_batches_rss_bytes"] = run["after_batches_rss_bytes"]

    print(f"\nforced checkpoint rewriting the run (median [min-max] of {CHECKPOINTS}: the first after the "
          f"{1 + batches} batches, each other after one more), and the indexes' answers for {CHECK_KEYS:,} keys and "
          "1,000 absent ones")
    for name, run in disk.items():
        agree = run["whole_range"]["answers"] == runs[name]["whole_range"]["answers"]
        kept = run["answers_after_checkpoint"] == run["whole_range"]["answers"] == run["answers_after_reopen"]
        seconds = run["checkpoint_s"]["median"]
        print(f"  {name:<11} checkpoint {cell(run['checkpoint_s'], 18)} s ({run['rows'] / seconds / 1e6:.1f} M "
              f"rows/s); memory_bytes after the batches "
              f"{run['after_batches_memory_bytes'] / mib:.1f} MiB, RSS growth {run['after_batches_rss_bytes'] / mib:.1f}"
              f" MiB; answers: on disk {'=' if agree else '!='} in memory, "
              f"{'unchanged' if kept else 'CHANGED'} by the checkpoint and a reopen")
        figures.update({
            f"{name}_disk_checkpoint_s": seconds, f"{name}_disk_checkpoint_s_min": run["checkpoint_s"]["min"],
            f"{name}_disk_checkpoint_s_max": run["checkpoint_s"]["max"],
            f"{name}_disk_answers_agree": agree, f"{name}_disk_answers_kept": kept,
        })

    print("\npeak RSS growth, MiB, anonymous in brackets (the rest: file-backed pages, mostly the run's files mapped "
          "in from the page cache,\nhanded back after each step; the kernel maps whole neighbourhoods of a page "
          "touched, so a batch's random lookups map most of the run)")
    print(f"{'key':<11} {'where':<6} {'build':>15} {'reopen':>15} {'batches':>15} {'checkpoint':>15}")

    def peak(total: float, anonymous: float) -> str:
        return f"{total / mib:.0f} ({anonymous / mib:.0f})".rjust(15)

    for name, run in disk.items():
        peer = runs[name]
        print(f"{name:<11} {'memory':<6} {peak(peer['peak_rss_bytes_per_row'] * rows, peer['peak_anonymous_bytes'])} "
              f"{'-':>15} {peak(peer['whole_range']['peak_rss_bytes'], peer['whole_range']['peak_anonymous_bytes'])} "
              f"{'-':>15}")
        print(f"{'':<11} {'disk':<6} {peak(run['peak_rss_bytes_per_row'] * rows, run['peak_anonymous_bytes'])} "
              f"{peak(run['reopen_peak_rss_bytes'], run['reopen_peak_anonymous_bytes'])} "
              f"{peak(run['whole_range']['peak_rss_bytes'], run['whole_range']['peak_anonymous_bytes'])} "
              f"{peak(run['checkpoint_peak_rss_bytes'], run['checkpoint_peak_anonymous_bytes'])}")
        for where, figure in (("memory", peer), ("disk", run)):
            figures[f"{name}_{where}_build_peak_anonymous_bytes"] = figure["peak_anonymous_bytes"]
            figures[f"{name}_{where}_batches_peak_rss_bytes"] = figure["whole_range"]["peak_rss_bytes"]
            figures[f"{name}_{where}_batches_peak_anonymous_bytes"] = figure["whole_range"]["peak_anonymous_bytes"]
        for step in ("reopen", "checkpoint"):
            figures[f"{name}_disk_{step}_peak_rss_bytes"] = run[f"{step}_peak_rss_bytes"]
            figures[f"{name}_disk_{step}_peak_anonymous_bytes"] = run[f"{step}_peak_anonymous_bytes"]

    scale = MIRROR_ROWS / rows
    fence = MIRROR_ROWS / BLOCK * 8
    print(f"\nEXTRAPOLATED (not measured): a mirror of {MIRROR_ROWS:,} rows, the per-row figures at {rows:,} rows "
          f"scaled linearly (on disk, its {MIRROR_ROWS // ROWS_PER_FILE:,} files of {ROWS_PER_FILE:,} rows still pack "
          "a location in 32 bits)")
    for name, run in disk.items():
        peer = runs[name]
        on_disk = run["disk_bytes_per_row"] * MIRROR_ROWS
        reopen = run["reopen_ms"]["median"] / 1e3 * scale
        checkpoint = run["checkpoint_s"]["median"] * scale
        print(f"  {name:<11} on disk {on_disk / 2**30:.1f} GiB; in memory fence {fence / mib:.1f} MiB + overlay "
              f"{OVERLAY_BYTES / mib:.0f} MiB = {(fence + OVERLAY_BYTES) / mib:.0f} MiB (and the path table); reopen "
              f"about {reopen:.0f} s (the run's checksums read: from the page cache, else at the device's speed); "
              f"a forced checkpoint about {checkpoint:.0f} s; in memory instead "
              f"{peer['bytes_per_row'] * MIRROR_ROWS / 2**30:.1f} GiB, rebuilt at each start in about "
              f"{peer['build_s']['median'] * scale:.0f} s")
        figures.update({
            f"{name}_disk_gib_at_1e9_rows_extrapolated": round(on_disk / 2**30, 1),
            f"{name}_disk_memory_mib_at_1e9_rows_extrapolated": round((fence + OVERLAY_BYTES) / mib, 1),
            f"{name}_disk_reopen_s_at_1e9_rows_extrapolated": round(reopen, 1),
            f"{name}_disk_checkpoint_s_at_1e9_rows_extrapolated": round(checkpoint, 1),
            f"{name}_memory_rebuild_s_at_1e9_rows_extrapolated": round(peer["build_s"]["median"] * scale, 1),
        })
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1,000,000 rows, fewer repeats (under 2 minutes)")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--data", type=Path, default=None,
                        help="a directory for the generated Parquet files (kept and reused); default: temporary")
    parser.add_argument("--no-numpy", action="store_true",
                        help="skip the text key's builds by the numpy fallback hash (when the C hash is built)")
    args = parser.parse_args()
    rows = args.rows or (1_000_000 if args.quick else 10_000_000)
    builds, batches = (3, 5) if args.quick else (3, 10)
    with contextlib.ExitStack() as stack:
        directory = args.data or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pgcdc-index-")))
        directory.mkdir(parents=True, exist_ok=True)
        existing = sorted(str(p) for p in directory.glob("*-data.parquet"))
        if existing and sum(pq.ParquetFile(p).metadata.num_rows for p in existing) == rows:
            paths = existing
        else:
            for stale in existing:
                Path(stale).unlink()
            started = time.perf_counter()
            paths = write_files(directory, rows)
            print(f"wrote {rows:,} rows in {len(paths)} Parquet files in {time.perf_counter() - started:.1f} s")

        def whole_range(column: str) -> tuple[pa.Table, pa.Table]:
            pool = whole_range_keys(paths, column, POOL_KEYS)
            return pool, pa.concat_tables([pool.slice(0, CHECK_KEYS), absent_keys(column, 1_000)])

        # each key: the in-memory index (the peer), then the one on disk, given the same whole-range batches
        bigint = whole_range("id")
        runs = {"bigint": measure(paths, "id", rows, builds, batches, bigint)}
        disk = {"bigint": measure_disk(paths, "id", builds, batches, *bigint)}
        del bigint
        text = whole_range("key")
        if key_codes.accelerator is not None:
            runs["text_c"] = measure(paths, "key", rows, builds, batches, text)
            disk["text_c"] = measure_disk(paths, "key", builds, batches, *text)
        else:
            print("the C key hash (_keyhash) is not built here: text keys are hashed by numpy only")
        with hashing_by("numpy"):
            if "text_c" not in disk:
                runs["text_numpy"] = measure(paths, "key", rows, builds, batches, text)
                disk["text_numpy"] = measure_disk(paths, "key", builds, batches, *text)
            elif not args.no_numpy:
                runs["text_numpy"] = measure(paths, "key", rows, builds if args.quick else 2, batches)
        del text

    print(f"\nkey index of {rows:,} rows ({len(paths)} files of {ROWS_PER_FILE:,}); times: median [min-max] of "
          f"{builds} builds, {batches} batches of {BATCH:,} keys")
    print(f"{'key':<11} {'build s':>17} {'read+hash s':>12} {'codes s':>7} {'sort s':>7} {'B/row':>6} {'RSS B/row':>9} "
          f"{'peak':>5} {'find ms':>15} {'forget ms':>15} {'add ms':>15} {'scan ms':>8} {'insert ms':>16}")

    def cell(figure: dict, width: int) -> str:
        return f"{figure['median']:.1f} [{figure['min']:.1f}-{figure['max']:.1f}]".rjust(width)

    for name, run in runs.items():
        print(f"{name:<11} {cell(run['build_s'], 17)} {run['read_and_hash_s']['median']:>12.2f} "
              f"{run['codes_s']['median']:>7.2f} "
              f"{run['sort_s']['median']:>7.2f} {run['bytes_per_row']:>6.1f} {run['rss_bytes_per_row']:>9.1f} "
              f"{run['peak_rss_bytes_per_row']:>5.0f} {cell(run['find_ms'], 15)} {cell(run['forget_ms'], 15)} "
              f"{cell(run['add_ms'], 15)} {run['forget_scan_ms']['median']:>8.0f} {cell(run['insert_new_ms'], 16)}")
    print("  read+hash: until the last file is added (reads run ahead in 2 threads); codes: computing the key "
          "codes (hash or integer) in add();\n"
          "  add: the batch's keys written again as a new file, placed; scan: forget without slots (entries "
          "moved), a pass over the index;\n"
          "  insert: 50,000 new keys (the max is a merge of the delta into the main run); peak: highest RSS "
          "growth during a build, bytes per row")
    print(f"\na mirror of {MIRROR_ROWS:,} rows would hold (the peak as measured at {rows:,} rows: it includes the "
          "read buffers of the files in flight, a smaller share the more rows):")
    for name, run in runs.items():
        print(f"  {name:<11} {run['bytes_per_row'] * MIRROR_ROWS / 2**30:6.1f} GiB in the index "
              f"(about {run['peak_rss_bytes_per_row'] * MIRROR_ROWS / 2**30:.0f} GiB at the peak of a build)")

    figures: dict[str, object] = {"rows": rows, "files": len(paths), "batch_keys": BATCH,
                                  "c_hash_built": key_codes.accelerator is not None}
    for name, run in runs.items():
        figures[f"{name}_build_s"] = run["build_s"]["median"]
        figures[f"{name}_build_s_min"] = run["build_s"]["min"]
        figures[f"{name}_build_s_max"] = run["build_s"]["max"]
        figures[f"{name}_read_and_hash_s"] = run["read_and_hash_s"]["median"]
        figures[f"{name}_codes_s"] = run["codes_s"]["median"]
        figures[f"{name}_sort_s"] = run["sort_s"]["median"]
        figures[f"{name}_bytes_per_row"] = run["bytes_per_row"]
        figures[f"{name}_rss_bytes_per_row"] = run["rss_bytes_per_row"]
        figures[f"{name}_peak_rss_bytes_per_row"] = run["peak_rss_bytes_per_row"]
        for batch in ("find_ms", "forget_ms", "add_ms", "forget_scan_ms", "insert_new_ms"):
            figures[f"{name}_{batch}"] = run[batch]["median"]
            figures[f"{name}_{batch}_max"] = run[batch]["max"]
        figures[f"{name}_gib_at_1e9_rows"] = round(run["bytes_per_row"] * MIRROR_ROWS / 2**30, 1)
    figures.update(report_disk(rows, runs, disk, batches))
    if "text_c" in runs and "text_numpy" in runs:
        figures["ratio_build_c_vs_numpy"] = round(runs["text_numpy"]["build_s"]["median"]
                                                  / runs["text_c"]["build_s"]["median"], 2)
        figures["ratio_codes_c_vs_numpy"] = round(runs["text_numpy"]["codes_s"]["median"]
                                                 / runs["text_c"]["codes_s"]["median"], 2)
        figures["ratio_find_c_vs_numpy"] = round(runs["text_numpy"]["find_ms"]["median"]
                                                 / runs["text_c"]["find_ms"]["median"], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
