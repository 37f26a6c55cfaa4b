"""Mirrors on object storage behind real Iceberg catalogs: S3 (a local S3 server, Hadoop's s3a client) with
Iceberg's JDBC catalog and with a REST catalog. The mixed workload runs against the JDBC catalog, a crash loop
against the REST catalog (the other two: make soak), every mirror compared row for row; the initial copy's tasks
write their Parquet files to S3 themselves; no secret (the S3 secret key, the catalog's password or token) shows in
any output. The servers are shared with the other object storage tests (conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_support import run_pgcdc
from objectstore_support import BUCKET, require_object_store
from pgcdc.apply import fold
from pgcdc.mirrors.catalog import MirrorCatalog
from pgcdc.mirrors.maintenance import MaintenancePolicy, maintain_table
from pgcdc.pipeline import Pipeline
from pgcdc.spark.destination import Destination
from pgcdc.spark.iceberg_java import load_table
from pipeline_support import (
    SHOP_TABLES,
    assert_mirrors_equal,
    catalog_arguments,
    crash_loop,
    mirror_mixed_workload,
    pipeline_config,
)
from pyiceberg_reader import assert_reads_alike, jdbc_catalog_table
from start_support import JavaStarts, assert_read_alike, run_until_caught_up

pytestmark = pytest.mark.slow

# each catalog's tests in one worker of a parallel run, with the other modules' on the same catalog: the groups
# s3-jdbc and s3-rest (conftest.py)
XDIST_GROUP_BY, XDIST_GROUP = "store", "s3"
# a lean crash loop: the local-directory suite aims at every window; here each kill restarts a JVM on S3:
# in the middle of the copy's task writes to S3, and with a batch's files on S3 but not committed
CRASH_ROUNDS = ["snapshot.copy:2:0.3", "apply.delta-commit:2"]
SOAK_CRASH_ROUNDS = [*CRASH_ROUNDS, "apply.between-mirrors:1", "apply.before-confirm:1", None]


@pytest.fixture(scope="module", params=["jdbc", "rest"])
def store(request):
    """One catalog per parameter, on the shared S3 server; both hold their tables in its bucket."""
    return request.getfixturevalue(f"{request.param}_store")


def assert_pyiceberg_reads_alike(spark, mirrors: MirrorCatalog, store, s3) -> None:
    """A reader that is not pgcdc, through the JDBC catalog: PyIceberg reads every mirror as Spark does."""
    for schema_table in SHOP_TABLES:
        identifier = mirrors.identifier_for(*schema_table.split("."))
        assert assert_reads_alike(spark, identifier, jdbc_catalog_table(store, s3, identifier)) > 0


def secrets_of(setup, s3) -> list[str]:
    return [s3.secret_key] + [value for key, value in setup.spark_conf.items()
                              if key.endswith((".password", ".token"))]


# both catalogs' in make test: the proof that mirrors on S3 equal their source behind each catalog pgcdc sets up
@pytest.mark.long
@pytest.mark.parametrize("store", ["jdbc", "rest"], indirect=True)
def test_mixed_workload_mirrors_equal_source_on_s3(pg, spark, s3, store):
    import pyarrow.parquet as pq
    from pyarrow.fs import S3FileSystem

    pipeline = mirror_mixed_workload(pg, spark, **store.config_overrides())
    customers = pipeline.mirrors.identifier_for("shop", "customers")
    # the settings Iceberg's FileIO writes the mirrors' files with keep s3a's directory markers: no file written is
    # followed by a request deleting the markers above it (Iceberg's writes make none)
    hadoop = load_table(spark, customers).io().conf()
    assert hadoop.get("fs.s3a.directory.marker.retention") == "keep"
    first = spark.sql(f"SELECT snapshot_id FROM {customers}.snapshots ORDER BY committed_at LIMIT 1").collect()
    files = spark.sql(f"SELECT file_path FROM {customers}.files VERSION AS OF {first[0].snapshot_id}").collect()
    assert files and all(f.file_path.startswith(f"s3a://{BUCKET}/") for f in files), files
    # the copy's data files were written by the tasks (Arrow's Parquet writer), not by Spark's writer
    filesystem = S3FileSystem(access_key=s3.access_key, secret_key=s3.secret_key, region="us-east-1",
                              endpoint_override=s3.endpoint.removeprefix("http://"), scheme="http")
    created_by = {pq.ParquetFile(f.file_path.split("://", 1)[1], filesystem=filesystem).metadata.created_by
                  for f in files}
    assert all("parquet-cpp-arrow" in c for c in created_by), created_by
    if store.catalog_type == "jdbc":  # (the REST catalog's: after its crash loop, by `pgcdc maintain`)
        # maintained through the same catalog, every snapshot but the newest expired: the position and rows stay
        position = pipeline.mirrors.positions.read(customers)
        maintained = maintain_table(spark, customers, pipeline.mirrors.positions.carried(customers),
                                    MaintenancePolicy(snapshots_kept=1, snapshot_max_age_seconds=0))
        assert maintained.after is not None and maintained.after.snapshots == 1, maintained
        assert MirrorCatalog(spark, pipeline.config.destination).positions.read(customers) == position
        assert_mirrors_equal(pipeline.config, spark, pg.dsn, SHOP_TABLES)
        assert_pyiceberg_reads_alike(spark, pipeline.mirrors, store, s3)


# The crash loop on S3 repeats the local one's proof (tests/reliability/test_crash_loop.py) on a second store and
# catalog: make soak. Its aimed kills land before the catalog is asked to commit (in the copy's writes to S3, and
# between a batch's files and its commit), and what follows a restart goes through the catalog as every commit
# does. The JDBC catalog's commands run through the CLI in make test (test_stop_on_s3.py,
# tests/reliability/test_security.py).
@pytest.mark.soak
@pytest.mark.parametrize("store", ["rest"], indirect=True)
def test_crash_loop_on_s3_loses_and_duplicates_nothing(pg, spark, s3, store, tmp_path):
    crash_loop_on_s3(pg, spark, s3, store, CRASH_ROUNDS, "crash", tmp_path)


@pytest.mark.soak
@pytest.mark.timeout(1800)  # longer than the suite's per-test limit on a busy machine
def test_soak_crash_loop_on_s3_loses_and_duplicates_nothing(pg, spark, s3, store, tmp_path):
    crash_loop_on_s3(pg, spark, s3, store, SOAK_CRASH_ROUNDS, "soak", tmp_path)


def crash_loop_on_s3(pg, spark, s3, store, rounds: list[str | None], name: str, tmp_path) -> None:
    # a run reaches its aim later than on a local directory (a JVM start, then S3 round trips for every commit):
    # a longer wait for it
    namespace = f"{name}_{store.catalog_type}"
    outputs = crash_loop(pg, spark, rounds, seed=20261125, aim_timeout=240, namespace=namespace,
                         **store.config_overrides())
    for secret in secrets_of(store, s3):
        assert all(secret not in output for output in outputs)

    # status reads the mirrors back through the same catalog, and their metadata, manifests and delete files from
    # S3, without a JVM; with --debug nothing secret shows either. Beside it (starting a JVM), check finds the
    # source ready and the destination wanting: a bucket that does not exist
    config = pipeline_config(pg, spark, namespace=namespace, **store.config_overrides())
    arguments = catalog_arguments(config)
    arguments[arguments.index("--warehouse") + 1] = "s3a://no-such-bucket/mirrors"
    checking = subprocess.Popen([sys.executable, "-m", "pgcdc.cli", "--debug", "check", "--dsn", config.dsn, "-p",
                                 config.publication, "--slot", config.slot, *arguments], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        java = JavaStarts(tmp_path)
        status = run_pgcdc("--debug", "status", "--dsn", config.dsn, *catalog_arguments(config), "--namespace",
                           config.destination.namespace, "--json", timeout=600, env=java.env)
        assert java.starts() == [], status.stderr[-3000:]
        check_out, check_err = checking.communicate(timeout=600)
    finally:
        if checking.poll() is None:
            checking.kill()
            checking.wait()
    assert status.returncode == 0, status.stderr[-3000:]
    assert '"shop.customers"' in status.stdout
    described = json.loads(status.stdout)["mirrors"]
    positions = {m["mirror"]: (m["lsn"], m["rows"]) for m in described}
    # its counts are the sources' (every mirror equals its source once the loop has ended), whether read from the
    # manifests and delete files on S3 or through Spark
    assert {m["source"]: m["rows"] for m in described} == {
        table: pg.execute(f"SELECT count(*) FROM {table}")[0][0] for table in SHOP_TABLES}
    assert checking.returncode == 3, check_out + check_err[-3000:]
    said = " ".join(check_out.split())  # as one line, however the terminal wrapped it
    assert "the bucket 'no-such-bucket' of --warehouse s3a://no-such-bucket/mirrors does not exist" in said, said

    # maintain one mirror through the same catalog (every mirror: tests/integration/test_maintenance.py),
    # expiring every snapshot but the newest: positions and rows stay
    maintain = run_pgcdc("--debug", "maintain", *catalog_arguments(config), "--namespace",
                         config.destination.namespace, "--table", "shop.customers", "--snapshots-kept", "1",
                         "--snapshot-retention-minutes", "0", "--json", timeout=600)
    assert maintain.returncode == 0, maintain.stderr[-3000:]
    maintained = json.loads(maintain.stdout)
    mirrors = MirrorCatalog(spark, config.destination)
    assert mirrors.identifier_for("shop", "customers") in {row["table"] for row in maintained}, maintained
    assert all(row["snapshots"] == 1 for row in maintained), maintained
    # read back in this process (its Spark is warm): the same positions, and every mirror still equal
    for identifier, (lsn, _) in positions.items():
        assert str(mirrors.positions.read(identifier)) == lsn, identifier
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    if store.catalog_type == "jdbc":
        assert_pyiceberg_reads_alike(spark, mirrors, store, s3)
    for secret in secrets_of(store, s3):
        assert secret not in status.stdout + status.stderr + maintain.stdout + maintain.stderr + check_out + check_err


def test_a_run_with_nothing_to_do_reads_the_catalog_without_a_jvm(pg, spark, s3, store, tmp_path, monkeypatch):
    """Behind either catalog, on S3: a ``run --until-caught-up`` with the mirrors at the slot's position reads
    their metadata itself (the JDBC catalog's table, or the REST catalog, then S3) and starts no JVM; what it reads
    is what Spark reads."""
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO items SELECT i, 'v' || i FROM generate_series(1, 20) i")
    pg.execute("CREATE PUBLICATION items FOR TABLE items")
    config = pipeline_config(pg, spark, publication="items", slot="lazy", namespace=f"lazy_{store.catalog_type}",
                             **store.config_overrides())
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    java = JavaStarts(tmp_path)
    result, started = run_until_caught_up(config, java)
    assert result.returncode == 0 and "applied 0 changes" in result.stdout, result.stderr[-3000:]
    assert started == [], (started, result.stderr[-3000:])
    assert assert_read_alike(config, spark)  # status's counts too: the copy left no delete file

    # rows updated and deleted, none folded into a new data file (pgcdc.apply.fold): position delete files on S3,
    # which status's counts read here too
    monkeypatch.setattr(fold, "FOLD_MAX_ROWS", 0)
    pg.execute("UPDATE items SET v = v || '!' WHERE id % 3 = 0")
    pg.execute("DELETE FROM items WHERE id % 10 = 0")
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    mirror = MirrorCatalog(spark, config.destination).identifier_for("public", "items")
    assert int(load_table(spark, mirror).currentSnapshot().summary()["total-position-deletes"]) > 0
    assert assert_read_alike(config, spark)
    assert spark.table(mirror).count() == pg.execute("SELECT count(*) FROM items")[0][0]
    for secret in secrets_of(store, s3):
        assert secret not in result.stdout + result.stderr


@pytest.mark.soak  # a whole demo on S3 (~90 s on 2 cores): make soak
@pytest.mark.postgres
@pytest.mark.spark
def test_object_store_demo_reports_every_mirror_equal_and_no_secret():
    require_object_store()
    result = run_pgcdc("demo", "--object-store", "--rows", "200", "--large-transaction-rows", "3000", timeout=900,
                       env={"COLUMNS": "200"})
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "every mirror equals its source" in result.stdout
    compared = result.stdout.split("source vs mirror")[1].split("query the mirrors")[0]
    assert compared.count(" yes ") == 5 and "NO" not in compared, compared
    assert "s3a://pgcdc-demo/" in result.stdout and "jdbc:postgresql://" in result.stdout
    # the demo's S3 secret key and catalog password are made afresh with these prefixes: neither may show
    assert "s3-secret-" not in output and "jdbc-secret-" not in output


def test_check_names_what_is_wrong_with_the_destination(spark, s3, store):
    """Each broken part of a destination is its own problem, found by writing before any slot exists."""
    from pgcdc.embedded import free_port
    from pgcdc.spark.destination import FAST_FAILURE_SETTINGS, check_destination
    from pgcdc.spark.session import attach_catalog

    def problems(name: str, warehouse: str, conf: dict[str, str], **catalog) -> list:
        attach_catalog(spark, Destination(warehouse=warehouse, catalog=name, conf={**FAST_FAILURE_SETTINGS, **conf},
                                          **catalog))
        return check_destination(spark, warehouse, name, "checked")

    good_s3 = s3.hadoop_settings("spark.hadoop.")
    kind = {"catalog_type": store.catalog_type, "catalog_uri": store.catalog_uri}
    catalog_conf = {k.replace(f".{store.catalog}.", f".{store.catalog}_ok."): v for k, v in store.spark_conf.items()}
    assert problems(f"{store.catalog}_ok", store.warehouse, catalog_conf, **kind) == []

    nowhere = f"http://127.0.0.1:{free_port()}"
    found = problems(f"{store.catalog}_endpoint", store.warehouse,
                     {**good_s3, "spark.hadoop.fs.s3a.endpoint": nowhere}, **kind)
    assert len(found) == 1 and "nothing answers" in found[0].what and nowhere in found[0].what, found

    found = problems(f"{store.catalog}_bucket", "s3a://no-such-bucket/mirrors", good_s3, catalog_type="hadoop")
    assert len(found) == 1 and "'no-such-bucket'" in found[0].what and "does not exist" in found[0].what, found

    if store.catalog_type == "jdbc":
        closed = f"jdbc:postgresql://127.0.0.1:{free_port()}/iceberg"
        found = problems(f"{store.catalog}_down", store.warehouse, good_s3, catalog_type="jdbc", catalog_uri=closed)
        assert len(found) == 1 and "cannot be reached" in found[0].what and closed in found[0].what, found
    else:  # the REST server wants its token: a wrong one is refused credentials
        wrong = {**good_s3, f"spark.sql.catalog.{store.catalog}_token.token": "not-the-token"}
        found = problems(f"{store.catalog}_token", store.warehouse, wrong, **kind)
        assert len(found) == 1 and "refused pgcdc's credentials" in found[0].what, found
    for problem in found:
        for secret in secrets_of(store, s3):
            assert secret not in problem.what + problem.fix
