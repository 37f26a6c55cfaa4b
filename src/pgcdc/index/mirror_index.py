"""A mirror's key index kept equal to its Iceberg metadata: where each row is, so a batch deletes by position.

The index (:class:`pgcdc.index.key_index.KeyIndex`) maps each row's key — the replica identity's columns, or the
whole row of a keyless table, as a multiset — to the data file and row position that hold it. It describes one
snapshot of the mirror (:attr:`MirrorIndex.snapshot_id`):

- **Built** when first needed, from the live data files of the current snapshot (Iceberg plans them, with the
  delete files that apply to each: the sequence-number rules are Iceberg's own), their key columns read with
  Arrow by field id (several files at once: :meth:`FileReader.read_each`), the rows their position and equality
  deletes remove left out.
- **Moved forward by pgcdc's own commits**: the rows a batch deleted leave the index, the rows of its new data
  file enter it at their positions, and the index describes the new snapshot.
- **Brought up to date with every snapshot someone else committed** (a compaction — pgcdc's own maintenance, a
  user's ``rewrite_data_files``, a catalog's optimizer — or the MERGE writer): the snapshots between the indexed
  one and the current one are walked, the data files they removed leave the index, those they added are read,
  and the rows their position deletes remove leave it. When the walk cannot reach the indexed snapshot (expired,
  rolled back) or meets what it cannot follow (equality deletes), the index is built again from scratch.

- **Kept on disk** when it does not fit its share of memory (:class:`IndexBudget`): its main run is a file under
  the index directory (``--index-dir``, one directory per table uuid), tied by a manifest to the snapshot it
  describes (:mod:`pgcdc.index.disk_runs`). A restart opens it and reads only what changed since that snapshot:
  the data files added (their rows, less the deletes applying to them), those removed, and the position deletes
  applying to the files it kept — set against the current snapshot's files, so an expired snapshot costs nothing.
  A manifest that names another key, a run that fails its checksums, or a table holding equality deletes: the
  index is built again, within the same bounded memory (sorted runs spilled to disk, merged once).

Why a position never points at the wrong row: Iceberg data files are immutable, so (file, position) names one row
for as long as the file is live; a batch resolves its positions against the snapshot the index describes, and its
commit names that snapshot (``validateFromSnapshot``) and every data file its deletes refer to
(``validateDataFilesExist``): a commit racing a compaction that removed one of them fails Iceberg's validation,
and is resolved again against the new files and retried — it never deletes against a file that is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.errors import Unindexable
from pgcdc.iceberg.locations import local_path, object_path
from pgcdc.index.disk_runs import (
    DamagedIndex,
    IndexDirectory,
    IndexInUse,
    default_index_directory,
    prune_unused,
)
from pgcdc.index.key_codes import Codes, KeyCoder
from pgcdc.index.key_index import KeyIndex, Located
from pgcdc.spark.iceberg_java import TableState, holds_equality_deletes, java_items

log = logging.getLogger("pgcdc.index.mirror_index")

POSITION_DELETE_PATH_ID, POSITION_DELETE_POS_ID = 2147483546, 2147483545  # Iceberg's reserved field ids


class MirrorIndex:
    """The key index of one mirror and the snapshot it describes (see the module)."""

    def __init__(self, key_names: list[str], layout: pa.Schema, *, multiset: bool,
                 disk: IndexDirectory | None = None, overlay_bytes: int = 64 << 20) -> None:
        """``key_names``: the key's columns (every column of a keyless mirror); ``layout``: the mirror's Parquet
        layout (field ids and stored types), which data files' columns are read in. ``disk``: keep the index in
        this directory, holding about ``overlay_bytes`` of it in memory (see the module)."""
        self.key_names = key_names
        self.layout = layout
        self.multiset = multiset
        self.disk = disk
        self.overlay_bytes = overlay_bytes
        self.keys = self._new_keys()
        self.snapshot_id: int | None = None
        self.consistent = True  # False while a commit is being followed: a failure there leaves it half-moved
        self.files: FileReader  # set by index_for
        # of a table with a partitioned spec (now or before): each data file's spec id and partition (a Java
        # StructLike), which a position-delete file naming it must carry; None for a table never partitioned
        self.partitions: dict[str, tuple[int, Any]] | None = None

    def _new_keys(self) -> KeyIndex:
        return KeyIndex(multiset=self.multiset, disk=self.disk, overlay_bytes=self.overlay_bytes)

    def key_ids(self) -> list[int]:
        return [_field_id(field) for field in self.key_fields()]

    @contextlib.contextmanager
    def following(self) -> Iterator[None]:
        """Around changes that move the index from one snapshot to the next: it is saved once they are all made,
        and never trusted again when they fail half-way."""
        self.consistent = False
        yield
        self.consistent = True
        self.save()

    def save(self, *, force: bool = False) -> None:
        """An index on disk writes what it holds in memory to its run when that has grown past its share (or
        ``force``: at a clean stop), and a manifest naming the snapshot it describes."""
        if self.disk is not None and self.consistent:
            self.keys.checkpoint(self.snapshot_id, self.key_ids(), force=force)

    def close(self, *, save: bool) -> None:
        """Frees what the index holds (saved first when ``save`` and it is kept on disk)."""
        if save:
            self.save(force=True)
        self.keys.close()
        if self.disk is not None:
            self.disk.close()

    # -- reading what the metadata says ----------------------------------------------------------------------
    def build(self, table: Any, files: FileReader) -> None:
        """The index of ``table``'s current snapshot, from its live data files and the deletes applying to them."""
        self.keys.close()
        self.keys = self._new_keys()
        snapshot = table.currentSnapshot()
        self.snapshot_id = None if snapshot is None else int(snapshot.snapshotId())
        self.partitions = {} if _ever_partitioned(table) else None
        if snapshot is not None:
            planned = self._planned(table, snapshot)
            self._add_surviving(table, planned, files, DeleteFiles(self, files))
        self.consistent = True
        self.save(force=True)
        where = f", {self.keys.disk_bytes >> 20:,} MB on disk" if self.disk is not None else ""
        log.info("indexed %d rows of %s (%d MB in memory%s)", self.keys.rows, table.name(),
                 self.keys.memory_bytes >> 20, where)

    def _add_surviving(self, table: Any, planned: list[tuple[str, list[Any]]], files: FileReader,
                       deletes: DeleteFiles) -> None:
        """The rows of each planned data file that the delete files applying to it leave, with a progress line
        every 10 s on a long read."""
        paths = [path for path, _ in planned]
        started = reported = time.monotonic()
        rows = 0
        for done, ((path, applying), chunks) in enumerate(
                zip(planned, files.read_each(paths, self.key_fields(), self.layout), strict=True), start=1):
            for offset, keys in chunks:
                keep = deletes.surviving(path, keys, applying, offset)
                positions = offset + (np.flatnonzero(keep) if keep is not None else np.arange(keys.num_rows))
                self.keys.add(path, keys if keep is None else keys.filter(pa.array(keep)), positions)
                rows += keys.num_rows
            if time.monotonic() - reported >= 10:
                reported = time.monotonic()
                log.info("indexing %s: %d of %d data files read, %d rows, %.0f s", table.name(), done, len(paths),
                         rows, reported - started)

    def open_saved(self, table: Any, files: FileReader) -> bool:
        """The index saved on disk, brought to ``table``'s current snapshot by what changed since the one it
        describes (see the module); False when there is none to trust (then :meth:`build`)."""
        assert self.disk is not None
        try:
            manifest = self.disk.read_manifest()
            if manifest is None:
                return False
            if manifest.key != self.key_ids() or manifest.multiset != self.multiset:
                log.info("%s: its index on disk is of another key; indexing it again", table.name())
                return False
            current = table.currentSnapshot()
            if current is None or holds_equality_deletes(current):
                return False
            keys = KeyIndex.opened(self.disk, manifest, pa.schema(self.key_fields()),
                                   overlay_bytes=self.overlay_bytes)
        except DamagedIndex as exc:
            log.warning("%s: its index on disk cannot be trusted (%s); indexing it again", table.name(), exc)
            return False
        self.keys.close()
        self.keys = keys
        current_id = int(current.snapshotId())
        self.partitions = {} if _ever_partitioned(table) else None
        if manifest.snapshot_id == current_id:
            self.snapshot_id = current_id
            if self.partitions is not None:
                self._planned(table, current)  # each data file's partition
            log.info("%s: opened its index of %d rows on disk", table.name(), keys.rows)
            return True
        planned = self._planned(table, current)
        held = set(keys.paths())
        live = {path for path, _ in planned}
        added = [(path, applying) for path, applying in planned if path not in held]
        deletes = DeleteFiles(self, files)
        # the deletes of the files it kept that the saved snapshot held were applied before it was saved: only
        # newer ones (a greater data sequence number) are read, where each would cost a pass over the run; when
        # that snapshot is gone from the history, every one is applied again (the same result, slower)
        saved = None if manifest.snapshot_id is None else table.snapshot(manifest.snapshot_id)
        applied_upto = None if saved is None else int(saved.sequenceNumber())
        dropped: dict[str, np.ndarray] = {}
        for path, applying in planned:
            if path in held and applying:
                newer = applying if applied_upto is None else [
                    delete for delete in applying if int(delete.dataSequenceNumber()) > applied_upto]
                if newer:
                    dropped[path] = deletes.positions_in(path, newer)
        gone = sorted(held - live)
        with self.following():
            keys.drop_many(gone, dropped)
            self._forget_partitions(gone)
            self._add_surviving(table, added, files, deletes)
            self.snapshot_id = current_id
        log.info("%s: opened its index of %d rows on disk, saved at snapshot %s: %d data files added and %d "
                 "removed since", table.name(), keys.rows, manifest.snapshot_id, len(added), len(gone))
        return True

    def refresh(self, table: Any, files: FileReader, *, state: TableState | None = None) -> None:
        """Bring the index up to ``table``'s current snapshot (see the module); built again when the snapshots in
        between cannot be followed. ``state``: what the table's refresh read, when the caller has it: an index that
        describes its snapshot asks the JVM nothing."""
        if state is not None and state.snapshot_id == self.snapshot_id:
            return
        current = table.currentSnapshot()
        current_id = None if current is None else int(current.snapshotId())
        if current_id == self.snapshot_id:
            return
        between = _snapshots_after(table, current, self.snapshot_id)
        if between is not None and holds_equality_deletes(current):
            # a file a compaction wrote keeps the sequence number it started from, so equality deletes newer than
            # that still apply to its rows: only a build, which lets Iceberg say what applies, reads them right
            between = None
        if between is None:
            log.info("%s: its index describes a snapshot no longer in its history; indexing it again",
                     table.name())
            self.build(table, files)
            return
        io = table.io()
        removed: list[str] = []
        retired: list[str] = []  # removed by rewrites
        dropped: dict[str, list[np.ndarray]] = defaultdict(list)
        try:
            with self.following():
                for snapshot in between:
                    self._follow(snapshot, io, files, removed, dropped, retired)
                # what left, in one pass over the index: a location once gone never comes back (data files are
                # immutable, their paths never reused), so dropping it after later snapshots' rows came is the same
                self.keys.drop_many(removed, {path: np.concatenate(parts) for path, parts in dropped.items()})
                # then the files rewrites removed, without a pass: what of them was not moved is dropped just above
                # (rows a delete before the rewrite removed)
                self.keys.retire_files(retired)
                self._forget_partitions(removed + retired)
                self.snapshot_id = current_id
        except _CannotFollow as exc:
            log.info("%s: indexing it again (%s)", table.name(), exc)
            self.build(table, files)

    def _follow(self, snapshot: Any, io: Any, files: FileReader, removed: list[str],
                dropped: dict[str, list[np.ndarray]], retired: list[str]) -> None:
        """One snapshot someone else committed, followed: the rows it added enter the index now (a keyed entry
        then moves within its slot when a compaction rewrites its row), the files it removed and the rows its
        position deletes remove are noted in ``removed`` and ``dropped``, to leave it in one pass (the files a
        rewrite removed, in ``retired``: their live rows moved)."""
        added_files = java_items(snapshot.addedDataFiles(io))
        added = [str(data.location()) for data in added_files]
        if self.partitions is not None:
            for path, data in zip(added, added_files, strict=True):
                self.partitions[path] = (int(data.specId()), data.partition())
        for path, chunks in zip(added, files.read_each(added, self.key_fields(), self.layout), strict=True):
            for offset, keys in chunks:
                self.keys.add(path, keys, offset + np.arange(keys.num_rows))
        gone = [str(data.location()) for data in java_items(snapshot.removedDataFiles(io))]
        if str(snapshot.operation()) == "replace":
            # a rewrite leaves the table's rows as they were (Iceberg's spec): the live rows of the files it removed
            # are in those it added, just indexed (their keys moved there), and the deletes it writes, merged ones
            # above all, name rows already gone; looking for either would pass over the whole index
            retired += gone
            return
        removed += gone
        for delete in java_items(snapshot.addedDeleteFiles(io)):
            if str(delete.content()) != "POSITION_DELETES":
                raise _CannotFollow(f"snapshot {snapshot.snapshotId()} added equality deletes")
            for path, positions in files.read_position_deletes(str(delete.location())).items():
                dropped[path].append(positions)

    def key_fields(self) -> list[pa.Field]:
        return [self.layout.field(name) for name in self.key_names]

    # -- a batch ---------------------------------------------------------------------------------------------
    def committed(self, snapshot_id: int, deleted: Located | None, written: list[tuple[str, pa.Table, Any]]
                  ) -> None:
        """pgcdc's own commit landed as ``snapshot_id``: the ``deleted`` entries are gone, and each data file it
        wrote — (location, its rows' keys in file order, its ``DataFile``) — holds its rows at their positions.
        (Called within :meth:`following`.)"""
        if deleted is not None:
            self.keys.forget(deleted)
        for path, rows, data_file in written:
            self.add_file(path, rows, data_file)
        self.snapshot_id = snapshot_id

    def add_file(self, path: str, rows: pa.Table, data_file: Any, positions: np.ndarray | None = None) -> None:
        """The rows of a data file pgcdc wrote (at ``positions``, default 0..n-1)."""
        if self.partitions is not None and data_file is not None:
            self.partitions[path] = (int(data_file.specId()), data_file.partition())
        if rows.num_rows:
            self.keys.add(path, rows.select(self.key_names), positions)

    def drop_file(self, path: str) -> None:
        """A data file pgcdc's own commit removed, folded into its new one: its live rows were added there first,
        the others forgotten."""
        self.keys.retire_files([path])
        self._forget_partitions([path])

    def replaced(self, snapshot_id: int, written: list[tuple[str, pa.Table, Any]]) -> None:
        """pgcdc's own commit replaced every row (a TRUNCATE): the index holds the new files' rows only."""
        self.keys.close()
        self.keys = self._new_keys()
        if self.partitions is not None:
            self.partitions.clear()
        self.committed(snapshot_id, None, written)

    def partitions_of(self, paths: Iterator[str] | list[str]) -> dict[str, tuple[int, Any]] | None:
        """The spec id and partition of each of these data files (None: the table was never partitioned)."""
        if self.partitions is None:
            return None
        return {path: self.partitions[path] for path in paths if path in self.partitions}

    def _forget_partitions(self, paths: list[str]) -> None:
        if self.partitions is not None:
            for path in paths:
                self.partitions.pop(path, None)

    def _planned(self, table: Any, snapshot: Any) -> list[tuple[str, list[Any]]]:
        """(data file, the delete files applying to it) of a snapshot, in the order Iceberg plans them; each
        file's partition noted (of a table ever partitioned)."""
        tasks = table.newScan().useSnapshot(snapshot.snapshotId()).planFiles()
        try:
            planned = []
            for task in java_items(tasks):
                file = task.file()
                path = str(file.location())
                if self.partitions is not None:
                    self.partitions[path] = (int(file.specId()), file.partition())
                planned.append((path, java_items(task.deletes())))
            return planned
        finally:
            tasks.close()


