"""A key index's sorted run kept in files, and the manifest that ties a run to the snapshot it describes.

A run is arrays sorted by the key code's first word (:mod:`pgcdc.index.key_index`), each a file of raw
little-endian values, plus ``fence``: every ``BLOCK``-th ``k1``, the only part held in memory besides ``ids``:

- ``k1``: the code's first word (int64 for an integer key, else uint64), 8 bytes an entry.
- ``k2``, hashed keys only: the high 32 bits of the code's second word (uint32), 4 bytes an entry. An index kept
  on disk uses 96-bit codes (see :class:`~pgcdc.index.key_index.KeyIndex`): the low 32 bits are zero and not
  stored; a writer refuses a second word that has any.
- ``loc``: each entry's location. Packed in 32 bits (uint32) when the run's locations fit: ``local << pos_bits |
  position``, where ``local`` numbers the file ids present in the run densely in their order, ``ids`` (int64,
  beside the run, checksummed like the rest) maps it back to the file id, and ``pos_bits`` is the bit length of
  the run's largest position. When they need up to ``HIGH_BITS`` more (a mirror holding a file of 10^8 rows, 27
  bits of position, and more than 32 files), ``loc`` holds the low ``PACKED_BITS`` of that packed value and
  ``hi`` (uint8) the rest. Otherwise int64, ``file id << 32 | position``, as held in memory. Readers only see the
  latter: :attr:`DiskRun.loc` decodes whatever it reads.

So an entry takes 12 bytes for an integer key and 16 for a hashed one while its run's locations pack in 32 bits,
13 and 17 in 40 bits, 16 and 20 when they do not.

- **Reading** maps the files read-only (:class:`DiskRun`). A lookup finds a key's block in the fence, then
  bisects inside the block: a key costs a page or two of each file, not a binary search over the whole run. What
  a batch touched is handed back to the kernel afterwards (:meth:`DiskRun.release`), so the process holds the
  fence and nothing else of the run, whatever its size; the pages stay in the kernel's cache while memory allows.
- **Writing** streams chunks (:class:`RunWriter`): a run of any size is written within the memory of one chunk,
  each file's CRC-32 taken on the way, the files synced before the run is named anywhere. Locations are written
  as they come and packed, a chunk at a time, once the run is complete: only then are its files and largest
  position known.
- **The manifest** (``index.json``, :class:`IndexDirectory`) names the run, its checksums, the data file of each
  file id and the snapshot the run describes. It is replaced atomically (written aside, synced, renamed), and only
  once the run it names is durable: a kill at any instant leaves the previous manifest and its run, or the new
  ones. A manifest of another ``FORMAT``, or whose run is missing, short or fails its checksums, is not trusted:
  the index is built again.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

log = logging.getLogger("pgcdc.index.disk_runs")

BLOCK = 512  # entries between two fence values: 4 KiB of codes, one page
FORMAT = 3  # 3: locations packed in 40 bits too (``hi``); format 2 is read as it is, format 1 built again
READABLE_FORMATS = (2, 3)
PACKED_BITS = 32  # a run's locations are packed in a uint32 when their run-local file number and position fit ...
HIGH_BITS = 8  # ... or in that and a byte more (``hi``)
_HIGH = np.uint64(32)  # a second word keeps its high 32 bits on disk
_LOW_BITS = np.uint64(0xFFFFFFFF)
_PACK_CHUNK = 1 << 20  # locations packed at once when a run is finished
_DENSE_IDS = 1 << 22  # file ids below this are noted in a bitmap while a run is written, others sorted
_CRC_CHUNK = 1 << 24  # bytes checksummed at once when a run is opened


@dataclass(frozen=True)
class RunInfo:
    """What a manifest says of a run: its name in the directory, its entries, whether its codes are hashed
    (two words), each file's CRC-32, and how its locations are stored: ``pos_bits`` None for int64 locations,
    else packed with ``files`` file ids in ``ids``; ``split``: when packed values are split between ``loc`` (their
    low ``split`` bits) and ``hi`` (the rest), else None (see the module)."""

    name: str
    rows: int
    hashed: bool
    crc: dict[str, int]
    pos_bits: int | None = None
    files: int = 0
    split: int | None = None

    def encode(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "hashed": self.hashed, "crc": self.crc,
                "pos_bits": self.pos_bits, "files": self.files, "split": self.split}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> RunInfo:
        pos_bits, split = data["pos_bits"], data.get("split")  # format 2 has no split
        return cls(str(data["name"]), int(data["rows"]), bool(data["hashed"]),
                   {str(k): int(v) for k, v in data["crc"].items()}, None if pos_bits is None else int(pos_bits),
                   int(data["files"]), None if split is None else int(split))

    @property
    def packed(self) -> bool:
        return self.pos_bits is not None

    def columns(self) -> list[str]:
        return ["k1", *(["k2"] if self.hashed else []), "loc", *(["hi"] if self.split is not None else []),
                *(["ids"] if self.packed else [])]

    def dtype(self, column: str) -> np.dtype[Any]:
        return _dtype(column, self.hashed, self.packed)


def _dtype(column: str, hashed: bool, packed: bool = False) -> np.dtype[Any]:
    if column == "hi":
        return np.dtype("u1")
    if column == "k2" or (column == "loc" and packed):
        return np.dtype("<u4")
    if column in ("loc", "ids") or (column == "k1" and not hashed):
        return np.dtype("<i8")
    return np.dtype("<u8")


class Decoded:
    """A column of a run as its readers see it: what is stored, decoded on each read (an index, a slice, an array
    of slots), so that nothing reads the stored form by mistake."""

    __slots__ = ("_decode", "raw")

    def __init__(self, raw: np.ndarray, decode: Callable[[np.ndarray], np.ndarray]) -> None:
        self.raw = raw
        self._decode = decode

    def __getitem__(self, index: Any) -> np.ndarray:
        return self._decode(np.asarray(self.raw[index]))

    def __len__(self) -> int:
        return len(self.raw)


def _second_words(stored: np.ndarray) -> np.ndarray:
    """A run's stored ``k2`` (high halves) as the second words they are."""
    return stored.astype(np.uint64) << _HIGH


