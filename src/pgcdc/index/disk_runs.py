"""A key index's sorted run kept in files, and the manifest that ties a run to the snapshot it describes.

A run is three arrays sorted by the key code's first word (:mod:`pgcdc.index.key_index`): ``k1`` (int64 for an
integer key, else uint64), ``k2`` (uint64, hashed keys only) and ``loc`` (int64, ``file id << 32 | position``),
each a file of raw little-endian values, plus ``fence``: every ``BLOCK``-th ``k1``, the only part held in memory.

- **Reading** maps the files read-only (:class:`DiskRun`). A lookup finds a key's block in the fence, then
  bisects inside the block: a key costs a page or two of each file, not a binary search over the whole run. What
  a batch touched is handed back to the kernel afterwards (:meth:`DiskRun.release`), so the process holds the
  fence and nothing else of the run, whatever its size; the pages stay in the kernel's cache while memory allows.
- **Writing** streams chunks (:class:`RunWriter`): a run of any size is written within the memory of one chunk,
  each file's CRC-32 taken on the way, the files synced before the run is named anywhere.
- **The manifest** (``index.json``, :class:`IndexDirectory`) names the run, its checksums, the data file of each
  file id and the snapshot the run describes. It is replaced atomically (written aside, synced, renamed), and only
  once the run it names is durable: a kill at any instant leaves the previous manifest and its run, or the new
  ones. A manifest whose run is missing, short or fails its checksums is not trusted: the index is built again.
- The directory is locked while a process uses it: two processes never write one index.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

log = logging.getLogger("pgcdc.index.disk_runs")

BLOCK = 512  # entries between two fence values: 4 KiB of codes, one page
FORMAT = 1
_CRC_CHUNK = 1 << 24  # bytes checksummed at once when a run is opened


@dataclass(frozen=True)
class RunInfo:
    """What a manifest says of a run: its name in the directory, its entries, whether its codes are hashed
    (two words), and each file's CRC-32."""

    name: str
    rows: int
    hashed: bool
    crc: dict[str, int]

    def encode(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "hashed": self.hashed, "crc": self.crc}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> RunInfo:
        return cls(str(data["name"]), int(data["rows"]), bool(data["hashed"]),
                   {str(k): int(v) for k, v in data["crc"].items()})

    def columns(self) -> list[str]:
        return ["k1", "k2", "loc"] if self.hashed else ["k1", "loc"]


def _dtype(column: str, hashed: bool) -> np.dtype[Any]:
    if column == "loc" or (column == "k1" and not hashed):
        return np.dtype("<i8")
    return np.dtype("<u8")


