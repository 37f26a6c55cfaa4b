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
from pgcdc.spark.iceberg_java import (
    commit_in_transaction,
    data_file,
    footer_metrics,
    iceberg_classes,
    steps_where_cheapest,
)
from pgcdc.spark.table_writer import TableWriter, Written

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
    """One mirror as the row-delta writer sees it for one batch: the Iceberg table as it stands now (its schema
    and field ids read fresh, so a schema change between batches is followed), and its Parquet layout."""

    def __init__(self, spark: SparkSession, table: Any) -> None:
        """``table``: the mirror's ``org.apache.iceberg.Table``, loaded or refreshed for this batch."""
        super().__init__(spark, table)
        self.start_snapshot = self.table.currentSnapshot()

    def unwritable(self, key_columns: list[str]) -> str | None:
        """Why the row-delta writer cannot write this mirror (the MERGE writer does), or None when it can.
        ``key_columns``: the columns its equality deletes would name (every column of a table without a key;
        none when it deletes by position)."""
        if self.partition_problem is not None:
            return self.partition_problem
        if self.partitioned and key_columns:
            return "it is partitioned, and deletes by equality (deleting by position, the default, writes it)"
        if int(self.table.operations().current().formatVersion()) < 2:
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
            # one transaction: the snapshot and the table properties land in one metadata file, or neither
            transaction = self.table.newTransaction()
            classes = iceberg_classes()
            if replace_all:
                operation = transaction.newOverwrite().overwriteByRowFilter(classes.always_true)
                for file in added:
                    operation = operation.addFile(file.data_file)
            else:
                operation = transaction.newRowDelta()
                start = validate_from if validate_from is not None else (
                    None if self.start_snapshot is None else int(self.start_snapshot.snapshotId()))
                if start is not None:
                    # conflicts are checked from the state the batch was built on: equality deletes need no data
                    # file of it to survive (a compaction meanwhile is no conflict); position deletes need every
                    # data file they name, and a commit that removed one makes this one fail, to be resolved again
                    operation = operation.validateFromSnapshot(start)
                if isinstance(deletes, PositionDeletes) and deletes.files:
                    referenced = classes.ArrayList()
                    for path in deletes.files:
                        referenced.add(path)
                    operation = operation.validateDataFilesExist(referenced).validateDeletedFiles()
                if removed or removed_deletes:
                    # the rows of a removed file are rewritten here: no data file nor delete file may have been
                    # added since (a delete of its rows would come back), and every file it removes must still be
                    # live: someone's compaction (a replace, which Iceberg does not count among added data) may
                    # have rewritten it, and its rows would count twice
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
            # a truncate's overwrite removes every file, as replace_with_files's does
            operation = steps_where_cheapest(operation, self.table, self.start_snapshot,
                                             removes_files=replace_all or bool(removed) or bool(removed_deletes))
            commit_in_transaction(transaction, operation, properties, table_properties)
            # the transaction's own view names the snapshot it committed, wherever the table has moved on since
            snapshot = transaction.table().currentSnapshot()
            parent = snapshot.parentId()
            clock.lap("commit")
            # folding carries one data file and one position-delete file to the next commit
            single = added[0] if len(added) == 1 and not self.partitioned else None
            delete_file = delete_files[0] if len(delete_files) == 1 and isinstance(deletes, PositionDeletes) \
                and not self.partitioned else None
            return Committed(int(snapshot.snapshotId()), None if parent is None else int(parent),
                             None if single is None else single.path, None if single is None else single.data_file,
                             delete_file, tuple(added))

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
        metrics_config = classes.metrics_for_position_deletes(self.table)
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
