"""Where each row of one mirror is: an in-memory index from a row's key to the data file and row position
holding it, so that a batch's updates and deletes become position deletes (which every reader handles)
instead of equality deletes (which PyIceberg refuses and every engine pays for at read time).

Example, the life of a keyed mirror's index::

    index = KeyIndex(multiset=False)
    for path, keys, live_positions in data_files_of_the_snapshot:      # key columns read with pyarrow
        index.add(path, keys, live_positions)                         # rows no delete file removes
    old = index.find(changed_keys)                     # rows to delete: old.file_ids (-1: none), old.positions
    ... commit the position deletes of `old` and the new data file ...
    index.forget(old)
    index.add(new_data_file, new_keys)                 # a key the index holds moves to its new row

Layout, chosen for memory (a mirror of 10^9 rows must fit) and for vectorized batches:

* Each entry is a key code (:mod:`pgcdc.index.key_codes`: the int64 value of a single integer key, else a
  128-bit hash as two uint64) and a location, ``file id << 32 | row position`` in one int64: 16 bytes an entry
  for integer keys, 24 for hashed ones. File paths are stored once, in a table of int32 ids.
* The entries sit in two runs sorted by the code's first word: a large main run and a small delta run of
  entries placed since the last merge. Lookups are ``np.searchsorted`` over both; the delta is merged into
  the main run (one linear pass) when it exceeds an eighth of it, so each entry is copied a bounded number
  of times on average.
* A removed entry's location becomes -1 (dead) in place; dead entries are dropped at the next merge, or
  earlier when they make up a quarter of the index. In a keyed index a key's entry keeps its slot for life:
  an update overwrites the location and a key that comes back after a delete revives its dead slot.
* :meth:`KeyIndex.add` only queues the rows; they are sorted and placed at the next call that reads the
  index. Building from many files therefore costs one sort, not one merge per file.

**On disk** (given an :class:`~pgcdc.index.disk_runs.IndexDirectory`): the main run is a file mapped read-only
(:mod:`pgcdc.index.disk_runs`), looked up through a fence of every 512th code; what changes it sits in memory
beside it until a checkpoint writes a new run: the delta, and a *patch* of the main run's slots whose location
changed (an update moving a key, a delete). The process holds the fence, the delta, the patch and the path table:
bounded by ``overlay_bytes``, whatever the mirror's size. The new run is written in a background thread (a pass over
the whole run: seconds at 10^8 entries, which the batches do not wait for), from the index as the checkpoint left
it; the changes made meanwhile are also noted by key (a *journal*) and replayed onto the new run when a later
checkpoint finds it written, then its manifest is saved. Adding more than that at once (a build) spills sorted
runs to disk, merged into the main run in one pass. :meth:`KeyIndex.checkpoint` writes the manifest that ties the
run to the snapshot it describes, so that a restart opens it instead of reading every data file again. Kept on
disk, a hashed code is 96 bits wherever the index holds it (the second word's low 32 bits zeroed as codes are
computed: the run stores the high half only) and a run packs its locations in 32 bits when they fit: 12 bytes an
entry on disk for integer keys, 16 for hashed ones (:mod:`pgcdc.index.disk_runs`); a run hands its locations back
in the form above.

Not thread-safe: one apply thread owns a mirror's index. A build may read and decode files in other threads,
but calls on the index must come from one thread at a time. The background rewrite reads only what was frozen for
it (copies of what changes in place, the run's files through a mapping of its own).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa

from pgcdc.faults import injection_point
from pgcdc.index.disk_runs import DiskRun, IndexDirectory, Manifest, RunInfo, RunWriter
from pgcdc.index.key_codes import Codes, KeyCoder

log = logging.getLogger("pgcdc.index.key_index")

POSITION_BITS = 32
MAX_POSITION = (1 << POSITION_BITS) - 1
MAX_FILE_ID = (1 << 31) - 1
DEAD = -1
# what an index kept on disk keeps of a hashed code's second word (96-bit codes: see KeyIndex)
_DISK_SECOND_WORD = np.uint64(0xFFFFFFFF00000000)
# the delta is merged into the main run when it holds more than this or an eighth of the main run
_MIN_MERGE = 1 << 16
# entries an index on disk keeps in memory beside its run at the least, whatever its share
_MIN_OVERLAY = 1 << 12
# entries a scan for locations looks at in one step (bounds its temporary arrays)
_SCAN_CHUNK = 1 << 20
# what sits in memory beside a run while a new one is written in the background, in shares of the index's memory,
# before a change waits for that run: with the notes of what changed since the freeze (at most as much again) the
# index holds about three shares at most, however slow the disk (a share is a quarter of what the budget leaves)
_OVERLAY_WHILE_REWRITING = 2
# one run written in the background at a time in the process: they share the disk and the cores with the batches
_REWRITES = threading.Semaphore(1)


@dataclass(frozen=True)
class _SlotHint:
    """Where the index held a :class:`Located`'s entries when it answered: lets :meth:`KeyIndex.forget` go
    straight to them while nothing has moved (``layout`` is still the index's), instead of scanning."""

    layout: object
    slots: np.ndarray


@dataclass(frozen=True)
class Located:
    """Entries of the index: per requested row, the data file (an id, -1: not found) and the row position."""

    file_ids: np.ndarray  # int32, -1 where nothing was found
    positions: np.ndarray  # int64 (-1 where file_ids == -1)
    hint: _SlotHint | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.file_ids)


class _Run:
    """Entries sorted by ``k1``: codes (``k1``; ``k2`` the second word of a hashed code) and locations."""

    __slots__ = ("k1", "k2", "loc")

    def __init__(self, k1: np.ndarray, k2: np.ndarray | None, loc: np.ndarray) -> None:
        self.k1, self.k2, self.loc = k1, k2, loc

    @classmethod
    def empty(cls, hashed: bool) -> _Run:
        return cls(np.empty(0, np.uint64 if hashed else np.int64), np.empty(0, np.uint64) if hashed else None,
                   np.empty(0, np.int64))

    def __len__(self) -> int:
        return len(self.k1)

    @property
    def nbytes(self) -> int:
        return self.k1.nbytes + self.loc.nbytes + (0 if self.k2 is None else self.k2.nbytes)

    def select(self, rows: np.ndarray) -> _Run:
        return _Run(self.k1[rows], None if self.k2 is None else self.k2[rows], self.loc[rows])

    def without_dead(self) -> _Run:
        live = self.loc != DEAD
        return self if live.all() else self.select(live)


