"""The pipeline end to end: sustained apply rate and replication lag, and the initial snapshot's speed.

1. Snapshot: a table of N rows copied into Iceberg by pgcdc (Spark tasks over page ranges, inside the
   slot's exported snapshot), beside ``COPY ... TO STDOUT`` drained into nothing (the server's own limit)
   and beside Spark's JDBC reader writing the same Iceberg table. Both Spark readers first copy a
   1,000,000-row table of the same shape (100,000 with --quick), so that neither pays the one-off
   start-up (JVM compilation, Python workers) in its figure; those first copies are printed too. Each
   copy also prints the CPU it took per row, by program (PostgreSQL, the JVM, Python workers).
2. Commit cost: the fixed cost of a batch per mirror — a 1-row UPDATE applied to a mirror of 100,000 rows, as the
   pipeline applies it, by each writer (the MERGE writer is the peer), after applies that warm the JVM up: wall
   time, the CPU of the JVM's and Python's threads doing it, py4j round trips, and the time of each step.
3. Apply, once per setting (``--apply delta,merge``, ``--deletes``, ``--maintenance``, ``--consistent-every``,
   ``--batch-seconds``, ``--partition-by``: a partitioned mirror's rate is printed as a ratio to the unpartitioned
   one's), each on a fresh slot and its own mirror, one pipeline through all of that setting's phases, as a
   deployed pgcdc runs: a writer commits transactions of 100 rows (inserts and updates) while the
   pipeline streams them into Iceberg. The first phase of a fresh pipeline (the JVM compiling the commit path,
   the first batches) is the warm-up, reported apart. Then ``--repeat`` unpaced phases (rows/s from commit to
   Iceberg commit, the CPU per applied row by program), and as many paced at 50% and 90% of their median rate
   (lag from each source commit to the applied batch holding it: p50, p99), each printed as median (min-max).
   Beside each: what ran beside the apply (maintenance turns, the catalog reads before each batch, consistent
   tag moves: count and seconds), the garbage collectors' time in the JVM and in Python, the machine's load and
   the CPU other processes took, and the apply thread's time per step (what bounds the figure).
CPU counts only this bench's processes (itself, its PostgreSQL, Spark's JVM and Python workers, the S3 server:
"other"), not the rest of the machine. ``--store s3-jdbc`` runs it all (pgcdc's snapshot, the JDBC reader's
Iceberg table, the apply) with the warehouse on a local S3 server behind Iceberg's JDBC catalog
(:mod:`pgcdc.local_object_store`); raw COPY stays the peer.
Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import psycopg
import pyarrow as pa
from catchup import cpu_per_change, cpu_seconds  # CPU of this bench's process tree, by program

from pgcdc.apply.batch import DELETES, WRITERS
from pgcdc.embedded import EmbeddedPostgres
from pgcdc.lsn import Lsn
from pgcdc.mirrors.maintenance import MaintenancePolicy
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.spark.destination import Destination
from pgcdc.spark.session import spark_session
from pgcdc.spark.settings import iceberg_runtime_jar

TABLE = """
CREATE TABLE big (id bigint PRIMARY KEY, a int, b text, c numeric(12, 2), d timestamptz, e bool, f float8,
                  g uuid, h jsonb, i date);
CREATE TABLE flow (id bigint PRIMARY KEY, n int, note text, at timestamptz);
CREATE TABLE warm (LIKE big INCLUDING ALL);
CREATE PUBLICATION snap FOR TABLE big;
CREATE PUBLICATION warm FOR TABLE warm;
CREATE PUBLICATION flow FOR TABLE flow;
"""
FILL = """
INSERT INTO {table} SELECT i, i %% 1000, 'name ' || i, i * 1.25, now(), i %% 2 = 0, i / 3.0, md5(i::text)::uuid,
       jsonb_build_object('k', i), date '2024-01-01' + (i %% 365)::int
