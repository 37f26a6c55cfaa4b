"""The mirrors are read by readers that are not pgcdc: PyIceberg, reading each table's own metadata, reads
exactly what Iceberg's Java reader (Spark) reads at every snapshot the stream and the maintenance beside it
committed, with both writers; and Spark reads exactly the source."""

from __future__ import annotations

import pytest

from pgcdc.demo import workload
from pgcdc.mirrors.maintenance import MaintenancePolicy
from pgcdc.pipeline import Pipeline
from pipeline_support import SHOP_TABLES, assert_mirrors_equal, pipeline_config, prepare_source
from pyiceberg_reader import assert_reads_alike, hadoop_table

pytestmark = pytest.mark.slow

# maintenance between batches at every turn: compactions, delete files rewritten, snapshots expired
BESIDE = MaintenancePolicy(interval_seconds=0, data_files=3, delete_files=2, check_seconds=0, snapshots_kept=50,
                           snapshot_max_age_seconds=3600)


# the MERGE writer's mirrors read alike too: a second writer, make soak
@pytest.mark.parametrize("writer", ["delta", pytest.param("merge", marks=pytest.mark.soak)])
def test_pyiceberg_reads_every_snapshot_of_the_mixed_workload_as_spark_does(pg, spark, writer, monkeypatch):
    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    from pgcdc.apply import fold

    # small files graduate at 50 rows: batches fold, and files pile up for the maintenance to compact
    monkeypatch.setattr(fold, "FOLD_MAX_ROWS", 50)
    prepare_source(pg, rows=300)
    config = pipeline_config(pg, spark, apply_writer=writer, batch_max_rows=1, maintenance=BESIDE)
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    with pg.connect() as conn:
        workload(conn, rows=300, large_rows=3000)
    progress = pipeline.run(until_caught_up=True, handle_signals=False)
    assert progress.batches_applied > 3
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)  # what Spark reads is the source

    compared = maintained = 0
    for name in sorted(SHOP_TABLES):
        identifier = pipeline.mirrors.identifier_for(*name.split("."))
        table = hadoop_table(spark, identifier)
        snapshots = spark.sql(f"SELECT snapshot_id, operation FROM {identifier}.snapshots "
                              "ORDER BY committed_at").collect()
        for snapshot in snapshots:  # every batch's commit, and the maintenance's beside them
            assert_reads_alike(spark, identifier, table, snapshot.snapshot_id)
            compared += 1
            maintained += snapshot.operation == "replace"
    print(f"{writer}: {compared} snapshots read alike, {maintained} of them compactions")
    assert compared > 3 * len(SHOP_TABLES) and maintained > 0
