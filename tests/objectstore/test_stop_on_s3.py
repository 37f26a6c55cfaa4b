"""A stop asked for on object storage ends in bounded time: Ctrl-C while a batch's commit is slow (a loaded S3 or
catalog) lets that batch finish and be confirmed, and nothing more: the batch collected meanwhile is not applied
(the server sends it again at the next start), and the slot stays confirmed to what the mirrors hold."""

from __future__ import annotations

import signal

import psycopg
import pytest

from pgcdc.lsn import Lsn
from pgcdc.pipeline import Pipeline
from pipeline_support import (
    SHOP_TABLES,
    assert_mirrors_equal,
    catch_up_in_process,
    insert_customers,
    pipeline_config,
    prepare_source,
    start_streaming,
    wait_for,
)

# the S3 server and JDBC catalog of the object storage tests (conftest.py): in the worker of the other JDBC tests
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("s3-jdbc")]

PAUSE_SECONDS = 10


def _confirmed(conn: psycopg.Connection, slot: str) -> Lsn:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)).fetchone()
    return Lsn.parse(row[0])


def test_ctrl_c_on_s3_finishes_the_batch_in_flight_and_nothing_more(pg, spark, jdbc_store):
    prepare_source(pg, rows=20)
    config = pipeline_config(pg, spark, **jdbc_store.config_overrides())
    Pipeline(config, spark=spark)  # the session reads the catalog too
    # the first batch's commit is slow: it lands, then its apply holds 10 s before returning
    run = start_streaming(config, "--batch-seconds", "1",
                          env={"PGCDC_INJECT": f"apply.before-confirm:1:{PAUSE_SECONDS}:PAUSE"})
    process = run.process
    try:
        with psycopg.connect(config.dsn, autocommit=True) as conn:
            first_end = insert_customers(conn, 1_000_001, 100, "first")
            mirror = f"`{config.destination.catalog}`.`{config.destination.namespace}`.`shop`.`customers`"
            wait_for(lambda: spark.catalog.clearCache() or spark.table(mirror).where(
                "name = 'first'").count() == 100, 180, "the first batch's commit")
            # a second batch collected while the first one applies, then Ctrl-C
            second_end = insert_customers(conn, 2_000_001, 100, "second")
            process.send_signal(signal.SIGINT)
            # the batch in flight still has most of its pause to go; what follows it is bounded
            process.wait(timeout=PAUSE_SECONDS + 60)
            run.reader.join(timeout=10)
            output = run.output
            assert process.returncode == 130, output[-3000:]
            assert "applied 100 changes in 1 transactions" in output, output[-3000:]
            # the batch collected meanwhile was not applied, and the slot is confirmed to the first only
            spark.catalog.clearCache()
            assert spark.table(mirror).where("name = 'second'").count() == 0
            confirmed = _confirmed(conn, config.slot)
            assert first_end <= confirmed < second_end, (first_end, confirmed, second_end)
            assert f"confirmed {confirmed}" in output, output[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    # the next start applies the second batch: nothing was lost
    catch_up_in_process(config, spark)
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)


def test_the_jdbc_catalog_reconnects_when_postgresql_ends_its_connections(pg, spark, jdbc_store):
    """The catalog's database ends its connections (a restart, a failover, pg_terminate_backend): the next call
    through the catalog opens a connection again instead of failing (57P01 is retried, as Iceberg retries its own
    list of connection errors)."""
    from pgcdc.spark.destination import Destination
    from pgcdc.spark.session import attach_catalog

    name = f"{jdbc_store.catalog}_reconnects"  # attached afresh here, with pgcdc's settings
    conf = {k.replace(f".{jdbc_store.catalog}.", f".{name}."): v for k, v in jdbc_store.spark_conf.items()}
    attach_catalog(spark, Destination(warehouse=jdbc_store.warehouse, catalog=name, conf=conf, catalog_type="jdbc",
                                      catalog_uri=jdbc_store.catalog_uri))
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {name}.reconnects")
    database = jdbc_store.catalog_uri.rsplit("/", 1)[1].split("?")[0]
    ended = pg.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = %s AND pid <> pg_backend_pid()", (database,))[0][0]
    assert ended >= 1, "the catalog held no connection to end"
    namespaces = [row[0] for row in spark.sql(f"SHOW NAMESPACES IN {name}").collect()]
    assert "reconnects" in namespaces, namespaces