FROM generate_series(%s::bigint, %s::bigint) i
"""
JDBC_JAR = Path("/usr/share/java/postgresql.jar")


BUCKET = "pgcdc-bench"
DRIVER = {"pgcdc": "driver"}  # catchup's name for this process: here the writer thread and pgcdc's driver


def cpu_text(used: dict[str, float]) -> str:
    return f"CPU µs/row: {', '.join(f'{program} {value:.2f}' for program, value in used.items())} " \
           f"(total {sum(used.values()):.2f})"


def raw_copy_rate(dsn: str, rows: int) -> float:
    with psycopg.connect(dsn) as conn:
        started = time.perf_counter()
        with conn.cursor().copy("COPY big TO STDOUT") as copy:
            for _ in copy:
                pass
        return rows / (time.perf_counter() - started)


def pgcdc_snapshot_rate(dsn: str, spark, store: dict, rows: int, table: str = "big",
                        rows_per_task: int | None = None) -> float:
    publication = "snap" if table == "big" else table
    tasks = {"snapshot_rows_per_task": rows_per_task} if rows_per_task else {}
    pipeline = Pipeline(PipelineConfig(dsn=dsn, publication=publication, slot=f"bench_{publication}", **tasks,
                                       destination=Destination(namespace=f"bench_{publication}", **store)),
                        spark=spark)
    started = time.perf_counter()
    copied = pipeline.snapshot()
    seconds = time.perf_counter() - started
    assert copied[f"public.{table}"] == rows, copied
    return rows / seconds


def ensure_jdbc_driver() -> str | None:
    if JDBC_JAR.exists():
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "the PostgreSQL JDBC driver (Debian: libpostgresql-jdbc-java) is not installed"
    result = subprocess.run(["apt-get", "install", "-y", "-q", "libpostgresql-jdbc-java"], capture_output=True,
                            text=True, timeout=600)
    if result.returncode != 0 or not JDBC_JAR.exists():
        return f"installing libpostgresql-jdbc-java failed: {result.stderr.strip()[-200:]}"
    return None


def jdbc_rate(server: EmbeddedPostgres, spark, catalog: str, rows: int, table: str = "big") -> float:
    url = f"jdbc:postgresql://{server.host}:{server.port}/postgres"
    frame = spark.read.jdbc(url, table, column="id", lowerBound=0, upperBound=rows, numPartitions=2,
                            properties={"user": "postgres", "driver": "org.postgresql.Driver", "fetchsize": "10000"})
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {catalog}.bench_jdbc")
    started = time.perf_counter()
    frame.writeTo(f"{catalog}.bench_jdbc.{table}").using("iceberg").createOrReplace()
    return rows / (time.perf_counter() - started)


class Writer(threading.Thread):
    """Commits transactions of 100 rows into ``flow`` (paced when ``rate`` is set): 80 inserts and 20 updates, of
    recent rows, or of rows drawn at random among ids 1 to ``updates_over`` when it is set; records (commit time,
    commit LSN) of each."""

    def __init__(self, dsn: str, seconds: float, rate: float | None, first_id: int,
                 updates_over: int | None = None) -> None:
        super().__init__(daemon=True)
        self.dsn, self.seconds, self.rate, self.next_id = dsn, seconds, rate, first_id
        self.updates_over = updates_over
        self.random = random.Random(first_id)
        self.commits: list[tuple[float, Lsn]] = []
        self.rows = 0

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            started = time.monotonic()
            while time.monotonic() - started < self.seconds:
                with conn.transaction():
                    conn.execute("INSERT INTO flow SELECT i, i %% 7, 'row ' || i, now() FROM "
                                 "generate_series(%s::bigint, %s::bigint) i", (self.next_id, self.next_id + 79))
                    if self.updates_over:
                        conn.execute("UPDATE flow SET n = n + 1 WHERE id = ANY(%s)",
                                     (self.random.sample(range(1, self.updates_over + 1), 20),))
                    else:
                        conn.execute("UPDATE flow SET n = n + 1 WHERE id BETWEEN %s AND %s",
                                     (self.next_id - 200, self.next_id - 181))
                    # a position inside the transaction: below its end LSN, which the pipeline reports once
                    # the transaction is in the mirror (a position read after the commit may be past any
                    # transaction's end when other WAL follows, and would never be reached)
                    lsn = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
                self.commits.append((time.monotonic(), Lsn.parse(lsn)))
                self.next_id += 80
                self.rows += 100
                if self.rate:
                    due = started + self.rows / self.rate
                    time.sleep(max(0.0, due - time.monotonic()))


class PythonGc:
    """Seconds this process has spent collecting garbage (``gc.callbacks``), every thread's collections."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._began: float | None = None
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None


def jvm_gc_seconds(spark) -> float:
    """Seconds Spark's JVM has spent collecting garbage, all collectors."""
    beans = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
    return sum(int(bean.getCollectionTime()) for bean in beans) / 1000


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (every process, every core; /proc/stat)."""
    with open("/proc/stat") as stat:
        values = [int(v) for v in stat.readline().split()[1:9]]
    return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")


BESIDE = ("maintenance_turns", "maintenance_seconds", "tag_moves", "tag_move_seconds", "catalog_checks",
          "catalog_check_seconds")


@dataclass
class Reading:
    """What the pipeline, both processes' collectors and the machine had done at one moment."""

    at: float
    progress: dict[str, float]
    steps: dict[str, float]
    jvm_gc: float
    python_gc: float
    cpu: Counter
    machine_cpu: float

    @classmethod
    def now(cls, pipeline: Pipeline, spark, python_gc: PythonGc, roots: list[int]) -> Reading:
        progress = pipeline.progress
        return cls(time.monotonic(), {name: getattr(progress, name) for name in (*BESIDE, "rows_applied",
                                                                                 "batches_applied")},
                   dict(progress.apply_step_seconds), jvm_gc_seconds(spark), python_gc.seconds, cpu_seconds(roots),
                   machine_cpu_seconds())


@dataclass
class Phase:
    rows_per_s: float  # from the first commit to the mirror holding the last
    lags: list[float]  # per source transaction: seconds from its commit to the mirror commit holding it reported
    next_id: int
    rows: int
    written_per_s: float  # what the writer committed while it ran
    batches: int
    beside: dict[str, float]  # what ran beside the apply meanwhile (BESIDE), GC, the machine's load
    steps: dict[str, float]  # the apply thread's seconds per step of the applies (pgcdc.apply.steps)
    cpu: dict[str, float]  # µs per applied row, by program of this bench
    first_applied_s: float  # from the writer's first commit to the first applied batch
    seconds: float  # from the writer's start to the mirror holding its last commit