class DiskRun:
    """A run mapped from its files (see the module). Its arrays are read-only views of the mappings."""

    on_disk = True

    def __init__(self, directory: Path, info: RunInfo) -> None:
        self.info = info
        self.directory = directory
        self._maps: list[mmap.mmap] = []
        arrays = {}
        fence = directory / f"{info.name}.fence"
        try:
            for column in info.columns():
                arrays[column] = self._map(directory / f"{info.name}.{column}", _dtype(column, info.hashed))
            self.fence = np.fromfile(fence, dtype=_dtype("k1", info.hashed))
        except FileNotFoundError as exc:
            self.close()
            raise DamagedIndex(f"{exc.filename} is missing") from None
        self.k1: np.ndarray = arrays["k1"]
        self.k2: np.ndarray | None = arrays.get("k2")
        self.loc: np.ndarray = arrays["loc"]
        if len(self.fence) != -(-info.rows // BLOCK):
            raise DamagedIndex(f"{fence} holds {len(self.fence)} values for {info.rows} entries")

    def _map(self, path: Path, dtype: np.dtype[Any]) -> np.ndarray:
        size = path.stat().st_size
        if size != self.info.rows * dtype.itemsize:
            raise DamagedIndex(f"{path} is {size} bytes, not the {self.info.rows * dtype.itemsize} of its "
                               f"{self.info.rows} entries")
        if not size:
            return np.empty(0, dtype)
        with open(path, "rb") as file:
            mapped = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ)
        self._maps.append(mapped)
        return np.frombuffer(mapped, dtype=dtype)

    def __len__(self) -> int:
        return self.info.rows

    @property
    def k1_dtype(self) -> np.dtype[Any]:
        return self.k1.dtype

    @property
    def nbytes(self) -> int:
        """The bytes this run holds in the process: its fence (the mapped pages are the kernel's to drop)."""
        return int(self.fence.nbytes)

    @property
    def disk_bytes(self) -> int:
        return self.info.rows * (24 if self.info.hashed else 16) + int(self.fence.nbytes)

    def verify(self) -> None:
        """Raises :class:`DamagedIndex` unless every file matches its checksum (read in chunks, each handed back
        to the kernel once read)."""
        for column in self.info.columns():
            array = {"k1": self.k1, "k2": self.k2, "loc": self.loc}[column]
            assert array is not None
            raw = array.view(np.uint8)
            crc = 0
            for start in range(0, len(raw), _CRC_CHUNK):
                crc = zlib.crc32(raw[start:start + _CRC_CHUNK].data, crc)
                self.release()
            if crc != self.info.crc.get(column):
                raise DamagedIndex(f"{self.directory / f'{self.info.name}.{column}'} fails its checksum")

    def search(self, queries: np.ndarray, side: Literal["left", "right"]) -> np.ndarray:
        """``np.searchsorted(self.k1, queries, side)``: the fence names each query's block, a bisection inside
        it reads a page of it."""
        size = len(self)
        queries = np.asarray(queries, dtype=self.k1.dtype)
        if not size:
            return np.zeros(len(queries), np.int64)
        block = np.searchsorted(self.fence, queries, side).astype(np.int64)
        # the answer lies in (block-1)*BLOCK .. block*BLOCK: fence[block-1] is before it, fence[block] at or after
        low = np.maximum(block - 1, 0) * BLOCK
        high = np.minimum(block * BLOCK, size)
        low = np.where(block == 0, 0, low)
        k1 = self.k1
        while True:
            active = np.flatnonzero(low < high)
            if not len(active):
                return low
            middle = (low[active] + high[active]) >> 1
            values = k1[middle]
            before = values < queries[active] if side == "left" else values <= queries[active]
            low[active[before]] = middle[before] + 1
            high[active[~before]] = middle[~before]

    def release(self) -> None:
        """Hands the pages this process touched back to the kernel (they stay cached while memory allows)."""
        for mapped in self._maps:
            with contextlib.suppress(ValueError, OSError):
                mapped.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.k1 = self.loc = self.fence = np.empty(0)
        self.k2 = None
        maps, self._maps = self._maps, []
        for mapped in maps:
            with contextlib.suppress(BufferError):  # a view still held elsewhere keeps it mapped until collected
                mapped.close()

    def files(self) -> list[Path]:
        return [self.directory / f"{self.info.name}.{column}" for column in [*self.info.columns(), "fence"]]


class DamagedIndex(Exception):
    """An index's files do not match its manifest: it is built again, never trusted."""


class RunWriter:
    """Writes one run from sorted chunks (see the module)."""

    def __init__(self, directory: Path, hashed: bool) -> None:
        self.directory = directory
        self.hashed = hashed
        self.name = f"run-{uuid.uuid4().hex[:12]}"
        self.rows = 0
        self._columns = ["k1", "k2", "loc"] if hashed else ["k1", "loc"]
        self._files = {column: open(directory / f"{self.name}.{column}", "wb")  # noqa: SIM115 (closed in finish)
                       for column in self._columns}
        self._crc = dict.fromkeys(self._columns, 0)
        self._fence: list[np.ndarray] = []
        self._last: Any = None

    def append(self, k1: np.ndarray, k2: np.ndarray | None, loc: np.ndarray) -> None:
        if not len(k1):
            return
        if self._last is not None and k1[0] < self._last:
            raise ValueError("a run's chunks must come in code order")
        self._last = k1[-1]
        codes = k1.astype(_dtype("k1", self.hashed), copy=False)
        arrays: dict[str, Any] = {"k1": codes, "k2": k2, "loc": loc.astype(np.int64, copy=False)}
        for column in self._columns:
            data = np.ascontiguousarray(arrays[column]).view(np.uint8).data
            self._files[column].write(data)
            self._crc[column] = zlib.crc32(data, self._crc[column])
        self._fence.append(codes[(-self.rows) % BLOCK::BLOCK].copy())
        self.rows += len(k1)

    def finish(self) -> RunInfo:
        """Syncs the run's files and writes its fence; the run is durable when this returns."""
        for file in self._files.values():
            file.flush()
            os.fsync(file.fileno())
            file.close()
        fence = np.concatenate(self._fence) if self._fence else np.empty(0, _dtype("k1", self.hashed))
        with open(self.directory / f"{self.name}.fence", "wb") as file:
            file.write(np.ascontiguousarray(fence).view(np.uint8).data)
            file.flush()
            os.fsync(file.fileno())
        return RunInfo(self.name, self.rows, self.hashed, dict(self._crc))

    def abandon(self) -> None:
        for file in self._files.values():
            file.close()
        for column in [*self._columns, "fence"]:
            with contextlib.suppress(FileNotFoundError):
                (self.directory / f"{self.name}.{column}").unlink()