class KeyIndex:
    """Where each row of one mirror is: key -> (data file, row position).

    ``multiset=False``: a keyed mirror, at most one entry per key (a key added again replaces its entry).
    ``multiset=True``: a keyless mirror (REPLICA IDENTITY FULL without a key) whose key is the whole row:
    several entries may share a key (identical rows); :meth:`take` hands them out.

    ``disk``: keep the main run in this directory (see the module), the rest within about ``overlay_bytes``;
    hashed codes are then compared by 96 of their 128 bits (odds of two keys of a 10^9-row mirror sharing one:
    about 6e-12; see docs/pipeline.md).

    Keys arrive as Arrow tables whose columns have the mirror's stored types; the first table the index sees
    fixes the kinds of its key columns (see :class:`pgcdc.index.key_codes.KeyCoder`).
    """

    def __init__(self, *, multiset: bool, disk: IndexDirectory | None = None, overlay_bytes: int = 64 << 20
                 ) -> None:
        self._multiset = multiset
        self._coder: KeyCoder | None = None
        self._main: _Run | DiskRun = _Run.empty(hashed=False)
        self._delta = _Run.empty(hashed=False)
        self._queued: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])  # k1, k2, loc
        self._live = 0
        self._dead = 0
        self._layout = object()  # replaced whenever entries change slots (see _SlotHint)
        self._paths: list[str | None] = []
        self._ids: dict[str, int] = {}
        # kept on disk: the main run's changed slots (sorted) and their locations now; runs spilled by large adds
        self._disk = disk
        self._overlay_entries = max(_MIN_OVERLAY, overlay_bytes // 32)
        self._patch_slots = np.empty(0, np.int64)
        self._patch_locs = np.empty(0, np.int64)
        self._pending: list[DiskRun] = []
        self._disk_ids = 0  # file ids below this may be named by the main run's files themselves
        self._saved: tuple[str, int | None] | None = None  # (run, snapshot) the manifest names
        self._rewriting: _Rewrite | None = None  # a new main run being written in the background

    @classmethod
    def opened(cls, disk: IndexDirectory, manifest: Manifest, key_schema: pa.Schema, *, overlay_bytes: int
               ) -> KeyIndex:
        """The index a manifest saved (its run's checksums verified): raises
        :class:`~pgcdc.index.disk_runs.DamagedIndex` when it cannot be trusted."""
        from pgcdc.index.disk_runs import DamagedIndex

        index = cls(multiset=manifest.multiset, disk=disk, overlay_bytes=overlay_bytes)
        index._coder = KeyCoder.for_schema(key_schema, integer_allowed=not manifest.multiset)
        if index._coder.integer == manifest.run.hashed:
            raise DamagedIndex("its codes are not of this key's kind")
        run = DiskRun(disk.path, manifest.run)
        try:
            run.verify()
        except BaseException:
            run.close()
            raise
        index._main = run
        index._delta = _Run.empty(hashed=manifest.run.hashed)
        index._live = len(run)
        index._paths = list(manifest.paths)
        index._ids = {path: file_id for file_id, path in enumerate(manifest.paths) if path is not None}
        index._disk_ids = len(manifest.paths)
        index._saved = (manifest.run.name, manifest.snapshot_id)
        return index

    def __repr__(self) -> str:  # without placing queued rows: a repr must not change the index
        kind = "multiset" if self._multiset else "keyed"
        queued = sum(len(k1) for k1 in self._queued[0])
        where = f", {self.disk_bytes:,} on disk" if self._disk is not None else ""
        return (f"KeyIndex({kind}, {self._live:,} rows placed and {queued:,} queued, {len(self._ids):,} files, "
                f"{self.memory_bytes:,} bytes{where})")

    # -- what the index holds -------------------------------------------------------------------------------

    @property
    def multiset(self) -> bool:
        return self._multiset

    @property
    def on_disk(self) -> bool:
        return self._disk is not None

    @property
    def rows(self) -> int:
        """Live entries (queued rows are placed first: after a build, this is where the sort happens)."""
        self._flush()
        return self._live

    @property
    def memory_bytes(self) -> int:
        """Bytes the index holds in memory now: its arrays (dead slots and queued rows included; of a run on disk,
        its fence), its patch and its path table."""
        arrays = (self._main.nbytes + self._delta.nbytes + sum(a.nbytes for queue in self._queued for a in queue)
                  + self._patch_slots.nbytes + self._patch_locs.nbytes + sum(run.nbytes for run in self._pending)
                  + (self._rewriting.nbytes if self._rewriting is not None else 0))
        paths = sys.getsizeof(self._paths) + sys.getsizeof(self._ids) + sum(
            sys.getsizeof(path) for path in self._paths if path is not None)
        return arrays + paths

    @property
    def disk_bytes(self) -> int:
        """Bytes the index's runs take on disk."""
        runs = [self._main, *self._pending]
        return sum(run.disk_bytes for run in runs if isinstance(run, DiskRun))

    def path(self, file_id: int) -> str:
        """The data file's path, exactly as given to :meth:`add` (Iceberg matches deletes to files by it)."""
        path = self._paths[file_id] if 0 <= file_id < len(self._paths) else None
        if path is None:
            raise KeyError(f"no data file has id {file_id} in this index")
        return path

    def file_id(self, path: str) -> int | None:
        """The id of a data file the index holds, or None."""
        return self._ids.get(path)

    def paths(self) -> list[str]:
        """The data files the index holds entries of (or held: until they are dropped)."""
        return list(self._ids)

    # -- changes --------------------------------------------------------------------------------------------

    def add(self, path: str, keys: pa.Table, positions: np.ndarray | None = None) -> None:
        """The rows of one data file: row i of ``keys`` (the key columns; for a multiset all columns) is at row
        position ``positions[i]`` of ``path`` (default: i).

        A keyed index given a key it already holds moves that key's entry here. When building from a
        snapshot, add only the rows no delete file removes (their positions) — or add the files oldest first
        and then :meth:`drop_positions` — so that a stale row never replaces a live one.
        """
        if not isinstance(path, str) or not path:
            raise ValueError("a data file path must be a non-empty string")
        keys = _table(keys)
        rows = keys.num_rows
        if positions is None:
            located_at = np.arange(rows, dtype=np.int64)
        else:
            located_at = _positions(positions, "positions")
            if len(located_at) != rows:
                raise ValueError(f"{len(located_at)} positions for {rows} key rows")
            if rows > 1 and not (located_at[1:] > located_at[:-1]).all() and len(_distinct(located_at)) != rows:
                raise ValueError("positions must not repeat: each row of a data file is one entry")
        k1, k2 = self._codes(keys)
        file_id = self._intern(path)
        if rows:
            self._queued[0].append(k1)
            if k2 is not None:
                self._queued[1].append(k2)
            self._queued[2].append((np.int64(file_id) << POSITION_BITS) | located_at)
            if self._disk is not None and sum(len(q) for q in self._queued[0]) > self._overlay_entries:
                self._spill_queue()

    def drop_file(self, path: str) -> int:
        """Forgets every entry of a data file (a compaction removed it); returns how many there were.

        After a compaction, add the rewritten files first and drop the old ones after: a keyed index then
        moves each key within its slot, and the old files have nothing left to drop.
        """
        return self.drop_many([path], {})

    def retire_files(self, paths: list[str]) -> None:
        """Forgets data files every entry of which was moved to another file or forgotten already — the rows of a
        file a compaction or a fold rewrote elsewhere, added there first — without the pass over the index that
        :meth:`drop_file` makes (over a large mirror, seconds at every fold or compaction followed). Only a keyed
        index moves a key's entry when the key is added again; a multiset's copies are dropped by a pass."""
        if self._multiset:
            self.drop_many(paths, {})
            return
        self._flush()  # the moves queued by add() placed first
        for path in paths:
            file_id = self._ids.pop(path, None)
            if file_id is not None:
                self._paths[file_id] = None  # ids are never reused: a stale Located can never name another file

    def drop_positions(self, path: str, positions: np.ndarray) -> int:
        """Forgets the entries at these row positions of a data file (rows a delete file removed); returns how
        many the index held."""
        return self.drop_many([], {path: positions})

    def drop_many(self, files: list[str], positions: dict[str, np.ndarray]) -> int:
        """:meth:`drop_file` of each of ``files`` and :meth:`drop_positions` of each of ``positions``, in one pass
        over the index; returns how many entries went."""
        targets = [(np.int64(self._ids[path]) << POSITION_BITS) | _positions(rows, "positions")
                   for path, rows in positions.items() if path in self._ids and len(rows)]
        whole = [self._ids[path] for path in files if path in self._ids]
        if not targets and not whole:
            return 0
        self._flush()
        located = _distinct(np.concatenate(targets)) if targets else np.empty(0, np.int64)
        dropped = self._kill(self._slots_holding(located, np.array(whole, np.int64)))
        for file_id in whole:
            path = self._paths[file_id]
            del self._ids[path]  # type: ignore[arg-type]
            self._paths[file_id] = None  # ids are never reused: a stale Located can never name another file
        self._settle()
        return dropped

    def forget(self, located: Located) -> None:
        """Removes exactly these entries (a commit deleted those rows); entries the index no longer holds (a
        later :meth:`add` moved the key, or they were forgotten already) are skipped.

        Fastest right after the :meth:`find` or :meth:`take` that produced ``located``: until entries change
        slots it goes straight to them, otherwise it scans the index for their locations.
        """
        file_ids = np.asarray(located.file_ids)
        positions = np.asarray(located.positions)
        if file_ids.ndim != 1 or positions.shape != file_ids.shape:
            raise ValueError("a Located needs file_ids and positions of one length")
        present = file_ids >= 0
        targets = (file_ids[present].astype(np.int64) << POSITION_BITS) | positions[present].astype(np.int64)
        hint = located.hint
        if hint is not None and hint.layout is self._layout and hint.slots.shape == file_ids.shape:
            slots = hint.slots[present]
            held = (slots >= 0) & (slots < len(self._main) + len(self._delta))
            slots, targets = slots[held], targets[held]
            # A slot that holds another location now lost this entry to a later add (or forget): entries have
            # not moved since the answer, so it is nowhere else.
            self._kill(_distinct(slots[self._locations(slots) == targets]))
            self._release()
        elif len(targets):
            self._flush()
            self._kill(self._slots_holding(_distinct(targets)))
        self._settle()

    def checkpoint(self, snapshot_id: int | None, key_ids: list[int], *, force: bool = False) -> None:
        """For an index kept on disk that now describes ``snapshot_id``: when what sits in memory beside its run
        has grown past its share, starts writing it into a new run in the background (taken, and its manifest
        saved, by a later checkpoint that finds it written); ``force`` writes it now. A manifest names the run and
        the snapshot it describes (see the module)."""
        if self._disk is None:
            return
        self._flush()
        if force:
            self._cancel_rewrite()  # everything is written below at once
        elif self._rewriting is not None and self._rewriting.done:
            self._adopt()
        overlay = len(self._delta) + len(self._patch_slots)
        if not isinstance(self._main, DiskRun) or (force and overlay):
            self._rewrite()  # a build's first run, or a clean stop: written now, whole
        elif overlay > self._overlay_entries and self._rewriting is None:
            self._rewriting = self._frozen(snapshot_id, key_ids)
            return
        if len(self._delta) + len(self._patch_slots):
            return  # what changed stays in memory until there is enough of it
        main = self._main
        assert isinstance(main, DiskRun)
        if self._saved != (main.info.name, snapshot_id):
            self._save(Manifest(snapshot_id, self._multiset, key_ids, main.info, list(self._paths)))

    def _save(self, manifest: Manifest) -> None:
        assert self._disk is not None
        injection_point("index.manifest")  # the new run written, the manifest still naming the one before
        self._disk.write_manifest(manifest)
        self._saved = (manifest.run.name, manifest.snapshot_id)
        writing = {self._rewriting.writer.name} if self._rewriting is not None else set()
        self._disk.remove_except({manifest.run.name, *writing})

    def close(self) -> None:
        """Unmaps the runs on disk (their files stay, for the manifest that names them); a run being written in the
        background is abandoned."""
        self._cancel_rewrite()
        for run in [self._main, *self._pending]:
            if isinstance(run, DiskRun):
                run.close()

    # -- lookups --------------------------------------------------------------------------------------------

    def find(self, keys: pa.Table) -> Located:
        """Keyed: the entry of each key row (file id -1 where the index holds none)."""
        if self._multiset:
            raise TypeError("a multiset index holds several entries per key: use take(keys, counts)")
        keys = _table(keys)
        k1, k2 = self._codes(keys)
        self._flush()
        queries, slots = self._lookup(k1, k2)
        locations = self._locations(slots)
        self._release()
        live = locations != DEAD
        queries, slots, locations = queries[live], slots[live], locations[live]
        rows = keys.num_rows
        found_slots = np.full(rows, -1, np.int64)
        found_slots[queries] = slots
        found = np.full(rows, DEAD, np.int64)
        found[queries] = locations
        return self._located(found, found_slots)

    def take(self, keys: pa.Table, counts: np.ndarray) -> Located:
        """For each row i of ``keys``, up to ``counts[i]`` entries whose key equals it, listed row after row
        (so the result is as long as what was found); never the same entry twice in one call, and never more
        than the index holds. For a keyed index each key has at most one entry."""
        keys = _table(keys)
        rows = keys.num_rows
        wanted = np.asarray(counts)
        if wanted.shape != (rows,) or (rows and wanted.dtype.kind not in "iu"):
            raise ValueError(f"counts must be {rows} integers, one per key row")
        wanted = wanted.astype(np.int64)
        if rows and wanted.min() < 0:
            raise ValueError("counts must not be negative")
        k1, k2 = self._codes(keys)
        self._flush()
        if not rows:
            return self._located(np.empty(0, np.int64), np.empty(0, np.int64))
        # Rows with equal keys draw from one pool: group them, look each group up once (groups are numbered
        # in code order, so the lookup needs no sort of its own).
        group, first_rows = _groups(k1, k2)
        groups = len(first_rows)
        needed = np.bincount(group, weights=wanted, minlength=groups).astype(np.int64)
        queries, slots = self._lookup(k1[first_rows], None if k2 is None else k2[first_rows], presorted=True)
        locations = self._locations(slots)
        self._release()
        live = locations != DEAD
        queries, slots, locations = queries[live], slots[live], locations[live]
        # main run's pairs, then the delta's, each by group: a stable sort by group keeps slots ascending
        by_group = np.argsort(queries, kind="stable")
        queries, slots, locations = queries[by_group], slots[by_group], locations[by_group]
        rank = np.arange(len(queries)) - np.searchsorted(queries, np.arange(groups), "left")[queries]
        kept = rank < needed[queries]
        queries, slots, locations = queries[kept], slots[kept], locations[kept]
        found = np.bincount(queries, minlength=groups)
        group_start = np.cumsum(found) - found
        # The rows of a group take its entries in row order: row i gets those after what earlier rows took.
        rows_by_group = np.argsort(group, kind="stable")
        taken_before_sorted = np.cumsum(wanted[rows_by_group]) - wanted[rows_by_group]
        first_of_group = np.searchsorted(group[rows_by_group], np.arange(groups), "left")
        taken_before = np.empty(rows, np.int64)
        taken_before[rows_by_group] = taken_before_sorted - taken_before_sorted[first_of_group[group[rows_by_group]]]
        got = np.clip(found[group] - taken_before, 0, wanted)
        row_of = np.repeat(np.arange(rows), got)
        within = np.arange(len(row_of)) - np.repeat(np.cumsum(got) - got, got)
        picks = group_start[group[row_of]] + taken_before[row_of] + within
        return self._located(locations[picks], slots[picks])

    # -- internals ------------------------------------------------------------------------------------------

    def _coder_for(self, schema: pa.Schema) -> KeyCoder:
        """The index's coder; the first key table fixes it (and the form of the runs' codes)."""
        if self._coder is None:
            self._coder = KeyCoder.for_schema(schema, integer_allowed=not self._multiset)
            self._main = _Run.empty(hashed=not self._coder.integer)
            self._delta = _Run.empty(hashed=not self._coder.integer)
        return self._coder

    def _codes(self, keys: pa.Table) -> Codes:
        """The codes of key rows as this index compares them: kept on disk, a hashed code keeps 96 of its 128 bits
        (the second word's low 32 bits zeroed), whether its entry sits in the run or in memory beside it."""
        k1, k2 = self._coder_for(keys.schema).codes(keys)
        if k2 is not None and self._disk is not None:
            k2 = k2 & _DISK_SECOND_WORD
        return k1, k2

    @property
    def _hashed(self) -> bool:
        return self._coder is not None and not self._coder.integer

    def _intern(self, path: str) -> int:
        file_id = self._ids.get(path)
        if file_id is None:
            file_id = len(self._paths)
            if file_id > MAX_FILE_ID:
                raise OverflowError("this index has given out 2**31 file ids; rebuild it")
            self._paths.append(path)
            self._ids[path] = file_id
        return file_id

    def _located(self, locations: np.ndarray, slots: np.ndarray) -> Located:
        found = locations != DEAD
        file_ids = np.where(found, locations >> POSITION_BITS, -1).astype(np.int32)
        positions = np.where(found, locations & MAX_POSITION, -1)
        return Located(file_ids, positions, _SlotHint(self._layout, slots))

    def _lookup(self, k1: np.ndarray, k2: np.ndarray | None, *, presorted: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
        """(query, slot) pairs: every slot (dead ones too) whose code equals query row's code. Slots count
        the main run first, then the delta."""
        if not presorted:  # sorted queries: each binary search starts where the previous one ended
            order = np.argsort(k1)
            k1 = k1[order]
            k2 = None if k2 is None else k2[order]
        in_main = _matches(self._main, k1, k2)
        self._release()  # the run's codes read: their pages go back before its locations are read
        in_delta = _matches(self._delta, k1, k2)
        queries = np.concatenate([in_main[0], in_delta[0]])
        slots = np.concatenate([in_main[1], in_delta[1] + len(self._main)])
        return (queries if presorted else order[queries]), slots

    def _locations(self, slots: np.ndarray) -> np.ndarray:
        boundary = len(self._main)
        in_main = slots < boundary
        locations = np.empty(len(slots), np.int64)
        main_slots = slots[in_main]
        main_locations = self._main.loc[main_slots]
        if len(self._patch_slots) and len(main_slots):
            order = np.argsort(main_slots)  # searched in order: each search starts where the one before ended
            at = np.empty(len(main_slots), np.int64)
            at[order] = np.searchsorted(self._patch_slots, main_slots[order])
            np.minimum(at, len(self._patch_slots) - 1, out=at)
            patched = self._patch_slots[at] == main_slots
            main_locations[patched] = self._patch_locs[at[patched]]
        locations[in_main] = main_locations
        locations[~in_main] = self._delta.loc[slots[~in_main] - boundary]
        return locations

    def _set_locations(self, slots: np.ndarray, locations: np.ndarray) -> None:
        boundary = len(self._main)
        in_main = slots < boundary
        if isinstance(self._main, DiskRun):  # the run's files are never written: the patch holds the change
            self._patch(slots[in_main], locations[in_main])
        else:
            self._main.loc[slots[in_main]] = locations[in_main]
        self._delta.loc[slots[~in_main] - boundary] = locations[~in_main]

    def _patch(self, slots: np.ndarray, locations: np.ndarray) -> None:
        if not len(slots):
            return
        order = np.argsort(slots, kind="stable")  # a slot given twice: its last location wins
        slots, locations = slots[order], locations[order]
        last = np.ones(len(slots), bool)
        last[:-1] = slots[1:] != slots[:-1]
        slots, locations = slots[last], locations[last]
        # slots patched before are changed in place; the others are inserted (one pass over the patch, not a sort)
        at = np.searchsorted(self._patch_slots, slots)
        held = at < len(self._patch_slots)
        held[held] = self._patch_slots[at[held]] == slots[held]
        self._patch_locs[at[held]] = locations[held]
        new = ~held
        added = int(new.sum())
        if added:  # one pass: the patch's entries and the new ones, each to its place
            placed = at[new] + np.arange(added)
            others = np.ones(len(self._patch_slots) + added, bool)
            others[placed] = False
            merged_slots = np.empty(len(others), np.int64)
            merged_locs = np.empty(len(others), np.int64)
            merged_slots[placed], merged_locs[placed] = slots[new], locations[new]
            merged_slots[others], merged_locs[others] = self._patch_slots, self._patch_locs
            self._patch_slots, self._patch_locs = merged_slots, merged_locs

    def _kill(self, slots: np.ndarray) -> int:
        """Marks distinct live slots dead; returns how many."""
        if not len(slots):
            return 0
        if self._rewriting is not None:
            k1, k2 = self._codes_at(slots)
            self._rewriting.note(k1, k2, self._locations(slots), removed=True)
        self._set_locations(slots, np.full(len(slots), DEAD, np.int64))
        self._live -= len(slots)
        self._dead += len(slots)
        return len(slots)

    def _slots_holding(self, targets: np.ndarray, whole: np.ndarray | None = None) -> np.ndarray:
        """Slots holding any of these locations (sorted, distinct), or any location of the file ids ``whole``:
        one pass over the index that tests each entry against a byte per row position of the files the targets
        name (a binary search per entry would take seconds at 10M entries). Of a run on disk, only the patch is
        read when every file named was added after the run was written."""
        whole = np.empty(0, np.int64) if whole is None else whole
        targets = targets[(targets >> POSITION_BITS) < len(self._paths)]  # ids never given out hold nothing
        if not len(targets) and not len(whole):
            return np.empty(0, np.int64)
        files = targets >> POSITION_BITS
        positions = targets & MAX_POSITION
        last_of_file = np.flatnonzero(np.append(files[1:] != files[:-1], True)) if len(files) else files
        named = files[last_of_file]
        extent = positions[last_of_file] + 1
        # per file id (and one more for dead entries, whose file is -1): where its marks start, how many
        start_of = np.zeros(len(self._paths) + 1, np.int64)
        start_of[named] = np.cumsum(extent) - extent
        extent_of = np.zeros(len(self._paths) + 1, np.int64)
        extent_of[named] = extent
        marked = np.zeros(int(extent.sum()), bool)
        marked[start_of[files] + positions] = True
        all_of = np.zeros(len(self._paths) + 1, bool)
        all_of[whole] = True

        def holding(loc: np.ndarray) -> np.ndarray:
            file_of = loc >> POSITION_BITS
            position = loc & MAX_POSITION
            candidates = np.flatnonzero(position < extent_of[file_of])
            hits = np.zeros(len(loc), bool)
            hits[candidates[marked[start_of[file_of[candidates]] + position[candidates]]]] = True
            hits |= all_of[file_of] & (loc != DEAD)
            return np.flatnonzero(hits)

        found = []
        main = self._main
        named_ids = np.concatenate([named, whole])
        if isinstance(main, DiskRun) and (not len(named_ids) or named_ids.min() >= self._disk_ids):
            # files added since the run was written: only patched slots of the run can hold them
            found.append(self._patch_slots[holding(self._patch_locs)])
        else:
            for first in range(0, len(main), _SCAN_CHUNK):
                found.append(holding(self._main_locations(first, first + _SCAN_CHUNK)) + first)
            self._release()
        for first in range(0, len(self._delta), _SCAN_CHUNK):
            found.append(holding(self._delta.loc[first:first + _SCAN_CHUNK]) + (len(main) + first))
        return np.concatenate(found) if found else np.empty(0, np.int64)

    def _main_locations(self, first: int, stop: int) -> np.ndarray:
        """The main run's locations of slots ``first``..``stop`` as they stand (its patch applied)."""
        loc = np.array(self._main.loc[first:stop])
        if len(self._patch_slots):
            low, high = np.searchsorted(self._patch_slots, [first, stop])
            loc[self._patch_slots[low:high] - first] = self._patch_locs[low:high]
        return loc

    def _release(self) -> None:
        if isinstance(self._main, DiskRun):
            self._main.release()

    def _queued_run(self) -> _Run | None:
        """The queued rows of add() as one sorted run (keyed: the row added last of each key), the queue emptied."""
        if not self._queued[0]:
            return None
        # one column at a time, each queue emptied as soon as it is joined: a build holds one copy of its
        # entries plus one column, not two copies
        columns = []
        for queue in self._queued:
            columns.append(np.concatenate(queue) if queue else None)
            queue.clear()
        incoming = _Run(columns[0], columns[1], columns[2])  # type: ignore[arg-type]
        del columns
        _sort(incoming, group_equal=not self._multiset)
        if not self._multiset:
            last = _last_of_each_code(incoming)
            if not last.all():
                incoming = incoming.select(last)  # of rows with one key, the row added last wins
        return incoming

    def _spill_queue(self) -> None:
        """The queued rows, sorted, to a run on disk of their own: merged into the main run at the next read."""
        assert self._disk is not None
        incoming = self._queued_run()
        if incoming is None:
            return
        writer = RunWriter(self._disk.path, hashed=incoming.k2 is not None)
        try:
            writer.append(incoming.k1, incoming.k2, incoming.loc)
            self._pending.append(DiskRun(self._disk.path, writer.finish()))
        except BaseException:
            writer.abandon()
            raise

    def _flush(self) -> None:
        """Places the queued rows of add(): sorted, then (keyed) moved into the slots of keys already held,
        the rest merged into the delta. With runs spilled to disk, everything is merged into a new main run."""
        if self._pending:
            self._rewrite()
            return
        incoming = self._queued_run()
        if incoming is None:
            return
        if self._rewriting is not None:
            self._rewriting.note(incoming.k1, incoming.k2, incoming.loc, removed=False)
        if not self._multiset and (len(self._main) or len(self._delta)):
            queries, slots = self._lookup(incoming.k1, incoming.k2, presorted=True)
            revived = int((self._locations(slots) == DEAD).sum())
            self._set_locations(slots, incoming.loc[queries])
            self._release()
            self._dead -= revived
            self._live += revived
            new = np.ones(len(incoming), bool)
            new[queries] = False
            incoming = incoming.select(new)
        self._live += len(incoming)
        if len(incoming):
            self._delta = _merged(self._delta, incoming)
            self._layout = object()
        self._settle()

    def _settle(self) -> None:
        """Merges the delta into the main run, dropping dead entries, once it is large enough for the pass to
        pay off (amortized: a merge copies the main run once per eighth of it added), or when dead entries
        make up a quarter of the index. A main run on disk is rewritten at checkpoints (:meth:`checkpoint`), or
        here once what sits beside it takes twice its share of memory."""
        if self._disk is not None:
            if self._rewriting is not None:
                if len(self._delta) + len(self._patch_slots) <= _OVERLAY_WHILE_REWRITING * self._overlay_entries:
                    return
                self._adopt()  # changes outran the disk: they wait for the run being written
            if len(self._delta) + len(self._patch_slots) > 2 * self._overlay_entries:
                self._rewrite()
            return
        slots = len(self._main) + len(self._delta)
        if len(self._delta) > max(_MIN_MERGE, len(self._main) >> 3) or self._dead > max(_MIN_MERGE, slots >> 2):
            main = self._main
            assert isinstance(main, _Run)
            self._main = _merged(main.without_dead(), self._delta.without_dead())
            self._delta = _Run.empty(hashed=self._main.k2 is not None)
            self._dead = 0
            self._layout = object()

    def _rewrite(self) -> None:
        """One new main run on disk holding every live entry (the main run patched, the delta, the spilled runs,
        the queue), written in one streaming pass; the old runs' files are removed unless a manifest names them."""
        assert self._disk is not None
        self._cancel_rewrite()  # this run holds everything that one would
        hashed = self._hashed
        incoming = self._queued_run()
        sources: list[_Source] = [_Source(self._main, self._patch_slots, self._patch_locs), _Source(self._delta)]
        sources += [_Source(run) for run in self._pending]
        if incoming is not None:
            sources.append(_Source(incoming))
        sources = [source for source in sources if len(source.run)]
        # keyed main run and delta never share a key; spilled runs and the queue may hold keys held before
        disjoint = self._multiset or not (self._pending or incoming is not None)
        # what the merge holds at once stays within half the index's share of memory, however many runs it merges
        step = max(1 << 10, (self._overlay_entries // 2) // max(1, len(sources)))
        writer = RunWriter(self._disk.path, hashed=hashed)
        try:
            for k1, k2, loc in _merge_sources(sources, step, keyed=not self._multiset, disjoint=disjoint):
                writer.append(k1, k2, loc)
            run = DiskRun(self._disk.path, writer.finish())
        except BaseException:
            writer.abandon()
            raise
        old = [self._main, *self._pending]
        self._main, self._pending = run, []
        self._delta = _Run.empty(hashed=hashed)
        self._patch_slots = np.empty(0, np.int64)
        self._patch_locs = np.empty(0, np.int64)
        self._live, self._dead = len(run), 0
        self._disk_ids = len(self._paths)
        self._layout = object()
        saved = None if self._saved is None else self._saved[0]
        for previous in old:
            if isinstance(previous, DiskRun):
                previous.close()
                if previous.info.name != saved:
                    for path in previous.files():
                        path.unlink(missing_ok=True)


    # -- the main run rewritten in the background ---------------------------------------------------------------

    def _frozen(self, snapshot_id: int | None, key_ids: list[int]) -> _Rewrite:
        """A new main run, written in the background from the index as it stands (describing ``snapshot_id``): what
        changes in place is copied, the run is read through a mapping of its own."""
        assert self._disk is not None and isinstance(self._main, DiskRun)
        main = DiskRun(self._disk.path, self._main.info)
        delta = _Run(self._delta.k1, self._delta.k2, self._delta.loc.copy())  # codes are never written in place
        sources = [_Source(main, self._patch_slots, self._patch_locs.copy()), _Source(delta)]
        sources = [source for source in sources if len(source.run)]
        step = max(1 << 10, (self._overlay_entries // 2) // max(1, len(sources)))
        manifest = Manifest(snapshot_id, self._multiset, key_ids, main.info, list(self._paths))
        return _Rewrite(self._disk.path, sources, step, hashed=self._hashed, keyed=not self._multiset,
                        manifest=manifest)

    def _adopt(self) -> None:
        """The run written in the background (waited for) becomes the main run, its manifest saved; the changes
        made since it was frozen are replayed onto it."""
        assert self._disk is not None and self._rewriting is not None
        rewrite = self._rewriting
        rewrite.wait()
        self._rewriting = None
        if rewrite.error is not None:
            raise rewrite.error
        assert rewrite.info is not None
        run = DiskRun(self._disk.path, rewrite.info)
        old = self._main
        hashed = self._hashed
        self._main = run
        self._delta = _Run.empty(hashed=hashed)
        self._patch_slots = np.empty(0, np.int64)
        self._patch_locs = np.empty(0, np.int64)
        self._live, self._dead = len(run), 0
        self._disk_ids = len(rewrite.manifest.paths)  # files interned since hold no entry of the new run
        self._layout = object()
        if self._multiset:
            self._replay_multiset(rewrite)
        else:
            self._replay_keyed(rewrite)
        log.info("a key index's run of %d entries written in the background in %.1f s; %d changes made meanwhile "
                 "replayed onto it", rewrite.info.rows, rewrite.seconds, rewrite.changes)
        if isinstance(old, DiskRun):
            old.close()
        self._save(replace(rewrite.manifest, run=rewrite.info))  # removes the old run's files

    def _replay_keyed(self, rewrite: _Rewrite) -> None:
        """Each key noted since the freeze takes its latest location (dead: the key is gone)."""
        noted = rewrite.noted(removed=False)
        if noted is None:
            return
        _sort(noted, group_equal=True)
        noted = noted.select(_last_of_each_code(noted))
        queries, slots = self._lookup(noted.k1, noted.k2, presorted=True)  # the delta is empty: main-run slots
        locations = noted.loc[queries]
        self._patch(slots, locations)
        gone = int((locations == DEAD).sum())
        self._live -= gone
        self._dead += gone
        new = np.ones(len(noted), bool)
        new[queries] = False
        new &= noted.loc != DEAD
        self._delta = noted.select(new)
        self._live += len(self._delta)

    def _replay_multiset(self, rewrite: _Rewrite) -> None:
        """Entries removed since the freeze go (those of the new run looked up by their code, matched by location),
        entries added since and still held join the delta. A location names one entry: file ids are never reused."""
        added = rewrite.noted(removed=False)
        removed = rewrite.noted(removed=True)
        if removed is not None:
            every_removed = removed.loc
            if added is not None:
                removed = removed.select(~np.isin(removed.loc, added.loc))
            queries, slots = self._lookup(removed.k1, removed.k2)
            self._kill(_distinct(slots[self._locations(slots) == removed.loc[queries]]))
            self._release()
            if added is not None:
                added = added.select(~np.isin(added.loc, every_removed))
        if added is not None and len(added):
            _sort(added, group_equal=False)
            self._delta = added
            self._live += len(added)

    def _codes_at(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """The codes of entries by slot (the main run's first, then the delta's)."""
        boundary = len(self._main)
        in_main = slots < boundary
        k1 = np.empty(len(slots), self._main.k1.dtype)
        k1[in_main] = self._main.k1[slots[in_main]]
        k1[~in_main] = self._delta.k1[slots[~in_main] - boundary]
        if self._main.k2 is None or self._delta.k2 is None:
            return k1, None
        k2 = np.empty(len(slots), np.uint64)
        k2[in_main] = self._main.k2[slots[in_main]]
        k2[~in_main] = self._delta.k2[slots[~in_main] - boundary]
        return k1, k2

    def _cancel_rewrite(self) -> None:
        if self._rewriting is not None:
            self._rewriting.cancel()
            self._rewriting = None


class _Cancelled(Exception):
    pass


class _Rewrite:
    """A main run written by a background thread from sources frozen at a checkpoint, and the changes made to the
    index since, noted by code: a keyed index notes each key's new location (dead: removed), a multiset the entries
    added and removed. ``manifest`` is what will be saved once it is adopted (its run replaced by the new one)."""

    def __init__(self, directory: Path, sources: list[_Source], step: int, *, hashed: bool, keyed: bool,
                 manifest: Manifest) -> None:
        self.manifest = manifest
        self._keyed = keyed
        self.writer = RunWriter(directory, hashed=hashed)
        self.info: RunInfo | None = None
        self.error: BaseException | None = None
        self.seconds = 0.0  # how long the run took to write, once written
        self._frozen_bytes = sum(source.patch_locs.nbytes + (source.run.nbytes if isinstance(source.run, _Run)
                                                             else 0) for source in sources)
        self._notes: dict[bool, list[_Run]] = {False: [], True: []}  # removed? -> runs of notes, oldest first
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._write, args=(sources, step, keyed), daemon=True,
                                        name=f"pgcdc-index-{self.writer.name}")
        self._thread.start()

    def _write(self, sources: list[_Source], step: int, keyed: bool) -> None:
        started = time.monotonic()
        try:
            with _REWRITES:
                for k1, k2, loc in _merge_sources(sources, step, keyed=keyed, disjoint=True):
                    if self._cancelled.is_set():
                        raise _Cancelled
                    self.writer.append(k1, k2, loc)
                if self._cancelled.is_set():
                    raise _Cancelled
                self.info = self.writer.finish()
                self.seconds = time.monotonic() - started
        except BaseException as exc:  # handed to the apply thread when it adopts the run
            self.writer.abandon()
            self.error = exc
        finally:
            for source in sources:
                if isinstance(source.run, DiskRun):
                    source.run.close()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    @property
    def changes(self) -> int:
        return sum(len(run) for runs in self._notes.values() for run in runs)

    @property
    def nbytes(self) -> int:
        return self._frozen_bytes + sum(run.nbytes for runs in self._notes.values() for run in runs)

    def wait(self) -> None:
        self._thread.join()

    def cancel(self) -> None:
        self._cancelled.set()
        self.wait()

    def note(self, k1: np.ndarray, k2: np.ndarray | None, loc: np.ndarray, *, removed: bool) -> None:
        """Changes made since the freeze: entries placed (keyed: each key's new location), or removed."""
        if not len(k1):
            return
        if self._keyed and removed:  # among the moves, in order: a key may go and come back
            loc, removed = np.full(len(k1), DEAD, np.int64), False
        self._notes[removed].append(_Run(k1.copy(), None if k2 is None else k2.copy(), loc.copy()))

    def noted(self, *, removed: bool) -> _Run | None:
        """What was noted, oldest first, as one run (a keyed index's removals are dead locations among its moves)."""
        runs = self._notes[removed]
        if not runs:
            return None
        k2 = None if runs[0].k2 is None else np.concatenate([run.k2 for run in runs])
        return _Run(np.concatenate([run.k1 for run in runs]), k2, np.concatenate([run.loc for run in runs]))


class _Source:
    """A sorted run read in chunks for a merge: its patch applied, its dead entries left out."""

    def __init__(self, run: _Run | DiskRun, patch_slots: np.ndarray | None = None,
                 patch_locs: np.ndarray | None = None) -> None:
        self.run = run
        self.patch_slots = patch_slots if patch_slots is not None else np.empty(0, np.int64)
        self.patch_locs = patch_locs if patch_locs is not None else np.empty(0, np.int64)
        self.at = 0

    def __len__(self) -> int:
        return len(self.run)

    def search(self, value: np.ndarray) -> int:
        return int(_search(self.run, value, "right")[0])

    def read(self, stop: int) -> _Run:
        first, self.at = self.at, stop
        run = self.run
        loc = np.array(run.loc[first:stop])
        if len(self.patch_slots):
            low, high = np.searchsorted(self.patch_slots, [first, stop])
            loc[self.patch_slots[low:high] - first] = self.patch_locs[low:high]
        k1 = np.array(run.k1[first:stop])
        k2 = None if run.k2 is None else np.array(run.k2[first:stop])
        if isinstance(run, DiskRun):
            run.release()
        return _Run(k1, k2, loc).without_dead()


def _merge_sources(sources: list[_Source], step: int, *, keyed: bool, disjoint: bool
                   ) -> Iterator[tuple[np.ndarray, np.ndarray | None, np.ndarray]]:
    """The entries of sorted ``sources`` in code order, chunk by chunk (about ``step`` entries of each at a
    time). ``keyed``: of entries with one code, the one of the latest source wins (``disjoint``: no two sources
    share a code, so none needs dropping)."""
    while True:
        remaining = [source for source in sources if source.at < len(source)]
        if not remaining:
            return
        bound = min(source.run.k1[min(source.at + step, len(source)) - 1] for source in remaining)
        pieces = []
        for source in remaining:
            stop = max(source.at, source.search(np.array([bound], dtype=source.run.k1.dtype)))
            if stop > source.at:
                pieces.append(source.read(stop))
        if len(pieces) == 1:
            merged = pieces[0]
        elif len(pieces) == 2 and disjoint:
            merged = _merged(pieces[0], pieces[1])
        else:
            merged = _Run(np.concatenate([p.k1 for p in pieces]),
                          None if pieces[0].k2 is None else np.concatenate([p.k2 for p in pieces if p.k2 is not None]),
                          np.concatenate([p.loc for p in pieces]))
            # in source order, sorted stably: of entries with one code, the latest source's comes last
            _sort(merged, group_equal=keyed and not disjoint)
            if keyed and not disjoint:
                merged = merged.select(_last_of_each_code(merged))
        yield merged.k1, merged.k2, merged.loc


def _search(run: _Run | DiskRun, queries: np.ndarray, side: Literal["left", "right"]) -> np.ndarray:
    """``np.searchsorted`` of a run's first words (a run on disk: through its fence)."""
    if isinstance(run, DiskRun):
        return run.search(queries, side)
    return np.searchsorted(run.k1, queries, side)


# -- arrays -------------------------------------------------------------------------------------------------


def _table(keys: pa.Table | pa.RecordBatch) -> pa.Table:
    if isinstance(keys, pa.RecordBatch):
        return pa.Table.from_batches([keys])
    if not isinstance(keys, pa.Table):
        raise TypeError(f"keys must be an Arrow table, not {type(keys).__name__}")
    return keys


def _positions(values: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or (len(array) and array.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a one-dimensional array of integers")
    array = array.astype(np.int64)
    if len(array) and (array.min() < 0 or array.max() > MAX_POSITION):
        raise ValueError(f"{name} must lie in [0, 2**32): row positions of a data file")
    return array


def _expand(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of range(start, end) for each pair."""
    lengths = ends - starts
    total = int(lengths.sum())
    return np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(total)


def _matches(run: _Run | DiskRun, k1: np.ndarray, k2: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(query, slot) pairs for every slot of ``run`` whose code equals a query's (``k1`` sorted ascending)."""
    size = len(run)
    if not size or not len(k1):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    low = _search(run, k1, "left")
    hit = (low < size) & (run.k1[np.minimum(low, size - 1)] == k1)
    several = hit & (low + 1 < size) & (run.k1[np.minimum(low + 1, size - 1)] == k1)
    if several.any():  # duplicate rows of a multiset, or (rarely) hashes whose first words collide
        high = low + hit
        high[several] = _search(run, k1[several], "right")
        queries = np.repeat(np.arange(len(k1)), high - low)
        slots = _expand(low, high)
    else:
        queries = np.flatnonzero(hit)
        slots = low[queries]
    if k2 is not None:
        if isinstance(run, DiskRun):  # the first words' pages go back before the second words' are read
            run.release()
        same = run.k2[slots] == k2[queries]  # type: ignore[index]
        queries, slots = queries[same], slots[same]
    return queries, slots.astype(np.int64, copy=False)


def _groups(k1: np.ndarray, k2: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """For rows of codes: each row's group of equal codes (0..g-1, in code order), and a row of each group."""
    order = np.argsort(k1) if k2 is None else np.lexsort((k2, k1))
    sorted_k1 = k1[order]
    starts = np.ones(len(k1), bool)
    starts[1:] = sorted_k1[1:] != sorted_k1[:-1]
    if k2 is not None:
        sorted_k2 = k2[order]
        starts[1:] |= sorted_k2[1:] != sorted_k2[:-1]
    group = np.empty(len(k1), np.int64)
    group[order] = np.cumsum(starts) - 1
    return group, order[starts]


def _stable_order(k1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The permutation that sorts ``k1`` (equal values in input order), and ``k1`` sorted.

    np.argsort of 10M int64 takes seconds here, np.sort of uint64 a fraction of that (vectorized): so the
    keys are sorted as ``(key - min) << index_bits | index`` packed in one uint64. Where the keys span more
    than the bits left, their low bits are dropped first, and runs of equal truncated keys that come out of
    order are then sorted exactly (for random hashes, a few dozen entries in 10M). Operations run in place
    where they can: at this size each fresh array costs as much in page faults as the work on it.
    """
    size = len(k1)
    if size < 2:
        return np.arange(size), k1.copy()
    signed = k1.dtype != np.uint64
    low, high = int(k1.min()), int(k1.max())
    index_bits = (size - 1).bit_length()
    shift = max(0, (high - low).bit_length() - (64 - index_bits))
    # (k1 - low) computed modulo 2**64 is exact: the difference is below 2**64 and not negative
    packed = np.subtract(k1.view(np.uint64) if signed else k1, np.uint64(low % 2**64))
    if shift:
        packed >>= np.uint64(shift)
    packed <<= np.uint64(index_bits)
    packed |= np.arange(size, dtype=np.uint64)
    packed.sort()
    order = np.bitwise_and(packed, np.uint64((1 << index_bits) - 1)).view(np.int64)
    packed >>= np.uint64(index_bits)  # the truncated keys, sorted
    if shift == 0:
        packed += np.uint64(low % 2**64)
        return order, packed.view(np.int64) if signed else packed
    sorted_k1 = k1[order]
    out_of_order = np.flatnonzero(sorted_k1[1:] < sorted_k1[:-1])
    if len(out_of_order):
        runs = _distinct(packed[out_of_order])
        members = _expand(np.searchsorted(packed, runs, "left"), np.searchsorted(packed, runs, "right"))
        exact = np.lexsort((order[members], sorted_k1[members]))  # runs are contiguous and stay in place
        order[members] = order[members][exact]
        sorted_k1[members] = sorted_k1[members][exact]
    return order, sorted_k1


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (np.unique's hash table is several times slower on int64 here)."""
    if len(values) < 2:
        return values.copy()
    ordered = np.sort(values)
    first = np.empty(len(ordered), bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered[first]


def _sort(run: _Run, *, group_equal: bool) -> None:
    """Sorts a run by ``k1``, equal codes in input order, replacing its arrays one by one (so only one column
    is ever held twice). ``group_equal``: also make entries with equal full codes adjacent (hashes with equal
    first words and different second words may interleave)."""
    order, run.k1 = _stable_order(run.k1)
    if run.k2 is not None:
        run.k2 = run.k2[order]
    run.loc = run.loc[order]
    del order
    if group_equal and run.k2 is not None and len(run) > 1:
        same_first = run.k1[1:] == run.k1[:-1]
        if same_first.any():
            in_tie = np.zeros(len(run), bool)
            in_tie[1:] |= same_first
            in_tie[:-1] |= same_first
            members = np.flatnonzero(in_tie)
            exact = members[np.lexsort((members, run.k2[members], run.k1[members]))]
            run.k2[members] = run.k2[exact]
            run.loc[members] = run.loc[exact]


def _last_of_each_code(run: _Run) -> np.ndarray:
    """Which entries of a run (equal codes adjacent, in input order) are the last of their code."""
    last = np.ones(len(run), bool)
    same = run.k1[1:] == run.k1[:-1]
    if run.k2 is not None:
        same &= run.k2[1:] == run.k2[:-1]
    last[:-1] = ~same
    return last


def _merged(first: _Run, second: _Run) -> _Run:
    """Two runs as one sorted run, in one linear pass (``second``'s entries after equal ones of ``first``)."""
    if not len(second):
        return first
    if not len(first):
        return second
    size = len(first) + len(second)
    at = np.searchsorted(first.k1, second.k1, "right") + np.arange(len(second))
    from_first = np.ones(size, bool)
    from_first[at] = False

    def interleave(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        out = np.empty(size, a.dtype)
        out[at] = b
        out[from_first] = a
        return out

    k2 = None if first.k2 is None else interleave(first.k2, second.k2)  # type: ignore[arg-type]
    return _Run(interleave(first.k1, second.k1), k2, interleave(first.loc, second.loc))