class _CannotFollow(Exception):
    pass


class DeleteFiles:
    """The delete files of a build (or of a compaction, :mod:`pgcdc.mirrors.small_compaction`), each read once:
    which rows of a data file they leave. ``index``: whose key equality deletes are matched on (None: a reader of
    position deletes alone)."""

    def __init__(self, index: MirrorIndex | None, files: FileReader) -> None:
        self._index = index
        self._files = files
        self._positions: dict[str, dict[str, np.ndarray]] = {}
        self._equality: dict[str, np.ndarray] = {}  # the codes of each equality delete file's rows

    def surviving(self, path: str, keys: pa.Table, deletes: list[Any], offset: int = 0) -> np.ndarray | None:
        """A mask of the rows of the data file at ``path`` (its ``keys``: the rows from position ``offset`` on) that
        ``deletes`` leave (None: all)."""
        if not deletes:
            return None
        keep = np.ones(keys.num_rows, dtype=bool)
        for delete in deletes:
            location = str(delete.location())
            if str(delete.content()) == "POSITION_DELETES":
                if location not in self._positions:
                    self._positions[location] = self._files.read_position_deletes(location)
                positions = self._positions[location].get(path)
                if positions is not None:
                    positions = positions - offset
                    keep[positions[(positions >= 0) & (positions < len(keep))]] = False
            else:
                keep &= ~self._equality_matches(delete, keys)
        return keep

    def positions_in(self, path: str, deletes: list[Any]) -> np.ndarray:
        """The positions of the data file at ``path`` that the position-delete files ``deletes`` remove."""
        found = [np.empty(0, np.int64)]
        for delete in deletes:
            location = str(delete.location())
            if str(delete.content()) != "POSITION_DELETES":
                raise Unindexable(f"an equality delete file ({location})")
            if location not in self._positions:
                self._positions[location] = self._files.read_position_deletes(location)
            positions = self._positions[location].get(path)
            if positions is not None:
                found.append(positions)
        return np.concatenate(found)

    def _equality_matches(self, delete: Any, keys: pa.Table) -> np.ndarray:
        """Which rows of ``keys`` an equality delete file removes (its columns must be the index's key): equal on
        every column, NULL matching NULL, as Iceberg applies them — by their 128-bit codes."""
        location = str(delete.location())
        if self._index is None:
            raise Unindexable(f"an equality delete file ({location}) where position deletes alone were expected")
        ids = sorted(int(i) for i in delete.equalityFieldIds())
        if ids != sorted(_field_id(f) for f in self._index.key_fields()):
            raise Unindexable(f"an equality delete file on other columns than its key ({location})")
        coder = KeyCoder.for_schema(keys.schema, integer_allowed=False)
        if location not in self._equality:
            deleted = self._files.read_columns(location, self._index.key_fields(), self._index.layout)
            self._equality[location] = np.unique(_code_pairs(coder.codes(deleted)))
        return np.isin(_code_pairs(coder.codes(keys)), self._equality[location])


