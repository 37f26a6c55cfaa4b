"""The pipeline end to end: sustained apply rate and replication lag, and the initial snapshot's speed.

1. Snapshot: a table of N rows copied into Iceberg by pgcdc (Spark tasks over page ranges, inside the
   slot's exported snapshot), beside ``COPY ... TO STDOUT`` drained into nothing (the server's own limit)
   and beside Spark's JDBC reader writing the same Iceberg table. Both Spark readers first copy a
   1,000,000-row table of the same shape (100,000 with --quick), so that neither pays the one-off
   start-up (JVM compilation, Python workers) in its figure; those first copies are printed too. Each
   copy also prints the CPU it took per row, by program (PostgreSQL, the JVM, Python workers).
2. Apply, once per apply writer (``--apply delta,merge``; the delta writer deleting by position, pgcdc's
   default, and by equality: ``--deletes``; the consistent tags moved every ``--consistent-every`` seconds),
   each on a fresh slot and its own mirror: a writer commits transactions of 100 rows (inserts and updates) as
   fast as it can while the pipeline streams them into Iceberg: rows/s from commit to Iceberg commit, and the CPU per applied row by program. Then the
   writer is paced at 50% and 90% of that rate and the lag from each source commit to the mirror commit
   holding it is measured (p50, p99).
CPU counts only this bench's processes (itself, its PostgreSQL, Spark's JVM and Python workers, the S3 server:
"other"), not the rest of the machine. ``--store s3-jdbc`` runs it all (pgcdc's snapshot, the JDBC reader's
Iceberg table, the apply) with the warehouse on a local S3 server behind Iceberg's JDBC catalog
(:mod:`pgcdc.local_object_store`); raw COPY stays the peer.
Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import psycopg
from catchup import cpu_per_change, cpu_seconds  # CPU of this bench's process tree, by program

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.lsn import Lsn
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.spark.apply import WRITERS
from pgcdc.spark.destination import Destination
from pgcdc.spark.session import iceberg_runtime_jar, spark_session

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
    """Commits transactions of 100 rows into ``flow`` (paced when ``rate`` is set); records (commit time,
    commit LSN) of each."""

    def __init__(self, dsn: str, seconds: float, rate: float | None, first_id: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.seconds, self.rate, self.next_id = dsn, seconds, rate, first_id
        self.commits: list[tuple[float, Lsn]] = []
        self.rows = 0

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            started = time.monotonic()
            while time.monotonic() - started < self.seconds:
                with conn.transaction():
                    conn.execute("INSERT INTO flow SELECT i, i %% 7, 'row ' || i, now() FROM "
                                 "generate_series(%s::bigint, %s::bigint) i", (self.next_id, self.next_id + 79))
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


@dataclass
class Phase:
    rows_per_s: float  # from the first commit to the mirror holding the last
    lags: list[float]  # per source transaction: seconds from its commit to the Iceberg commit holding it
    next_id: int
    rows: int
    written_per_s: float  # what the writer committed while it ran


def streaming_phase(dsn: str, spark, store: dict, writer_kind: str, seconds: float, rate: float | None,
                    first_id: int, *, deletes: str, consistent_seconds: float | None, label: str) -> Phase:
    """Run the writer and the pipeline (with apply writer ``writer_kind`` removing rows by ``deletes``, moving the
    consistent tags every ``consistent_seconds``, on the slot of ``label``) together."""
    applied: list[tuple[float, Lsn]] = []

    def on_progress(progress) -> None:
        if progress.applied_lsn is not None and (not applied or applied[-1][1] != progress.applied_lsn):
            applied.append((time.monotonic(), progress.applied_lsn))

    config = PipelineConfig(dsn=dsn, publication="flow", slot=f"bench_flow_{label}", batch_max_seconds=1.0,
                            snapshot=False, apply_writer=writer_kind, deletes=deletes,
                            consistent_seconds=consistent_seconds,
                            destination=Destination(namespace=f"bench_flow_{label}", **store))
    pipeline = Pipeline(config, spark=spark, on_progress=on_progress)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            pipeline.run(handle_signals=False)
        except BaseException as exc:  # reported by the waiting loop below
            failures.append(exc)

    runner = threading.Thread(target=run, daemon=True)
    writer = Writer(dsn, seconds, rate, first_id)
    runner.start()
    time.sleep(3)  # the stream is up before the load starts
    before = pipeline.progress.rows_applied
    started = time.monotonic()
    writer.start()
    writer.join()
    target = writer.commits[-1][1]
    while not applied or applied[-1][1] < target:
        if not runner.is_alive():
            raise RuntimeError(f"the pipeline stopped before catching up: {failures[0] if failures else 'no error'}")
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    rows = pipeline.progress.rows_applied - before
    pipeline.stop()
    runner.join(timeout=120)
    lags = []
    for committed_at, lsn in writer.commits:
        mirrored_at = next(t for t, applied_lsn in applied if applied_lsn >= lsn)
        lags.append(max(0.0, mirrored_at - committed_at))
    return Phase(rows / elapsed, lags, writer.next_id, rows, writer.rows / seconds)


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


def label_text(writer_kind: str, deletes: str, consistent_seconds: float | None) -> str:
    tags = "no consistent tags" if consistent_seconds is None else (
        "consistent tags after every batch" if consistent_seconds == 0 else
        f"consistent tags every {consistent_seconds:g}s")
    return f"{writer_kind} writer{f', {deletes} deletes' if writer_kind == 'delta' else ''}, {tags}"


def apply_phases(server: EmbeddedPostgres, spark, store: dict, writer_kind: str, seconds: float, first_id: int,
                 roots: list[int], figures: dict[str, object], *, deletes: str, consistent_seconds: float | None,
                 label: str) -> int:
    """The unpaced phase, then 50% and 90% of its rate, for one apply writer (figures named by ``label``) on a
    fresh slot; returns the next free id."""
    slot = f"bench_flow_{label}"
    phase = functools.partial(streaming_phase, deletes=deletes, consistent_seconds=consistent_seconds, label=label)
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    cpu = cpu_seconds(roots)
    unpaced = phase(server.dsn, spark, store, writer_kind, seconds, None, first_id)
    used = cpu_per_change(cpu, cpu_seconds(roots), unpaced.rows)
    apply_rate, next_id = unpaced.rows_per_s, unpaced.next_id
    figures[f"apply_rows_per_s_{label}"] = round(apply_rate)
    figures[f"written_rows_per_s_{label}"] = round(unpaced.written_per_s)
    figures.update({f"{DRIVER.get(program, program).replace(' ', '_')}_us_per_row_{label}": value
                    for program, value in used.items()})
    print(f"{label_text(writer_kind, deletes, consistent_seconds)}: apply under an unpaced writer: {apply_rate:,.0f} rows/s from source commit to "
          f"Iceberg commit (the writer committed {unpaced.written_per_s:,.0f} rows/s)", flush=True)
    print(f"  {cpu_text(used)} (pgcdc: this process, the writer and pgcdc's driver"
          f"{'; other: the S3 server' if 'other' in used else ''})", flush=True)
    for share in (0.5, 0.9):
        paced = phase(server.dsn, spark, store, writer_kind, seconds, apply_rate * share, next_id)
        lags, next_id = paced.lags, paced.next_id
        p50, p99 = percentile(lags, 0.5), percentile(lags, 0.99)
        suffix = "" if share == 0.9 else "_at_50pct"
        figures.update({f"lag_p50_s{suffix}_{label}": round(p50, 2),
                        f"lag_p99_s{suffix}_{label}": round(p99, 2)})
        print(f"  lag at {share:.0%} of that rate: p50 {p50:.1f}s, p99 {p99:.1f}s, "
              f"mean {statistics.mean(lags):.1f}s", flush=True)
    drop_slot(server.dsn, slot)
    return next_id


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="300,000-row snapshot, 15-second load phases")
    parser.add_argument("--only", choices=("snapshot", "apply"), help="measure one part only")
    parser.add_argument("--store", choices=("local", "s3-jdbc"), default="local",
                        help="where the Iceberg warehouse lives: a local directory (default), or a local S3 server "
                             "behind Iceberg's JDBC catalog on the bench's PostgreSQL")
    parser.add_argument("--apply", default=",".join(WRITERS),
                        help=f"the apply writers to measure, one after the other (default {','.join(WRITERS)})")
    parser.add_argument("--master", help="a Spark master to run on (e.g. spark://127.0.0.1:7077 of a standalone "
                                         "cluster); default local[*]")
    parser.add_argument("--executors", type=int, help="with a cluster --master: executors of one core to use")
    parser.add_argument("--rows-per-task", type=int, help="rows per snapshot task (default: pgcdc's)")
    parser.add_argument("--deletes", default="position,equality",
                        help="how the delta writer removes rows, comma-separated to measure each in the same run "
                             "(default position,equality: pgcdc's default beside equality deletes)")
    parser.add_argument("--consistent-every", default=f"{PipelineConfig.consistent_seconds:g}",
                        help="seconds between moves of the consistent tags, or off; comma-separated to measure the "
                             "apply under each, one after the other (e.g. off,10,0; default pgcdc's)")
    args = parser.parse_args()
    deletes_kinds = [d.strip() for d in args.deletes.split(",") if d.strip()]
    if not deletes_kinds or any(d not in ("position", "equality") for d in deletes_kinds):
        parser.error(f"--deletes takes position and/or equality, comma-separated; got {args.deletes!r}")
    try:
        tag_settings = [None if v.strip() == "off" else float(v) for v in args.consistent_every.split(",")]
    except ValueError:
        parser.error(f"--consistent-every takes seconds or off, comma-separated; got {args.consistent_every!r}")
    writers = [w.strip() for w in args.apply.split(",") if w.strip()]
    if not writers or any(w not in WRITERS for w in writers):
        parser.error(f"--apply takes writers among {', '.join(WRITERS)}, comma-separated; got {args.apply!r}")
    if args.store == "s3-jdbc":
        from pgcdc.local_object_store import missing_parts

        missing = missing_parts()
        if missing:
            sys.exit(f"--store s3-jdbc needs {'; '.join(missing)}: make test (or make demo-object-store) "
                     "installs them")
    cluster_conf = {"spark.executor.cores": "1", "spark.cores.max": str(args.executors),
                    "spark.executor.memory": "768m"} if args.executors else {}
    rows = 300_000 if args.quick else 5_000_000
    warm_rows = 100_000 if args.quick else 1_000_000
    phase_seconds = 15.0 if args.quick else 60.0
    notes: dict[str, str] = {}
    figures: dict[str, object] = {"store": args.store, "master": args.master or "local[*]",
                                  "executors": args.executors, "snapshot_rows": rows, "snapshot_rows_per_s": None,
                                  "copy_rows_per_s": None, "jdbc_rows_per_s": None, "snapshot_ratio_vs_copy": None,
                                  "snapshot_ratio_vs_jdbc": None}
    jdbc_problem = ensure_jdbc_driver() if args.only != "apply" else None
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
        if args.only != "apply":
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
        if args.only != "snapshot":
            next_id = 1
            for writer_kind in writers:
                for deletes in deletes_kinds if writer_kind == "delta" else ["position"]:
                    base = writer_kind if deletes == "position" else f"{writer_kind}_{deletes}"
                    for tags in tag_settings:
                        label = base if len(tag_settings) == 1 else \
                            f"{base}_tags_{'off' if tags is None else f'{tags:g}s'}"
                        next_id = apply_phases(server, spark, store, writer_kind, phase_seconds, next_id, roots,
                                               figures, deletes=deletes, consistent_seconds=tags, label=label)
                    if len(tag_settings) > 1 and None in tag_settings:
                        off = figures[f"apply_rows_per_s_{base}_tags_off"]
                        for tags in (t for t in tag_settings if t is not None):
                            key = f"{base}_tags_{tags:g}s"
                            ratio = figures[f"apply_rows_per_s_{key}"] / off if off else None
                            figures[f"apply_ratio_vs_no_tags_{key}"] = None if ratio is None else round(ratio, 2)
                            print(f"{label_text(writer_kind, deletes, tags)}: apply rate {ratio:.2f}x of no tags",
                                  flush=True)
            if "delta" in writers and len(deletes_kinds) == 2 and len(tag_settings) == 1:
                ratio = figures["apply_rows_per_s_delta"] / figures["apply_rows_per_s_delta_equality"]
                figures["apply_ratio_position_vs_equality"] = round(ratio, 2)
                print(f"delta writer: deleting by position (the default) applies {ratio:.2f}x as fast as by equality",
                      flush=True)
        spark.stop()
    shutil.rmtree(warehouse, ignore_errors=True)
    print(json.dumps({**figures, "notes": notes}))


if __name__ == "__main__":
    main()
