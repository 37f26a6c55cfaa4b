"""Capture throughput: pgcdc receiving, decoding and assembling a slot, beside pg_recvlogical (the C client).

Identical slots hold the same changes (inserts of a 10-column table in transactions of 10,000 rows);
pg_recvlogical drains one into /dev/null, pgcdc drains another through the walsender, decoding every
message and assembling every transaction. Then the stream side as the pipeline runs it, on the same backlog:
decode, assemble, convert and batch into change tables (the batcher, batches of the pipeline's size), with
text values and with binary ones; its CPU per change is this process's own CPU time, beside pg_recvlogical's
(and each drain is repeated: the spread is printed). Then the peak memory of pgcdc while one large transaction
streams (protocol 4, streaming 'parallel'), measured in a separate process. Last line: JSON figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import psycopg

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.lsn import Lsn

TABLE = """
CREATE TABLE events (id bigint PRIMARY KEY, a int, b text, c numeric(12, 2), d timestamptz, e bool, f float8,
                     g uuid, h jsonb, i date);
CREATE PUBLICATION pub FOR TABLE events;
"""
FILL = """
INSERT INTO events SELECT i, i %% 1000, 'name ' || i, i * 1.25, now(), i %% 2 = 0, i / 3.0, md5(i::text)::uuid,
       jsonb_build_object('k', i), date '2024-01-01' + (i %% 365)::int
