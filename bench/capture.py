"""Capture throughput: pgcdc receiving, decoding and assembling a slot, beside pg_recvlogical (the C client).

Two identical slots hold the same changes (inserts of a 10-column table in transactions of 10,000 rows);
pg_recvlogical drains one into /dev/null, pgcdc drains the other through the walsender, decoding every
message and assembling every transaction. Then the peak memory of pgcdc while one large transaction
streams (protocol 4, streaming 'parallel'), measured in a separate process. Last line: JSON figures.
"""

from __future__ import annotations

import argparse
import json
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

    stream = LogicalReplicationStream(dsn, slot=slot, options=ReplicationOptions(publication="pub", proto_version=1))
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
    stream = LogicalReplicationStream({dsn!r}, slot="large", options=ReplicationOptions(publication="pub"))
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
    args = parser.parse_args()
    rows = 200_000 if args.quick else 1_000_000
    per_transaction = 10_000
    with EmbeddedPostgres(settings={"max_wal_size": "4GB"}) as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(TABLE)
            for slot in ("for_pgcdc", "for_recvlogical"):
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
            fill(conn, rows, per_transaction)
            end = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        transactions = -(-rows // per_transaction)
        recvlogical_seconds = recvlogical_drain(server, "for_recvlogical", end)
        pgcdc_seconds, changes = pgcdc_drain(server.dsn, "for_pgcdc", transactions)
        assert changes == rows, (changes, rows)
        large = large_transaction_rss(server, rows)
    ours, theirs = rows / pgcdc_seconds, rows / recvlogical_seconds
    print(f"draining a slot of {rows:,} changes ({transactions} transactions), protocol 1")
    print(f"{'client':<34} {'changes/s':>12}")
    print(f"{'pg_recvlogical (to /dev/null)':<34} {theirs:>12,.0f}")
    print(f"{'pgcdc (decode + assemble)':<34} {ours:>12,.0f}   {ours / theirs:.0%} of pg_recvlogical")
    print(f"one {rows:,}-row transaction streamed: peak RSS {large['peak_rss_mb']:.0f} MB "
          f"(spilled to disk: {large['spilled']})")
    print(json.dumps({"changes": rows, "pgcdc_changes_per_s": round(ours),
                      "pg_recvlogical_changes_per_s": round(theirs), "ratio_vs_pg_recvlogical": round(ours / theirs, 2),
                      "peak_rss_mb_large_txn": round(large["peak_rss_mb"]), "large_txn_rows": large["changes"],
                      "large_txn_spilled": large["spilled"]}))


if __name__ == "__main__":
    main()
