"""pgcdc on a real Spark standalone cluster (a master and a worker of two cores, on loopback): the initial copy and
the stream run in an executor JVM of its own, and losing the executor in the middle of either loses no row and
duplicates none. The executor is lost the way a machine is: SIGKILL of its JVM, no clean-up of any kind; the
worker starts another in its place, as it would on a machine that came back."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import psycopg
import pytest

from pgcdc.demo import workload
from pgcdc.lsn import Lsn
from pgcdc.pipeline import Pipeline
from pipeline_support import (
    SHOP_TABLES,
    Workload,
    assert_mirrors_equal,
    pipeline_config,
    prepare_source,
    run_cli,
    start_streaming,
    wait_for,
    wait_for_transactions,
)
from spark_cluster import StandaloneCluster, standalone_cluster

# one worker of a parallel run holds the module's cluster for all its tests
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("standalone-cluster")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with standalone_cluster(tmp_path_factory.mktemp("standalone"), workers=1, cores=2) as started:
        yield started


def cluster_options(cluster: StandaloneCluster) -> list[str]:
    # the worker's whole memory for its executor; few shuffle partitions for small batches
    return ["--master", cluster.master_url, "--conf", "spark.executor.memory=768m",
            "--conf", "spark.sql.shuffle.partitions=4", "--conf", "spark.default.parallelism=2"]


def namespace_directory(spark, namespace: str) -> Path:
    warehouse = spark.conf.get("spark.sql.catalog.pgcdc.warehouse")
    return Path(unquote(urlparse(warehouse).path)) / namespace


def data_files(directory: Path) -> set[Path]:
    return {path for path in directory.glob("**/data/**/*.parquet")}


def a_file_being_written(directory: Path, process, timeout: float) -> Path:
    """A copy task's data file that is open and not written yet (a Parquet file holds only its 4-byte header
    until its rows are written at its end): the task writing it is in the middle of its COPY."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        for path in data_files(directory):
            try:
                if path.stat().st_size <= 4:
                    return path
            except FileNotFoundError:
                continue
        time.sleep(0.003)
    raise AssertionError("no copy task was seen in the middle of writing its data file")


def unreferenced_files(spark, pipeline: Pipeline) -> list[Path]:
    """Data files in a mirror's directory that no snapshot of the mirror references."""
    found = []
    for schema_table in sorted(SHOP_TABLES):
        schema, table = schema_table.split(".")
        identifier = pipeline.mirrors.identifier_for(schema, table)
        referenced = {Path(unquote(urlparse(row.file_path).path))
                      for row in spark.sql(f"SELECT file_path FROM {identifier}.all_files").collect()}
        location = namespace_directory(spark, pipeline.config.destination.namespace) / schema / table / "data"
        found += [path for path in data_files(location) if path not in referenced]
    return found


@pytest.mark.long(3)
def test_copy_and_stream_on_a_standalone_cluster_survive_lost_executors(pg, spark, cluster):
    """``pgcdc run --master spark://…``: the executor is killed while the copy's tasks write their data files,
    and again while a batch is applied; Spark runs the lost tasks again on the executor the worker starts in its
    place. The copy commits only the attempts that finished (a killed attempt's file is removed, never
    committed), and every mirror ends equal to its source."""
    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    prepare_source(pg, rows=10000)
    # the MERGE writer, whose applies run in executors' tasks (the row-delta writer's run in the driver)
    config = pipeline_config(pg, spark, apply_writer="merge")
    mirrors = namespace_directory(spark, config.destination.namespace)
    # started by hand, not by start_streaming: the first kill lands before it streams
    # several tasks per table, so that both of the executor's cores hold a task when it is lost
    process = run_cli(config, *cluster_options(cluster), "--snapshot-rows-per-task", "5000",
                      "--snapshot-writer", "arrow", env={"PGCDC_LOG_LEVEL": "INFO"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True)
    reader.start()
    try:
        # a task opens its data file before its COPY runs and writes it whole at its end; one of a large table's
        # tasks (orders: 5,000 rows each, a tenth of them with long notes), whose write takes far longer than the
        # kill takes to land (a small table's task may finish in between, and its file is then committed)
        half_written = a_file_being_written(mirrors / "shop" / "orders", process, 180)
        killed_in_copy = cluster.kill_executors()
        assert killed_in_copy, "no executor was running during the copy"
        wait_for(lambda: any("streaming slot" in line for line in lines) or process.poll() is not None, 300,
                 "the pipeline to stream after the copy")
        assert process.poll() is None, "".join(lines)[-3000:]
        output = "".join(lines)
        assert "Lost executor" in output, output[-3000:]  # the kill hit executors the copy was using

        spark.catalog.clearCache()
        # the lost attempts' files were written (opened at least) and are neither committed nor left behind;
        # the rows the copy committed are compared at the end, with the stream's
        assert not half_written.exists()
        assert unreferenced_files(spark, Pipeline(config, spark=spark)) == []

        # the stream: a steady workload, and every executor killed while a batch's MERGE writes its files
        after_copy = data_files(mirrors)
        with Workload(pg.dsn, seed=11) as workload:
            wait_for_transactions(workload, 20)
            wait_for(lambda: data_files(mirrors) - after_copy or process.poll() is not None, 180,
                     "a batch's MERGE writing data files")
            assert process.poll() is None, "".join(lines)[-3000:]
            killed_in_apply = cluster.kill_executors()
            assert killed_in_apply
            wait_for_transactions(workload, workload.transactions + 30)
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            written = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])

            def confirmed() -> Lsn:
                row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                                   "WHERE slot_name = %s", (config.slot,)).fetchone()
                return Lsn.parse(row[0])

            wait_for(lambda: confirmed() >= written or process.poll() is not None, 300,
                     f"the slot confirmed up to {written}")
        assert process.poll() is None, "".join(lines)[-3000:]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
        reader.join(timeout=10)
        output = "".join(lines)
        assert process.returncode == 0, output[-3000:]
        assert output.count("Lost executor") >= 2, output[-3000:]
        assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # the worker survived what was killed: the cluster keeps serving the next application
    deadline = time.monotonic() + 5
    while cluster.state().get("aliveworkers") != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.state().get("aliveworkers") == 1


@pytest.mark.soak
def test_a_copy_and_stream_on_the_cluster_resume_after_the_driver_is_killed(pg, spark, cluster):
    """The driver side lost: ``pgcdc run`` (the Spark driver) killed in the middle of its copy on the cluster;
    the next run copies again, streams, and ends equal; the cluster's executors of the dead driver end with it."""
    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    prepare_source(pg, rows=3000)
    config = pipeline_config(pg, spark)
    killed = run_cli(config, *cluster_options(cluster), "--snapshot-rows-per-task", "1000",
                     env={"PGCDC_INJECT": "snapshot.copy:2:0.3"})
    assert killed.wait(timeout=180) == -signal.SIGKILL, killed.stdout.read() if killed.stdout else ""
    run = start_streaming(config, *cluster_options(cluster), timeout=300)
    try:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            workload(conn, rows=3000, large_rows=500)
            written = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
            wait_for(lambda: Lsn.parse(conn.execute(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (config.slot,)).fetchone()[0]) >= written or run.process.poll() is not None, 300,
                f"the slot confirmed up to {written}")
        assert run.process.poll() is None, run.output[-3000:]
        run.process.send_signal(signal.SIGTERM)
        assert run.process.wait(timeout=120) == 0, run.output[-3000:]
    finally:
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()
        run.reader.join(timeout=10)
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
