"""The compaction of a small table in pgcdc's own process: its live rows read with Arrow and written back as one
data file (one per partition), in one Iceberg rewrite that also drops every delete file — no Spark job.

Spark's ``rewrite_data_files`` plans jobs, starts tasks and reads through Spark's readers: seconds for a table of
a few hundred rows in a JVM started minutes ago, paid on the apply thread between two batches
(:mod:`pgcdc.mirrors.maintenance`), where a schema of hundreds of small mirrors made it the main cause of lag. A
small table is read and rewritten here in milliseconds:

- **What is read.** The data files Iceberg plans for the current snapshot, with the delete files that apply to
  each (Iceberg's own sequence-number rules), every column by field id in its stored type now (a column a file
  predates is NULL, one widened since is cast): the rows the position deletes remove are left out.
- **What is committed.** One ``RewriteFiles``, validated from the snapshot read: it removes every live data file
  and every live delete file (the deletes all applied to files it removes) and adds the new files, carrying the
  table's position in its summary. A delete committed meanwhile to a file it removes, or a file removed
  meanwhile, makes Iceberg refuse it: nothing changed, and the compaction is due again at the next look.
- **What it leaves to Spark.** A table above ``SMALL_ROWS`` rows or ``SMALL_BYTES`` of data files, one holding
  equality deletes (a row they delete would come back in a file newer than they are) or deletion vectors, and one
  whose files Arrow cannot read or write (:class:`pgcdc.spark.table_writer.TableWriter`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pgcdc.errors import Unindexable
from pgcdc.faults import injection_point
from pgcdc.index.mirror_index import DeleteFiles, FileReader
from pgcdc.spark.iceberg_java import (
    holds_equality_deletes,
    java_items,
    live_files,
    steps_where_cheapest,
)
from pgcdc.spark.table_writer import TableWriter

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("pgcdc.mirrors.small_compaction")

# A table this small (its live rows, and its data files' bytes) is compacted in the driver: its rows held in
# memory at once are a few tens of MB at most, and read and written in well under a second.
SMALL_ROWS = 500_000
SMALL_BYTES = 32 << 20


def compact_small_table(spark: SparkSession, table: Any, carried: Mapping[str, str]) -> int | None:
    """Rewrite ``table``'s live rows into one data file per partition, dropping every delete file, in one commit
    carrying ``carried``; returns the data files rewritten (0: nothing to gain), or None when Spark's compaction
    must do it (see the module). A commit conflict is raised, as Spark's action raises it."""
    snapshot = table.currentSnapshot()
    if snapshot is None or holds_equality_deletes(snapshot):
        return None if snapshot is not None else 0
    writer = TableWriter(spark, table)
    if writer.arrow_problem() is not None:
        return None
    try:
        files = FileReader(table)
    except Unindexable:
        return None
    planned = _planned(table, snapshot)
    live_deletes = live_files(table, snapshot, "deletes")
    if any(str(delete.format()) != "PARQUET" or str(delete.content()) != "POSITION_DELETES"
           for delete in live_deletes):
        return None  # deletion vectors or equality deletes: Spark's readers apply them
    if len(planned) <= 1 and not live_deletes:
        return 0
    fields = list(writer.schema)
    surviving = DeleteFiles(None, files)  # each delete file read once
    pieces = []
    for data, deletes in planned:
        path = str(data.location())
        rows = files.read_columns(path, fields, writer.schema)
        keep = surviving.surviving(path, rows, deletes)
        pieces.append(rows if keep is None else rows.filter(pa.array(keep)))
    rows = pa.concat_tables(pieces) if pieces else pa.Table.from_batches([], writer.schema)
    with writer.committing("the compaction's") as written:
        added = writer.data_files(rows, written) if rows.num_rows else []
        injection_point("maintain.small-commit")
        rewrite = table.newRewrite().validateFromSnapshot(snapshot.snapshotId())
        for data, _ in planned:
            rewrite = rewrite.deleteFile(data)
        for delete in live_deletes:
            rewrite = rewrite.deleteFile(delete)
        for file in added:
            rewrite = rewrite.addFile(file.data_file)
        for key, value in carried.items():
            rewrite = rewrite.set(str(key), str(value))
        steps_where_cheapest(rewrite, table, snapshot, removes_files=True).commit()
    log.info("%s: %d data files and %d delete files compacted into %d in the driver (%d rows)", table.name(),
             len(planned), len(live_deletes), len(added), rows.num_rows)
    return len(planned)


def _planned(table: Any, snapshot: Any) -> list[tuple[Any, list[Any]]]:
    """(data file, the delete files applying to it) of ``snapshot``, as Iceberg plans them."""
    tasks = table.newScan().useSnapshot(snapshot.snapshotId()).planFiles()
    try:
        return [(task.file(), java_items(task.deletes())) for task in java_items(tasks)]
    finally:
        tasks.close()