def _code_pairs(codes: Codes) -> np.ndarray:
    """Hash-form codes as one array of (h1, h2) pairs, comparable as wholes."""
    h1, h2 = codes
    pairs = np.empty(len(h1), dtype=[("h1", np.uint64), ("h2", np.uint64)])
    pairs["h1"], pairs["h2"] = h1, h2
    return pairs


def _field_id(field: pa.Field) -> int:
    return int(field.metadata[b"PARQUET:field_id"])


def _ever_partitioned(table: Any) -> bool:
    """Whether any spec of the table partitions it: then its files' partitions must be known to delete from them.
    A table of one spec is asked of it alone (two calls into the JVM, where walking the specs took a dozen)."""
    if int(table.specs().size()) == 1:
        return bool(table.spec().isPartitioned())
    return any(bool(spec.isPartitioned()) for spec in table.specs().values())


def _snapshots_after(table: Any, current: Any, indexed: int | None) -> list[Any] | None:
    """The snapshots from the one after ``indexed`` to ``current``, oldest first; None when ``indexed`` is not an
    ancestor of ``current`` (expired, or a rollback)."""
    found = []
    snapshot = current
    while snapshot is not None and (indexed is None or int(snapshot.snapshotId()) != indexed):
        found.append(snapshot)
        parent = snapshot.parentId()
        snapshot = table.snapshot(parent) if parent is not None else None
    if indexed is not None and snapshot is None:
        return None
    return list(reversed(found))


