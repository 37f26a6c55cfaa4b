"""Catch-up: a backlog in the slot turned into committed Iceberg rows, beside pg_recvlogical draining a twin slot.

A table of 10 columns gets a backlog of inserts in 1,000-row transactions, then one UPDATE of a fifth of the
rows (full: 500,000 + 100,000 changes; --quick: 100,000 + 20,000). Slots created before the backlog hold the
same changes: pg_recvlogical drains one into /dev/null (the slot's own rate, the peer); pgcdc drains one per
apply writer into empty mirrors (``run --until-caught-up`` in this process, Spark already started: the
delta writer runs first and pays the JVM's warm-up), the row-delta writer both deleting by position (the
default) and by equality. Then pgcdc's start-up alone: a ``pgcdc run
--until-caught-up`` process with nothing to do. CPU per change is counted by program. Last line: JSON figures.
"""

from __future__ import annotations

import argparse
import json
import os
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
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.spark.destination import Destination
from pgcdc.spark.session import spark_session

# (name, apply writer, deletes): the default, the row-delta writer deleting by equality, and MERGE
VARIANTS = (("delta", "delta", "position"), ("delta_equality", "delta", "equality"), ("merge", "merge", "position"))


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


def startup_seconds(config: PipelineConfig) -> float:
    """A whole ``pgcdc run --until-caught-up`` process on a slot with nothing to do."""
    command = [sys.executable, "-m", "pgcdc.cli", "run", "--dsn", config.dsn, "--publication", config.publication,
               "--slot", config.slot, "--warehouse", str(config.destination.warehouse), "--namespace", config.destination.namespace,
               "--apply", config.apply_writer, "--until-caught-up"]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=600,
                   env={**os.environ, "PGCDC_LOG_LEVEL": "WARNING"})
    return time.perf_counter() - started


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
            label = {"delta": "delta writer (default)", "delta_equality": "delta writer, equality deletes",
                     "merge": "merge writer"}[writer]
            print(f"{'pgcdc into Iceberg, ' + label:<40} {ours:>10,.0f}  {ours / theirs:.2f}   "
                  f"CPU µs/change {used}", flush=True)
            figures[f"{writer}_changes_per_s"] = round(ours)
            figures[f"{writer}_ratio_vs_pg_recvlogical"] = round(ours / theirs, 2)
            figures.update({f"{writer}_{program.replace(' ', '_')}_cpu_us_per_change": value
                            for program, value in used.items()})
        print(f"deleting by position (the default) applies {rates['delta'] / rates['delta_equality']:.2f}x as fast as "
              "by equality", flush=True)
        spark.stop()
        startup = startup_seconds(configs["delta"])
        print(f"pgcdc start-up (a run --until-caught-up with nothing to do): {startup:.1f}s")
        figures["startup_s"] = round(startup, 1)
    figures["ratio_vs_pg_recvlogical"] = figures["delta_ratio_vs_pg_recvlogical"]
    figures["position_vs_equality_deletes"] = round(rates["delta"] / rates["delta_equality"], 2)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
