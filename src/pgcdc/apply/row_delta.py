"""The row-delta writer (the default): a batch's rows written as an Iceberg data file and a delete file by
Arrow, committed by Iceberg's Java API in one commit that carries ``pgcdc.lsn`` — no Spark query per batch.

:mod:`pgcdc.apply.reduce` decides what a batch means (the last change per key, unchanged TOAST values, key
changes, TRUNCATE); this module makes it durable:

- the new row images go to one Parquet data file, and the rows they replace or remove to one Parquet delete
  file: by default a position-delete file naming each row by data file and position (from the mirror's key
  index, :mod:`pgcdc.index`), or with ``--deletes equality`` an equality-delete file on the key's field ids
  (Iceberg format v2); both in the mirror's layout (field ids, Iceberg's stored types, codec), at paths the
  table's location provider gives, through the table's FileIO (Arrow writes a local warehouse's files
  directly);
- one ``RowDelta`` adds both (folding in the small files of pgcdc's commit before: :mod:`.fold`). Its position
  deletes name rows of older files only, and an equality delete applies only to data files of a *lower* data
  sequence number, so a row written in the same commit as the delete of its key survives it, while every older
  row with that key is gone;
- a batch that begins by emptying the mirror (TRUNCATE) is one overwrite of every row by the new file;
- a partitioned mirror gets a data file per partition its rows fall in (:mod:`pgcdc.iceberg.partition_values`), and a
  position-delete file per partition of the data files its deletes name, each labelled with its partition (and
  its spec: a file written before the user evolved the spec keeps its own).

A commit that loses a race with another writer (a maintenance commit) is retried by Iceberg on the new
table state with the same files; the position is in the same commit, so it lands once or not at all. The
files of a commit that failed for sure are deleted; when the outcome is unknown they are left (they may be
part of the table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pgcdc.apply.steps import StepClock
from pgcdc.faults import injection_point
from pgcdc.spark import iceberg_java
from pgcdc.spark.iceberg_java import (
    TableState,
    commit_in_transaction,
    data_file,
    footer_metrics,
    holds_equality_deletes,
    iceberg_classes,
    steps_where_cheapest,
)
from pgcdc.spark.table_writer import Layout, TableWriter, Written

if TYPE_CHECKING:
    from collections.abc import Mapping

    from pyspark.sql import SparkSession


# a position-delete file's columns and their reserved field ids (the Iceberg spec)
POSITION_DELETE_SCHEMA = pa.schema([
    pa.field("file_path", pa.string(), nullable=False, metadata={b"PARQUET:field_id": b"2147483546"}),
    pa.field("pos", pa.int64(), nullable=False, metadata={b"PARQUET:field_id": b"2147483545"}),
])


@dataclass(frozen=True)
class PositionDeletes:
    """Rows removed by their place: per data file (its location exactly as the table's manifests hold it, which
    is how readers match them), the positions of its rows that go. ``partitions``: of a table with a partitioned
    spec (now or before), each data file's spec id and partition (a Java ``StructLike``), which its deletes share."""

    files: dict[str, np.ndarray]
    partitions: Mapping[str, tuple[int, Any]] | None = None


@dataclass(frozen=True)
class Committed:
    """A commit that landed: its snapshot and that snapshot's parent (another writer's, when Iceberg retried the
    commit on top of a commit made meanwhile), the data files it added, and — when it wrote one data file and one
    position-delete file, which is what folding carries to the next commit — that data file's location and
    ``DataFile`` and the delete file's ``DeleteFile``."""

    snapshot_id: int
    parent_id: int | None
    data_path: str | None
    data_file: Any = None
    delete_file: Any = None
    written: tuple[Written, ...] = ()


