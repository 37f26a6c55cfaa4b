"""A mirror larger than memory, end to end: its key index kept on disk, beside the index held in memory.

``flow`` (bench/pipeline.py's table: id bigint, n int, note text, at timestamptz) is filled with ``--rows`` rows
(default 100,000,000) and copied once into Iceberg by pgcdc (timed), and its copy's files packed by a first
maintenance (timed apart). Then, on that mirror and its slot, each index
in turn — kept on disk (``--index-memory-mb 256``, ``--disk-budget-mb``: the index does not fit, and keeps a share
of that beside its run) and held in memory (the default budget, a quarter of the machine's memory; the peer) — is
measured:

1. Restart to the first committed batch, ``--restarts`` times each: one transaction (20 updates of random rows) waits
   in the slot; a fresh ``pgcdc run --until-caught-up`` process starts; the seconds until the slot confirms it
   (its batch committed to Iceberg), and the process's peak resident memory. Each after a clean stop (the index on
   disk saved at the last snapshot), and after a kill (``kill -9`` of a streaming ``pgcdc run`` a few batches after
   its start: the index saved at an older snapshot, the files added since indexed again at the restart).
2. Apply, in this process (Spark started once): a pipeline streams bench/pipeline.py's workload — transactions of
   80 inserts and 20 updates — except that the updates hit rows drawn at random over the whole key range. A short
   unpaced phase settles each pipeline (its index opened or built, reported apart); then ``--repeat`` unpaced phases
   (rows/s from source commit to Iceberg commit); then ``--repeat`` phases paced at 90% of the slower index's
   median rate, the same load for both (lag p50/p99). Beside each: the apply thread's time per step, and this
   process's peak resident memory (pgcdc's driver; Spark's JVM apart) while the phases ran.
3. Stream (``--only stream``): a ``pgcdc run`` process of each index streams ``--seconds`` of the same workload,
   paced at ``--stream-rate`` rows/s; sampled every 0.2 s: the process's anonymous resident memory and its
   VmHWM (pgcdc's own process, Spark's JVM apart: its child), and the lag from each source commit until the
   slot confirms it.

Last line: JSON figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import psycopg
from catchup import confirmed

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.lsn import Lsn
from pgcdc.mirrors.maintenance import MaintenancePolicy, maintain_table
from pgcdc.mirrors.metadata import MirrorMetadata
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.positions import LSN_SUMMARY, carried_summary
from pgcdc.spark.destination import Destination
from pgcdc.spark.iceberg_java import load_table
from pgcdc.spark.session import spark_session
from pipeline import PythonGc, RunningPipeline, Writer, percentile, spread, steps_text

SLOT = "large_flow"
FILL_CHUNK = 10_000_000
INDEXES = ("disk", "memory")  # the index kept on disk, and its peer held in memory


def fill(dsn: str, rows: int) -> float:
    """``flow`` filled with ids 1..rows, its primary key made after the rows (much faster than row by row)."""
    started = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE flow (id bigint NOT NULL, n int, note text, at timestamptz)")
        for start in range(1, rows + 1, FILL_CHUNK):
            conn.execute("INSERT INTO flow SELECT i, i %% 7, 'row ' || i, now() FROM generate_series(%s::bigint, "
                         "%s::bigint) i", (start, min(rows, start + FILL_CHUNK - 1)))
            print(f"  filled {min(rows, start + FILL_CHUNK - 1):,} of {rows:,} rows", flush=True)
        conn.execute("ALTER TABLE flow ADD PRIMARY KEY (id)")
        conn.execute("VACUUM ANALYZE flow")
        conn.execute("CREATE PUBLICATION flow FOR TABLE flow")
    return time.perf_counter() - started


def index_settings(index: str, index_dir: str, budget_mb: int) -> dict:
    return {"index_memory_mb": budget_mb, "index_dir": index_dir} if index == "disk" else {"index_dir": index_dir}


def run_command(server: EmbeddedPostgres, warehouse: str, index: str, index_dir: str, budget_mb: int,
                *extra: str) -> list[str]:
    """``pgcdc run`` on the mirror's slot, as a user starts it, with ``index``'s setting."""
    memory = ["--index-memory-mb", str(budget_mb)] if index == "disk" else []
    return [sys.executable, "-m", "pgcdc.cli", "run", "--dsn", server.dsn, "--publication", "flow", "--slot", SLOT,
            "--warehouse", warehouse, "--namespace", SLOT, "--index-dir", index_dir, *memory, *extra]


def update_random_rows(dsn: str, rows: int, rng: random.Random) -> Lsn:
    """One transaction of 20 updates of random rows; the server's position after it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE flow SET n = n + 1 WHERE id = ANY(%s)", (rng.sample(range(1, rows + 1), 20),))
        return Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])