@dataclass(frozen=True)
class Manifest:
    """A saved index: its run describes ``snapshot_id`` of the table whose uuid names the directory; ``paths``
    the data file of each file id (None: dropped), ``key`` the key's field ids."""

    snapshot_id: int | None
    multiset: bool
    key: list[int]
    run: RunInfo
    paths: list[str | None]

    def encode(self) -> str:
        return json.dumps({"format": FORMAT, "snapshot_id": self.snapshot_id, "multiset": self.multiset,
                           "key": self.key, "run": self.run.encode(), "paths": self.paths})

    @classmethod
    def decode(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise DamagedIndex(f"manifest format {data.get('format')!r}, not {FORMAT}")
        snapshot = data["snapshot_id"]
        return cls(None if snapshot is None else int(snapshot), bool(data["multiset"]),
                   [int(i) for i in data["key"]], RunInfo.decode(data["run"]),
                   [None if p is None else str(p) for p in data["paths"]])


class IndexDirectory:
    """The directory of one mirror's index (its table's uuid under the index directory), locked by this process
    for as long as it is open."""

    MANIFEST = "index.json"

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        self._lock = open(path / "lock", "a+")  # noqa: SIM115 (held open: the lock lives with the file)
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise IndexInUse(f"{path} is in use by another process") from None
        os.utime(path / "lock")  # when it was last opened: see prune_unused

    def read_manifest(self) -> Manifest | None:
        try:
            text = (self.path / self.MANIFEST).read_text()
        except FileNotFoundError:
            return None
        try:
            return Manifest.decode(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise DamagedIndex(f"{self.path / self.MANIFEST} cannot be read: {exc}") from None

    def write_manifest(self, manifest: Manifest) -> None:
        """Replaces the manifest atomically (its run must be durable already)."""
        aside = self.path / f"{self.MANIFEST}.{uuid.uuid4().hex[:8]}"
        with open(aside, "w") as file:
            file.write(manifest.encode())
            file.flush()
            os.fsync(file.fileno())
        os.replace(aside, self.path / self.MANIFEST)
        descriptor = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def remove_except(self, keep: set[str]) -> None:
        """Deletes every run file and stray manifest whose run name is not in ``keep`` (a kill's leftovers)."""
        for entry in self.path.iterdir():
            name = entry.name
            if name in (self.MANIFEST, "lock"):
                continue
            run = name.split(".", 1)[0]
            if run not in keep:
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()

    def forget(self) -> None:
        """Removes the manifest: what is here describes nothing any more."""
        with contextlib.suppress(FileNotFoundError):
            (self.path / self.MANIFEST).unlink()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
        self._lock.close()


class IndexInUse(Exception):
    """Another process holds this index directory."""


def prune_unused(directory: Path, *, older_than_seconds: float) -> list[Path]:
    """Removes the index directories under ``directory`` that no process holds and none opened for
    ``older_than_seconds`` (a mirror dropped and made again has a new uuid: its old index describes nothing);
    returns them."""
    import shutil
    import time

    removed = []
    cutoff = time.time() - older_than_seconds
    for entry in directory.iterdir() if directory.is_dir() else []:
        lock = entry / "lock"
        try:
            if not entry.is_dir() or lock.stat().st_mtime > cutoff:
                continue
            with open(lock, "a") as file:
                fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(entry)
            removed.append(entry)
        except (OSError, BlockingIOError):
            continue  # in use, or not an index directory
    return removed


def default_index_directory() -> Path:
    """Where key indexes kept on disk live when no ``--index-dir`` is given: the user's cache directory."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pgcdc" / "index"
