"""Data files an interrupted copy wrote but never committed: nothing references them, nothing else would ever
remove them, and they would sit in the warehouse for good. Removed before the table is copied again."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pgcdc.iceberg.locations import local_path

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("pgcdc.spark.orphans")


def remove_unreferenced_files(spark: SparkSession, identifier: str, table: Any = None) -> int:
    """Delete the files under the table's ``data`` directory that no snapshot of it references (local and
    mounted warehouses; object stores keep them for Iceberg's own ``remove_orphan_files``). Call it only while
    nothing else writes the table: a file being written now is not referenced yet either. ``table``: its Iceberg
    table, when loaded (or made) already and not committed to since."""
    from pgcdc.spark.iceberg_java import load_table

    table = table if table is not None else load_table(spark, identifier)
    directory = local_path(str(table.location()))
    if directory is None:
        return 0
    data = Path(directory) / "data"
    if not data.is_dir():  # a table made afresh, say: nothing written there yet, nothing to ask Spark
        return 0
    referenced = set() if not table.snapshots().iterator().hasNext() else {
        Path(local_path(row.file_path) or row.file_path)
        for row in spark.sql(f"SELECT file_path FROM {identifier}.all_files").collect()}
    removed = 0
    for path in sorted(data.rglob("*")):
        if not path.is_file() or path in referenced:
            continue
        if path.name.startswith(".") and path.name.endswith(".crc") and \
                path.with_name(path.name[1:].removesuffix(".crc")) in referenced:
            continue  # the checksum beside a referenced file
        path.unlink()
        removed += 1
    if removed:
        log.info("removed %d files of an interrupted copy of %s that no commit references", removed, identifier)
    return removed
