"""Catch-up: a backlog in the slot turned into committed Iceberg rows, beside pg_recvlogical draining a twin slot.

A table of 10 columns gets a backlog of inserts in 1,000-row transactions, then one UPDATE of a fifth of the
rows (full: 500,000 + 100,000 changes; --quick: 100,000 + 20,000). Slots created before the backlog hold the
same changes: pg_recvlogical drains one into /dev/null (the slot's own rate, the peer); pgcdc drains one per
apply writer into empty mirrors (``run --until-caught-up`` in this process, Spark already started, after a
warm-up drain of its own slot that compiles the JVM's commit path, reported apart), the row-delta writer both
deleting by position (the default) and by equality. CPU per change is counted by program; beside it the apply
thread's time per step and the maintenance that ran during the drain (what bounds the figure).

Then pgcdc's start-up, each figure repeated (median, min, max):

- a ``pgcdc run --until-caught-up`` process with nothing to do, which reads the mirrors' metadata itself and
  starts no JVM; beside it the same run made to read them through Spark (``PYSPARK_SUBMIT_ARGS`` set: pgcdc
  then leaves the catalog to Spark, as before it read metadata itself), and pg_recvlogical connecting to a twin
  slot and finding nothing to read (``--endpos`` at the server's position);
- ``pgcdc status`` of the warehouse: the position-delete mirror's rows counted from its manifests and delete files
  without a JVM, beside the same command made to count them through Spark (both must give the same counts);
- the first batch of a fresh run: one transaction waits in the slot, a ``pgcdc run --until-caught-up`` process
  starts, and the time until the slot confirms that transaction (its batch committed to Iceberg first; Spark
  started for it), beside pg_recvlogical's time from its start to the first message of the same transaction on
  a twin slot.

Last line: JSON figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import psycopg
from capture import FILL, TABLE, recvlogical_drain  # the capture bench's table, rows and peer

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.lsn import Lsn
from pgcdc.mirrors.metadata import MirrorMetadata
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.spark.destination import Destination
from pgcdc.spark.session import spark_session

# (name, apply writer, deletes): the default, the row-delta writer deleting by equality, and MERGE
# the first drain of a fresh JVM compiles the whole commit path: a warm-up drain of the same backlog (the default
# writer), reported apart, so that no measured writer pays it
VARIANTS = (("warmup", "delta", "position"), ("delta", "delta", "position"), ("delta_equality", "delta", "equality"),
            ("merge", "merge", "position"))


def cpu_seconds(roots: list[int]) -> Counter[str]:
    """CPU seconds used so far by the processes under ``roots`` (this bench and its server; ended children count
    in their parent), by program: other work on the machine is left out."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, str, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        stats[int(entry.name)] = (int(fields[1]), stat[stat.index("(") + 1:stat.rindex(")")],
                                  sum(int(f) for f in fields[11:15]) / ticks)
    mine = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, (parent, _, _) in stats.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                grew = True
    totals: Counter[str] = Counter()
    for pid in mine & stats.keys():
        _, name, seconds = stats[pid]
        program = ("pgcdc" if pid == os.getpid() else "postgres" if name.startswith("postgres") else
                   "jvm" if name == "java" else "python workers" if name.startswith(("python", "pyspark"))
                   else "other")
        totals[program] += seconds
    return totals


def cpu_per_change(before: Counter[str], after: Counter[str], changes: int) -> dict[str, float]:
    used = Counter(after)
    used.subtract(before)
    return {program: round(seconds * 1e6 / changes, 2) for program, seconds in sorted(used.items())
            if seconds > 0}


def config_for(server: EmbeddedPostgres, warehouse: str, name: str, writer: str, deletes: str) -> PipelineConfig:
    return PipelineConfig(dsn=server.dsn, publication="pub", slot=f"catchup_{name}", apply_writer=writer,
                          deletes=deletes, destination=Destination(warehouse=warehouse, namespace=f"catchup_{name}"))


