"""Shared by the fault tests: a steady mixed workload, the pipeline as a subprocess, row-for-row proof."""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import psycopg

from pgcdc.demo import SCHEMA, seed_rows
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.verify import compare_publication

# small enough that the workload's larger transactions are streamed (protocol 2+) while in progress
STREAMING_SETTINGS = "-c logical_decoding_work_mem=64kB"


def run_in_background(pipeline: Pipeline) -> tuple[threading.Thread, list[BaseException]]:
    """``pipeline.run()`` started on a daemon thread (a failed assertion must not leave it running forever);
    whatever it raises lands in the returned list."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            pipeline.run(handle_signals=False)
        except BaseException as exc:
            failures.append(exc)

    runner = threading.Thread(target=run, name="pipeline", daemon=True)
    runner.start()
    return runner, failures


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` until it holds; past ``timeout`` seconds fail naming ``what`` and show every thread."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            faulthandler.dump_traceback(all_threads=True)  # where the pipeline is stuck
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def prepare_source(pg, rows: int) -> None:
    with pg.connect() as conn:
        conn.execute(SCHEMA)
        conn.execute(seed_rows(rows))


def pipeline_config(pg, spark, **overrides) -> PipelineConfig:
    # the session's warehouse, so that mirrors written by a pipeline subprocess are read back here
    warehouse = spark.conf.get("spark.sql.catalog.pgcdc.warehouse")
    values = dict(dsn=pg.dsn + f" options='{STREAMING_SETTINGS}'", publication="shop", slot="pgcdc_test",
                  warehouse=warehouse, namespace=f"m_{os.getpid()}_{random.randrange(10**9)}",
                  batch_max_seconds=1.0)
    values.update(overrides)
    return PipelineConfig(**values)


def wait_for_transactions(workload: Workload, count: int, timeout: float = 120) -> None:
    """A workload's first ``count`` transactions committed: a mix that a fixed sleep only hoped for."""
    wait_for(lambda: workload.transactions >= count or bool(workload.errors), timeout,
             f"{count} workload transactions (committed so far: {workload.transactions})")
    assert not workload.errors, workload.errors


@dataclass
class Workload:
    """Writes until stopped, in its own thread: inserts, updates, deletes, multi-table transactions, two-phase
    commits and rollbacks (the prepared state held a moment), larger streamed transactions and truncates."""

    dsn: str
    seed: int = 7
    pause: float = 0.005
    survive_disconnects: bool = False
    errors: list[BaseException] = field(default_factory=list)
    transactions: int = 0
    disconnects: int = 0
    _next_id: int = 1_000_000
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Workload:
        self._thread = threading.Thread(target=self._run, name="workload", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=60)

    def _run(self) -> None:
        rng = random.Random(self.seed)
        self._next_id = 1_000_000
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    self._finish_orphans(conn)
                    while not self._stop.is_set():
                        self._one_transaction(conn, rng)
                        self.transactions += 1
                        time.sleep(self.pause)
            except psycopg.OperationalError as exc:  # the server restarted under us: like an application, retry
                if not self.survive_disconnects:
                    self.errors.append(exc)
                    return
                self.disconnects += 1
                time.sleep(0.5)
            except BaseException as exc:  # surfaced by the test
                self.errors.append(exc)
                return

    def _finish_orphans(self, conn: psycopg.Connection) -> None:
        """Commit what a lost connection left prepared (a stuck prepared transaction would hold the slot)."""
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s AND database = "
                                   "current_database()", (f"w{self.seed}_%",)).fetchall():
            conn.execute(psycopg.sql.SQL("COMMIT PREPARED {}").format(psycopg.sql.Literal(gid)))

    def _one_transaction(self, conn: psycopg.Connection, rng: random.Random) -> None:
        choice = rng.random()
        next_id = self._next_id
        self._next_id += 1
        if choice < 0.06:
            gid = f"w{self.seed}_{next_id}"
            conn.execute("BEGIN")
            conn.execute("INSERT INTO shop.events (id, score) VALUES (%s, %s)", (next_id, rng.random()))
            conn.execute("UPDATE shop.customers SET active = NOT coalesce(active, false) WHERE id = %s",
                         (rng.randrange(1, 200),))
            conn.execute(psycopg.sql.SQL("PREPARE TRANSACTION {}").format(psycopg.sql.Literal(gid)))
            time.sleep(rng.uniform(0.05, 0.5))  # held prepared: a kill may land here
            verb = "COMMIT PREPARED" if rng.random() < 0.8 else "ROLLBACK PREPARED"
            conn.execute(psycopg.sql.SQL(verb + " {}").format(psycopg.sql.Literal(gid)))
        elif choice < 0.08:
            with conn.transaction():  # larger than logical_decoding_work_mem: streamed
                conn.execute("INSERT INTO shop.audit SELECT 'bulk', repeat('x', 40) || i, now() "
                             "FROM generate_series(1, 1500) i")
                conn.execute("UPDATE shop.orders SET notes = 'bulk ' || id WHERE id %% 5 = %s", (rng.randrange(5),))
        elif choice < 0.085:
            conn.execute("TRUNCATE shop.events")
        else:
            with conn.transaction():
                if choice < 0.5:
                    conn.execute("INSERT INTO shop.customers (id, name, balance) VALUES (%s, %s, %s)",
                                 (next_id, f"c{next_id}", rng.randrange(10**6) / 100))
                elif choice < 0.75:
                    conn.execute("UPDATE shop.customers SET balance = balance + 1 WHERE id = %s",
                                 (rng.randrange(1, next_id),))
                elif choice < 0.85:
                    conn.execute("DELETE FROM shop.customers WHERE id = %s", (rng.randrange(1, next_id),))
                else:  # one transaction over two tables, with a key change
                    conn.execute("UPDATE shop.orders SET total = total + 1 WHERE id %% 17 = %s",
                                 (rng.randrange(17),))
                    conn.execute("UPDATE shop.customers SET id = id + 5000000 WHERE id = %s",
                                 (rng.randrange(1, 300),))


