"""A snapshot's rows counted from its manifests and delete files in Python (pgcdc.iceberg.table_files), as `pgcdc
status` counts them without a JVM: on tables Spark wrote with its own merge-on-read deletes (not pgcdc's writer),
through a delete file committed twice and deletes left dangling by a compaction, the count is the one Spark and
PyIceberg read; where only a reader of the rows can count (equality deletes), it declines."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pgcdc.apply.batch import apply_changes
from pgcdc.change_table import ChangeColumns as C
from pgcdc.change_table import change_schema
from pgcdc.iceberg.catalog_reader import Storage
from pgcdc.iceberg.table_files import POSITION_DELETES, live_rows, snapshot_files
from pgcdc.iceberg.table_metadata import TableMetadata
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import MirrorCatalog, TableSpec
from pgcdc.spark.destination import Destination
from pgcdc.spark.iceberg_java import load_table
from pyiceberg_reader import hadoop_table

STORAGE = Storage({})


def metadata_of(spark, identifier: str) -> TableMetadata:
    """The table's current metadata, read from its metadata file as pgcdc reads it without a JVM."""
    location = load_table(spark, identifier).operations().current().metadataFileLocation()
    return TableMetadata.parse(STORAGE.read(location), location)


def counted_alike(spark, identifier: str) -> int:
    """live_rows counts what Spark and PyIceberg read of the table's current snapshot; returns that count."""
    spark_count = spark.table(identifier).count()
    assert live_rows(metadata_of(spark, identifier), STORAGE) == spark_count, identifier
    assert hadoop_table(spark, identifier).scan().to_arrow().num_rows == spark_count, identifier
    return spark_count


@pytest.mark.parametrize("partitioned", [False, True], ids=["unpartitioned", "partitioned"])
def test_position_deletes_are_counted_once_and_dangling_ones_not_at_all(spark, iceberg_namespace, partitioned):
    identifier = f"pgcdc.{iceberg_namespace}.spark_written"
    spark.sql(f"CREATE TABLE {identifier} (id bigint, part int, v string) USING iceberg "
              f"{'PARTITIONED BY (part)' if partitioned else ''} "
              "TBLPROPERTIES ('format-version'='2', 'write.delete.mode'='merge-on-read', "
              "'write.update.mode'='merge-on-read', 'write.merge.mode'='merge-on-read')")
    for batch in range(3):
        spark.sql(f"INSERT INTO {identifier} SELECT id, CAST(id % 3 AS int), concat('v', id) "
                  f"FROM range({batch * 100}, {batch * 100 + 100})")
    spark.sql(f"DELETE FROM {identifier} WHERE id % 7 = 0")
    spark.sql(f"UPDATE {identifier} SET v = 'changed' WHERE id % 5 = 0")
    spark.sql(f"DELETE FROM {identifier} WHERE id BETWEEN 50 AND 60")
    table = metadata_of(spark, identifier)
    assert int(table.currentSnapshot().summary()["total-position-deletes"]) > 0
    left = [key for key in range(300) if key % 7 and not 50 <= key <= 60]
    assert counted_alike(spark, identifier) == len(left)

    # one delete file committed a second time: two live entries naming the same positions, each taken away once
    java_table = load_table(spark, identifier)
    again = next(iter(java_table.currentSnapshot().addedDeleteFiles(java_table.io())))
    java_table.newRowDelta().addDeletes(again).commit()
    assert sum(file.path == again.path() for file in snapshot_files(metadata_of(spark, identifier).currentSnapshot(),
                                                                    STORAGE)) == 2
    assert counted_alike(spark, identifier) == len(left)

    # a compaction rewrites every data file and leaves the delete files, which now name files no longer live:
    # the summary still counts their deletes, and a reader takes nothing away for them
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{iceberg_namespace}.spark_written', "
              "options => map('rewrite-all', 'true'))")
    summary = metadata_of(spark, identifier).currentSnapshot().summary()
    assert int(summary["total-position-deletes"]) > 0
    assert int(summary["total-records"]) - int(summary["total-position-deletes"]) != len(left)
    assert counted_alike(spark, identifier) == len(left)

    # and new deletes on the compacted files are counted again
    spark.sql(f"DELETE FROM {identifier} WHERE id < 10")
    assert counted_alike(spark, identifier) == len([key for key in left if key >= 10])


@pytest.mark.parametrize("deletes", ["position", "equality"])
def test_pgcdcs_own_writer_is_counted_by_position_and_declined_by_equality(spark, iceberg_namespace, deletes,
                                                                           monkeypatch):
    from pgcdc.apply import fold

    monkeypatch.setattr(fold, "FOLD_MAX_ROWS", 0)  # each batch's deletes in a delete file, none folded away
    mirrors = MirrorCatalog(spark, Destination(namespace=iceberg_namespace))
    mirror = mirrors.ensure(TableSpec("public", f"counted_{deletes}", StructType(
        [StructField("id", LongType()), StructField("v", StringType())]), ("id",)))
    arrow = pa.schema([("id", pa.int64()), ("v", pa.string())])

    def batch(lsn: int, *events: tuple[str, int, str | None]) -> None:
        rows = [{"id": key, "v": value, C.OP: op, C.LSN: lsn, C.ORDINAL: ordinal, C.UNCHANGED: [], C.OLD_KEY: None,
                 C.XID: 1, C.COMMIT_TS: None, C.ORIGIN: None, C.BEFORE: None}
                for ordinal, (op, key, value) in enumerate(events)]
        applied = apply_changes(spark, mirror, pa.Table.from_pylist(rows, schema=change_schema(arrow, ("id",))),
                                lsn=Lsn(lsn), writer="delta", deletes=deletes)
        mirror.position = applied.position

    batch(1, *[("I", key, f"v{key}") for key in range(20)])
    batch(2, ("U", 3, "new"), ("D", 4, None), ("D", 5, None), ("I", 40, "added"))
    files = snapshot_files(metadata_of(spark, mirror.identifier).currentSnapshot(), STORAGE)
    if deletes == "position":
        assert any(file.content == POSITION_DELETES for file in files)
        assert counted_alike(spark, mirror.identifier) == 19
    else:
        assert live_rows(metadata_of(spark, mirror.identifier), STORAGE) is None
        assert spark.table(mirror.identifier).count() == 19
