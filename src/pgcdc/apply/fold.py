"""Folding a streaming mirror's newest rows into one small file, so that every reader reads it about as fast as
a table freshly written.

Each batch adds a data file and a position-delete file to every mirror it touches: at a batch a second, a mirror
would gain thousands of each an hour, and every reader pays for each file it opens (Spark ~3x a fresh table's
read time after 50 batches, PyIceberg ~6x). Maintenance's compaction (:mod:`pgcdc.mirrors.maintenance`) is a Spark
job of seconds to minutes, run every few minutes at most. In between, pgcdc folds what it wrote itself, in the
batch's own commit, without Spark and without reading a file back:

- **The small file.** pgcdc keeps in memory the rows of the data file its last commit wrote, when it holds fewer
  than ``FOLD_MAX_ROWS`` rows. The next batch's data file holds the batch's rows and then that file's rows that
  are still live (the batch's deletes of them applied here, not written as deletes), and the batch's commit
  removes the old file: a mirror fed by small batches keeps one small data file, rewritten at each batch — as
  copy-on-write would, for its newest rows only. Once the small file and the batch together would reach
  ``FOLD_MAX_ROWS``, the small file stays as it is (a file that size reads about as fast as any) and the batch's
  file starts the next one; those files, and batches that large, are maintenance's to compact.
- **The small delete file.** Likewise the position-delete file of the last commit, while it names fewer than
  ``FOLD_MAX_ROWS`` rows: the batch's delete file holds its positions and the batch's, and the commit removes it.
- **One commit.** All of it is the batch's own row delta, carrying the mirror's position: Iceberg validates it
  as it validates every batch (every data file it deletes from or removes must still be live, and no delete file
  may have been added meanwhile when it removes a data file). A commit that loses that race changes nothing.
- **What is known.** Only files pgcdc wrote in its last commit are folded, and only when that commit is the
  snapshot the batch was resolved against: as soon as the table shows a commit pgcdc did not make (someone's
  compaction, another writer, a maintenance), or holds equality deletes (which a new file would escape),
  :meth:`SmallFiles.forget` starts over from the next commit's files. A new process reads the small files of the
  mirror's last commit back from storage (:meth:`SmallFiles.recover`), when that commit is pgcdc's, so a restart
  folds into them rather than leaving them for maintenance.

The key index follows: the small file's keys move to their rows in the new file.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pgcdc.positions import LSN_SUMMARY
from pgcdc.spark.iceberg_java import java_items

if TYPE_CHECKING:
    from pgcdc.apply.row_delta import Committed
    from pgcdc.index.mirror_index import FileReader

# A data file of this many rows, or a delete file of this many positions, is no longer folded: a batch that large
# is read about as fast as a fresh file already, and a fold stays a fraction of an apply (its rows are rewritten
# from memory; their Parquet encoding costs ~1 ms per thousand rows).
FOLD_MAX_ROWS = 16_384


@dataclass
class SmallData:
    path: str
    java: Any  # its Iceberg DataFile, as committed
    rows: pa.Table  # its rows, as written (read back: in the mirror's stored types, until a batch's types are known)
    read_back: bool = False


@dataclass
class SmallDeletes:
    java: Any  # its Iceberg DeleteFile, as committed
    positions: dict[str, np.ndarray]  # per data file it names

    @property
    def count(self) -> int:
        return sum(len(positions) for positions in self.positions.values())


@dataclass(frozen=True)
class Fold:
    """What one commit writes and removes: ``rows`` (the batch's rows, then ``folded`` — the small file's live rows,
    at the positions after the batch's) in its data file, ``deletes`` in its delete file, and the files it removes."""

    rows: pa.Table
    deletes: dict[str, np.ndarray]
    folded: pa.Table | None = None
    folded_path: str | None = None
    remove_data: list[Any] = field(default_factory=list)
    remove_deletes: list[Any] = field(default_factory=list)


class SmallFiles:
    """The small data file and the small delete file of pgcdc's last commit to one mirror (see the module)."""

    def __init__(self) -> None:
        self.data: SmallData | None = None
        self.deletes: SmallDeletes | None = None
        self.snapshot_id: int | None = None  # the commit that wrote them

    def forget(self) -> None:
        self.data, self.deletes, self.snapshot_id = None, None, None

    def recover(self, table: Any, snapshot_id: int | None, files: FileReader, layout: pa.Schema) -> None:
        """The small files of commit ``snapshot_id`` of an unpartitioned ``table`` (the snapshot a process's first
        batch to the mirror is resolved against), read back from storage in ``layout`` when it is a commit of
        pgcdc's — it carries a position, and is no rewrite — that added at most one data file and at most one
        position-delete file: a new process folds into them as the one before would have. Without it each run of a
        short-lived process (``--until-caught-up`` on a schedule) left a data file and a delete file in every mirror
        it touched, for maintenance to compact."""
        self.forget()
        snapshot = None if snapshot_id is None else table.snapshot(snapshot_id)
        if snapshot is None or str(snapshot.operation()) == "replace" or \
                snapshot.summary().get(LSN_SUMMARY) is None:
            return
        io = table.io()
        data, deletes = java_items(snapshot.addedDataFiles(io)), java_items(snapshot.addedDeleteFiles(io))
        if len(data) > 1 or len(deletes) > 1:
            return
        self.snapshot_id = snapshot_id
        if data and int(data[0].recordCount()) < FOLD_MAX_ROWS and str(data[0].format()) == "PARQUET":
            path = str(data[0].location())
            self.data = SmallData(path, data[0], files.read_columns(path, list(layout), layout), read_back=True)
        if deletes and str(deletes[0].content()) == "POSITION_DELETES" and str(deletes[0].format()) == "PARQUET" \
                and int(deletes[0].recordCount()) < FOLD_MAX_ROWS:
            self.deletes = SmallDeletes(deletes[0], files.read_position_deletes(str(deletes[0].location())))

    def plan(self, rows: pa.Table, deletes: dict[str, np.ndarray], *, built_on: int | None,
             equality_deletes: bool) -> Fold:
        """The commit of a batch of ``rows`` deleting ``deletes`` (positions per data file), resolved against
        snapshot ``built_on``: what it folds in. Nothing when that snapshot is not pgcdc's last commit."""
        if built_on is None or built_on != self.snapshot_id or equality_deletes:
            self.forget()
            return Fold(rows, deletes)
        folded = folded_path = None
        remove_data: list[Any] = []
        remaining = dict(deletes)
        small = self.data
        if small is not None and small.read_back and not small.rows.schema.equals(rows.schema):
            small.read_back = False
            # the stored types hold what the batch's held when the file was written (another schema since: the
            # cast fails, and the file is left to maintenance)
            with contextlib.suppress(pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError):
                small.rows = small.rows.cast(rows.schema)
        if small is not None and small.rows.schema.equals(rows.schema):
            gone = remaining.pop(small.path, None)
            live = small.rows
            if gone is not None and len(gone):
                keep = np.ones(live.num_rows, dtype=bool)
                keep[gone] = False
                live = live.filter(pa.array(keep))
            if rows.num_rows + live.num_rows < FOLD_MAX_ROWS:
                folded, folded_path, remove_data = live, small.path, [small.java]
                # one chunk: the small file's rows are carried from commit to commit, and chunks appended at each
                # made every later step over them (writes, filters, key codes) slower, batch after batch
                rows = pa.concat_tables([rows, live]).combine_chunks() if live.num_rows else rows
            else:  # the small file stays: the batch's deletes of its rows are written as deletes
                remaining = dict(deletes)
        remove_deletes: list[Any] = []
        carried = self.deletes
        # folded into the batch's own delete file, when it writes one: a batch deleting nothing leaves it as it is
        if carried is not None and remaining and \
                carried.count + sum(len(p) for p in remaining.values()) < FOLD_MAX_ROWS:
            for path, positions in carried.positions.items():
                if path != folded_path:  # (the small file's rows are never in a delete file: they fold)
                    before = remaining.get(path)
                    remaining[path] = positions if before is None else np.union1d(before, positions)
            remove_deletes = [carried.java]
        return Fold(rows, remaining, folded, folded_path, remove_data, remove_deletes)

    def committed(self, committed: Committed, fold: Fold | None) -> None:
        """pgcdc's commit of ``fold`` landed (None: a commit that replaced every row): its files are the small ones
        when small enough."""
        if fold is None or committed.parent_id != self.snapshot_id:
            self.forget()
        self.snapshot_id = committed.snapshot_id
        if fold is None:
            return
        self.data = None  # the small file was folded into this commit's, or has grown out of folding
        if committed.data_file is not None and committed.data_path and fold.rows.num_rows < FOLD_MAX_ROWS:
            self.data = SmallData(committed.data_path, committed.data_file, fold.rows)
        if committed.delete_file is not None:  # else the small delete file, if any, stays as it was
            written = SmallDeletes(committed.delete_file, fold.deletes)
            self.deletes = written if written.count < FOLD_MAX_ROWS else None