class RunningPipeline:
    """One pipeline streaming ``flow`` from a fresh slot through every phase of one configuration, as a deployed
    pgcdc runs: its JVM, key index and maintenance schedule carry over from phase to phase."""

    def __init__(self, server: EmbeddedPostgres, spark, store: dict, label: str, python_gc: PythonGc,
                 roots: list[int], *, slot: str | None = None, **settings) -> None:
        self.spark, self.python_gc, self.roots = spark, python_gc, roots
        self.slot = slot or "bench_flow_" + "".join(c if c.isalnum() or c == "_" else "_" for c in label.lower())
        self.dsn = server.dsn
        self.applied: list[tuple[float, Lsn]] = []
        # the pipeline makes its slot and copies the table (the rows earlier settings wrote) before it streams: the
        # copy is behind it when the first phase starts (a slot given is one whose mirror was copied already)
        config = PipelineConfig(dsn=server.dsn, publication="flow", slot=self.slot,
                                destination=Destination(namespace=self.slot, **store), **settings)
        self.pipeline = Pipeline(config, spark=spark, on_progress=self._on_progress)
        self.failures: list[BaseException] = []
        self.runner = threading.Thread(target=self._run, daemon=True)
        self.runner.start()
        while self.pipeline.progress.phase != "streaming":
            self._check_alive()
            time.sleep(0.1)
        time.sleep(1)  # the run's start (tags settled, watch thread) is behind it before the load starts

    def _on_progress(self, progress) -> None:
        if progress.applied_lsn is not None and (not self.applied or self.applied[-1][1] != progress.applied_lsn):
            self.applied.append((time.monotonic(), progress.applied_lsn))

    def _run(self) -> None:
        try:
            self.pipeline.run(handle_signals=False)
        except BaseException as exc:  # reported by the waiting loops
            self.failures.append(exc)

    def _check_alive(self) -> None:
        if not self.runner.is_alive():
            raise RuntimeError(f"the pipeline stopped: {self.failures[0] if self.failures else 'no error'}")

    def phase(self, seconds: float, rate: float | None, first_id: int, updates_over: int | None = None) -> Phase:
        """The writer for ``seconds`` (paced at ``rate`` rows/s, or unpaced), until the mirror holds it all."""
        before = Reading.now(self.pipeline, self.spark, self.python_gc, self.roots)
        writer = Writer(self.dsn, seconds, rate, first_id, updates_over)
        started = time.monotonic()
        writer.start()
        writer.join()
        target = writer.commits[-1][1]
        while not self.applied or self.applied[-1][1] < target:
            self._check_alive()
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        after = Reading.now(self.pipeline, self.spark, self.python_gc, self.roots)
        rows = int(after.progress["rows_applied"] - before.progress["rows_applied"])
        lags = []
        for committed_at, lsn in writer.commits:
            mirrored_at = next(t for t, applied_lsn in self.applied if applied_lsn >= lsn)
            lags.append(max(0.0, mirrored_at - committed_at))
        span = after.at - before.at
        own = sum(after.cpu.values()) - sum(before.cpu.values())
        beside = {name: after.progress[name] - before.progress[name] for name in BESIDE}
        beside.update(jvm_gc_seconds=after.jvm_gc - before.jvm_gc, python_gc_seconds=after.python_gc - before.python_gc,
                      load=os.getloadavg()[0],
                      other_cores=max(0.0, (after.machine_cpu - before.machine_cpu - own) / span))
        steps = {step: seconds - before.steps.get(step, 0.0) for step, seconds in after.steps.items()
                 if seconds - before.steps.get(step, 0.0) > 0}
        first = next((t for t, lsn in self.applied if t >= started), started) - writer.commits[0][0]
        return Phase(rows / elapsed, lags, writer.next_id, rows, writer.rows / seconds,
                     int(after.progress["batches_applied"] - before.progress["batches_applied"]), beside, steps,
                     cpu_per_change(before.cpu, after.cpu, max(rows, 1)), first, elapsed)

    def stop(self, *, drop: bool = True) -> None:
        self.pipeline.stop()
        self.runner.join(timeout=120)
        if drop:
            drop_slot(self.dsn, self.slot)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def drop_slot(dsn: str, slot: str) -> None:
    """Drop a slot once its walsender has gone (a stopped pipeline's ends a moment later)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(100):
            active = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
            if active is None:
                return
            if not active[0]:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                return
            time.sleep(0.1)


@dataclass(frozen=True)
class ApplySetting:
    """One configuration of the apply the bench measures (each its own slot, mirror and figures)."""

    writer: str
    deletes: str
    maintenance: bool
    consistent_seconds: float | None
    batch_seconds: float
    partition_by: str | None = None  # the mirror's partition spec (None: unpartitioned)

    def text(self) -> str:
        tags = "no consistent tags" if self.consistent_seconds is None else (
            "consistent tags after every batch" if self.consistent_seconds == 0 else
            f"consistent tags every {self.consistent_seconds:g}s")
        deletes = f", {self.deletes} deletes" if self.writer == "delta" else ""
        partitioned = f", partitioned by {self.partition_by}" if self.partition_by else ""
        return (f"{self.writer} writer{deletes}, maintenance {'on' if self.maintenance else 'off'}, {tags}, "
                f"batch clock {self.batch_seconds:g}s{partitioned}")


def spread(values: list[float], unit: str = "", digits: int = 0) -> str:
    """median (min-max)"""
    fmt = f",.{digits}f"
    return (f"{statistics.median(values):{fmt}}{unit} ({min(values):{fmt}}-{max(values):{fmt}}{unit})"
            if len(values) > 1 else f"{values[0]:{fmt}}{unit}")


def beside_text(phases: list[Phase]) -> str:
    def median(name: str) -> float:
        return statistics.median(phase.beside[name] for phase in phases)

    return (f"maintenance turns {median('maintenance_turns'):g} ({median('maintenance_seconds'):.1f}s), "
            f"catalog checks {median('catalog_checks'):g} ({median('catalog_check_seconds'):.2f}s), "
            f"tag moves {median('tag_moves'):g} ({median('tag_move_seconds'):.2f}s), "
            f"GC JVM {median('jvm_gc_seconds'):.2f}s, Python {median('python_gc_seconds'):.2f}s; "
            f"machine load {median('load'):.1f}, other processes {median('other_cores'):.1f} cores")


def steps_text(phases: list[Phase]) -> str:
    """The apply thread's time per step over the phases, as µs per applied row, largest first."""
    rows = sum(phase.rows for phase in phases) or 1
    total: Counter = Counter()
    for phase in phases:
        total.update(phase.steps)
    return ", ".join(f"{step} {seconds * 1e6 / rows:.1f}" for step, seconds in total.most_common())