READ_AHEAD = 8  # data files read at once while an index is built or follows someone else's commits ...
CHUNK_ROWS = 1 << 22  # ... whole up to this many rows; a larger file's keys are read this many at a time


def _stored_names(parquet: Any, fields: list[pa.Field]) -> list[str | None]:
    """The name each of ``fields`` has in this Parquet file, by field id (None: the file predates it)."""
    by_id = {int(f.metadata[b"PARQUET:field_id"]): f.name
             for f in parquet.schema_arrow if f.metadata and b"PARQUET:field_id" in f.metadata}
    return [by_id.get(_field_id(field)) for field in fields]


def _shaped(table: pa.Table, wanted: list[str | None], fields: list[pa.Field], count: int) -> pa.Table:
    """Columns read in their stored types now: a column a file predates is NULL, one widened since is cast."""
    columns = [table.column(name).cast(field.type) if name is not None else pa.nulls(count, field.type)
               for name, field in zip(wanted, fields, strict=True)]
    return pa.Table.from_arrays(columns, schema=pa.schema(fields))


class FileReader:
    """Reads a mirror's Parquet files with Arrow, where this machine reaches them: a local or mounted directory, or
    S3 with the table's own Hadoop settings (:func:`pgcdc.spark.iceberg_java.s3_options`)."""

    def __init__(self, table: Any) -> None:
        from pgcdc.spark.iceberg_java import data_directory, s3_options

        self._filesystem = None
        directory = data_directory(table) or str(table.location())
        if local_path(directory) is None:
            options = s3_options(table, directory)
            if options is None:
                raise Unindexable(f"its files ({directory}) are out of this machine's reach")
            from pyarrow.fs import S3FileSystem

            self._filesystem = S3FileSystem(**options)

    def _open(self, location: str) -> Any:
        import pyarrow.parquet as pq

        if self._filesystem is None:
            local = local_path(location)
            if local is None:
                raise Unindexable(f"{location} is out of this machine's reach")
            return pq.ParquetFile(local)
        return pq.ParquetFile(object_path(location), filesystem=self._filesystem)

    def read_columns(self, location: str, fields: list[pa.Field], layout: pa.Schema,
                     rows: np.ndarray | None = None) -> pa.Table:
        """The columns of ``fields`` (by their field ids) of the Parquet file at ``location``, in their stored
        types now (a column a file predates is NULL; one widened since is cast); only ``rows`` when given."""
        return self._columns(self._open(location), fields, rows)

    @staticmethod
    def _columns(parquet: Any, fields: list[pa.Field], rows: np.ndarray | None = None) -> pa.Table:
        wanted = _stored_names(parquet, fields)
        present = [name for name in wanted if name is not None]
        if rows is None:
            table = parquet.read(columns=present) if present else pa.table({})
            return _shaped(table, wanted, fields, parquet.metadata.num_rows)
        rows = np.asarray(rows, np.int64)
        if not present:
            return _shaped(pa.table({}), wanted, fields, len(rows))
        # only the row groups holding those rows: a few rows of a file of 10^8 do not read all of it
        sizes = np.array([parquet.metadata.row_group(group).num_rows for group in range(parquet.num_row_groups)])
        ends = np.cumsum(sizes)
        starts = ends - sizes
        groups = np.unique(np.searchsorted(ends, rows, "right"))
        table = parquet.read_row_groups(groups.tolist(), columns=present)
        # a row's place among the groups read: its position less the rows of the groups skipped before it
        skipped = np.cumsum(starts[groups] - np.concatenate([[0], ends[groups][:-1]]))
        group_of = np.searchsorted(ends[groups], rows, "right")
        return _shaped(table.take(pa.array(rows - skipped[group_of])), wanted, fields, len(rows))

    @staticmethod
    def _chunks(parquet: Any, fields: list[pa.Field]) -> Iterator[tuple[int, pa.Table]]:
        """The columns of ``fields`` of the whole file as :meth:`read_columns` reads them, ``CHUNK_ROWS`` rows at a
        time: (position of the first, columns)."""
        wanted = _stored_names(parquet, fields)
        present = [name for name in wanted if name is not None]
        total, offset = parquet.metadata.num_rows, 0
        if not present:
            for offset in range(0, total, CHUNK_ROWS):
                yield offset, _shaped(pa.table({}), wanted, fields, min(CHUNK_ROWS, total - offset))
            return
        for batch in parquet.iter_batches(batch_size=CHUNK_ROWS, columns=present, use_threads=False):
            yield offset, _shaped(pa.Table.from_batches([batch]), wanted, fields, batch.num_rows)
            offset += batch.num_rows

    def read_each(self, locations: list[str], fields: list[pa.Field], layout: pa.Schema
                  ) -> Iterator[Iterator[tuple[int, pa.Table]]]:
        """For each of ``locations``, in their order, its columns in chunks (:meth:`_chunks`), with up to
        ``READ_AHEAD`` files read at once: each read mostly waits on storage (on S3, a few round trips per file;
        Arrow waits without holding the interpreter), so an index is built at the storage's parallelism rather
        than one file at a time. A file of at most ``CHUNK_ROWS`` rows is read ahead whole; a larger one is read
        chunk by chunk as its chunks are taken: at most ``READ_AHEAD + 1`` chunks' columns are held at once,
        whatever the files' sizes."""
        def ahead(location: str) -> Iterator[tuple[int, pa.Table]]:
            parquet = self._open(location)
            if parquet.metadata.num_rows > CHUNK_ROWS:
                return self._chunks(parquet, fields)  # read when its turn comes
            return iter([(0, self._columns(parquet, fields))])

        remaining = iter(locations)
        with ThreadPoolExecutor(max_workers=max(1, min(READ_AHEAD, len(locations))),
                                thread_name_prefix="pgcdc-index-read") as pool:
            reading = deque(pool.submit(ahead, location) for location in itertools.islice(remaining, READ_AHEAD))
            while reading:
                chunks = reading.popleft().result()
                following = next(remaining, None)
                if following is not None:
                    reading.append(pool.submit(ahead, following))
                yield chunks

    def read_position_deletes(self, location: str) -> dict[str, np.ndarray]:
        """A position-delete file's positions, per data file it names."""
        table = self._open(location).read(columns=["file_path", "pos"])
        grouped: dict[str, list[np.ndarray]] = defaultdict(list)
        for path in pc.unique(table.column("file_path")).to_pylist():
            selected = table.filter(pc.equal(table.column("file_path"), path))
            grouped[path].append(selected.column("pos").to_numpy())
        return {path: np.concatenate(parts) for path, parts in grouped.items()}