class RowDeltaWriter(TableWriter):
    """One mirror as the row-delta writer sees it for one batch: the Iceberg table as it stands now, and its Parquet
    layout (kept from the batch before while the table's shape is the same: a schema change is followed)."""

    def __init__(self, spark: SparkSession, table: Any, known: Layout | None = None,
                 state: TableState | None = None) -> None:
        """``table``: the mirror's ``org.apache.iceberg.Table``, loaded or refreshed for this batch; ``known``: its
        layout as the last batch read it; ``state``: what its refresh read
        (:func:`~pgcdc.spark.iceberg_java.refreshed_state`), else it is asked of the table."""
        super().__init__(spark, table, known, None if state is None else state.shape)
        self.state = state
        if state is None:
            self._start_snapshot = self.table.currentSnapshot()
            self.start_snapshot_id = None if self._start_snapshot is None else int(self._start_snapshot.snapshotId())
            self.equality_deletes = holds_equality_deletes(self._start_snapshot)
        else:
            self._start_snapshot = None
            self.start_snapshot_id = state.snapshot_id
            self.equality_deletes = state.equality_deletes

    @property
    def start_snapshot(self) -> Any:
        """The table's snapshot this writer started from (Iceberg's ``Snapshot``; None: the table has none), asked
        of the JVM when first needed."""
        if self._start_snapshot is None and self.start_snapshot_id is not None:
            self._start_snapshot = self.table.snapshot(self.start_snapshot_id)
        return self._start_snapshot

    def _steps_in_calling_thread(self, removes_files: bool) -> bool:
        """Whether the commit runs its steps in the calling thread (``steps_where_cheapest``): by the manifests the
        refresh counted, when it read the table's state."""
        if self.state is None:
            return iceberg_java.steps_in_calling_thread(self.table, self.start_snapshot, removes_files)
        return iceberg_java.steps_in_calling_thread(self.table, self.state.snapshot_id, removes_files,
                                                    manifests=self.state.manifests)

    def unwritable(self, key_columns: list[str]) -> str | None:
        """Why the row-delta writer cannot write this mirror (the MERGE writer does), or None when it can.
        ``key_columns``: the columns its equality deletes would name (every column of a table without a key;
        none when it deletes by position)."""
        if self.partition_problem is not None:
            return self.partition_problem
        if self.partitioned and key_columns:
            return "it is partitioned, and deletes by equality (deleting by position, the default, writes it)"
        if self.layout.format_version < 2:
            return "it is an Iceberg format-version 1 table, which has no delete files"
        if self.layout_problem is not None:
            return self.layout_problem
        nested = [name for name in key_columns if pa.types.is_nested(self.schema.field(name).type)]
        if nested:
            return f"rows are matched on {', '.join(nested)}, which equality deletes cannot name (nested types)"
        return None

    def field_ids(self, names: list[str]) -> list[int]:
        return [int(self.schema.field(name).metadata[b"PARQUET:field_id"]) for name in names]

    def commit(self, rows: pa.Table | None, deletes: pa.Table | PositionDeletes | None,
               properties: Mapping[str, str], *, table_properties: Mapping[str, str] | None = None,
               replace_all: bool = False, validate_from: int | None = None, removed: Sequence[Any] = (),
               removed_deletes: Sequence[Any] = (), clock: StepClock | None = None) -> Committed:
        """One commit: ``rows`` added, and removed either every older row equal to a row of ``deletes`` (an Arrow
        table: equality deletes on its columns) or the rows at ``deletes``' positions (:class:`PositionDeletes`)
        — or, with ``replace_all``, every row of the table replaced by ``rows`` — ``properties`` in its snapshot
        summary and ``table_properties`` set on the table, all in one metadata commit. Concurrent commits are
        validated from ``validate_from`` (default: the snapshot this writer loaded): for position deletes, the
        snapshot their positions were read from, and every data file they name must still be live. ``removed``
        and ``removed_deletes`` (Iceberg ``DataFile``/``DeleteFile`` objects) leave the table in the same commit
        (apply/fold.py): no data or delete file may have been added since ``validate_from``.
        ``clock`` times the files and the commit."""
        clock = clock or StepClock()
        with self.committing("the commit's") as written:
            injection_point("apply.delta-write")
            added = self.data_files(rows, written) if rows is not None and rows.num_rows else []
            clock.lap("data file")
            injection_point("apply.delta-deletes")
            delete_files = [] if replace_all else self._delete_files(deletes, written)
            clock.lap("delete file")
            injection_point("apply.delta-commit")
            start = validate_from if validate_from is not None else self.start_snapshot_id
            referenced = list(deletes.files) if isinstance(deletes, PositionDeletes) else []
            if replace_all:
                snapshot_id, parent = self._replace_all(added, properties, table_properties)
            elif iceberg_classes().commits is not None:  # one call into the JVM
                snapshot_id, parent, added, delete_files = self._row_delta_in_jvm(
                    start, referenced, added, delete_files, removed, removed_deletes, properties, table_properties,
                    read_back=isinstance(deletes, PositionDeletes) and not self.partitioned)
            else:
                snapshot_id, parent = self._row_delta(start, referenced, added, delete_files, removed,
                                                      removed_deletes, properties, table_properties)
            clock.lap("commit")
            # folding carries one data file and one position-delete file to the next commit
            single = added[0] if len(added) == 1 and not self.partitioned else None
            delete_file = delete_files[0] if len(delete_files) == 1 and isinstance(deletes, PositionDeletes) \
                and not self.partitioned else None
            return Committed(snapshot_id, parent, None if single is None else single.path,
                             None if single is None else single.data_file, delete_file, tuple(added))

    def _replace_all(self, added: list[Written], summary: Mapping[str, str],
                     table_properties: Mapping[str, str] | None) -> tuple[int, int | None]:
        """Every row of the table replaced by ``added`` (a batch that begins with TRUNCATE), in one transaction."""
        transaction = self.table.newTransaction()
        operation = transaction.newOverwrite().overwriteByRowFilter(iceberg_classes().always_true)
        for file in added:
            operation = operation.addFile(file.data_file)
        # a truncate's overwrite removes every file
        operation = steps_where_cheapest(operation, self.table, self.start_snapshot, removes_files=True)
        commit_in_transaction(transaction, operation, summary, table_properties)
        return _committed(transaction)

    def _row_delta_in_jvm(self, start: int | None, referenced: list[str], added: list[Written],
                          delete_files: list[Any], removed: Sequence[Any], removed_deletes: Sequence[Any],
                          summary: Mapping[str, str], table_properties: Mapping[str, str] | None, *,
                          read_back: bool) -> tuple[int, int | None, list[Written], list[Any]]:
        """:meth:`_row_delta`'s commit made by ``pgcdc.iceberg.Commits`` in one call. With ``read_back``, a single
        data file and delete file come back as read from the snapshot's manifests, each knowing the manifest that
        lists it: the next batch's fold, which removes them, then reads that manifest alone, not every manifest of
        the table."""
        read_back = read_back and len(added) == 1 and len(delete_files) <= 1
        committed = iceberg_classes().commits.rowDelta(
            self.table, -1 if start is None else start, _joined(referenced),
            _one_or_list([file.data_file for file in added]), _one_or_list(delete_files), _one_or_list(removed),
            _one_or_list(removed_deletes), _joined(_flat(summary)), _joined(_flat(table_properties or {})),
            self._steps_in_calling_thread(bool(removed) or bool(removed_deletes)), read_back)
        snapshot_id, parent = (int(part) for part in str(committed.ids()).split())
        if read_back:
            data_file = committed.dataFile()
            if data_file is not None:
                added = [Written(added[0].path, data_file, added[0].rows)]
            delete_file = committed.deleteFile() if delete_files else None
            if delete_file is not None:
                delete_files = [delete_file]
        return snapshot_id, None if parent == -1 else parent, added, delete_files

    def _row_delta(self, start: int | None, referenced: list[str], added: list[Written], delete_files: list[Any],
                   removed: Sequence[Any], removed_deletes: Sequence[Any], summary: Mapping[str, str],
                   table_properties: Mapping[str, str] | None) -> tuple[int, int | None]:
        """One row delta in one transaction: the snapshot and the table properties land in one metadata file, or
        neither does."""
        classes = iceberg_classes()
        transaction = self.table.newTransaction()
        operation = transaction.newRowDelta()
        if start is not None:
            # conflicts are checked from the state the batch was built on: equality deletes need no data file of it
            # to survive (a compaction meanwhile is no conflict); position deletes need every data file they name,
            # and a commit that removed one makes this one fail, to be resolved again
            operation = operation.validateFromSnapshot(start)
        if referenced:
            names = classes.ArrayList()
            for path in referenced:
                names.add(path)
            operation = operation.validateDataFilesExist(names).validateDeletedFiles()
        if removed or removed_deletes:
            # the rows of a removed file are rewritten here: no data file nor delete file may have been added since
            # (a delete of its rows would come back), and every file it removes must still be live: someone's
            # compaction (a replace, which Iceberg does not count among added data) may have rewritten it, and its
            # rows would count twice
            operation = (operation.validateNoConflictingDataFiles().validateNoConflictingDeleteFiles()
                         .validateDeletedFiles())
        for old in removed:
            operation = operation.removeRows(old)
        for old in removed_deletes:
            operation = operation.removeDeletes(old)
        for file in added:
            operation = operation.addRows(file.data_file)
        for delete_file in delete_files:
            operation = operation.addDeletes(delete_file)
        operation = steps_where_cheapest(operation, self.table, self.start_snapshot,
                                         removes_files=bool(removed) or bool(removed_deletes))
        commit_in_transaction(transaction, operation, summary, table_properties)
        return _committed(transaction)

    def _delete_files(self, deletes: pa.Table | PositionDeletes | None, written: list[str]) -> list[Any]:
        """The delete files of ``deletes`` (none: nothing to delete): equality deletes on the table's columns, or
        position deletes (``file_path``, ``pos`` sorted, as the spec asks), their metrics from the footer — one
        file per spec and partition of the data files they name."""
        if isinstance(deletes, PositionDeletes):
            if not deletes.files:
                return []
            if deletes.partitions is None:
                return [self._position_delete_file(deletes.files, self.spec, None, written)]
            return [self._position_delete_file(files, self.table.specs().get(spec_id), partition, written)
                    for spec_id, partition, files in _by_partition(deletes)]
        if deletes is None or not deletes.num_rows:
            return []
        names = deletes.column_names
        key_schema = pa.schema([self.schema.field(name) for name in names])
        path, size, footer = self.write(deletes, key_schema, written)
        return [data_file(self.spark, self.table, path, size, footer, equality_ids=self.field_ids(names))]

    def _position_delete_file(self, files: Mapping[str, np.ndarray], spec: Any, partition: Any,
                              written: list[str]) -> Any:
        classes = iceberg_classes()
        paths = sorted(files)
        positions = [np.sort(files[path]) for path in paths]
        rows = pa.Table.from_arrays(
            [pa.array(np.repeat(np.array(paths, dtype=object), [len(p) for p in positions]), pa.string()),
             pa.array(np.concatenate(positions), pa.int64())], schema=POSITION_DELETE_SCHEMA)
        path, size, footer = self.write(rows, POSITION_DELETE_SCHEMA, written, partition=partition, spec=spec)
        metrics_config = self.layout.position_metrics
        # (readers that match delete files to data files by their referenced data file go straight to the one)
        referenced = paths[0] if len(paths) == 1 else None
        if classes.files is not None:  # one call into the JVM, not a round trip per step of the builder
            return classes.files.positionDeletes(spec, partition, path, size, bytearray(footer), metrics_config,
                                                 referenced)
        metrics = footer_metrics(footer, metrics_config)
        builder = (classes.delete_file_builder(spec).ofPositionDeletes()
                   .withPath(path).withFormat(classes.PARQUET).withFileSizeInBytes(size)
                   .withMetrics(metrics))
        if partition is not None:
            builder = builder.withPartition(partition)
        if referenced is not None:
            builder = builder.withReferencedDataFile(referenced)
        return builder.build()