def memory_mib(pid: int | str) -> tuple[float, float] | None:
    """The process's peak resident memory so far (VmHWM) and its anonymous resident memory now (RssAnon: what is
    not pages of files mapped in, such as the index's run, which the kernel takes back at will), or None once it
    has gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            fields = dict(line.split(":", 1) for line in status if ":" in line)
        return int(fields["VmHWM"].split()[0]) / 1024, int(fields["RssAnon"].split()[0]) / 1024
    except (OSError, KeyError):
        return None


def first_batch(server: EmbeddedPostgres, command: list[str], rows: int, rng: random.Random
                ) -> tuple[float, float, float]:
    """A transaction waiting in the slot, then a fresh ``pgcdc run --until-caught-up``: seconds from its start until
    the slot confirms the transaction, and the process's peak resident memory until then, all and anonymous (MiB).
    Prints what the process logged of its index."""
    written = update_random_rows(server.dsn, rows, rng)
    with psycopg.connect(server.dsn, autocommit=True) as conn, tempfile.TemporaryFile("w+") as log:
        started = time.perf_counter()
        process = subprocess.Popen([*command, "--until-caught-up"], stdout=subprocess.DEVNULL, stderr=log, text=True,
                                   env={**os.environ, "PGCDC_LOG_LEVEL": "INFO"})
        peak = anonymous = 0.0
        try:
            while confirmed(conn, SLOT) < written:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"pgcdc exited with {process.returncode} before confirming {written}: "
                                       f"{log.read()[-2000:]}")
                held = memory_mib(process.pid)
                if held is not None:
                    peak, anonymous = max(peak, held[0]), max(anonymous, held[1])
                time.sleep(0.05)
            seconds = time.perf_counter() - started
        finally:
            process.wait(timeout=600)
        log.seek(0)
        about_index = [line for line in log.read().splitlines() if "index" in line]
    for line in about_index[-2:]:
        print(f"      {line[-220:]}", flush=True)
    return seconds, peak, anonymous


def killed_run(server: EmbeddedPostgres, command: list[str], rows: int, rng: random.Random) -> None:
    """A streaming ``pgcdc run`` killed (its process group, JVM included, ``kill -9``) once it has committed three
    batches of random updates: what its index saved describes an older snapshot than the mirror's."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, "PGCDC_LOG_LEVEL": "WARNING"})
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            for _ in range(3):
                written = update_random_rows(server.dsn, rows, rng)
                deadline = time.monotonic() + 600
                while confirmed(conn, SLOT) < written:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the run to kill stopped ({process.returncode}) or confirmed nothing")
                    time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def streamed(server: EmbeddedPostgres, command: list[str], seconds: float, rate: float, first_id: int, rows: int
             ) -> dict[str, float]:
    """A ``pgcdc run`` streaming a paced writer for ``seconds``: its peak memory from its start (VmHWM and anonymous,
    MiB, sampled every 0.1-0.2 s), and each transaction's lag from its commit until the slot confirms it (p50, p99,
    s)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               env={**os.environ, "PGCDC_LOG_LEVEL": "WARNING"})
    peak = anonymous = 0.0
    lags: list[float] = []

    def sample() -> None:
        nonlocal peak, anonymous
        held = memory_mib(process.pid)
        if held is not None:
            peak, anonymous = max(peak, held[0]), max(anonymous, held[1])

    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            written = update_random_rows(server.dsn, rows, random.Random(first_id))
            while confirmed(conn, SLOT) < written:  # started: its index opened, its first batch committed
                if process.poll() is not None:
                    raise RuntimeError(f"pgcdc exited with {process.returncode} before its first batch")
                sample()
                time.sleep(0.1)
            writer = Writer(server.dsn, seconds, rate, first_id, updates_over=rows)
            writer.start()
            seen = 0
            while writer.is_alive() or seen < len(writer.commits):
                now = time.monotonic()
                position = confirmed(conn, SLOT)
                commits = writer.commits[seen:]
                for committed_at, lsn in commits:
                    if lsn > position:
                        break
                    lags.append(now - committed_at)
                    seen += 1
                sample()
                if process.poll() is not None:
                    raise RuntimeError(f"pgcdc exited with {process.returncode} while streaming")
                time.sleep(0.2)
            writer.join()
    finally:
        os.killpg(process.pid, signal.SIGINT)  # a clean stop: the index on disk saved
        try:
            process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return {"peak_rss_mib": peak, "peak_anonymous_mib": anonymous, "lag_p50_s": percentile(lags, 0.5),
            "lag_p99_s": percentile(lags, 0.99), "next_id": writer.next_id}


class RssSampler(threading.Thread):
    """This process's anonymous resident memory, sampled every 0.2 s until stopped: its peak (MiB)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0.0  # anonymous resident memory (see memory_mib)
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.is_set():
            held = memory_mib("self")
            if held is not None:
                self.peak = max(self.peak, held[1])
            self._done.wait(0.2)

    def stop(self) -> float:
        self._done.set()
        self.join()
        return self.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=100_000_000, help="rows of the mirror (default 100,000,000)")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of each apply phase (default 30)")
    parser.add_argument("--repeat", type=int, default=3, help="unpaced and paced phases of each index (default 3)")
    parser.add_argument("--restarts", type=int, default=3, help="restarts of each kind for each index (default 3)")
    parser.add_argument("--only", default="apply,restart",
                        help="the parts to measure, comma-separated among apply, restart, stream (default apply and "
                             "restart)")
    parser.add_argument("--stream-rate", type=float, default=25_000.0,
                        help="rows/s of the writer while a pgcdc process streams (--only stream; default 25,000)")
    parser.add_argument("--disk-budget-mb", type=int, default=256,
                        help="--index-memory-mb of the index kept on disk (default 256; 0: the least share)")
    args = parser.parse_args()
    if args.rows < 1000 or args.repeat < 1 or args.restarts < 1:
        parser.error("--rows takes 1,000 or more, --repeat and --restarts 1 or more")
    only = {part.strip() for part in args.only.split(",") if part.strip()}
    if not only or not only <= {"apply", "restart", "stream"}:
        parser.error(f"--only takes apply, restart, stream, comma-separated; got {args.only!r}")
    rng = random.Random(20261128)
    warehouse = tempfile.mkdtemp(prefix="pgcdc-large-")
    index_dir = tempfile.mkdtemp(prefix="pgcdc-large-index-")
    figures: dict[str, object] = {"rows": args.rows, "disk_budget_mb": args.disk_budget_mb}
    with EmbeddedPostgres(settings={"max_wal_size": "16GB"}) as server:
        print(f"filling flow with {args.rows:,} rows", flush=True)
        figures["fill_s"] = round(fill(server.dsn, args.rows), 1)
        spark = spark_session(Destination(warehouse=warehouse))
        config = PipelineConfig(dsn=server.dsn, publication="flow", slot=SLOT, index_memory_mb=args.disk_budget_mb,
                                index_dir=index_dir,
                                destination=Destination(warehouse=warehouse, namespace=SLOT))
        started = time.perf_counter()
        copied = Pipeline(config, spark=spark).snapshot()
        copy_s = time.perf_counter() - started
        assert copied["public.flow"] == args.rows, copied
        figures.update(copy_s=round(copy_s, 1), copy_rows_per_s=round(args.rows / copy_s))
        print(f"copied {args.rows:,} rows in {copy_s:.1f}s ({args.rows / copy_s:,.0f} rows/s); filled in "
              f"{figures['fill_s']}s", flush=True)
        # the copy's files (one per task) are packed by the mirror's first maintenance, once: made here, timed
        # apart, so that no measured phase holds it
        (_, _, identifier), = MirrorMetadata.of(config.destination).source_tables()
        position = load_table(spark, identifier).currentSnapshot().summary().get(LSN_SUMMARY)
        result = maintain_table(spark, identifier, carried_summary(Lsn.parse(str(position))), MaintenancePolicy(),
                                steps=["compact-data", "compact-deletes", "rewrite-manifests"])
        assert result.before is not None and result.after is not None
        figures["first_compaction_s"] = round(result.seconds, 1)
        print(f"the first maintenance packed the copy's {result.before.data_files} data files into "
              f"{result.after.data_files} in {result.seconds:.1f}s", flush=True)

        next_id = args.rows + 1
        if "apply" in only:
            python_gc = PythonGc()
            roots = [os.getpid()] + ([server.pid] if server.pid else [])
            phases: dict[tuple[str, str], list] = {(index, kind): [] for index in INDEXES for kind in ("unpaced", "paced")}
            peaks = dict.fromkeys(INDEXES, 0.0)
            settled: dict[str, list[float]] = {index: [] for index in INDEXES}

            def measure(index: str, rate: float | None) -> None:
                """A pipeline of ``index`` started on the mirror, settled by a short unpaced phase, then one phase."""
                nonlocal next_id
                running = RunningPipeline(server, spark, {"warehouse": warehouse}, index, python_gc, roots, slot=SLOT,
                                          **index_settings(index, index_dir, args.disk_budget_mb))
                sampler = RssSampler()
                sampler.start()
                try:
                    settle = running.phase(min(10.0, args.seconds), None, next_id, updates_over=args.rows)
                    settled[index].append(settle.first_applied_s)
                    phase = running.phase(args.seconds, rate, settle.next_id, updates_over=args.rows)
                    next_id = phase.next_id
                finally:
                    running.stop(drop=False)
                    peaks[index] = max(peaks[index], sampler.stop())
                phases[index, "unpaced" if rate is None else "paced"].append(phase)
                what = f"{phase.rows_per_s:,.0f} rows/s" if rate is None else \
                    f"lag p50 {percentile(phase.lags, 0.5):.2f}s p99 {percentile(phase.lags, 0.99):.2f}s"
                print(f"  index {index}: {what} (first batch of the pipeline {settle.first_applied_s:.1f}s after its "
                      f"first commit; maintenance {phase.beside['maintenance_turns']:g} turns, "
                      f"{phase.beside['maintenance_seconds']:.1f}s)", flush=True)

            # the two indexes alternate, a fresh pipeline each phase: neither is measured only on a colder JVM or a
            # fuller mirror
            print(f"apply, unpaced: {args.repeat} phases of {args.seconds:g}s for each index, alternating", flush=True)
            for _ in range(args.repeat):
                for index in INDEXES:
                    measure(index, None)
            rates = {index: [phase.rows_per_s for phase in phases[index, "unpaced"]] for index in INDEXES}
            pace = 0.9 * min(statistics.median(rates[index]) for index in INDEXES)
            print(f"apply, paced at {pace:,.0f} rows/s (90% of the slower index's median), {args.repeat} phases each",
                  flush=True)
            for _ in range(args.repeat):
                for index in INDEXES:
                    measure(index, pace)
            for index in INDEXES:
                unpaced, paced = phases[index, "unpaced"], phases[index, "paced"]
                p50s = [percentile(phase.lags, 0.5) for phase in paced]
                p99s = [percentile(phase.lags, 0.99) for phase in paced]
                figures.update({f"apply_rows_per_s_{index}": round(statistics.median(rates[index])),
                                f"apply_rows_per_s_min_{index}": round(min(rates[index])),
                                f"apply_rows_per_s_max_{index}": round(max(rates[index])),
                                f"lag_p50_s_{index}": round(statistics.median(p50s), 2),
                                f"lag_p99_s_{index}": round(statistics.median(p99s), 2),
                                f"pipeline_first_batch_s_{index}": round(statistics.median(settled[index]), 2),
                                f"apply_peak_anonymous_mib_{index}": round(peaks[index])})
                print(f"index {index}: unpaced {spread(rates[index], ' rows/s')}; at {pace:,.0f} rows/s lag p50 "
                      f"{spread(p50s, 's', 2)}, p99 {spread(p99s, 's', 2)}; a pipeline's first batch "
                      f"{spread(settled[index], 's', 1)} after its first commit; this process's peak anonymous RSS "
                      f"{peaks[index]:,.0f} MiB", flush=True)
                print(f"  apply thread, µs per applied row by step: {steps_text(unpaced)}", flush=True)
        spark.stop()

        if "stream" in only:
            print(f"a pgcdc process of each index streaming {args.seconds:g}s at {args.stream_rate:,.0f} rows/s",
                  flush=True)
            for index in INDEXES:
                command = run_command(server, warehouse, index, index_dir, args.disk_budget_mb)
                got = streamed(server, command, args.seconds, args.stream_rate, next_id, args.rows)
                next_id = int(got.pop("next_id"))
                figures.update({f"stream_{name}_{index}": round(value, 2) for name, value in got.items()})
                print(f"  index {index}: peak RSS of pgcdc's process {got['peak_rss_mib']:,.0f} MiB, anonymous "
                      f"{got['peak_anonymous_mib']:,.0f} MiB; lag p50 {got['lag_p50_s']:.2f}s p99 "
                      f"{got['lag_p99_s']:.2f}s", flush=True)

        if "restart" in only:
            print(f"restart to the first committed batch, {args.restarts} times each (a fresh process, its JVM "
                  "included)", flush=True)
            for index in INDEXES:
                command = run_command(server, warehouse, index, index_dir, args.disk_budget_mb)
                # untimed: the other index's runs committed since this one's was saved; each restart timed after it
                # follows a clean stop of its own (its index saved at the mirror's last snapshot), or a kill
                first_batch(server, command, args.rows, rng)
                for kind in ("clean", "killed"):
                    seconds, peaks, anonymous = [], [], []
                    for _ in range(args.restarts):
                        if kind == "killed":
                            killed_run(server, command, args.rows, rng)
                        took, peak, anon = first_batch(server, command, args.rows, rng)
                        seconds.append(took)
                        peaks.append(peak)
                        anonymous.append(anon)
                    figures.update({f"restart_s_{kind}_{index}": round(statistics.median(seconds), 2),
                                    f"restart_peak_rss_mib_{kind}_{index}": round(max(peaks)),
                                    f"restart_peak_anonymous_mib_{kind}_{index}": round(max(anonymous))})
                    print(f"  index {index}, after a {'clean stop' if kind == 'clean' else 'kill'}: "
                          f"{spread(seconds, 's', 2)}; peak RSS of pgcdc's process {max(peaks):,.0f} MiB, anonymous "
                          f"{max(anonymous):,.0f} MiB", flush=True)

    if "apply" in only:
        ratio = figures["apply_rows_per_s_disk"] / figures["apply_rows_per_s_memory"]  # type: ignore[operator]
        figures["apply_ratio_disk_vs_memory"] = round(ratio, 2)
        print(f"apply rate on disk: {ratio:.2f}x the in-memory index's (goal >= 0.7x); lag p50/p99 on disk "
              f"{figures['lag_p50_s_disk']}/{figures['lag_p99_s_disk']}s, in memory {figures['lag_p50_s_memory']}/"
              f"{figures['lag_p99_s_memory']}s at the same load")
    if "restart" in only:
        print(f"restart on disk {figures['restart_s_clean_disk']}s after a clean stop, "
              f"{figures['restart_s_killed_disk']}s after a kill (goal <= 15s); in memory "
              f"{figures['restart_s_clean_memory']}s / {figures['restart_s_killed_memory']}s")
    index_bytes = sum(f.stat().st_size for f in Path(index_dir).rglob("*") if f.is_file())
    mirror_rows = next_id - 1  # every id inserted is still there
    figures["index_bytes_per_row"] = round(index_bytes / mirror_rows, 2)
    print(f"index on disk: {index_bytes / 2**20:,.0f} MiB, {index_bytes / mirror_rows:.2f} bytes a row of the "
          f"mirror's {mirror_rows:,}")
    shutil.rmtree(warehouse, ignore_errors=True)
    shutil.rmtree(index_dir, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