FROM generate_series(%s::bigint, %s::bigint) i
"""


def fill(conn: psycopg.Connection, rows: int, per_transaction: int) -> None:
    for start in range(0, rows, per_transaction):
        conn.execute(FILL, (start, min(rows, start + per_transaction) - 1))


def pgcdc_drain(dsn: str, slot: str, transactions: int) -> tuple[float, int]:
    """Seconds to receive ``transactions`` transactions, and the changes they held."""
    from pgcdc.replication import LogicalReplicationStream, ReplicationOptions
    from pgcdc.runtime import streaming_gc
    from pgcdc.transactions import TransactionReader

    stream = LogicalReplicationStream(dsn, slot=slot, options=ReplicationOptions(publication="pub", proto_version=1),
                                      raw_changes=True)
    started = time.perf_counter()
    changes = done = 0
    with streaming_gc():
        for txn in TransactionReader(stream.events(idle_timeout=5.0)).transactions():
            changes += txn.change_count
            done += 1
            stream.confirm(txn.end_lsn)
            if done >= transactions:
                break
    seconds = time.perf_counter() - started
    stream.close()
    return seconds, changes


def batched_drain(dsn: str, slot: str, transactions: int, *, binary: bool) -> tuple[float, float, int]:
    """Wall seconds and this process's CPU seconds to turn ``transactions`` transactions into change tables as the
    pipeline's stream thread does (decode, assemble, convert, batch; a batch finished at the pipeline's size), and
    the changes they held."""
    from pgcdc.pipeline import PipelineConfig
    from pgcdc.pipeline.batcher import Batch, Batcher
    from pgcdc.pipeline.tables import SourceTables
    from pgcdc.replication import LogicalReplicationStream, ReplicationOptions
    from pgcdc.runtime import streaming_gc
    from pgcdc.transactions import Transaction, TransactionReader

    config = PipelineConfig(dsn=dsn, publication="pub", slot=slot, binary=binary)
    batcher = Batcher(SourceTables(config, lambda: None))
    stream = LogicalReplicationStream(dsn, slot=slot, options=ReplicationOptions(
        publication="pub", proto_version=1, binary=binary), raw_changes=True)
    changes = done = 0
    batch = Batch()
    started, cpu = time.perf_counter(), time.process_time()
    with streaming_gc():
        for txn in TransactionReader(stream.events(idle_timeout=5.0)):  # with a tick per message, as the pipeline
            if not isinstance(txn, Transaction):
                continue
            batcher.add(batch, txn)
            done += 1
            if batch.rows >= config.batch_max_rows or done >= transactions:
                batcher.finish(batch)
                changes += sum(chunk.num_rows for segments in batch.tables.values() for segment in segments
                               for chunk in segment.chunks)
                stream.confirm(txn.end_lsn)
                batch = Batch()
            if done >= transactions:
                break
    cpu, seconds = time.process_time() - cpu, time.perf_counter() - started
    stream.close()
    return seconds, cpu, changes


def recvlogical_drain(server: EmbeddedPostgres, slot: str, end: Lsn) -> float:
    command = [str(server.bin_dir / "pg_recvlogical"), "-d", server.dsn, "--slot", slot, "--start",
               "-o", "proto_version=1", "-o", "publication_names=pub", "-f", "/dev/null", "-E", str(end),
               "--no-loop"]
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=1800)
    return time.perf_counter() - started


LARGE_TRANSACTION = textwrap.dedent("""
    import resource, sys, json
    sys.path.insert(0, {src!r})
    from pgcdc.replication import LogicalReplicationStream, ReplicationOptions
    from pgcdc.transactions import TransactionReader
    stream = LogicalReplicationStream({dsn!r}, slot="large", options=ReplicationOptions(publication="pub"),
                                      raw_changes=True)
    for txn in TransactionReader(stream.events(idle_timeout=5.0), memory_limit_bytes=64 << 20).transactions():
        changes = sum(1 for _ in txn.changes())
        spilled = txn.spilled
        break
    stream.close()
    print(json.dumps({{"changes": changes, "spilled": spilled,
                       "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
""")


def large_transaction_rss(server: EmbeddedPostgres, rows: int) -> dict:
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE events")
        conn.execute("SELECT pg_create_logical_replication_slot('large', 'pgoutput')")
        with conn.transaction():
            fill(conn, rows, rows)
    dsn = server.dsn + " options='-c logical_decoding_work_mem=64MB'"
    script = LARGE_TRANSACTION.format(src=str(Path(__file__).resolve().parents[1] / "src"), dsn=dsn)
    output = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                            timeout=1800).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="200,000 changes instead of 1,000,000")
    parser.add_argument("--repeat", type=int, default=3, help="drains of each kind (each its own slot)")
    parser.add_argument("--skip-large", action="store_true", help="leave out the large transaction's memory")
    args = parser.parse_args()
    rows = 200_000 if args.quick else 1_000_000
    per_transaction = 10_000
    repeat = max(1, args.repeat)
    kinds = ("recvlogical", "pgcdc", "text", "binary")
    with EmbeddedPostgres(settings={"max_wal_size": "8GB"}) as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(TABLE)
            for kind in kinds:
                for run in range(repeat):
                    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (f"{kind}_{run}",))
            fill(conn, rows, per_transaction)
            end = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        transactions = -(-rows // per_transaction)
        wall: dict[str, list[float]] = {kind: [] for kind in kinds}
        cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
        for run in range(repeat):  # interleaved: a machine that slows down slows every kind down alike
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            wall["recvlogical"].append(recvlogical_drain(server, f"recvlogical_{run}", end))
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu["recvlogical"].append(after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime)
            started = time.process_time()
            seconds, changes = pgcdc_drain(server.dsn, f"pgcdc_{run}", transactions)
            wall["pgcdc"].append(seconds)
            cpu["pgcdc"].append(time.process_time() - started)
            assert changes == rows, (changes, rows)
            for kind in ("text", "binary"):
                seconds, used, changes = batched_drain(server.dsn, f"{kind}_{run}", transactions,
                                                       binary=kind == "binary")
                assert changes == rows, (kind, changes, rows)
                wall[kind].append(seconds)
                cpu[kind].append(used)
        large = None if args.skip_large else large_transaction_rss(server, rows)

    def rate(kind: str) -> float:
        return rows / statistics.median(wall[kind])

    def micros(kind: str) -> list[float]:
        return sorted(round(seconds * 1e6 / rows, 2) for seconds in cpu[kind])

    ours, theirs = rate("pgcdc"), rate("recvlogical")
    labels = {"recvlogical": "pg_recvlogical (to /dev/null)", "pgcdc": "pgcdc (decode + assemble)",
              "text": "pgcdc to change tables, text", "binary": "pgcdc to change tables, binary"}
    print(f"draining a slot of {rows:,} changes ({transactions} transactions), protocol 1, {repeat} runs each "
          f"(median rate; CPU of the draining process, min..max; load {os.getloadavg()[0]:.1f})")
    print(f"{'client':<34} {'changes/s':>12} {'of recvlogical':>15}   CPU µs/change")
    for kind in kinds:
        spread = micros(kind)
        print(f"{labels[kind]:<34} {rate(kind):>12,.0f} {rate(kind) / theirs:>15.0%}   "
              f"{statistics.median(spread):.2f} ({spread[0]:.2f}..{spread[-1]:.2f})")
    figures: dict[str, object] = {
        "changes": rows, "pgcdc_changes_per_s": round(ours), "pg_recvlogical_changes_per_s": round(theirs),
        "ratio_vs_pg_recvlogical": round(ours / theirs, 2),
        "pg_recvlogical_cpu_us_per_change": statistics.median(micros("recvlogical")),
        "pgcdc_assemble_cpu_us_per_change": statistics.median(micros("pgcdc"))}
    for kind in ("text", "binary"):
        figures[f"stream_side_{kind}_changes_per_s"] = round(rate(kind))
        figures[f"stream_side_{kind}_cpu_us_per_change"] = statistics.median(micros(kind))
        figures[f"stream_side_{kind}_cpu_us_per_change_spread"] = [micros(kind)[0], micros(kind)[-1]]
        figures[f"stream_side_{kind}_ratio_vs_pg_recvlogical"] = round(rate(kind) / theirs, 2)
    if large is not None:
        print(f"one {rows:,}-row transaction streamed: peak RSS {large['peak_rss_mb']:.0f} MB "
              f"(spilled to disk: {large['spilled']})")
        figures.update({"peak_rss_mb_large_txn": round(large["peak_rss_mb"]), "large_txn_rows": large["changes"],
                        "large_txn_spilled": large["spilled"]})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
