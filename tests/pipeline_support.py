"""Shared by the fault tests: a steady mixed workload, the pipeline as a subprocess, row-for-row proof."""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import psycopg

from cli_support import Command, start_pgcdc
from pgcdc.demo import SCHEMA, seed_rows
from pgcdc.lsn import Lsn
from pgcdc.mirrors.status import namespace_positions
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.spark.destination import Destination
from pgcdc.verify import compare_publication

# small enough that the workload's larger transactions are streamed (protocol 2+) while in progress
STREAMING_SETTINGS = "-c logical_decoding_work_mem=64kB"
# What a fault test's workload rests between its transactions (Workload): 10 to 20 transactions a second keep
# changes of every kind in flight at each kill and fault. A flood proves nothing more, and costs: every change is
# decoded, applied (again after each restart) and compared at the end, and a slower machine, whose fault tests
# take longer, wrote more of them. make soak floods.
STEADY_PAUSE = 0.05
FLOOD_PAUSE = 0.005


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
                  batch_max_seconds=1.0)
    destination = dict(warehouse=warehouse, namespace=f"m_{os.getpid()}_{random.randrange(10**9)}")
    fields = {field.name for field in dataclasses.fields(Destination)}
    for name, value in overrides.items():  # a Destination's fields name where the mirrors go
        (destination if name in fields else values)[name] = value
    return PipelineConfig(**values, destination=Destination(**destination))


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
    pause: float = STEADY_PAUSE
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


def insert_customers(conn: psycopg.Connection, first: int, count: int, name: str) -> Lsn:
    """``count`` customers with ids from ``first`` on, named ``name``, in one transaction; returns the server's WAL
    position after it (what a slot has confirmed once it holds them)."""
    conn.execute("INSERT INTO shop.customers (id, name) SELECT g, %s FROM generate_series(%s::int, %s::int) g",
                 (name, first, first + count - 1))
    return Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])


def catalog_arguments(config: PipelineConfig) -> list[str]:
    """The flags that name ``config``'s catalog and warehouse, with its Spark settings as ``--conf``."""
    arguments = ["--warehouse", config.destination.warehouse or "warehouse", "--catalog", config.destination.catalog]
    if config.destination.catalog_type:
        arguments += ["--catalog-type", config.destination.catalog_type]
    if config.destination.catalog_uri:
        arguments += ["--catalog-uri", config.destination.catalog_uri]
    for key, value in config.destination.conf.items():
        arguments += ["--conf", f"{key}={value}"]
    return arguments


def index_arguments(config: PipelineConfig) -> list[str]:
    """The flags of ``config``'s key-index memory and directory, when it sets them."""
    arguments = [] if config.index_memory_mb is None else ["--index-memory-mb", str(config.index_memory_mb)]
    return arguments + ([] if config.index_dir is None else ["--index-dir", config.index_dir])


def run_cli(config: PipelineConfig, *args: str, env: dict[str, str] | None = None) -> Command:
    """``pgcdc run`` of ``config`` started (tests/cli_support.py), its output one stream read as it comes."""
    return start_pgcdc("run", "--dsn", config.dsn, "--publication", config.publication, "--slot", config.slot,
                       *catalog_arguments(config), "--namespace", config.destination.namespace, "--batch-seconds",
                       str(config.batch_max_seconds), "--apply", config.apply_writer, "--deletes", config.deletes,
                       *([] if config.apply_workers is None else ["--apply-workers", str(config.apply_workers)]),
                       *index_arguments(config), *args,
                       env={"PGCDC_LOG_LEVEL": "WARNING", **(env or {})})


def catch_up_in_process(config: PipelineConfig, spark) -> Pipeline:
    """Mirror everything up to the server's current position with the session's Spark (no JVM start): for
    runs that only catch up before a comparison, where the process itself is not what is under test."""
    pipeline = Pipeline(config, spark=spark)
    pipeline.run(until_caught_up=True, handle_signals=False)
    return pipeline


@dataclass
class StreamingRun:
    """A ``pgcdc run`` subprocess logging at INFO, its output collected as it comes."""

    process: Command
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