def run_command(config: PipelineConfig) -> list[str]:
    """``pgcdc run --until-caught-up`` of ``config``, as a user starts it."""
    return [sys.executable, "-m", "pgcdc.cli", "run", "--dsn", config.dsn, "--publication", config.publication,
            "--slot", config.slot, "--warehouse", str(config.destination.warehouse), "--namespace",
            config.destination.namespace, "--apply", config.apply_writer, "--deletes", config.deletes,
            "--until-caught-up"]


def timed(command: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """A whole ``pgcdc`` process: its seconds and its output."""
    started = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PGCDC_LOG_LEVEL": "WARNING", **(env or {})})
    return time.perf_counter() - started, done.stdout


def startup_seconds(config: PipelineConfig, env: dict[str, str] | None = None) -> float:
    """A whole ``pgcdc run --until-caught-up`` process on a slot with nothing to do."""
    return timed(run_command(config), env)[0]


def status_run(config: PipelineConfig, env: dict[str, str] | None = None) -> tuple[float, list[dict]]:
    """A whole ``pgcdc status --json`` process on the warehouse of ``config``: its seconds, and the mirrors it
    described."""
    seconds, output = timed([sys.executable, "-m", "pgcdc.cli", "status", "--dsn", config.dsn, "--warehouse",
                             str(config.destination.warehouse), "--namespace", config.destination.namespace, "--json"],
                            env)
    return seconds, json.loads(output)["mirrors"]


def confirmed(conn: psycopg.Connection, slot: str) -> Lsn:
    row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)).fetchone()
    return Lsn.parse(row[0])


def first_batch_seconds(server: EmbeddedPostgres, config: PipelineConfig, first: int) -> float:
    """One transaction (100 inserts from ``first``) waiting in the slot; a fresh ``pgcdc run --until-caught-up``
    process: seconds from its start until the slot confirms the transaction, which it does once its batch is
    committed to Iceberg."""
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(FILL, (first, first + 99))
        written = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        started = time.perf_counter()
        process = subprocess.Popen(run_command(config), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env={**os.environ, "PGCDC_LOG_LEVEL": "WARNING"})
        try:
            while confirmed(conn, config.slot) < written:
                if process.poll() is not None:
                    raise RuntimeError(f"pgcdc exited with {process.returncode} before confirming {written}")
                time.sleep(0.05)
            seconds = time.perf_counter() - started
        finally:
            process.wait(timeout=600)
    return seconds


def recvlogical_command(server: EmbeddedPostgres, slot: str, *extra: str) -> list[str]:
    return [str(server.bin_dir / "pg_recvlogical"), "-d", server.dsn, "--slot", slot, "--start", "-o",
            "proto_version=1", "-o", "publication_names=pub", "--no-loop", *extra]


def recvlogical_nothing_seconds(server: EmbeddedPostgres, slot: str) -> float:
    """pg_recvlogical connecting to ``slot`` and stopping at the server's position, with nothing to read."""
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (slot,))
        end = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0]
    started = time.perf_counter()
    subprocess.run(recvlogical_command(server, slot, "-f", "/dev/null", "-E", end), check=True, capture_output=True,
                   timeout=600)
    return time.perf_counter() - started


def recvlogical_first_message_seconds(server: EmbeddedPostgres, slot: str) -> float:
    """pg_recvlogical's time from its start to the first message of a transaction waiting in ``slot``."""
    started = time.perf_counter()
    process = subprocess.Popen(recvlogical_command(server, slot, "-f", "-"), stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL)
    try:
        assert process.stdout is not None and process.stdout.read(1), "pg_recvlogical wrote nothing"
        return time.perf_counter() - started
    finally:
        process.kill()
        process.wait()


def spread(label: str, seconds: list[float]) -> str:
    return (f"{label:<64} {statistics.median(seconds):6.2f} s  (min {min(seconds):.2f}, max {max(seconds):.2f}, "
            f"{len(seconds)} runs)")