LAG_GOALS = (0.5, 1.0)  # p50, p99 seconds at 90% load (issue 29)


def bound_text(phases: list[Phase], clock: float) -> str:
    """What the lag of these phases is made of, per batch: the wait for the batch clock, the apply (its largest
    step), what held the apply thread besides (maintenance, tag moves), and the machine's load."""
    batches = sum(phase.batches for phase in phases) or 1
    steps: Counter = Counter()
    for phase in phases:
        steps.update(phase.steps)
    apply = sum(steps.values()) / batches
    largest, largest_s = steps.most_common(1)[0] if steps else ("-", 0.0)
    seconds = sum(phase.seconds for phase in phases)
    busy = (sum(steps.values()) + sum(p.beside["maintenance_seconds"] + p.beside["tag_move_seconds"]
                                      for p in phases)) / seconds
    return (f"a batch waits up to {clock:g}s for the clock, then applies in {apply:.2f}s ({largest} "
            f"{largest_s / batches:.2f}s); the apply thread busy {busy:.0%} of the time, maintenance "
            f"{statistics.median(p.beside['maintenance_seconds'] for p in phases):.1f}s and tag moves "
            f"{statistics.median(p.beside['tag_move_seconds'] for p in phases):.1f}s a phase; machine load "
            f"{statistics.median(p.beside['load'] for p in phases):.1f} on {os.cpu_count()} cores")


def lag_figures(label: str, share: float, phases: list[Phase], figures: dict[str, object]) -> str:
    p50s = [percentile(phase.lags, 0.5) for phase in phases]
    p99s = [percentile(phase.lags, 0.99) for phase in phases]
    suffix = "" if share == 0.9 else f"_at_{share:.0%}".replace("%", "pct")
    figures.update({f"lag_p50_s{suffix}_{label}": round(statistics.median(p50s), 2),
                    f"lag_p99_s{suffix}_{label}": round(statistics.median(p99s), 2),
                    f"lag_p99_s{suffix}_max_{label}": round(max(p99s), 2)})
    return f"p50 {spread(p50s, 's', 2)}, p99 {spread(p99s, 's', 2)}"


