"""Several slots in parallel: a source split by publication (disjoint tables), one ``pgcdc run`` per publication,
each with its own slot and positions, all writing their mirrors into one warehouse and one namespace at once.
Neither run takes the other's mirrors for its own, and a crash of one leaves the other streaming."""

from __future__ import annotations

import signal
from dataclasses import replace

import psycopg
import pytest

from pgcdc.demo import workload
from pgcdc.errors import ConfigError
from pgcdc.lsn import Lsn
from pgcdc.pipeline import Pipeline
from pipeline_support import (
    FLOOD_PAUSE,
    Workload,
    assert_mirrors_equal,
    pipeline_config,
    prepare_source,
    run_cli,
    start_streaming,
    wait_for,
    wait_for_transactions,
)

pytestmark = pytest.mark.slow

FIRST_TABLES = {"shop.customers", "shop.kinds"}
SECOND_TABLES = {"shop.orders", "shop.events", "shop.audit"}


def split_source(pg, rows: int) -> None:
    prepare_source(pg, rows=rows)
    pg.execute("CREATE PUBLICATION first_half FOR TABLE shop.customers, shop.kinds")
    pg.execute("CREATE PUBLICATION second_half FOR TABLE shop.orders, shop.events, shop.audit")


def confirmed(conn: psycopg.Connection, slot: str) -> Lsn:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)).fetchone()
    return Lsn.parse(row[0]) if row and row[0] else Lsn(0)


@pytest.mark.long
def test_two_runs_copy_and_stream_into_one_warehouse_at_once(pg, spark):
    """Both halves copied into one namespace (the second slot's first run is not refused for the first slot's
    mirror positions: they are not its own), then changed by transactions that span both; two ``pgcdc run
    --until-caught-up`` processes started together stream them, their commits interleaving in one warehouse;
    each ends equal to its own publication's tables. A slot lost for its own publication's mirrors is still
    refused."""
    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    split_source(pg, rows=200)
    first = pipeline_config(pg, spark, publication="first_half", slot="first_slot")
    second = replace(first, publication="second_half", slot="second_slot")
    assert set(Pipeline(first, spark=spark).snapshot()) == FIRST_TABLES
    assert set(Pipeline(second, spark=spark).snapshot()) == SECOND_TABLES
    with pg.connect() as conn:
        workload(conn, rows=200, large_rows=1000)
    runs = [run_cli(config, "--master", "local[1]", "--until-caught-up") for config in (first, second)]
    try:
        for process in runs:
            output, _ = process.communicate(timeout=300)
            assert process.returncode == 0, output[-3000:]
    finally:
        for process in runs:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert_mirrors_equal(first, spark, pg.dsn, FIRST_TABLES)
    assert_mirrors_equal(second, spark, pg.dsn, SECOND_TABLES)

    pg.execute("SELECT pg_drop_replication_slot('second_slot')")
    with pytest.raises(ConfigError, match=r"'second_slot' does not exist, but 3 mirrors"):
        Pipeline(second, spark=spark).snapshot()


@pytest.mark.soak
def test_two_slots_stream_one_warehouse_at_once_and_one_crashes(pg, spark):
    """Two ``pgcdc run`` processes under one workload whose transactions span both publications; one is killed
    (SIGKILL) while the other keeps streaming, and started again: both end equal to their sources."""
    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    split_source(pg, rows=300)
    first = pipeline_config(pg, spark, publication="first_half", slot="first_slot")
    second = replace(first, publication="second_half", slot="second_slot")
    options = ("--master", "local[1]")
    runs = {"first": start_streaming(first, *options, timeout=300)}
    try:
        runs["second"] = start_streaming(second, *options, timeout=300)
        with Workload(pg.dsn, seed=5, pause=FLOOD_PAUSE) as workload:
            wait_for_transactions(workload, 40)
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                mark = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
                wait_for(lambda: confirmed(conn, "second_slot") >= mark, 180, "the second slot to confirm")
            runs["second"].process.send_signal(signal.SIGKILL)
            runs["second"].process.wait(timeout=60)
            before = workload.transactions
            wait_for_transactions(workload, before + 40)  # the first streams on alone
            runs["second"] = start_streaming(second, *options, timeout=300)
            wait_for_transactions(workload, workload.transactions + 40)
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            written = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
            for name, config in (("first", first), ("second", second)):
                wait_for(lambda config=config, name=name: confirmed(conn, config.slot) >= written
                         or runs[name].process.poll() is not None, 300, f"slot {config.slot} to confirm {written}")
        for run in runs.values():
            assert run.process.poll() is None, run.output[-3000:]
            run.process.send_signal(signal.SIGTERM)
        for run in runs.values():
            assert run.process.wait(timeout=120) == 0, run.output[-3000:]
    finally:
        for run in runs.values():
            if run.process.poll() is None:
                run.process.kill()
                run.process.wait()
            run.reader.join(timeout=10)
    assert_mirrors_equal(first, spark, pg.dsn, FIRST_TABLES)
    assert_mirrors_equal(second, spark, pg.dsn, SECOND_TABLES)
