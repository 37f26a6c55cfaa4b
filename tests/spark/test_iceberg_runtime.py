"""The pinned Iceberg runtime jar really works: create, MERGE, and a property in the same commit."""

from pgcdc.spark.iceberg import with_commit_properties


def test_create_merge_and_snapshot_property(spark, iceberg_namespace):
    table = f"pgcdc.{iceberg_namespace}.merge_check"
    spark.sql(f"CREATE TABLE {table} (id bigint, v string) USING iceberg")
    spark.sql(f"INSERT INTO {table} VALUES (1, 'a'), (2, 'b')")
    source = spark.createDataFrame([(2, "bb"), (3, "c")], "id bigint, v string")
    source.createOrReplaceTempView("merge_source")

    with_commit_properties(spark, {"pgcdc.lsn": "0/16B3748"}, lambda: spark.sql(
        f"MERGE INTO {table} t USING merge_source s ON t.id = s.id "
        "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"))

    rows = [tuple(r) for r in spark.sql(f"SELECT id, v FROM {table} ORDER BY id").collect()]
    assert rows == [(1, "a"), (2, "bb"), (3, "c")]
    snapshots = spark.sql(
        f"SELECT operation, summary['pgcdc.lsn'] AS lsn FROM {table}.snapshots ORDER BY committed_at").collect()
    assert [s.operation for s in snapshots] == ["append", "overwrite"]
    assert snapshots[0].lsn is None
    assert snapshots[1].lsn == "0/16B3748"


def test_python_tasks_are_forked_from_pgcdcs_daemon_with_the_copys_modules_imported(spark):
    def probe(_):
        import os
        import sys

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
            parent = cmdline.read().replace(b"\0", b" ").decode()
        yield parent, sorted(name for name in ("pyarrow.parquet", "psycopg2", "pgcdc.spark.snapshot")
                             if name in sys.modules)

    [(parent, loaded)] = spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()
    assert "-m pgcdc.spark.worker_daemon" in parent, parent
    assert loaded == ["pgcdc.spark.snapshot", "psycopg2", "pyarrow.parquet"], loaded