def apply_phases(server: EmbeddedPostgres, spark, store: dict, setting: ApplySetting, seconds: float, repeat: int,
                 first_id: int, roots: list[int], python_gc: PythonGc, figures: dict[str, object], label: str) -> int:
    """A warm-up phase of a fresh pipeline, reported apart; then ``repeat`` unpaced phases, and ``repeat`` phases
    paced at 50% and 90% of their median rate; returns the next free id."""
    running = RunningPipeline(server, spark, store, label, python_gc, roots, apply_writer=setting.writer,
                              deletes=setting.deletes, consistent_seconds=setting.consistent_seconds,
                              batch_max_seconds=setting.batch_seconds,
                              maintenance=MaintenancePolicy(enabled=setting.maintenance),
                              partition_by={"public.flow": setting.partition_by} if setting.partition_by else {})
    print(f"{setting.text()}:", flush=True)
    try:
        warm = running.phase(seconds, None, first_id)
        next_id = warm.next_id
        figures[f"warmup_rows_per_s_{label}"] = round(warm.rows_per_s)
        print(f"  warm-up (a fresh pipeline's first {seconds:g}s, unpaced): {warm.rows_per_s:,.0f} rows/s, first batch "
              f"applied {warm.first_applied_s:.1f}s after the first commit, lag p50 {percentile(warm.lags, 0.5):.1f}s "
              f"p99 {percentile(warm.lags, 0.99):.1f}s; {cpu_text(warm.cpu)}", flush=True)
        unpaced = []
        for _ in range(repeat):
            unpaced.append(running.phase(seconds, None, next_id))
            next_id = unpaced[-1].next_id
        rates = [phase.rows_per_s for phase in unpaced]
        rate = statistics.median(rates)
        used = {program: round(statistics.median(phase.cpu.get(program, 0.0) for phase in unpaced), 2)
                for program in unpaced[0].cpu}
        figures.update({f"apply_rows_per_s_{label}": round(rate), f"apply_rows_per_s_min_{label}": round(min(rates)),
                        f"apply_rows_per_s_max_{label}": round(max(rates)),
                        f"written_rows_per_s_{label}": round(statistics.median(p.written_per_s for p in unpaced))})
        figures.update({f"{DRIVER.get(program, program).replace(' ', '_')}_us_per_row_{label}": value
                        for program, value in used.items()})
        print(f"  steady state, {repeat} repeats of {seconds:g}s, median (min-max):", flush=True)
        print(f"    apply under an unpaced writer: {spread(rates, ' rows/s')} from source commit to Iceberg commit "
              f"(the writer committed {statistics.median(p.written_per_s for p in unpaced):,.0f} rows/s), "
              f"{statistics.median(p.batches for p in unpaced):g} batches a phase", flush=True)
        print(f"    {cpu_text(used)} (pgcdc: this process, the writer and pgcdc's driver"
              f"{'; other: the S3 server' if 'other' in used else ''})", flush=True)
        print(f"    beside it: {beside_text(unpaced)}", flush=True)
        print(f"    apply thread, µs per applied row by step: {steps_text(unpaced)}", flush=True)
        paced: dict[float, list[Phase]] = {0.5: [], 0.9: []}
        for _ in range(repeat):
            for share in paced:
                paced[share].append(running.phase(seconds, rate * share, next_id))
                next_id = paced[share][-1].next_id
        for share, phases in paced.items():
            print(f"    lag at {share:.0%} of that rate: {lag_figures(label, share, phases, figures)}; "
                  f"{statistics.median(p.batches for p in phases):g} batches a phase", flush=True)
            p50 = statistics.median(percentile(p.lags, 0.5) for p in phases)
            p99 = statistics.median(percentile(p.lags, 0.99) for p in phases)
            met = p50 <= LAG_GOALS[0] and p99 <= LAG_GOALS[1]
            print(f"      {'within' if met else 'outside'} the goal (p50 <= {LAG_GOALS[0]:g}s, p99 <= "
                  f"{LAG_GOALS[1]:g}s): {bound_text(phases, setting.batch_seconds)}", flush=True)
            print(f"      beside it: {beside_text(phases)}", flush=True)
            print(f"      apply thread, µs per applied row by step: {steps_text(phases)}", flush=True)
    finally:
        running.stop()
    return next_id


COMMIT_SCHEMA = pa.schema([("id", pa.int64()), ("n", pa.int32()), ("note", pa.string()),
                           ("at", pa.timestamp("us", tz="UTC"))])


def one_row_batch(lsn: int, ids: list[int], op: str) -> pa.Table:
    """A change table (pgcdc.change_table) of ``op`` on ``ids``, all in the transaction committed at ``lsn``."""
    from pgcdc.change_table import ChangeColumns, change_schema

    schema = change_schema(COMMIT_SCHEMA, ("id",))
    count = len(ids)
    given = {"id": pa.array(ids, pa.int64()), "n": pa.array([i % 7 for i in ids], pa.int32()),
             "note": pa.array([f"row {i}" for i in ids]), ChangeColumns.OP: pa.array([op] * count),
             ChangeColumns.LSN: pa.array([lsn] * count, pa.int64()),
             ChangeColumns.ORDINAL: pa.array(range(count), pa.int64())}
    return pa.Table.from_arrays([given.get(f.name, pa.nulls(count, f.type)) for f in schema], schema=schema)


class RoundTrips:
    """py4j round trips from this process to the JVM, counted while ``counting``."""

    def __init__(self) -> None:
        from py4j.clientserver import ClientServerConnection

        self.count = 0
        self.counting = False
        send = ClientServerConnection.send_command
        trips = self

        def counted(connection, command):
            if trips.counting:
                trips.count += 1
            return send(connection, command)

        ClientServerConnection.send_command = counted


def apply_as_pipeline(spark, mirrors, mirror, writer: str, lsn: int, changes: pa.Table) -> dict[str, float]:
    """``changes`` applied to ``mirror`` and its position recorded, as the pipeline's apply thread does
    (pgcdc.pipeline.applier.SparkMirrors); returns the seconds of each step."""
    from pgcdc.apply.batch import apply_changes

    with mirrors.positions.recording(mirror.identifier, before=mirror.position, upto=Lsn(lsn),
                                     held=lambda: mirror.position, whole=False, deferred=True) as recording:
        applied = apply_changes(spark, mirror, changes, lsn=Lsn(lsn), writer=writer,
                                before_merge=recording.mark_pending)
        if applied.recorded:
            recording.written_by_commit()
        mirror.position = applied.position
        started = time.perf_counter()
    return {**applied.seconds, "record": time.perf_counter() - started}


