"""End to end: a real PostgreSQL mirrored into real Iceberg tables by Spark, compared row for row."""

from __future__ import annotations

import threading
import time

import psycopg
import pytest

from pgcdc.demo import workload
from pgcdc.mirrors.status import namespace_positions
from pgcdc.pipeline import Pipeline
from pgcdc.verify import compare_publication
from pipeline_support import (
    SHOP_TABLES,
    assert_mirrors_equal,
    mirror_mixed_workload,
    pipeline_config,
    prepare_source,
    run_cli_while_changing,
    run_in_background,
)

pytestmark = pytest.mark.slow

def _assert_mirrors_equal(pipeline, dsn):
    assert_mirrors_equal(pipeline.config, pipeline.spark, dsn, SHOP_TABLES)


# each writer once, each value format once: the other pairs differ in nothing the writers or the formats share
@pytest.mark.parametrize(("binary", "writer"), [(False, "merge"), (True, "delta")], ids=["text-merge", "binary-delta"])
def test_mixed_workload_mirrors_equal_source(pg, spark, binary, writer):
    mirror_mixed_workload(pg, spark, binary=binary, apply_writer=writer)


@pytest.mark.parametrize("writer", ["arrow", "spark"])
def test_both_snapshot_writers_copy_every_type_exactly(pg, spark, writer, monkeypatch):
    """The initial copy written as Parquet data files by the tasks (arrow, the default for a local warehouse) and
    through Spark's Iceberg writer (spark, for any storage): the same mirrors, with Iceberg's column metrics and
    the consistent point in the commit; each mirror made, copied and committed through the Table its making
    returned, never loaded again for its copy."""
    import sys

    import pyarrow.parquet as pq

    import pgcdc.spark.iceberg_java as iceberg_java
    import pgcdc.spark.snapshot as snapshot

    copy_loads = []

    def counted(load):
        def load_table(session, identifier):
            if sys._getframe(1).f_code.co_name in ("copy_table", "remove_unreferenced_files"):
                copy_loads.append(identifier)
            return load(session, identifier)
        return load_table

    monkeypatch.setattr(iceberg_java, "load_table", counted(iceberg_java.load_table))
    monkeypatch.setattr(snapshot, "load_table", counted(snapshot.load_table))
    prepare_source(pg, rows=400)
    config = pipeline_config(pg, spark, snapshot_writer=writer)
    pipeline = Pipeline(config, spark=spark)
    copied = pipeline.snapshot()
    assert copied["shop.customers"] == 400
    assert copy_loads == []
    _assert_mirrors_equal(pipeline, pg.dsn)

    customers = pipeline.mirrors.identifier_for("shop", "customers")
    files = spark.sql(f"SELECT file_path, record_count, lower_bounds, upper_bounds FROM {customers}.files").collect()
    assert sum(f.record_count for f in files) == 400
    assert all(f.lower_bounds and f.upper_bounds for f in files)  # metrics: scans can skip files
    created_by = {pq.ParquetFile(f.file_path.removeprefix("file:")).metadata.created_by for f in files}
    assert all(("parquet-cpp-arrow" in c) == (writer == "arrow") for c in created_by), created_by
    if writer == "arrow":  # a dictionary for the columns whose values repeat, none for those of distinct values
        orders = pipeline.mirrors.identifier_for("shop", "orders")
        for path in spark.sql(f"SELECT file_path FROM {orders}.files").collect():
            group = pq.ParquetFile(path.file_path.removeprefix("file:")).metadata.row_group(0)
            dictionary = {group.column(i).path_in_schema: group.column(i).has_dictionary_page
                          for i in range(group.num_columns)}
            assert dictionary["status"] and not dictionary["id"], dictionary
    summary = spark.sql(f"SELECT summary FROM {customers}.snapshots ORDER BY committed_at DESC LIMIT 1").collect()
    assert summary[0].summary["pgcdc.lsn"] == str(namespace_positions(pipeline.mirrors)[("shop", "customers")])
    # a key lookup goes through the metrics
    assert spark.sql(f"SELECT count(*) AS n FROM {customers} WHERE id = 7").collect()[0].n == 1

    # changes stream on top of either
    with pg.connect() as conn:
        workload(conn, rows=400, large_rows=500)
    pipeline.run(until_caught_up=True, handle_signals=False)
    _assert_mirrors_equal(pipeline, pg.dsn)


