"""A stop asked for is a stop in order: Ctrl-C or SIGTERM in the middle of a MERGE lets that batch finish and
be confirmed; during the initial copy it ends the run at once, commits nothing partial, and the next run
resumes. Signals come from inside the process at a named instant (``PGCDC_INJECT=...:INT``, see
:mod:`pgcdc.faults`), as a terminal's Ctrl-C reaches pgcdc (Spark's JVM runs in a session of its own)."""

from __future__ import annotations

import dataclasses
import signal

import psycopg
import pytest

from pgcdc.lsn import Lsn
from pipeline_support import (
    SHOP_TABLES,
    assert_mirrors_equal,
    catch_up_in_process,
    insert_customers,
    pipeline_config,
    prepare_source,
    run_cli,
    start_streaming,
    wait_for,
)

pytestmark = pytest.mark.slow


def confirmed_flush(conn: psycopg.Connection, slot: str) -> Lsn:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)).fetchone()
    return Lsn.parse(row[0])


def test_ctrl_c_in_the_middle_of_a_merge_lets_the_batch_finish_and_be_confirmed(pg, spark):
    prepare_source(pg, rows=20)
    config = pipeline_config(pg, spark)
    # 0.3 s into the first MERGE of the stream (a fresh JVM's first MERGE takes seconds): SIGINT
    run = start_streaming(config, env={"PGCDC_INJECT": "apply.mirror:1:0.3:INT"})
    process = run.process
    try:
        with psycopg.connect(config.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO shop.customers (id, name, email) "
                         "SELECT 1000000 + g, 'late ' || g, 'late' || g || '@example.com' FROM generate_series(1, 500) g")
            written = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
            process.wait(timeout=300)
            run.reader.join(timeout=10)
            output = run.output
            assert process.returncode == 130, output[-3000:]
            assert "cancel" not in output.lower() and "Traceback" not in output, output[-3000:]
            # the batch that was merging when the signal came is in the mirror and confirmed to the slot
            assert confirmed_flush(conn, config.slot) >= written
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)


@pytest.mark.long
def test_ctrl_c_during_the_initial_copy_of_run_stops_at_once_and_the_next_run_resumes(pg, spark):
    prepare_source(pg, rows=200)
    config = pipeline_config(pg, spark)
    # at the second table's copy (the first one committed): a signal at that very instant always lands in the
    # copy, whatever the machine's speed (the snapshot command's own test interrupts a running copy job)
    process = run_cli(config, env={"PGCDC_INJECT": "snapshot.copy:2:0:INT", "PGCDC_LOG_LEVEL": "WARNING"})
    try:
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, output[-3000:]
    assert output.strip().splitlines()[-1] == "interrupted" and "Traceback" not in output, output[-3000:]
    with psycopg.connect(config.dsn, autocommit=True) as conn:
        wait_for(lambda: conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s AND active",
                                      (config.slot,)).fetchone()[0] == 0, 30, "the interrupted run to let go of its slot")
    catch_up_in_process(config, spark)
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)


def _slot_backend(conn: psycopg.Connection, slot: str) -> int | None:
    row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return row[0] if row else None


def _stop_when_confirmed(run, config, written: Lsn) -> tuple[str, Lsn]:
    """SIGTERM once the slot confirmed ``written``; returns the run's output and the slot's confirmed position."""
    process = run.process
    with psycopg.connect(config.dsn, autocommit=True) as conn:
        wait_for(lambda: confirmed_flush(conn, config.slot) >= written or process.poll() is not None, 300,
                 f"the slot confirmed up to {written}")
        assert process.poll() is None, run.output[-3000:]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=300)
        run.reader.join(timeout=10)
        wait_for(lambda: _slot_backend(conn, config.slot) is None, 30, "the run to let go of its slot")
        return run.output, confirmed_flush(conn, config.slot)


def test_a_batch_applying_longer_than_the_server_waits_keeps_the_connection_and_counts_once(pg, spark):
    """A stream thread waiting for a long apply still reports to the server: its wal_sender_timeout (2 s here)
    never ends the connection, nothing is sent again, every change is counted once, and the position printed
    at the end is the one the server records."""
    prepare_source(pg, rows=20)
    config = pipeline_config(pg, spark)
    config = dataclasses.replace(config, dsn=config.dsn.replace("options='", "options='-c wal_sender_timeout=2s "))
    # the first batch's apply takes 6 s; the next batch is full at once, so the stream waits for it
    run = start_streaming(config, "--batch-rows", "50", env={"PGCDC_INJECT": "apply.before-confirm:1:6:PAUSE"})
    try:
        with psycopg.connect(config.dsn, autocommit=True) as conn:
            for transaction in range(5):
                written = insert_customers(conn, 1_000_000 + transaction * 100, 100, "late")
        output, recorded = _stop_when_confirmed(run, config, written)
    finally:
        if run.process.poll() is None:
            run.process.kill()
    assert run.process.returncode == 0, output[-3000:]
    assert "connection lost" not in output, output[-3000:]
    assert "applied 500 changes in 5 transactions" in output, output[-3000:]
    assert f"confirmed {recorded}" in output, output[-3000:]
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)


def test_a_transaction_replayed_after_a_reconnection_is_counted_once(pg, spark):
    """The connection lost while a batch applies: the server sends that batch's transaction again, which the
    mirrors already hold. Logs, the final line and the metrics count what reached the mirrors, once."""
    prepare_source(pg, rows=20)
    config = pipeline_config(pg, spark)
    run = start_streaming(config, env={"PGCDC_INJECT": "apply.before-confirm:1:8:PAUSE"})
    try:
        with psycopg.connect(config.dsn, autocommit=True) as conn:
            written = insert_customers(conn, 1_000_001, 500, "late")
            # committed to the mirror, not yet confirmed (the apply pauses after its commit): cut the connection
            mirror = f"`pgcdc`.`{config.destination.namespace}`.`shop`.`customers`"
            wait_for(lambda: spark.catalog.clearCache() or spark.table(mirror).where("name = 'late'").count() == 500,
                     120, "the batch's commit")
            conn.execute("SELECT pg_terminate_backend(%s)", (_slot_backend(conn, config.slot),))
        output, recorded = _stop_when_confirmed(run, config, written)
    finally:
        if run.process.poll() is None:
            run.process.kill()
    assert run.process.returncode == 0, output[-3000:]
    assert "connection lost" in output, output[-3000:]  # the replay happened
    assert "applied 500 changes in 1 transactions" in output, output[-3000:]
    assert f"confirmed {recorded}" in output, output[-3000:]
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