def commit_cost(spark, store: dict, applies: int, figures: dict[str, object]) -> None:
    """The fixed cost of a batch per mirror: a 1-row UPDATE applied, as the pipeline applies it, to a mirror of
    100,000 rows, by each writer (the MERGE writer is the peer), after a few applies that warm the JVM up."""
    from pyspark.sql.types import IntegerType, LongType, StringType, StructField, StructType, TimestampType

    from pgcdc.mirrors.catalog import MirrorCatalog, TableSpec

    trips = RoundTrips()
    threads = spark.sparkContext._jvm.java.lang.management.ManagementFactory.getThreadMXBean()
    schema = StructType([StructField("id", LongType()), StructField("n", IntegerType()),
                         StructField("note", StringType()), StructField("at", TimestampType())])
    print(f"commit cost: a 1-row batch applied to a mirror of 100,000 rows, {applies} times after 10 warm-up applies "
          f"(median; wall time on this machine, CPU of the apply's own threads)", flush=True)
    per_writer: dict[str, float] = {}
    for writer in WRITERS:
        mirrors = MirrorCatalog(spark, Destination(namespace=f"bench_commit_{writer}", **store))
        mirror = mirrors.ensure(TableSpec("public", "flow", schema, ("id",)))

        apply_as_pipeline(spark, mirrors, mirror, writer, 10, one_row_batch(10, list(range(100_000)), "I"))
        walls, jvm, python, counts = [], [], [], []
        steps: dict[str, list[float]] = {}
        for number in range(10 + applies):
            lsn = 100 + number
            changes = one_row_batch(lsn, [number * 997 % 100_000], "U")
            jvm_before, python_before = int(threads.getCurrentThreadCpuTime()), time.thread_time()
            trips.count, trips.counting = 0, True
            started = time.perf_counter()
            seconds = apply_as_pipeline(spark, mirrors, mirror, writer, lsn, changes)
            wall = time.perf_counter() - started
            trips.counting = False
            jvm_used = (int(threads.getCurrentThreadCpuTime()) - jvm_before) / 1e9
            if number < 10:
                continue
            walls.append(wall)
            jvm.append(jvm_used)
            python.append(time.thread_time() - python_before)
            counts.append(trips.count)
            for step, value in seconds.items():
                steps.setdefault(step, []).append(value)
        wall = statistics.median(walls)
        per_writer[writer] = wall
        figures.update({f"commit_s_{writer}": round(wall, 4), f"commit_jvm_cpu_s_{writer}": round(
            statistics.median(jvm), 4), f"commit_python_cpu_s_{writer}": round(statistics.median(python), 4),
            f"commit_round_trips_{writer}": statistics.median(counts)})
        breakdown = ", ".join(f"{step} {statistics.median(values) * 1000:.1f}"
                              for step, values in sorted(steps.items(), key=lambda kv: -statistics.median(kv[1])))
        print(f"  {writer:5s} writer: {wall * 1000:,.0f} ms a batch ({spread([w * 1000 for w in walls], ' ms')}); "
              f"CPU: JVM {statistics.median(jvm) * 1000:.0f} ms (the apply's py4j thread), Python "
              f"{statistics.median(python) * 1000:.0f} ms; {statistics.median(counts):g} round trips to the JVM",
              flush=True)
        print(f"    ms by step: {breakdown}", flush=True)
    if "merge" in per_writer and "delta" in per_writer:
        figures["commit_ratio_vs_merge"] = round(per_writer["delta"] / per_writer["merge"], 2)
        print(f"  row-delta writer: {per_writer['delta'] / per_writer['merge']:.2f}x the MERGE writer's time",
              flush=True)