class _Split:
    """Packed locations held in two columns, read as one: the low ``split`` bits in ``low``, the rest in ``high``."""

    __slots__ = ("high", "low", "split")

    def __init__(self, low: np.ndarray, high: np.ndarray, split: int) -> None:
        self.low, self.high, self.split = low, high, split

    def __getitem__(self, index: Any) -> np.ndarray:
        packed = np.asarray(self.high[index]).astype(np.int64)
        packed <<= self.split
        packed |= np.asarray(self.low[index])
        return packed

    def __len__(self) -> int:
        return len(self.low)


def _location_decoder(ids: np.ndarray, pos_bits: int) -> Callable[[np.ndarray], np.ndarray]:
    """Packed locations (``local << pos_bits | position``) back to ``file id << 32 | position``."""
    mask = np.int64((1 << pos_bits) - 1)

    def decode(packed: np.ndarray) -> np.ndarray:
        wide = packed.astype(np.int64)
        located = ids[wide >> pos_bits]
        located <<= 32
        located |= np.bitwise_and(wide, mask, out=wide)
        return located

    return decode


class DiskRun:
    """A run mapped from its files (see the module). Its arrays are read-only views of the mappings."""

    on_disk = True

    def __init__(self, directory: Path, info: RunInfo) -> None:
        self.info = info
        self.directory = directory
        self._maps: list[mmap.mmap] = []
        self._raw: dict[str, np.ndarray] = {}
        fence = directory / f"{info.name}.fence"
        try:
            for column in info.columns():
                if column == "ids":
                    self._raw[column] = self._read(directory / f"{info.name}.ids", info.files, info.dtype(column))
                else:
                    self._raw[column] = self._map(directory / f"{info.name}.{column}", info.dtype(column))
            self.fence = np.fromfile(fence, dtype=info.dtype("k1"))
        except FileNotFoundError as exc:
            self.close()
            raise DamagedIndex(f"{exc.filename} is missing") from None
        except DamagedIndex:
            self.close()
            raise
        self.k1: np.ndarray = self._raw["k1"]
        self.k2: Decoded | None = Decoded(self._raw["k2"], _second_words) if info.hashed else None
        stored: Any = self._raw["loc"] if info.split is None else _Split(self._raw["loc"], self._raw["hi"], info.split)
        self.loc = Decoded(stored, _location_decoder(self._raw["ids"], info.pos_bits)
                           if info.pos_bits is not None else np.asarray)
        if len(self.fence) != -(-info.rows // BLOCK):
            self.close()
            raise DamagedIndex(f"{fence} holds {len(self.fence)} values for {info.rows} entries")
        if info.pos_bits is not None:
            ids = self._raw["ids"]
            bits = 32 if info.split is None else info.split + HIGH_BITS
            if not 0 <= info.pos_bits <= 32 or max(0, info.files - 1).bit_length() + info.pos_bits > bits \
                    or (info.split is not None and not 0 <= info.split <= 32) \
                    or (len(ids) and (ids[0] < 0 or (ids[1:] <= ids[:-1]).any())):
                self.close()
                raise DamagedIndex(f"{directory / f'{info.name}.ids'} does not describe packed locations")

    def _read(self, path: Path, count: int, dtype: np.dtype[Any]) -> np.ndarray:
        size = path.stat().st_size
        if size != count * dtype.itemsize:
            raise DamagedIndex(f"{path} is {size} bytes, not the {count * dtype.itemsize} of its {count} values")
        return np.fromfile(path, dtype=dtype)

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
        """The bytes this run holds in the process: its fence and file ids (the mapped pages are the kernel's to
        drop)."""
        return int(self.fence.nbytes) + (int(self._raw["ids"].nbytes) if "ids" in self._raw else 0)

    @property
    def disk_bytes(self) -> int:
        return sum(int(array.nbytes) for array in self._raw.values()) + int(self.fence.nbytes)

    def verify(self) -> None:
        """Raises :class:`DamagedIndex` unless every file matches its checksum (read in chunks, each handed back
        to the kernel once read)."""
        for column in self.info.columns():
            raw = self._raw[column].view(np.uint8)
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
        self.k1 = self.fence = np.empty(0)
        self.loc = Decoded(np.empty(0, np.int64), np.asarray)
        self.k2 = None
        self._raw = {}
        maps, self._maps = self._maps, []
        for mapped in maps:
            with contextlib.suppress(BufferError):  # a view still held elsewhere keeps it mapped until collected
                mapped.close()

    def files(self) -> list[Path]:
        return [self.directory / f"{self.info.name}.{column}" for column in [*self.info.columns(), "fence"]]


class DamagedIndex(Exception):
    """An index's files do not match its manifest: it is built again, never trusted."""


class RunWriter:
    """Writes one run from sorted chunks (see the module). Locations come as ``file id << 32 | position``; they are
    written so first (``.wide``), the file ids and largest position noted on the way, and packed in 32 bits when
    the run is finished, if they fit."""

    def __init__(self, directory: Path, hashed: bool) -> None:
        self.directory = directory
        self.hashed = hashed
        self.name = f"run-{uuid.uuid4().hex[:12]}"
        self.rows = 0
        self._columns = ["k1", "k2", "wide"] if hashed else ["k1", "wide"]
        self._files = {column: open(directory / f"{self.name}.{column}", "wb")  # noqa: SIM115 (closed in finish)
                       for column in self._columns}
        self._crc = dict.fromkeys(self._columns, 0)
        self._fence: list[np.ndarray] = []
        self._last: Any = None
        # what the locations hold: file ids (a bitmap of the small ones, the others sorted), the largest position
        self._dense = np.zeros(0, bool)
        self._sparse = np.empty(0, np.int64)
        self._max_position = 0
        self._negative = False  # a location below 0 (never written by the index: dead entries stay in memory)

    def append(self, k1: np.ndarray, k2: np.ndarray | None, loc: np.ndarray) -> None:
        if not len(k1):
            return
        if self._last is not None and k1[0] < self._last:
            raise ValueError("a run's chunks must come in code order")
        codes = k1.astype(_dtype("k1", self.hashed), copy=False)
        high = None
        if self.hashed:
            assert k2 is not None
            second = k2.astype(np.uint64, copy=False)
            if (second & _LOW_BITS).any():
                raise ValueError("a run on disk holds 96-bit codes: the low 32 bits of a second word must be 0")
            high = (second >> _HIGH).astype(np.uint32)
        self._last = k1[-1]
        loc = loc.astype(np.int64, copy=False)
        self._note(loc)
        arrays: dict[str, Any] = {"k1": codes, "k2": high, "wide": loc}
        for column in self._columns:
            data = np.ascontiguousarray(arrays[column]).view(np.uint8).data
            self._files[column].write(data)
            if column != "wide":  # checksummed once packed (or not)
                self._crc[column] = zlib.crc32(data, self._crc[column])
        self._fence.append(codes[(-self.rows) % BLOCK::BLOCK].copy())
        self.rows += len(k1)

    def _note(self, loc: np.ndarray) -> None:
        if self._negative:
            return
        files = loc >> 32
        if files.min() < 0:
            self._negative = True
            return
        self._max_position = max(self._max_position, int(np.bitwise_and(loc, 0xFFFFFFFF).max()))
        top = int(files.max())
        if top >= _DENSE_IDS:
            self._sparse = np.union1d(self._sparse, files[files >= _DENSE_IDS])
            files = files[files < _DENSE_IDS]
            if not len(files):
                return
            top = int(files.max())
        if top >= len(self._dense):
            grown = np.zeros(max(top + 1, 2 * len(self._dense)), bool)
            grown[:len(self._dense)] = self._dense
            self._dense = grown
        self._dense[files] = True

    def _file_ids(self) -> np.ndarray:
        """The file ids the run's locations name, sorted."""
        return np.concatenate([np.flatnonzero(self._dense).astype(np.int64), self._sparse])

    def finish(self) -> RunInfo:
        """Packs the locations (when they fit), syncs the run's files and writes its fence; the run is durable when
        this returns."""
        for column, file in self._files.items():
            file.flush()
            if column != "wide":
                os.fsync(file.fileno())
            file.close()
        ids = self._file_ids()
        pos_bits = self._max_position.bit_length()
        wide = self.directory / f"{self.name}.wide"
        bits = max(0, len(ids) - 1).bit_length() + pos_bits
        split = None
        if self.rows and not self._negative and bits <= PACKED_BITS + HIGH_BITS:
            split = PACKED_BITS if bits > PACKED_BITS else None
            self._pack(wide, ids, pos_bits, split)
            self._crc["ids"] = self._write(self.directory / f"{self.name}.ids", ids.astype("<i8"))
            wide.unlink()
            info_bits: int | None = pos_bits
        else:
            self._crc["loc"] = _file_crc(wide)
            with open(wide, "rb") as reading:
                os.fsync(reading.fileno())
            os.replace(wide, self.directory / f"{self.name}.loc")
            ids, info_bits = ids[:0], None
        del self._crc["wide"]
        fence = np.concatenate(self._fence) if self._fence else np.empty(0, _dtype("k1", self.hashed))
        self._write(self.directory / f"{self.name}.fence", fence)
        return RunInfo(self.name, self.rows, self.hashed, dict(self._crc), info_bits, len(ids), split)

    def _pack(self, wide: Path, ids: np.ndarray, pos_bits: int, split: int | None) -> None:
        """Writes ``.loc`` packed from the ``.wide`` locations, chunk by chunk (and ``.hi``, the bits above
        ``split``, when given), noting their CRC-32s."""
        dense, sparse = ids[ids < _DENSE_IDS], ids[ids >= _DENSE_IDS]
        local = np.zeros(int(dense[-1]) + 1 if len(dense) else 0, np.int64)
        local[dense] = np.arange(len(dense))
        crc = {"loc": 0, "hi": 0}
        with contextlib.ExitStack() as opened:
            out = {column: opened.enter_context(open(self.directory / f"{self.name}.{column}", "wb"))
                   for column in ["loc", *(["hi"] if split is not None else [])]}
            for start in range(0, self.rows, _PACK_CHUNK):
                loc = np.fromfile(wide, "<i8", min(_PACK_CHUNK, self.rows - start), offset=start * 8)
                files = loc >> 32
                if len(sparse) and files.max() >= _DENSE_IDS:
                    small = files < _DENSE_IDS
                    number = np.empty(len(loc), np.int64)
                    number[small] = local[files[small]]
                    number[~small] = len(dense) + np.searchsorted(sparse, files[~small])
                else:
                    number = local[files]
                number <<= pos_bits
                number |= np.bitwise_and(loc, 0xFFFFFFFF, out=loc)
                if split is None:
                    parts = {"loc": number.astype("<u4")}
                else:
                    parts = {"loc": np.bitwise_and(number, (1 << split) - 1).astype("<u4"),
                             "hi": (number >> split).astype("u1")}
                for column, part in parts.items():
                    data = part.view(np.uint8).data
                    out[column].write(data)
                    crc[column] = zlib.crc32(data, crc[column])
            for column, file in out.items():
                file.flush()
                os.fsync(file.fileno())
                self._crc[column] = crc[column]

    def _write(self, path: Path, array: np.ndarray) -> int:
        data = np.ascontiguousarray(array).view(np.uint8).data
        with open(path, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        return zlib.crc32(data)

    def abandon(self) -> None:
        for file in self._files.values():
            file.close()
        for column in ["k1", "k2", "wide", "loc", "hi", "ids", "fence"]:
            with contextlib.suppress(FileNotFoundError):
                (self.directory / f"{self.name}.{column}").unlink()


def _file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CRC_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


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
        if data.get("format") not in READABLE_FORMATS:
            raise DamagedIndex(f"manifest format {data.get('format')!r}, not one of {READABLE_FORMATS}")
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