def mirror_summaries(config: PipelineConfig) -> list[dict[str, str]]:
    """The current snapshot summary of each mirror of ``config``'s namespace, read from its metadata."""
    mirrors = MirrorMetadata.of(config.destination)
    summaries = []
    for _, _, identifier in mirrors.source_tables():
        table = mirrors.table(identifier)
        snapshot = None if table is None else table.currentSnapshot()
        summaries.append({} if snapshot is None else dict(snapshot.summary()))
    return summaries


def startup_figures(server: EmbeddedPostgres, config: PipelineConfig, repeats: int) -> dict[str, float]:
    """pgcdc's start-up with nothing to do and its first batch, each beside pg_recvlogical (see the module)."""
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('twin_start', 'pgoutput')")
    startup_seconds(config)  # a first run may have tags to settle after the catch-up's maintenance
    nothing = [startup_seconds(config) for _ in range(repeats)]
    through_spark = [startup_seconds(config, {"PYSPARK_SUBMIT_ARGS": "pyspark-shell"}) for _ in range(repeats)]
    recvlogical_nothing = [recvlogical_nothing_seconds(server, "twin_start") for _ in range(repeats)]
    status_here = [status_run(config) for _ in range(repeats)]
    status_spark = [status_run(config, {"PYSPARK_SUBMIT_ARGS": "pyspark-shell"}) for _ in range(repeats)]
    counted = {json.dumps(mirrors, sort_keys=True) for _, mirrors in status_here + status_spark}
    assert len(counted) == 1, f"status counted differently with and without Spark: {counted}"
    position_deletes = sum(int(summary.get("total-position-deletes", 0)) for summary in mirror_summaries(config))
    first_batch, recvlogical_first = [], []
    for repeat in range(repeats):
        first_batch.append(first_batch_seconds(server, config, 10_000_000 + repeat * 100))
        recvlogical_first.append(recvlogical_first_message_seconds(server, "twin_start"))
    print(spread("pgcdc start-up, a run --until-caught-up with nothing to do", nothing))
    print(spread("  the same, the mirrors read through Spark", through_spark))
    print(spread("  pg_recvlogical connecting and finding nothing to read", recvlogical_nothing))
    print(spread(f"pgcdc status, rows counted through {position_deletes:,} position deletes, no JVM",
                 [seconds for seconds, _ in status_here]))
    print(spread("  the same, counted through Spark", [seconds for seconds, _ in status_spark]))
    print(spread("pgcdc's first batch of a fresh run, committed and confirmed", first_batch))
    print(spread("  pg_recvlogical from its start to the transaction's first message", recvlogical_first))
    return {"startup_s": round(statistics.median(nothing), 2), "startup_min_s": round(min(nothing), 2),
            "startup_max_s": round(max(nothing), 2),
            "startup_through_spark_s": round(statistics.median(through_spark), 2),
            "startup_ratio_vs_through_spark": round(statistics.median(nothing) / statistics.median(through_spark), 2),
            "pg_recvlogical_nothing_s": round(statistics.median(recvlogical_nothing), 2),
            "status_s": round(statistics.median(seconds for seconds, _ in status_here), 2),
            "status_through_spark_s": round(statistics.median(seconds for seconds, _ in status_spark), 2),
            "status_position_deletes": position_deletes,
            "first_batch_s": round(statistics.median(first_batch), 2), "first_batch_min_s": round(min(first_batch), 2),
            "first_batch_max_s": round(max(first_batch), 2),
            "pg_recvlogical_first_message_s": round(statistics.median(recvlogical_first), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="100,000 inserts and a 20,000-row UPDATE")
    args = parser.parse_args()
    inserts = 100_000 if args.quick else 500_000
    updated = inserts // 5
    changes = inserts + updated
    warehouse = tempfile.mkdtemp(prefix="pgcdc-catchup-")
    figures: dict[str, object] = {"changes": changes}
    with EmbeddedPostgres(settings={"max_wal_size": "8GB"}) as server:
        spark = spark_session(Destination(warehouse=warehouse))
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(TABLE)
        configs = {name: config_for(server, warehouse, name, writer, deletes) for name, writer, deletes in VARIANTS}
        for config in configs.values():  # each slot and its empty mirror, before the backlog
            Pipeline(config, spark=spark).snapshot()
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_create_logical_replication_slot('for_recvlogical', 'pgoutput')")
            for start in range(0, inserts, 1000):
                conn.execute(FILL, (start, start + 999))
            conn.execute("UPDATE events SET a = a + 1, b = b || '!' WHERE id < %s", (updated,))
            end = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        roots = [os.getpid()] + ([server.pid] if server.pid else [])
        cpu = cpu_seconds(roots)
        theirs = changes / recvlogical_drain(server, "for_recvlogical", end)
        recvlogical_cpu = cpu_per_change(cpu, cpu_seconds(roots), changes)
        print(f"backlog of {changes:,} changes ({inserts // 1000} transactions of 1,000 inserts, one UPDATE of "
              f"{updated:,} rows)")
        print(f"{'drained by':<40} {'changes/s':>10}  ratio")
        print(f"{'pg_recvlogical (to /dev/null)':<40} {theirs:>10,.0f}  1.00   CPU µs/change {recvlogical_cpu}",
              flush=True)
        figures["pg_recvlogical_changes_per_s"] = round(theirs)
        rates: dict[str, float] = {}
        for writer, config in configs.items():  # the variant's name
            cpu = cpu_seconds(roots)
            started = time.perf_counter()
            progress = Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
            seconds = time.perf_counter() - started
            used = cpu_per_change(cpu, cpu_seconds(roots), changes)
            assert progress.rows_applied == changes, (writer, progress.rows_applied, changes)
            count = spark.sql(f"SELECT count(*) AS n FROM pgcdc.catchup_{writer}.public.events").collect()[0].n
            assert count == inserts, (writer, count)
            ours = rates[writer] = changes / seconds
            label = {"warmup": "warm-up: the delta writer in a fresh JVM (apart)", "delta": "delta writer (default)",
                     "delta_equality": "delta writer, equality deletes", "merge": "merge writer"}[writer]
            print(f"{'pgcdc into Iceberg, ' + label:<40} {ours:>10,.0f}  {ours / theirs:.2f}   "
                  f"CPU µs/change {used}", flush=True)
            steps = sorted(progress.apply_step_seconds.items(), key=lambda item: -item[1])
            print(f"    {seconds:.1f} s in all: {progress.batches_applied} batches; the apply thread "
                  + ", ".join(f"{step} {value:.2f}" for step, value in steps)
                  + f" s; maintenance {progress.maintenance_turns} turns, {progress.maintenance_seconds:.2f} s; "
                  f"tag moves {progress.tag_moves}", flush=True)
            figures[f"{writer}_apply_thread_s"] = round(sum(progress.apply_step_seconds.values()), 2)
            figures[f"{writer}_maintenance_s"] = round(progress.maintenance_seconds, 2)
            figures[f"{writer}_changes_per_s"] = round(ours)
            figures[f"{writer}_ratio_vs_pg_recvlogical"] = round(ours / theirs, 2)
            figures.update({f"{writer}_{program.replace(' ', '_')}_cpu_us_per_change": value
                            for program, value in used.items()})
        print(f"deleting by position (the default) applies {rates['delta'] / rates['delta_equality']:.2f}x as fast as "
              "by equality", flush=True)
        spark.stop()
        figures.update(startup_figures(server, configs["delta"], 3 if args.quick else 5))
    figures["ratio_vs_pg_recvlogical"] = figures["delta_ratio_vs_pg_recvlogical"]
    figures["position_vs_equality_deletes"] = round(rates["delta"] / rates["delta_equality"], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