BYTES_PER_ROW = 24  # what an index is planned at per row before it is built (KeyIndex holds 16-24)
UNUSED_INDEX_SECONDS = 30 * 86400  # an index directory no start opened for this long is removed
MIN_OVERLAY_BYTES = 1 << 20  # what an index on disk holds in memory beside its run at the least ...
MAX_OVERLAY_BYTES = 256 << 20  # ... and at the most
HELD_SUM_SECONDS = 1.0  # how often at most the indexes' memory is summed to tell whether the budget is exceeded


class IndexBudget:
    """The memory the mirrors' key indexes may take together (None: no limit), and where the indexes that do not
    fit in it are kept on disk (``directory``, one directory per table uuid; default: the user's cache).

    A mirror's index is held in memory when it fits beside the others; otherwise it is kept on disk, holding in
    memory a share of what is left (a quarter of it, 1 to 256 MB): its fence, and the changes not yet written
    into its run. The mirrors of a batch are indexed on several threads at once: an index being built holds its
    room from the moment it is admitted, so two builds never both take the last of it."""

    def __init__(self, limit_bytes: int | None, directory: str | Path | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.directory = Path(directory) if directory is not None else default_index_directory()
        self._indexes: list[MirrorIndex] = []
        self._reserved = 0  # bytes promised to indexes being built
        self._lock = threading.Lock()
        self._pruned = False
        self._summed, self._summed_at = 0, float("-inf")  # the indexes' bytes as last summed (exceeded), and when

    def reserve(self, rows: int) -> int | None:
        """Room for an in-memory index of about ``rows`` rows beside the indexes built or being built: the bytes
        held for it until :meth:`add` or :meth:`cancel` (None: it does not fit)."""
        wanted = rows * BYTES_PER_ROW
        with self._lock:
            if self.limit_bytes is not None and (self.limit_bytes == 0 or  # 0: every index on disk
                                                 self._held() + self._reserved + wanted > self.limit_bytes):
                return None
            self._reserved += wanted
            return wanted

    def reserve_overlay(self) -> int:
        """The memory share of an index kept on disk (held until :meth:`add` or :meth:`cancel`)."""
        with self._lock:
            free = MAX_OVERLAY_BYTES * 4 if self.limit_bytes is None else \
                self.limit_bytes - self._held() - self._reserved
            share = max(MIN_OVERLAY_BYTES, min(MAX_OVERLAY_BYTES, free // 4))
            self._reserved += share
            return share

    def cancel(self, reserved: int) -> None:
        with self._lock:
            self._reserved -= reserved

    def held_bytes(self) -> int:
        with self._lock:
            return self._held()

    def _held(self) -> int:
        return sum(index.keys.memory_bytes for index in self._indexes)

    def exceeded(self) -> bool:
        """Whether the indexes, grown with their mirrors, take more than the limit together. Asked for every mirror
        of every batch, it sums them at most every ``HELD_SUM_SECONDS`` (a sum over hundreds of indexes per mirror
        made a batch's cost grow with the square of the mirrors); meanwhile an index grows by a batch at most."""
        if self.limit_bytes is None:
            return False
        now = time.monotonic()
        with self._lock:
            if now - self._summed_at >= HELD_SUM_SECONDS:
                self._summed, self._summed_at = self._held(), now
            return self._summed > self.limit_bytes

    def add(self, index: MirrorIndex, reserved: int = 0) -> None:
        with self._lock:
            self._reserved -= reserved
            self._indexes.append(index)
            self._summed_at = float("-inf")

    def release(self, index: MirrorIndex) -> None:
        with self._lock:
            self._indexes = [held for held in self._indexes if held is not index]
            self._summed_at = float("-inf")

    def directory_for(self, table: Any) -> IndexDirectory:
        """The directory of ``table``'s index, locked for this process (:class:`Unindexable` when another process
        holds it, or it cannot be made)."""
        path = self.directory / str(table.operations().current().uuid())
        with self._lock:
            first, self._pruned = not self._pruned, True
        if first:
            for removed in prune_unused(self.directory, older_than_seconds=UNUSED_INDEX_SECONDS):
                log.info("removed the key index %s: no mirror opened it for %d days", removed,
                         UNUSED_INDEX_SECONDS // 86400)
        try:
            return IndexDirectory(path)
        except IndexInUse as exc:
            raise Unindexable(f"its index directory {exc}") from None
        except OSError as exc:
            raise Unindexable(f"its index cannot be kept in {path} ({exc.strerror}); choose --index-dir") from None

    def close(self, *, save: bool) -> None:
        """Every index freed; those on disk saved first when ``save`` (a clean stop), so a restart reads nothing."""
        with self._lock:
            indexes, self._indexes = self._indexes, []
        for index in indexes:
            try:
                index.close(save=save)
            except Exception as exc:  # a stop goes on: the index is built again, or caught up, at the next start
                log.warning("could not save the key index of %s: %s", ", ".join(index.key_names), exc)


def index_for(mirror_index: MirrorIndex | None, table: Any, key_names: list[str], layout: pa.Schema, *,
              multiset: bool, budget: IndexBudget | None, state: TableState | None = None) -> MirrorIndex:
    """The mirror's index, brought up to ``table``'s current snapshot (``state``: what its refresh read, when the
    caller has it): in memory when it fits the budget, else on disk (opened from what was saved, or built). Raises
    :class:`Unindexable` when its files are out of reach."""
    if mirror_index is not None and not mirror_index.consistent:  # a failure left it half-way: never trusted
        if budget is not None:
            budget.release(mirror_index)
        mirror_index.close(save=False)
        mirror_index = None
    if mirror_index is None:
        snapshot = table.currentSnapshot()
        rows = 0 if snapshot is None else int(snapshot.summary().getOrDefault("total-records", "0"))
        reserved = budget.reserve(rows) if budget is not None else 0
        if reserved is None:
            assert budget is not None
            return _index_on_disk(table, key_names, layout, multiset=multiset, budget=budget)
        mirror_index = MirrorIndex(key_names, layout, multiset=multiset)
        try:
            mirror_index.files = FileReader(table)
            mirror_index.build(table, mirror_index.files)
        except BaseException:
            if budget is not None:
                budget.cancel(reserved)
            raise
        if budget is not None:
            budget.add(mirror_index, reserved)
        return mirror_index
    mirror_index.refresh(table, mirror_index.files, state=state)
    if budget is not None and mirror_index.disk is None and budget.exceeded():
        # the mirror grew: its index moves to disk, within a share of memory
        log.info("%s: the key indexes grew to %d MB with their mirrors, past the %d MB they may take "
                 "(--index-memory-mb): its index moves to disk", table.name(), budget.held_bytes() >> 20,
                 (budget.limit_bytes or 0) >> 20)
        budget.release(mirror_index)
        mirror_index.close(save=False)
        return _index_on_disk(table, key_names, layout, multiset=multiset, budget=budget, files=mirror_index.files)
    return mirror_index


def _index_on_disk(table: Any, key_names: list[str], layout: pa.Schema, *, multiset: bool, budget: IndexBudget,
                   files: FileReader | None = None) -> MirrorIndex:
    """The mirror's index kept on disk, holding a share of the budget's memory: opened from what was saved and
    caught up with the table, or built."""
    disk = budget.directory_for(table)
    reserved = budget.reserve_overlay()
    index = MirrorIndex(key_names, layout, multiset=multiset, disk=disk, overlay_bytes=reserved)
    try:
        index.files = files if files is not None else FileReader(table)
        if not index.open_saved(table, index.files):
            index.build(table, index.files)
    except BaseException:
        budget.cancel(reserved)
        index.close(save=False)
        raise
    budget.add(index, reserved)
    log.info("%s: its index is kept on disk in %s (%d MB of memory beside it)", table.name(), disk.path,
             reserved >> 20)
    return index