def _by_partition(deletes: PositionDeletes) -> list[tuple[int, Any, dict[str, np.ndarray]]]:
    """The files of ``deletes`` grouped by their data files' spec and partition (Java's ``equals``, within a
    bucket of its ``hashCode``: one round trip a file, not one a pair)."""
    assert deletes.partitions is not None
    groups: list[tuple[int, Any, dict[str, np.ndarray]]] = []
    by_hash: dict[tuple[int, int], list[int]] = {}
    for path, positions in deletes.files.items():
        held = deletes.partitions.get(path)
        if held is None:
            raise KeyError(f"the partition of {path}, a data file its deletes name, is not known")
        spec_id, partition = held
        bucket = by_hash.setdefault((spec_id, 0 if partition is None else int(partition.hashCode())), [])
        for index in bucket:  # one spec's files all have a partition, or none does
            if partition is None or groups[index][1].equals(partition):
                groups[index][2][path] = positions
                break
        else:
            bucket.append(len(groups))
            groups.append((spec_id, partition, {path: positions}))
    return groups


def _committed(transaction: Any) -> tuple[int, int | None]:
    """The snapshot a committed transaction made, and its parent: the transaction's own view names it, wherever the
    table has moved on since."""
    snapshot = transaction.table().currentSnapshot()
    parent = snapshot.parentId()
    return int(snapshot.snapshotId()), None if parent is None else int(parent)


def _one_or_list(files: Sequence[Any]) -> Any:
    """Files as ``pgcdc.iceberg.Commits`` takes them: None, the one file, or a list (which py4j converts with a round
    trip a file)."""
    return None if not files else files[0] if len(files) == 1 else list(files)


def _flat(entries: Mapping[str, str]) -> list[str]:
    return [str(part) for key, value in entries.items() for part in (key, value)]


def _joined(parts: list[str]) -> str | None:
    """``parts`` as one string for ``pgcdc.iceberg.Commits``: each followed by NUL (None: no parts)."""
    if not parts:
        return None
    if any("\0" in part for part in parts):
        raise ValueError("a path or property of a commit holds a NUL character")
    return "".join(part + "\0" for part in parts)
