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

Not thread-safe: one apply thread owns a mirror's index. A build may read and decode files in other threads,
but calls on the index must come from one thread at a time.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pgcdc.index.key_codes import KeyCoder

POSITION_BITS = 32
MAX_POSITION = (1 << POSITION_BITS) - 1
MAX_FILE_ID = (1 << 31) - 1
DEAD = -1
# the delta is merged into the main run when it holds more than this or an eighth of the main run
_MIN_MERGE = 1 << 16
# entries a scan for locations looks at in one step (bounds its temporary arrays)
_SCAN_CHUNK = 1 << 20


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

    Keys arrive as Arrow tables whose columns have the mirror's stored types; the first table the index sees
    fixes the kinds of its key columns (see :class:`pgcdc.index.key_codes.KeyCoder`).
    """

    def __init__(self, *, multiset: bool) -> None:
        self._multiset = multiset
        self._coder: KeyCoder | None = None
        self._main = _Run.empty(hashed=False)
        self._delta = _Run.empty(hashed=False)
        self._queued: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])  # k1, k2, loc
        self._live = 0
        self._dead = 0
        self._layout = object()  # replaced whenever entries change slots (see _SlotHint)
        self._paths: list[str | None] = []
        self._ids: dict[str, int] = {}

    def __repr__(self) -> str:  # without placing queued rows: a repr must not change the index
        kind = "multiset" if self._multiset else "keyed"
        queued = sum(len(k1) for k1 in self._queued[0])
        return (f"KeyIndex({kind}, {self._live:,} rows placed and {queued:,} queued, {len(self._ids):,} files, "
                f"{self.memory_bytes:,} bytes)")

    # -- what the index holds -------------------------------------------------------------------------------

    @property
    def multiset(self) -> bool:
        return self._multiset

    @property
    def rows(self) -> int:
        """Live entries (queued rows are placed first: after a build, this is where the sort happens)."""
        self._flush()
        return self._live

    @property
    def memory_bytes(self) -> int:
        """Bytes the index holds now: its arrays (dead slots and queued rows included) and its path table."""
        arrays = self._main.nbytes + self._delta.nbytes + sum(a.nbytes for queue in self._queued for a in queue)
        paths = sys.getsizeof(self._paths) + sys.getsizeof(self._ids) + sum(
            sys.getsizeof(path) for path in self._paths if path is not None)
        return arrays + paths

    def path(self, file_id: int) -> str:
        """The data file's path, exactly as given to :meth:`add` (Iceberg matches deletes to files by it)."""
        path = self._paths[file_id] if 0 <= file_id < len(self._paths) else None
        if path is None:
            raise KeyError(f"no data file has id {file_id} in this index")
        return path

    def file_id(self, path: str) -> int | None:
        """The id of a data file the index holds, or None."""
        return self._ids.get(path)

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
        k1, k2 = self._coder_for(keys.schema).codes(keys)
        file_id = self._intern(path)
        if rows:
            self._queued[0].append(k1)
            if k2 is not None:
                self._queued[1].append(k2)
            self._queued[2].append((np.int64(file_id) << POSITION_BITS) | located_at)

    def drop_file(self, path: str) -> int:
        """Forgets every entry of a data file (a compaction removed it); returns how many there were.

        After a compaction, add the rewritten files first and drop the old ones after: a keyed index then
        moves each key within its slot, and the old files have nothing left to drop.
        """
        file_id = self._ids.get(path)
        if file_id is None:
            return 0
        self._flush()
        first = file_id << POSITION_BITS
        dropped = self._kill(self._slots_between(first, first + MAX_POSITION))
        del self._ids[path]
        self._paths[file_id] = None  # ids are never reused: a stale Located can never name another file
        self._settle()
        return dropped

    def drop_positions(self, path: str, positions: np.ndarray) -> int:
        """Forgets the entries at these row positions of a data file (rows a delete file removed); returns how
        many the index held."""
        file_id = self._ids.get(path)
        targets = _positions(positions, "positions")
        if file_id is None or not len(targets):
            return 0
        self._flush()
        dropped = self._kill(self._slots_holding(_distinct((np.int64(file_id) << POSITION_BITS) | targets)))
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
        elif len(targets):
            self._flush()
            self._kill(self._slots_holding(_distinct(targets)))
        self._settle()

    # -- lookups --------------------------------------------------------------------------------------------

    def find(self, keys: pa.Table) -> Located:
        """Keyed: the entry of each key row (file id -1 where the index holds none)."""
        if self._multiset:
            raise TypeError("a multiset index holds several entries per key: use take(keys, counts)")
        keys = _table(keys)
        k1, k2 = self._coder_for(keys.schema).codes(keys)
        self._flush()
        queries, slots = self._lookup(k1, k2)
        locations = self._locations(slots)
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
        k1, k2 = self._coder_for(keys.schema).codes(keys)
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
        in_delta = _matches(self._delta, k1, k2)
        queries = np.concatenate([in_main[0], in_delta[0]])
        slots = np.concatenate([in_main[1], in_delta[1] + len(self._main)])
        return (queries if presorted else order[queries]), slots

    def _locations(self, slots: np.ndarray) -> np.ndarray:
        boundary = len(self._main)
        in_main = slots < boundary
        locations = np.empty(len(slots), np.int64)
        locations[in_main] = self._main.loc[slots[in_main]]
        locations[~in_main] = self._delta.loc[slots[~in_main] - boundary]
        return locations

    def _set_locations(self, slots: np.ndarray, locations: np.ndarray) -> None:
        boundary = len(self._main)
        in_main = slots < boundary
        self._main.loc[slots[in_main]] = locations[in_main]
        self._delta.loc[slots[~in_main] - boundary] = locations[~in_main]

    def _kill(self, slots: np.ndarray) -> int:
        """Marks distinct live slots dead; returns how many."""
        if not len(slots):
            return 0
        self._set_locations(slots, np.full(len(slots), DEAD, np.int64))
        self._live -= len(slots)
        self._dead += len(slots)
        return len(slots)

    def _slots_between(self, low: int, high: int) -> np.ndarray:
        """Slots whose location lies in [low, high] (dead slots never do: locations are not negative)."""
        parts = []
        for base, run in ((0, self._main), (len(self._main), self._delta)):
            parts.append(np.flatnonzero((run.loc >= low) & (run.loc <= high)) + base)
        return np.concatenate(parts)

    def _slots_holding(self, targets: np.ndarray) -> np.ndarray:
        """Slots holding any of these locations (sorted, distinct): one pass over the index that tests each
        entry against a byte per row position of the files the targets name (a binary search per entry
        would take seconds at 10M entries)."""
        targets = targets[(targets >> POSITION_BITS) < len(self._paths)]  # ids never given out hold nothing
        if not len(targets):
            return np.empty(0, np.int64)
        files = targets >> POSITION_BITS
        positions = targets & MAX_POSITION
        last_of_file = np.flatnonzero(np.append(files[1:] != files[:-1], True))
        named = files[last_of_file]
        extent = positions[last_of_file] + 1
        # per file id (and one more for dead entries, whose file is -1): where its marks start, how many
        start_of = np.zeros(len(self._paths) + 1, np.int64)
        start_of[named] = np.cumsum(extent) - extent
        extent_of = np.zeros(len(self._paths) + 1, np.int64)
        extent_of[named] = extent
        marked = np.zeros(int(extent.sum()), bool)
        marked[start_of[files] + positions] = True
        found = []
        for base, run in ((0, self._main), (len(self._main), self._delta)):
            for first in range(0, len(run), _SCAN_CHUNK):
                loc = run.loc[first:first + _SCAN_CHUNK]
                file_of = loc >> POSITION_BITS
                position = loc & MAX_POSITION
                candidates = np.flatnonzero(position < extent_of[file_of])
                hits = candidates[marked[start_of[file_of[candidates]] + position[candidates]]]
                found.append(hits + (base + first))
        return np.concatenate(found) if found else np.empty(0, np.int64)

    def _flush(self) -> None:
        """Places the queued rows of add(): sorted, then (keyed) moved into the slots of keys already held,
        the rest merged into the delta."""
        if not self._queued[0]:
            return
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
            if len(self._main) or len(self._delta):
                queries, slots = self._lookup(incoming.k1, incoming.k2, presorted=True)
                revived = int((self._locations(slots) == DEAD).sum())
                self._set_locations(slots, incoming.loc[queries])
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
        make up a quarter of the index."""
        slots = len(self._main) + len(self._delta)
        if len(self._delta) > max(_MIN_MERGE, len(self._main) >> 3) or self._dead > max(_MIN_MERGE, slots >> 2):
            self._main = _merged(self._main.without_dead(), self._delta.without_dead())
            self._delta = _Run.empty(hashed=self._main.k2 is not None)
            self._dead = 0
            self._layout = object()


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


def _matches(run: _Run, k1: np.ndarray, k2: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(query, slot) pairs for every slot of ``run`` whose code equals a query's (``k1`` sorted ascending)."""
    size = len(run)
    if not size or not len(k1):
        return np.empty(0, np.int64), np.empty(0, np.int64)
    low = np.searchsorted(run.k1, k1, "left")
    hit = (low < size) & (run.k1[np.minimum(low, size - 1)] == k1)
    several = hit & (low + 1 < size) & (run.k1[np.minimum(low + 1, size - 1)] == k1)
    if several.any():  # duplicate rows of a multiset, or (rarely) hashes whose first words collide
        high = low + hit
        high[several] = np.searchsorted(run.k1, k1[several], "right")
        queries = np.repeat(np.arange(len(k1)), high - low)
        slots = _expand(low, high)
    else:
        queries = np.flatnonzero(hit)
        slots = low[queries]
    if k2 is not None:
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