@pytest.mark.soak  # make test runs a standalone cluster's executors (test_standalone_cluster.py)
def test_on_a_local_cluster_executors_share_no_driver_state(pg, spark):
    """The same workload with separate executor processes (local-cluster): the copy, and the MERGE writer's
    conversion, reduce and MERGE run in Spark tasks, so nothing may rely on state in the driver."""
    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    prepare_source(pg, rows=100)
    config = pipeline_config(pg, spark, apply_writer="merge")
    # one run (its three JVMs start once): the copy, then the workload streamed on top of it
    run_cli_while_changing(config, lambda conn: workload(conn, rows=100, large_rows=2000),
                           "--master", "local-cluster[2,1,1024]")
    _assert_mirrors_equal(Pipeline(config, spark=spark), pg.dsn)


def test_quiet_slot_keeps_advancing_and_tables_added_later_are_copied_while_streaming(pg, spark):
    from pgcdc.lsn import Lsn

    pg.execute("CREATE TABLE first (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO first VALUES (1, 'a')")
    pg.execute("CREATE TABLE later (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO later SELECT i, 'existing' FROM generate_series(1, 500) i")
    pg.execute("CREATE PUBLICATION pub FOR TABLE first")
    config = pipeline_config(pg, spark, publication="pub", heartbeat_seconds=0.5)
    pipeline = Pipeline(config, spark=spark)
    runner = threading.Thread(target=lambda: pipeline.run(handle_signals=False), daemon=True)
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while pipeline.progress.phase != "streaming" and time.monotonic() < deadline:
            time.sleep(0.2)
        # WAL written elsewhere (another database): the idle slot confirms past it, so WAL does not pile up
        with psycopg.connect(pg.server.dsn, autocommit=True) as other:
            other.execute("CREATE TABLE IF NOT EXISTS elsewhere AS SELECT generate_series(1, 20000) AS i")
            target = Lsn.parse(other.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        while time.monotonic() < deadline:
            confirmed = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                                   "WHERE slot_name = %s", (config.slot,))[0][0]
            if Lsn.parse(confirmed) >= target:
                break
            time.sleep(0.5)
        assert Lsn.parse(confirmed) >= target

        # a table joins the publication while streaming: copied at a fresh consistent point, then streamed
        pg.execute("ALTER PUBLICATION pub ADD TABLE later")
        pg.execute("INSERT INTO later VALUES (501, 'streamed')")
        pg.execute("UPDATE later SET v = 'changed' WHERE id <= 10")
        pg.execute("INSERT INTO first VALUES (2, 'b')")
        while time.monotonic() < deadline and ("public", "later") not in namespace_positions(pipeline.mirrors):
            time.sleep(0.5)
        time.sleep(3)
    finally:
        pipeline.stop()
        runner.join(timeout=120)
    results = {r.table: r for r in compare_publication(pipeline, pg.dsn, "pub")}
    assert set(results) == {"public.first", "public.later"}
    assert all(r.equal for r in results.values()), [r.describe() for r in results.values()]
    assert results["public.later"].source_rows == 501


def test_the_next_batch_is_read_while_one_is_merged(pg, spark):
    """The stream does not stop for a MERGE: while one batch is being merged into Iceberg, the transactions
    committed meanwhile arrive and are decoded into the next batch; the mirror ends equal to the source."""
    pg.execute("CREATE TABLE flow (id bigint PRIMARY KEY, n int, v text)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE flow")
    config = pipeline_config(pg, spark, publication="pub", batch_max_seconds=0.3)
    pipeline = Pipeline(config, spark=spark)
    writing = threading.Event()
    writing.set()

    def write() -> None:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            i = 0
            while writing.is_set():
                i += 1
                conn.execute("INSERT INTO flow VALUES (%s, 0, 'new') ON CONFLICT (id) DO UPDATE SET n = flow.n + 1",
                             (i % 500,))
                if i % 7 == 0:
                    conn.execute("DELETE FROM flow WHERE id = %s", ((i * 13) % 500,))
                time.sleep(0.005)

    writer = threading.Thread(target=write, daemon=True)
    runner, failures = run_in_background(pipeline)
    overlapped = 0
    try:
        deadline = time.monotonic() + 180
        while pipeline.progress.phase != "streaming" and time.monotonic() < deadline and not failures:
            time.sleep(0.2)
        writer.start()
        previous = None
        while overlapped < 3 and time.monotonic() < deadline and not failures:
            progress = pipeline.progress
            sample = (progress.applying_rows, progress.batches_applied, progress.received_lsn)
            # the same batch still merging (none finished between the two looks), and more received meanwhile
            if (previous is not None and previous[0] and sample[0] and previous[1] == sample[1]
                    and previous[2] is not None and sample[2] is not None and sample[2] > previous[2]):
                overlapped += 1
            previous = sample
            time.sleep(0.01)
    finally:
        writing.clear()
        writer.join(timeout=30)
    pipeline.stop()
    runner.join(timeout=120)
    assert not failures, failures
    assert overlapped >= 3, f"transactions were received during a MERGE only {overlapped} times"
    # what was still on its way at the stop: a second run reads the positions back and catches up
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    results = {r.table: r for r in compare_publication(pipeline, pg.dsn, "pub")}
    assert results["public.flow"].equal, results["public.flow"].describe()


