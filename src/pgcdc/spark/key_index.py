"""Where each row of a mirror is: key -> (data file, row position). (A plain reference implementation.)"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pgcdc.spark.arrow import plain_type


@dataclass(frozen=True)
class Located:
    """Entries of the index: per requested row, the data file (an id, -1: not found) and the row position."""

    file_ids: np.ndarray
    positions: np.ndarray


def _normalized(value: object) -> object:
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value == 0.0:
            return 0.0
    if isinstance(value, list):
        return tuple(_normalized(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _normalized(v)) for k, v in value.items())
    return value


def _rows(keys: pa.Table) -> list[tuple]:
    plain = keys.cast(pa.schema([pa.field(f.name, plain_type(f.type)) for f in keys.schema]))
    columns = [plain.column(i).to_pylist() for i in range(plain.num_columns)]
    return [tuple(_normalized(v) for v in row) for row in zip(*columns, strict=True)] if columns else []


class KeyIndex:
    """Where each row of one mirror is: key -> (data file, row position)."""

    def __init__(self, *, multiset: bool) -> None:
        self.multiset = multiset
        self._paths: list[str] = []
        self._ids: dict[str, int] = {}
        self._entries: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        self._by_file: dict[int, dict[int, tuple]] = defaultdict(dict)

    @property
    def rows(self) -> int:
        return sum(len(v) for v in self._by_file.values())

    @property
    def memory_bytes(self) -> int:
        return self.rows * 200

    def path(self, file_id: int) -> str:
        return self._paths[file_id]

    def file_id(self, path: str) -> int | None:
        return self._ids.get(path)

    def _id(self, path: str) -> int:
        if path not in self._ids:
            self._ids[path] = len(self._paths)
            self._paths.append(path)
        return self._ids[path]

    def add(self, path: str, keys: pa.Table, positions: np.ndarray | None = None) -> None:
        file_id = self._id(path)
        rows = _rows(keys)
        at = range(len(rows)) if positions is None else [int(p) for p in positions]
        for key, position in zip(rows, at, strict=True):
            if not self.multiset:
                for old in self._entries.get(key, []):
                    self._by_file[old[0]].pop(old[1], None)
                self._entries[key] = []
            self._entries[key].append((file_id, position))
            self._by_file[file_id][position] = key

    def drop_file(self, path: str) -> int:
        file_id = self._ids.get(path)
        if file_id is None:
            return 0
        held = self._by_file.pop(file_id, {})
        for position, key in held.items():
            self._entries[key].remove((file_id, position))
        return len(held)

    def drop_positions(self, path: str, positions: np.ndarray) -> int:
        file_id = self._ids.get(path)
        if file_id is None:
            return 0
        dropped = 0
        for position in positions.tolist():
            key = self._by_file[file_id].pop(int(position), None)
            if key is not None:
                self._entries[key].remove((file_id, int(position)))
                dropped += 1
        return dropped

    def find(self, keys: pa.Table) -> Located:
        ids, positions = [], []
        for key in _rows(keys):
            entries = self._entries.get(key)
            if entries:
                ids.append(entries[0][0])
                positions.append(entries[0][1])
            else:
                ids.append(-1)
                positions.append(0)
        return Located(np.array(ids, dtype=np.int32), np.array(positions, dtype=np.int64))

    def take(self, keys: pa.Table, counts: np.ndarray) -> Located:
        ids, positions = [], []
        used: set[tuple[int, int]] = set()
        for key, count in zip(_rows(keys), counts.tolist(), strict=True):
            for entry in self._entries.get(key, []):
                if count <= 0:
                    break
                if entry in used:
                    continue
                used.add(entry)
                ids.append(entry[0])
                positions.append(entry[1])
                count -= 1
        return Located(np.array(ids, dtype=np.int32), np.array(positions, dtype=np.int64))

    def forget(self, located: Located) -> None:
        for file_id, position in zip(located.file_ids.tolist(), located.positions.tolist(), strict=True):
            key = self._by_file[file_id].pop(position, None)
            if key is not None:
                self._entries[key].remove((file_id, position))