def apply_label(setting: ApplySetting, settings: list[ApplySetting]) -> str:
    """The figures' name of a setting: its writer, and whatever else varies among the settings measured."""
    parts = [setting.writer]
    if setting.writer == "delta" and setting.deletes != "position":  # pgcdc's default goes unnamed
        parts.append(setting.deletes)
    if len({s.maintenance for s in settings}) > 1:
        parts.append("maintenance_" + ("on" if setting.maintenance else "off"))
    if len({s.consistent_seconds for s in settings}) > 1:
        parts.append("tags_" + ("off" if setting.consistent_seconds is None else f"{setting.consistent_seconds:g}s"))
    if len({s.batch_seconds for s in settings}) > 1:
        parts.append(f"clock_{setting.batch_seconds:g}s")
    if len({s.partition_by for s in settings}) > 1:
        parts.append("partitioned_" + "".join(c if c.isalnum() else "_" for c in setting.partition_by).strip("_")
                     if setting.partition_by else "unpartitioned")
    return "_".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="300,000-row snapshot, 10-second load phases, 20 "
                                                               "commit-cost applies")
    parser.add_argument("--only", help="the parts to measure, comma-separated among snapshot, commit-cost, apply "
                                       "(default all)")
    parser.add_argument("--store", choices=("local", "s3-jdbc"), default="local",
                        help="where the Iceberg warehouse lives: a local directory (default), or a local S3 server "
                             "behind Iceberg's JDBC catalog on the bench's PostgreSQL")
    parser.add_argument("--apply", default=",".join(WRITERS),
                        help=f"the apply writers to measure, one after the other (default {','.join(WRITERS)})")
    parser.add_argument("--deletes", default="position,equality",
                        help="how the delta writer removes rows, comma-separated to measure each in the same run "
                             "(default position,equality: pgcdc's default beside equality deletes)")
    parser.add_argument("--maintenance", default="on", help="on, off, or on,off: maintenance while streaming")
    parser.add_argument("--batch-seconds", default=f"{PipelineConfig.batch_max_seconds:g}",
                        help="the batch clock, comma-separated to measure several "
                             f"(default pgcdc's, {PipelineConfig.batch_max_seconds:g})")
    parser.add_argument("--repeat", type=int, default=3, help="repeats of each apply phase (median and spread)")
    parser.add_argument("--commit-applies", type=int, help="1-row applies the commit cost is the median of "
                                                             "(default 60; 20 with --quick)")
    parser.add_argument("--master", help="a Spark master to run on (e.g. spark://127.0.0.1:7077 of a standalone "
                                         "cluster); default local[*]")
    parser.add_argument("--executors", type=int, help="with a cluster --master: executors of one core to use")
    parser.add_argument("--rows-per-task", type=int, help="rows per snapshot task (default: pgcdc's)")
    parser.add_argument("--consistent-every", default=f"{PipelineConfig.consistent_seconds:g}",
                        help="seconds between moves of the consistent tags, or off; comma-separated to measure the "
                             "apply under each, one after the other (e.g. off,10,0; default pgcdc's)")
    parser.add_argument("--partition-by", action="append",
                        help="the mirror's partition spec (e.g. 'days(at)', 'bucket(16, id)'; none: unpartitioned); "
                             "repeat it to measure the apply under each, one after the other (default: none)")
    args = parser.parse_args()
    parts = {"snapshot", "commit-cost", "apply"}
    only = parts if args.only is None else {p.strip() for p in args.only.split(",") if p.strip()}
    if not only or not only <= parts:
        parser.error(f"--only takes parts among {', '.join(sorted(parts))}, comma-separated; got {args.only!r}")
    try:
        tag_settings = [None if v.strip() == "off" else float(v) for v in args.consistent_every.split(",")]
        clocks = [float(v) for v in args.batch_seconds.split(",")]
    except ValueError:
        parser.error(f"--consistent-every takes seconds or off, --batch-seconds seconds, comma-separated; got "
                     f"{args.consistent_every!r}, {args.batch_seconds!r}")
    writers = [w.strip() for w in args.apply.split(",") if w.strip()]
    if not writers or any(w not in WRITERS for w in writers):
        parser.error(f"--apply takes writers among {', '.join(WRITERS)}, comma-separated; got {args.apply!r}")
    deletes = [d.strip() for d in args.deletes.split(",") if d.strip()]
    if not deletes or any(d not in DELETES for d in deletes):
        parser.error(f"--deletes takes {', '.join(DELETES)}, comma-separated; got {args.deletes!r}")
    maintenance = [m.strip() for m in args.maintenance.split(",") if m.strip()]
    if not maintenance or any(m not in ("on", "off") for m in maintenance):
        parser.error(f"--maintenance takes on, off or on,off; got {args.maintenance!r}")
    if args.repeat < 1:
        parser.error("--repeat takes 1 or more")
    partitionings = [None if spec.strip().lower() == "none" else spec.strip() for spec in args.partition_by or ["none"]]
    settings = [ApplySetting(writer, deleting, on == "on", tags, clock, partitioning)
                for writer in writers for deleting in (deletes if writer == "delta" else ["position"])
                for on in maintenance for tags in tag_settings for clock in clocks for partitioning in partitionings]
    cluster_conf = {"spark.executor.cores": "1", "spark.cores.max": str(args.executors),
                    "spark.executor.memory": "768m"} if args.executors else {}
    rows = 300_000 if args.quick else 5_000_000
    warm_rows = 100_000 if args.quick else 1_000_000
    phase_seconds = 10.0 if args.quick else 60.0
    commit_applies = args.commit_applies or (20 if args.quick else 60)
    notes: dict[str, str] = {}
    figures: dict[str, object] = {"store": args.store, "master": args.master or "local[*]",
                                  "executors": args.executors, "snapshot_rows": rows, "snapshot_rows_per_s": None,
                                  "copy_rows_per_s": None, "jdbc_rows_per_s": None, "snapshot_ratio_vs_copy": None,
                                  "snapshot_ratio_vs_jdbc": None}
    jdbc_problem = ensure_jdbc_driver() if "snapshot" in only else None
    warehouse = tempfile.mkdtemp(prefix="pgcdc-bench-")
    jars = [str(iceberg_runtime_jar())] + ([str(JDBC_JAR)] if JDBC_JAR.exists() else [])
    with EmbeddedPostgres(settings={"max_wal_size": "8GB"}) as server, contextlib.ExitStack() as stack:
        roots = [os.getpid()] + ([server.pid] if server.pid else [])
        if args.store == "s3-jdbc":
            from pgcdc.local_object_store import s3_jdbc_store

            s3, setup = stack.enter_context(s3_jdbc_store(server.dsn, BUCKET))
            store: dict = setup.config_overrides()
            catalog = setup.catalog
            spark = spark_session(Destination(master=args.master, **{**store, "conf": {**setup.spark_conf,
                                                                                       **cluster_conf}}))
            print(f"store: {setup.warehouse} on a local S3 server ({s3.endpoint}), Iceberg's JDBC catalog at "
                  f"{setup.catalog_uri}", flush=True)
        else:
            store, catalog = {}, "pgcdc"
            spark = spark_session(Destination(warehouse=str(warehouse), master=args.master,
                                              conf={"spark.jars": ",".join(jars), **cluster_conf}))
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(TABLE)
        if "snapshot" in only:
            with psycopg.connect(server.dsn, autocommit=True) as conn:
                for start in range(0, rows, 500_000):
                    conn.execute(FILL.format(table="big"), (start, min(rows, start + 500_000) - 1))
                conn.execute(FILL.format(table="warm"), (0, warm_rows - 1))
                conn.execute("VACUUM ANALYZE big")
                conn.execute("VACUUM ANALYZE warm")
            # Both Spark readers first copy a small table: neither figure then holds the JVM's compilation of
            # the Iceberg writer or the start of Python workers (one-off seconds, whichever runs first pays).
            cold = pgcdc_snapshot_rate(server.dsn, spark, store, warm_rows, "warm")
            cold_jdbc = jdbc_rate(server, spark, catalog, warm_rows, "warm") if not jdbc_problem else None
            print(f"warm-up on {warm_rows:,} rows: pgcdc {cold:,.0f} rows/s"
                  + (f", JDBC {cold_jdbc:,.0f} rows/s" if cold_jdbc else ""), flush=True)
            figures["snapshot_warmup_rows_per_s"] = round(cold)
            cpu = cpu_seconds(roots)
            copy_rate = raw_copy_rate(server.dsn, rows)
            copy_cpu = cpu_text(cpu_per_change(cpu, cpu_seconds(roots), rows))
            cpu = cpu_seconds(roots)
            snapshot_rate = pgcdc_snapshot_rate(server.dsn, spark, store, rows, rows_per_task=args.rows_per_task)
            snapshot_cpu = cpu_text(cpu_per_change(cpu, cpu_seconds(roots), rows))
            figures.update(snapshot_rows_per_s=round(snapshot_rate), copy_rows_per_s=round(copy_rate),
                           snapshot_ratio_vs_copy=round(snapshot_rate / copy_rate, 2))
            print(f"snapshot of {rows:,} rows (10 columns), warehouse: {args.store}")
            print(f"  COPY TO STDOUT, drained          {copy_rate:>12,.0f} rows/s  {copy_cpu}")
            print(f"  pgcdc snapshot into Iceberg      {snapshot_rate:>12,.0f} rows/s  "
                  f"({snapshot_rate / copy_rate:.0%} of COPY)  {snapshot_cpu}", flush=True)
            if jdbc_problem:
                notes["jdbc"] = jdbc_problem
                print(f"  Spark JDBC reader: not measured ({jdbc_problem})")
            else:
                cpu = cpu_seconds(roots)
                jdbc = jdbc_rate(server, spark, catalog, rows)
                jdbc_cpu = cpu_text(cpu_per_change(cpu, cpu_seconds(roots), rows))
                figures.update(jdbc_rows_per_s=round(jdbc), snapshot_ratio_vs_jdbc=round(snapshot_rate / jdbc, 2))
                print(f"  Spark JDBC reader into Iceberg   {jdbc:>12,.0f} rows/s  "
                      f"(pgcdc is {snapshot_rate / jdbc:.1f}x)  {jdbc_cpu}", flush=True)
        if "commit-cost" in only:
            commit_cost(spark, store, commit_applies, figures)
        if "apply" in only:
            next_id = 1
            python_gc = PythonGc()
            print(f"machine at the start of the apply phases: load {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
                  "cores", flush=True)
            for setting in settings:
                label = apply_label(setting, settings)
                next_id = apply_phases(server, spark, store, setting, phase_seconds, args.repeat, next_id, roots,
                                       python_gc, figures, label)
            by_writer = {s.writer: apply_label(s, settings) for s in settings if s.deletes == "position"}
            equality = [s for s in settings if s.writer == "delta" and s.deletes == "equality"]
            if "delta" in by_writer and len(equality) == 1 and len(settings) <= 3:
                position_rate = figures.get(f"apply_rows_per_s_{by_writer['delta']}")
                equality_rate = figures.get(f"apply_rows_per_s_{apply_label(equality[0], settings)}")
                if position_rate and equality_rate:
                    figures["apply_ratio_position_vs_equality"] = round(position_rate / equality_rate, 2)
                    print(f"delta writer: deleting by position (the default) applies {position_rate / equality_rate:.2f}x "
                          "as fast as by equality", flush=True)
            if {"delta", "merge"} <= by_writer.keys():
                delta, merge = (figures.get(f"apply_rows_per_s_{by_writer[w]}") for w in ("delta", "merge"))
                if delta and merge:
                    figures["apply_ratio_vs_merge"] = round(delta / merge, 2)
                    print(f"row-delta writer: {delta / merge:.2f}x the MERGE writer's apply rate", flush=True)
            unpartitioned = [s for s in settings if s.partition_by is None]
            if len(unpartitioned) == 1:
                plain = figures.get(f"apply_rows_per_s_{apply_label(unpartitioned[0], settings)}")
                for setting in settings:
                    rate = figures.get(f"apply_rows_per_s_{apply_label(setting, settings)}")
                    if setting.partition_by and plain and rate:
                        figures[f"apply_ratio_partitioned_{apply_label(setting, settings)}"] = round(rate / plain, 2)
                        print(f"partitioned by {setting.partition_by}: {rate / plain:.2f}x the unpartitioned mirror's "
                              "apply rate (goal >= 0.8x)", flush=True)
        spark.stop()
    shutil.rmtree(warehouse, ignore_errors=True)
    print(json.dumps({**figures, "notes": notes}))


if __name__ == "__main__":
    main()
