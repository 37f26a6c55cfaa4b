"""The process to profile for the stream side: fills capture.py's backlog, prints READY and its PID, then drains
it into change tables as the pipeline's stream thread does (``py-spy record -p PID`` in between).

    TREE=<checkout> python bench/profiles/profile_stream_side.py 300000 [binary]
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, os.environ.get("TREE", str(Path(__file__).resolve().parents[2])) + "/bench")
sys.path.insert(0, os.environ.get("TREE", str(Path(__file__).resolve().parents[2])) + "/src")

import psycopg
from capture import TABLE, batched_drain, fill

from pgcdc.embedded import EmbeddedPostgres


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    binary = len(sys.argv) > 2 and sys.argv[2] == "binary"
    with EmbeddedPostgres(settings={"max_wal_size": "8GB"}) as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(TABLE)
            conn.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
            fill(conn, rows, 10_000)
        for module in ("pgcdc.pipeline.batcher", "pgcdc.replication", "pgcdc.transactions"):
            importlib.import_module(module)  # before the profile starts

        print("READY", os.getpid(), flush=True)
        seconds, cpu, changes = batched_drain(server.dsn, "s", rows // 10_000, binary=binary)
        print(f"{changes} changes, {cpu * 1e6 / changes:.2f} µs/change CPU, {seconds:.1f}s")


if __name__ == "__main__":
    main()
