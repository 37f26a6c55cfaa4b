"""Server and network faults under a steady workload: PostgreSQL restarted (fast and crash), the walsender
terminated, the network reset and silently partitioned, the spill directory full. pgcdc recovers (or stops
with a clear error), never confirms a position past what the mirrors hold, and ends equal to the source."""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time

import psycopg
import pytest

from pgcdc.lsn import Lsn
from pgcdc.pipeline import Pipeline
from pgcdc.replication import SlotManager, SourceWatch
from pipeline_support import (
    SHOP_TABLES,
    Workload,
    assert_mirrors_equal,
    catch_up_in_process,
    pipeline_config,
    prepare_source,
    run_cli,
    run_in_background,
    start_streaming,
    wait_for,
)
from tcp_proxy import TcpProxy

pytestmark = pytest.mark.slow


def _slot_confirmed(pg, slot: str) -> Lsn | None:
    rows = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return Lsn.parse(rows[0][0]) if rows and rows[0][0] else None


@pytest.mark.long
def test_restarts_terminations_and_network_cuts_lose_nothing(pg, spark):
    pg.server.require(15, "two-phase decoding")
    if pg.server.embedded is None:
        pytest.skip("restarts need the embedded server")
    prepare_source(pg, rows=200)
    with TcpProxy("127.0.0.1", pg.server.embedded.port) as proxy:
        direct = pipeline_config(pg, spark, receive_timeout_seconds=6.0)
        config = dataclasses.replace(direct, dsn=proxy.dsn(direct.dsn))
        pipeline = Pipeline(config, spark=spark)
        faults = []
        with contextlib.ExitStack() as cleanup, Workload(pg.dsn, seed=11, survive_disconnects=True) as workload:
            runner, failures = run_in_background(pipeline)
            # stopped whatever happens: a failed assertion must not leave it reconnecting forever
            cleanup.callback(lambda: (pipeline.stop(), runner.join(timeout=300)))
            wait_for(lambda: pipeline.progress.phase == "streaming" or failures, 180,
                      f"streaming (phase {pipeline.progress.phase})")
            assert not failures, failures

            def applying_again(after: str) -> None:
                # Recovered means mirrored past what the server had written when we asked: the stream is back
                # and the workload's later commits reach the mirrors (a fixed sleep only hoped so).
                target = Lsn.parse(pg.execute("SELECT pg_current_wal_lsn()::text")[0][0])
                wait_for(lambda: (pipeline.progress.applied_lsn or 0) > target or failures, 180,
                         f"changes applied past {target} after {after} (applied {pipeline.progress.applied_lsn})")
                assert not failures, failures

            applying_again("the start")

            def fault(name, action):
                before = pipeline.progress.reconnections
                action()
                faults.append(name)
                wait_for(lambda: pipeline.progress.reconnections > before or failures, 90, f"{name} noticed")
                applying_again(name)

            fault("server restart (fast)", lambda: pg.server.restart("fast"))
            fault("server crash (immediate restart)", lambda: pg.server.restart("immediate"))
            fault("walsender terminated", lambda: pg.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s",
                (config.slot,)))

            def reset_for_a_while():
                proxy.reset()
                time.sleep(3)
                proxy.heal()
            fault("network reset for 3 s", reset_for_a_while)

            def partition_until_noticed():
                # Silence only: noticed by the receive timeout once pgcdc has read what was already on its way,
                # which can take a while when it lags behind the workload: so the partition lasts until then.
                before = pipeline.progress.reconnections
                proxy.blackhole()
                try:
                    wait_for(lambda: pipeline.progress.reconnections > before or failures, 120, "the partition noticed")
                finally:
                    proxy.heal()
            fault("silent partition", partition_until_noticed)
        assert not workload.errors, workload.errors
        pipeline.stop()
        runner.join(timeout=300)
        assert not failures, failures
    reconnections = pipeline.progress.reconnections
    catch_up_in_process(direct, spark)
    figures = assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    print(f"faults: {faults}; reconnections: {reconnections}; workload transactions: {workload.transactions} "
          f"(its own reconnections: {workload.disconnects}); {figures}")
    assert reconnections >= len(faults)