def run_cli(config: PipelineConfig, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    command = [sys.executable, "-m", "pgcdc.cli", "run", "--dsn", config.dsn, "--publication", config.publication,
               "--slot", config.slot, "--warehouse", config.warehouse, "--namespace", config.namespace,
               "--batch-seconds", str(config.batch_max_seconds), "--apply", config.apply_writer, *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PGCDC_LOG_LEVEL": "WARNING", **(env or {})})


def catch_up_in_process(config: PipelineConfig, spark) -> Pipeline:
    """Mirror everything up to the server's current position with the session's Spark (no JVM start): for
    runs that only catch up before a comparison, where the process itself is not what is under test."""
    pipeline = Pipeline(config, spark=spark)
    pipeline.run(until_caught_up=True, handle_signals=False)
    return pipeline


@dataclass
class StreamingRun:
    """A ``pgcdc run`` subprocess logging at INFO, its output collected as it comes."""

    process: subprocess.Popen
    lines: list[str]
    reader: threading.Thread

    @property
    def output(self) -> str:
        return "".join(self.lines)


def start_streaming(config: PipelineConfig, *args: str, timeout: float = 600,
                    env: dict[str, str] | None = None) -> StreamingRun:
    """``pgcdc run`` started; returns once it streams the slot (its initial copy, if any, done)."""
    process = run_cli(config, *args, env={"PGCDC_LOG_LEVEL": "INFO", **(env or {})})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout or ()), daemon=True)
    reader.start()
    run = StreamingRun(process, lines, reader)
    try:
        wait_for(lambda: any("streaming slot" in line for line in lines) or process.poll() is not None, timeout,
                 "the pipeline to stream")
    except BaseException:
        process.kill()
        raise
    assert process.poll() is None, run.output[-3000:]
    return run


def run_cli_while_changing(config: PipelineConfig, change, *args: str, timeout: float = 600) -> str:
    """One ``pgcdc run`` that copies the tables, then streams what ``change(conn)`` writes once it streams; stopped
    by SIGTERM when the slot confirms everything written (so it applied it all), and it must exit cleanly."""
    from pgcdc.lsn import Lsn

    run = start_streaming(config, *args, timeout=timeout)
    process = run.process
    try:
        with psycopg.connect(config.dsn, autocommit=True) as conn:
            change(conn)
            written = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])

            def confirmed() -> Lsn:
                row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                                   (config.slot,)).fetchone()
                return Lsn.parse(row[0])
            wait_for(lambda: confirmed() >= written or process.poll() is not None, timeout,
                     f"the slot confirmed up to {written}")
        assert process.poll() is None, run.output[-3000:]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        run.reader.join(timeout=10)
    assert process.returncode == 0, run.output[-3000:]
    return run.output


def assert_mirrors_equal(config: PipelineConfig, spark, dsn: str, tables: set[str] | None = None) -> dict:
    """Every mirror equals its source row for row; returns the figures a fault test prints."""
    spark.catalog.clearCache()
    results = compare_publication(Pipeline(config, spark=spark), dsn, config.publication)
    if tables is not None:
        assert {r.table for r in results} == tables
    figures = {"tables": len(results), "rows_compared": sum(r.source_rows for r in results),
               "rows_lost": sum(r.lost for r in results), "rows_extra": sum(r.extra for r in results)}
    print(figures)
    for result in results:
        assert result.equal, result.describe()
    return figures


SHOP_TABLES = {"shop.customers", "shop.orders", "shop.events", "shop.audit", "shop.kinds"}