def mirror_mixed_workload(pg, spark, **overrides) -> Pipeline:
    """The initial copy, then the demo's mixed workload streamed on top of it (inserts, updates, deletes,
    large streamed and prepared transactions, truncates) into mirrors with a changelog; every mirror is then
    compared row for row, and a second run with nothing new must change nothing."""
    from pgcdc.demo import workload

    pg.server.require(16, "streaming 'parallel' and two-phase decoding")
    prepare_source(pg, rows=300)
    config = pipeline_config(pg, spark, changelog=True, **overrides)
    pipeline = Pipeline(config, spark=spark)
    copied = pipeline.snapshot()
    assert copied["shop.customers"] == 300
    with pg.connect() as conn:
        workload(conn, rows=300, large_rows=3000)
    progress = pipeline.run(until_caught_up=True, handle_signals=False)
    assert progress.rows_applied > 3000
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)

    # the slot's confirmed position never passes what the mirrors hold, and reached the end of the workload
    positions = namespace_positions(pipeline.mirrors)
    confirmed = pg.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                           (config.slot,))
    assert Lsn.parse(confirmed[0][0]) >= max(positions.values())

    # a second run with nothing new applies nothing and changes no mirror
    again = Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert again.rows_applied == 0
    assert namespace_positions(pipeline.mirrors) == positions

    changes = spark.sql(f"SELECT count(*) AS n FROM {pipeline.mirrors.changelog_identifier_for('shop', 'audit')}")
    assert changes.collect()[0].n > 0
    return pipeline


def crash_loop(pg, spark, rounds: list[str | None], seed: int, *, aim_timeout: float = 60,
               workload_pause: float = STEADY_PAUSE, copied_first: bool = False, **overrides) -> list[str]:
    """SIGKILL ``pgcdc run`` at each of ``rounds`` (an injection point spec, or None for a random instant) under
    a steady mixed workload, restart it each time, and prove that every mirror equals its source row for row;
    returns every run's output. An aimed kill not fired within ``aim_timeout`` seconds is sent at random; the
    workload rests ``workload_pause`` seconds between its transactions. ``copied_first``: the initial copy is
    made before, so that every kill lands in the stream's applies."""
    pg.server.require(15, "two-phase decoding")
    prepare_source(pg, rows=300)
    config = pipeline_config(pg, spark, **overrides)
    if copied_first:
        Pipeline(config, spark=spark).snapshot()
    rng = random.Random(seed)
    fired: dict[str, int] = {}
    outputs = []
    with Workload(pg.dsn, seed=seed, pause=workload_pause) as workload:
        wait_for_transactions(workload, 30)  # the first kill lands with changes already in flight
        for spec in rounds:
            env = {"PGCDC_INJECT": spec} if spec else {}
            process = run_cli(config, env=env)
            try:
                # an aimed kill fires by itself; a random one (or an aim the run never reached) is sent here
                process.wait(timeout=aim_timeout if spec else rng.uniform(4, 14))
            except Exception:
                process.send_signal(signal.SIGKILL)
                process.wait()
                spec = f"random instant ({spec or 'unaimed'})"
            output = process.stdout.read() if process.stdout else ""
            outputs.append(output)
            assert process.returncode == -signal.SIGKILL, f"{spec}: exited {process.returncode}\n{output}"
            fired[spec or "random"] = fired.get(spec or "random", 0) + 1
        assert not workload.errors, workload.errors
        transactions = workload.transactions
    # The last restart only catches up before the comparison: the session's Spark, not one more cold JVM.
    catch_up_in_process(config, spark)
    figures = assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    if config.destination.catalog_type is None:  # the session's local Hadoop-catalog warehouse
        # a reader that is not pgcdc reads every mirror as Spark does (on S3: tests/objectstore, via the catalog)
        from pgcdc.mirrors.catalog import MirrorCatalog
        from pyiceberg_reader import assert_reads_alike, hadoop_table

        mirrors = MirrorCatalog(spark, config.destination)
        for schema_table in SHOP_TABLES:
            identifier = mirrors.identifier_for(*schema_table.split("."))
            assert_reads_alike(spark, identifier, hadoop_table(spark, identifier))
    print(f"kills survived: {sum(fired.values())} {fired}; workload transactions: {transactions}; {figures}")
    assert figures["rows_lost"] == 0 and figures["rows_extra"] == 0
    # kills, not distinct aims: the soak run repeats each aim (a repeated snapshot aim finds the copy done)
    aimed_kills = sum(count for spec, count in fired.items() if not spec.startswith("random"))
    assert aimed_kills >= len([r for r in rounds if r]) // 2, f"most aimed kills must fire: {fired}"
    return outputs


def expire_all_but_the_newest(spark, name: str) -> None:
    """A user's own expiry: every snapshot but the current one, whoever made it."""
    cutoff = (datetime.now() + timedelta(minutes=1)).strftime("%Y-%m-%d %H:%M:%S")
    spark.sql(f"CALL pgcdc.system.expire_snapshots(table => '{name}', older_than => TIMESTAMP '{cutoff}', "
              "retain_last => 1)")