def test_status_and_heartbeat_queries_wait_on_their_own_thread_behind_a_partition(pg):
    """The slot's status and the heartbeats go over ordinary connections, which a silent partition holds until
    their timeouts: on the stream's own loop that wait came once per buffered message, so the stream took minutes
    to reach the silence that tells it the connection is gone. Beside it, asking never waits on the server."""
    if pg.server.embedded is None:
        pytest.skip("the proxy needs the embedded server's port")
    pg.execute("CREATE PUBLICATION watched_pub")  # empty: logical messages are decoded all the same
    with SlotManager(pg.dsn).create("watched", export_snapshot=False), \
            TcpProxy("127.0.0.1", pg.server.embedded.port) as proxy, \
            SourceWatch(proxy.dsn(pg.dsn), "watched", interval=0.5, query_timeout=2) as watch:
        wait_for(lambda: watch.latest() is not None, 60, "a first status")
        first = watch.latest()
        assert first is not None and first.wal_status == "reserved" and first.wal_retained_bytes is not None

        proxy.blackhole()
        wait_for(lambda: proxy.connections >= 3, 60, "queries stuck behind the partition")
        asked = time.monotonic()
        for _ in range(20):  # each query now waits its full 2 s timeout on the watch's thread
            watch.heartbeat()
            assert watch.latest() is first
        assert time.monotonic() - asked < 2

        proxy.heal()
        pg.execute("SELECT pg_switch_wal()")  # the server's position moves on
        wait_for(lambda: watch.latest().server_lsn > first.server_lsn, 60, "a status after the partition")
        watch.heartbeat()

        def heartbeats() -> int:
            rows = pg.execute("SELECT data FROM pg_logical_slot_peek_binary_changes('watched', NULL, NULL, "
                              "'proto_version', '1', 'publication_names', 'watched_pub', 'messages', 'true')")
            return sum(b"pgcdc.heartbeat" in bytes(row[0]) for row in rows)
        wait_for(lambda: heartbeats() >= 1, 60, "a heartbeat in the slot")


def test_a_full_spill_directory_stops_with_a_clear_error_and_confirms_nothing_past_the_mirrors(pg, spark, tmp_path):
    """The spill directory fills up (a file size limit on the running pipeline: writes fail with EFBIG, as
    they would with ENOSPC) while a transaction larger than the memory limit arrives."""
    pg.execute("CREATE TABLE big (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO big VALUES (0, 'before')")
    pg.execute("CREATE PUBLICATION pub FOR TABLE big")
    config = pipeline_config(pg, spark, publication="pub", spill_dir=str(tmp_path))
    catch_up_in_process(config, spark)  # the initial copy; the subject is the run below

    run = start_streaming(config, "--memory-limit", "1", "--spill-dir", str(tmp_path), timeout=180)
    process = run.process
    # only the pipeline's own process: the JVM it started keeps writing Iceberg files normally
    resource.prlimit(process.pid, resource.RLIMIT_FSIZE, (256 << 10, 256 << 10))
    with psycopg.connect(pg.dsn) as conn:  # one transaction; its commit record lies after before_commit
        conn.execute("INSERT INTO big SELECT i, repeat('v', 200) FROM generate_series(1, 30000) i")
        before_commit = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
    assert process.wait(timeout=300) != 0
    run.reader.join(timeout=10)
    output = run.output
    assert "cannot spill transaction" in output and "File too large" in output, output[-3000:]
    assert "--spill-dir" in output
    # The slot may have been confirmed up to a keepalive's position inside the transaction (safe: the server
    # resends every transaction that commits after the confirmed position), never past its commit.
    assert _slot_confirmed(pg, config.slot) <= before_commit

    # with room again, a restart gets the transaction from the server and completes the mirror
    catch_up_in_process(dataclasses.replace(config, memory_limit_bytes=1 << 20), spark)
    assert list(tmp_path.iterdir()) == []
    results = assert_mirrors_equal(config, spark, pg.dsn)
    assert results["rows_compared"] == 30001


def test_a_server_that_is_not_there_fails_fast_and_says_so(pg, spark):
    """At start-up nothing is retried: a wrong address is a configuration error (mid-stream losses are retried,
    above)."""
    config = pipeline_config(pg, spark)
    params = psycopg.conninfo.conninfo_to_dict(config.dsn)
    params["port"] = "1"
    bad = dataclasses.replace(config, dsn=psycopg.conninfo.make_conninfo(**params))
    process = run_cli(bad, "--until-caught-up")
    output, _ = process.communicate(timeout=120)
    assert process.returncode != 0
    assert "connection" in output.lower() and "Traceback" not in output, output