def test_a_prepared_transaction_committed_while_another_is_held_is_applied_once_across_restarts(pg, spark):
    """Y prepared, X prepared, Y committed: pgcdc applies Y and holds the slot at X's PREPARE. Started again
    from there, the server sends Y's COMMIT PREPARED alone (its PREPARE lies before the slot's position): Y is
    already in the mirror and is not applied twice; X, committed later, is applied whole."""
    pg.server.require(15, "two-phase decoding")
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY, v text);
        INSERT INTO t VALUES (1, 'seed');
        CREATE PUBLICATION pub FOR TABLE t;
    """)
    config = pipeline_config(pg, spark, publication="pub")
    Pipeline(config, spark=spark).snapshot()
    with pg.connect() as conn:
        conn.execute("BEGIN; INSERT INTO t VALUES (2, 'y'); UPDATE t SET v = 'y too' WHERE id = 1; "
                     "PREPARE TRANSACTION 'y'")
        conn.execute("BEGIN; INSERT INTO t VALUES (3, 'x'); PREPARE TRANSACTION 'x'")
        conn.execute("COMMIT PREPARED 'y'")
    for _ in range(2):  # twice: each start meets Y's commit alone
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
        spark.catalog.clearCache()
        identifier = Pipeline(config, spark=spark).mirrors.identifier_for("public", "t")
        assert sorted(tuple(r) for r in spark.table(identifier).collect()) == [(1, "y too"), (2, "y")]
    pg.execute("COMMIT PREPARED 'x'")
    pg.execute("INSERT INTO t VALUES (4, 'after')")
    pipeline = Pipeline(config, spark=spark)
    pipeline.run(until_caught_up=True, handle_signals=False)
    assert_mirrors_equal(config, spark, pg.dsn, {"public.t"})


def test_a_transaction_the_server_cannot_decode_while_streaming_is_decoded_at_its_commit(pg, spark, caplog):
    """A large transaction that adds a column inside a rolled-back savepoint, then another: PostgreSQL's decoder
    fails on it while streaming it in progress ("could not map filenumber"), and decodes it whole at commit.
    pgcdc streams on without in-progress streaming, and mirrors it whole."""
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY, v int);
        INSERT INTO t SELECT g, g FROM generate_series(1, 100) g;
        CREATE PUBLICATION pub FOR TABLE t;
    """)
    config = pipeline_config(pg, spark, publication="pub")
    Pipeline(config, spark=spark).snapshot()
    pg.execute("""
        BEGIN;
        INSERT INTO t SELECT g, g FROM generate_series(1000, 21000) g;
        SAVEPOINT a;
        ALTER TABLE t ADD COLUMN x int DEFAULT 5;
        INSERT INTO t SELECT g, g, 7 FROM generate_series(30000, 40000) g;
        ROLLBACK TO SAVEPOINT a;
        INSERT INTO t SELECT g, g FROM generate_series(50000, 60000) g;
        ALTER TABLE t ADD COLUMN y text;
        INSERT INTO t SELECT g, g, 'y' FROM generate_series(70000, 80000) g;
        COMMIT;
        INSERT INTO t VALUES (-1, -1, 'after');
    """)
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert_mirrors_equal(config, spark, pg.dsn, {"public.t"})
