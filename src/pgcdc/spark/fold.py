"""Folding a mirror's small files while it streams, so that every reader reads it about as fast as a table freshly
written.

Each batch adds a data file and a position-delete file to every mirror it touches: at a batch a second, a mirror
gains thousands of each an hour, and every reader pays for each file it opens (Spark ~3x a fresh table's read
time after 50 batches, PyIceberg ~6x). Maintenance's compaction (:mod:`pgcdc.spark.maintenance`) is a Spark
job of seconds to minutes, run every few minutes at most. In between, pgcdc folds the small files it wrote
itself, on the apply thread right after a batch's commit, without Spark:

- **Tiers.** A data file pgcdc wrote belongs to tier ``t`` when it holds fewer than ``FOLD_FILES ** (t + 1)``
  rows. Once a tier holds ``FOLD_FILES`` files, they and every file of the tiers below are read with Arrow,
  their deleted rows left out, and written as one file — which lands in a higher tier. Each row is rewritten
  about once per tier (log(rows) times in all, like a log-structured merge tree), and a mirror holds at most
  ``FOLD_FILES - 1`` small files per tier. Files of ``FOLD_MAX_ROWS`` rows or more are maintenance's.
- **Deletes.** Every position-delete file pgcdc wrote since is folded in the same commit: its rows in the
  folded data files are applied (left out of the new file), the others (rows of larger files) go to one new
  position-delete file. Once ``FOLD_FILES`` delete files have gathered with no tier full (batches deleting
  rows of larger files), they alone are folded into one.
- **One commit**, a ``RewriteFiles`` (operation ``replace``: the same rows) carrying the mirror's position, that
  Iceberg validates against every commit since the batch: a file it replaces must still be live, with no delete
  added to it by anyone else. A commit that loses that race changes nothing; the files are folded later.
- **What is known.** A fold reads only what pgcdc knows it wrote: the deletes it applies are those pgcdc
  committed to the files it folds. As soon as the table shows a commit pgcdc did not make (someone's compaction,
  another writer), :meth:`SmallFiles.forget` starts over from the files written after it.

The key index follows the fold: each key of a folded file moves to its row in the new file.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pgcdc.spark.mirror_index import FileReader, MirrorIndex
    from pgcdc.spark.row_delta import Committed, RowDeltaWriter

log = logging.getLogger("pgcdc.spark.fold")

# files of one tier folded together, and the factor between tiers: a mirror holds at most 3 small files per tier
# (and 3 delete files); each row is rewritten about once per tier, log4 of its mirror's growth
FOLD_FILES = 4
# Files of this many rows (delete files: positions) or more are left to maintenance's compaction. A batch this large
# is read at about a fresh file's speed already, and a fold stays small enough (at most ~4 x this many rows read and
# written with Arrow) not to hold up the next batch's apply for long.
FOLD_MAX_ROWS = 16_384


def tier(rows: int) -> int:
    """The tier of a data file of ``rows`` rows: 0 below FOLD_FILES rows, 1 below FOLD_FILES**2, ..."""
    level, bound = 0, FOLD_FILES
    while rows >= bound:
        level, bound = level + 1, bound * FOLD_FILES
    return level


@dataclass
class SmallDataFile:
    path: str
    rows: int
    java: Any  # its Iceberg DataFile, as committed
    deleted: list[np.ndarray] = field(default_factory=list)  # positions pgcdc deleted from it since


@dataclass
class SmallDeleteFile:
    java: Any  # its Iceberg DeleteFile, as committed
    positions: dict[str, np.ndarray]  # per data file it names


class SmallFiles:
    """The data and position-delete files pgcdc committed to one mirror since the last commit it did not make."""

    def __init__(self) -> None:
        self.data: dict[str, SmallDataFile] = {}
        self.deletes: list[SmallDeleteFile] = []
        self.snapshot_id: int | None = None  # the commit the files are known up to

    def forget(self) -> None:
        self.data, self.deletes, self.snapshot_id = {}, [], None

    def committed(self, committed: Committed, deleted: dict[str, np.ndarray] | None, *, follows: int | None,
                  new_deletes: bool = True) -> None:
        """A commit of pgcdc's on top of snapshot ``follows``, which deleted ``deleted`` (positions per data file):
        the files are known from there only if they were known up to it (else from this commit on, with the files
        of this commit alone). ``new_deletes``: False for a fold's delete file, whose positions are known."""
        if follows is None or follows != self.snapshot_id:
            self.forget()
        if committed.data_file is not None and committed.data_rows < FOLD_MAX_ROWS:
            self.data[committed.data_path or ""] = SmallDataFile(committed.data_path or "", committed.data_rows,
                                                                 committed.data_file)
        if committed.delete_file is not None and deleted:
            if sum(len(positions) for positions in deleted.values()) < FOLD_MAX_ROWS:
                self.deletes.append(SmallDeleteFile(committed.delete_file, deleted))
            # a delete file left to maintenance still names rows of small files: a fold leaves those rows out, and
            # the file's positions in the folded files then name files no longer live, which no reader applies
            for path, positions in deleted.items() if new_deletes else ():
                if path in self.data:
                    self.data[path].deleted.append(positions)
        self.snapshot_id = committed.snapshot_id

    def due(self) -> list[SmallDataFile] | None:
        """The data files to fold now: a full tier and every file of the tiers below; none (an empty list) when
        only the delete files are due; None when nothing is."""
        counts: dict[int, int] = {}
        for small in self.data.values():
            counts[tier(small.rows)] = counts.get(tier(small.rows), 0) + 1
        full = [level for level, count in counts.items() if count >= FOLD_FILES]
        if not full:
            return [] if len(self.deletes) >= FOLD_FILES else None
        top = max(full)
        return [small for small in self.data.values() if tier(small.rows) <= top]


