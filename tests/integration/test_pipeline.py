"""End to end: a real PostgreSQL mirrored into real Iceberg tables by Spark, compared row for row."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import psycopg
import pytest

from pgcdc.demo import SCHEMA, seed_rows, workload
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.verify import compare_publication

pytestmark = pytest.mark.slow

STREAMING_SETTINGS = "-c logical_decoding_work_mem=64kB"


def _prepare_source(pg, rows: int) -> None:
    with pg.connect() as conn:
        conn.execute(SCHEMA)
        conn.execute(seed_rows(rows))


def _assert_mirrors_equal(pipeline, dsn):
    results = compare_publication(pipeline, dsn, "shop")
    assert {r.table for r in results} == {"shop.customers", "shop.orders", "shop.events", "shop.audit",
                                          "shop.kinds"}
    for result in results:
        assert result.equal, result.describe()


def _config(pg, spark, **overrides) -> PipelineConfig:
    # the session's warehouse, so that mirrors written by a pipeline subprocess are read back here
    warehouse = spark.conf.get("spark.sql.catalog.pgcdc.warehouse")
    values = dict(dsn=pg.dsn + f" options='{STREAMING_SETTINGS}'", publication="shop", slot="pgcdc_test",
                  warehouse=warehouse, namespace=f"m_{os.getpid()}_{random.randrange(10**9)}",
                  batch_max_seconds=1.0)
    values.update(overrides)
    return PipelineConfig(**values)


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_mixed_workload_mirrors_equal_source(pg, spark, binary):
    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    _prepare_source(pg, rows=300)
    config = _config(pg, spark, binary=binary, changelog=True)
    pipeline = Pipeline(config, spark=spark)
    copied = pipeline.snapshot()
    assert copied["shop.customers"] == 300
    with pg.connect() as conn:
        workload(conn, rows=300, large_rows=3000)
    progress = pipeline.run(until_caught_up=True, handle_signals=False)
    assert progress.rows_applied > 3000
    _assert_mirrors_equal(pipeline, pg.dsn)

    # the slot's confirmed position never passes what the mirrors hold, and reached the end of the workload
    positions = pipeline.mirrors.positions()
    confirmed = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'pgcdc_test'")
    from pgcdc.lsn import Lsn

    assert Lsn.parse(confirmed[0][0]) >= max(positions.values())

    # a second run with nothing new applies nothing and changes no mirror
    again = Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert again.rows_applied == 0
    assert pipeline.mirrors.positions() == positions

    changes = spark.sql(f"SELECT count(*) AS n FROM {pipeline.mirrors.changelog_identifier_for('shop', 'audit')}")
    assert changes.collect()[0].n > 0


def _continuous_workload(dsn: str, stop: threading.Event, errors: list[BaseException]) -> None:
    rng = random.Random(7)
    next_id = 1_000_000
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                choice = rng.random()
                with conn.transaction():
                    if choice < 0.5:
                        conn.execute("INSERT INTO shop.customers (id, name, balance) VALUES (%s, %s, %s)",
                                     (next_id, f"c{next_id}", rng.randrange(10**6) / 100))
                        next_id += 1
                    elif choice < 0.8:
                        conn.execute("UPDATE shop.customers SET balance = balance + 1 WHERE id = %s",
                                     (rng.randrange(1, next_id),))
                    elif choice < 0.9:
                        conn.execute("DELETE FROM shop.customers WHERE id = %s", (rng.randrange(1, next_id),))
                    else:
                        conn.execute("UPDATE shop.orders SET total = total + 1 WHERE id %% 17 = %s",
                                     (rng.randrange(17),))
                time.sleep(0.005)
    except BaseException as exc:  # surfaced by the test
        errors.append(exc)


def _run_cli(config: PipelineConfig, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "pgcdc.cli", "run", "--dsn", config.dsn, "--publication", config.publication,
               "--slot", config.slot, "--warehouse", config.warehouse, "--namespace", config.namespace,
               "--batch-seconds", "1", *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PGCDC_LOG_LEVEL": "WARNING"})


def test_killed_at_random_points_and_restarted_loses_and_duplicates_nothing(pg, spark):
    pg.server.require(15, "two-phase decoding")
    _prepare_source(pg, rows=200)
    config = _config(pg, spark)
    stop = threading.Event()
    errors: list[BaseException] = []
    writer = threading.Thread(target=_continuous_workload, args=(pg.dsn, stop, errors))
    writer.start()
    rng = random.Random(20261122)
    try:
        for _ in range(10):
            process = _run_cli(config)
            time.sleep(rng.uniform(4, 14))
            process.send_signal(signal.SIGKILL)
            process.wait()
    finally:
        stop.set()
        writer.join()
    assert not errors
    final = _run_cli(config, "--until-caught-up")
    output, _ = final.communicate(timeout=600)
    assert final.returncode == 0, output
    spark.catalog.clearCache()
    _assert_mirrors_equal(Pipeline(config, spark=spark), pg.dsn)


def test_on_a_local_cluster_executors_share_no_driver_state(pg, spark):
    """The same workload with separate executor processes (local-cluster): conversion, reduce and MERGE run
    in Spark tasks, so nothing may rely on state in the driver."""
    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    _prepare_source(pg, rows=100)
    config = _config(pg, spark)
    snapshot = _run_cli(config, "--master", "local-cluster[2,1,1024]", "--until-caught-up")
    output, _ = snapshot.communicate(timeout=600)
    assert snapshot.returncode == 0, output
    with pg.connect() as conn:
        workload(conn, rows=100, large_rows=2000)
    streamed = _run_cli(config, "--master", "local-cluster[2,1,1024]", "--until-caught-up")
    output, _ = streamed.communicate(timeout=600)
    assert streamed.returncode == 0, output
    _assert_mirrors_equal(Pipeline(config, spark=spark), pg.dsn)


def test_quiet_slot_keeps_advancing_and_tables_added_later_are_copied_while_streaming(pg, spark):
    from pgcdc.lsn import Lsn

    pg.execute("CREATE TABLE first (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO first VALUES (1, 'a')")
    pg.execute("CREATE TABLE later (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO later SELECT i, 'existing' FROM generate_series(1, 500) i")
    pg.execute("CREATE PUBLICATION pub FOR TABLE first")
    config = _config(pg, spark, publication="pub", heartbeat_seconds=0.5)
    pipeline = Pipeline(config, spark=spark)
    runner = threading.Thread(target=lambda: pipeline.run(handle_signals=False))
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
        while time.monotonic() < deadline and ("public", "later") not in pipeline.mirrors.positions():
            time.sleep(0.5)
        time.sleep(3)
    finally:
        pipeline.stop()
        runner.join(timeout=120)
    results = {r.table: r for r in compare_publication(pipeline, pg.dsn, "pub")}
    assert set(results) == {"public.first", "public.later"}
    assert all(r.equal for r in results.values()), [r.describe() for r in results.values()]
    assert results["public.later"].source_rows == 501