@dataclass(frozen=True)
class Folded:
    snapshot_id: int
    files: int  # data files folded
    rows: int  # rows in the new file


def fold(writer: RowDeltaWriter, small: SmallFiles, reader: FileReader, index: MirrorIndex | None,
         carried: Mapping[str, str]) -> Folded | None:
    """Fold the mirror's due small files (see the module) in one commit carrying ``carried``; None when none is
    due, or when the commit lost a race (nothing changed; the files known start over)."""
    from pgcdc.spark.iceberg import is_commit_conflict

    folding = small.due()
    table = writer.table
    current = table.currentSnapshot()
    if folding is None or current is None or int(current.snapshotId()) != small.snapshot_id:
        return None
    if int(current.summary().getOrDefault("total-equality-deletes", "0")) > 0:
        return None  # a new file would escape the equality deletes that apply to the old ones
    layout = writer.schema
    parts = []
    for data in folding:
        rows = reader.read_columns(data.path, list(layout), layout)
        if data.deleted:
            keep = np.ones(rows.num_rows, dtype=bool)
            keep[np.concatenate(data.deleted)] = False
            rows = rows.filter(pa.array(keep))
        parts.append(rows)
    merged = pa.concat_tables(parts) if parts else layout.empty_table()
    folded_paths = {data.path for data in folding}
    remaining: dict[str, list[np.ndarray]] = {}
    for delete in small.deletes:
        for path, positions in delete.positions.items():
            if path not in folded_paths:
                remaining.setdefault(path, []).append(positions)
    left = {path: np.unique(np.concatenate(parts)) for path, parts in remaining.items()}
    try:
        committed = writer.rewrite([data.java for data in folding], [delete.java for delete in small.deletes],
                                   merged, left, carried, validate_from=int(current.snapshotId()))
    except Exception as exc:
        if not is_commit_conflict(exc):
            raise
        log.info("%s: folding its small files lost to a concurrent commit; they are folded later", table.name())
        small.forget()
        return None
    if index is not None:  # each key moves to its row in the new file (added first: it keeps its slot)
        if committed.data_path is not None:
            index.keys.add(committed.data_path, merged.select(index.key_names))
        for path in folded_paths:
            index.keys.drop_file(path)
        index.snapshot_id = committed.snapshot_id
    for path in folded_paths:
        del small.data[path]
    small.deletes = []
    small.committed(committed, left or None, follows=small.snapshot_id, new_deletes=False)
    log.debug("%s: folded %d small files into one of %d rows", table.name(), len(folding), merged.num_rows)
    return Folded(committed.snapshot_id, len(folding), merged.num_rows)
