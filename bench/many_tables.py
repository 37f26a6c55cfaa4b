"""Many tables: a publication of many small tables, mirrored by ``pgcdc run --until-caught-up`` as a user runs it
(a new process each time, its JVM start included: a restart, or a scheduled job).

1. The initial copy of every table (the first run, which copies and then catches up): its wall time, per table.
2. Rounds: a workload of transactions that each touch every table (inserts, updates, deletes), drained by
   pg_recvlogical from a twin slot (the peer: the server decoding and sending the same changes, nothing applied),
   then caught up by a new ``pgcdc run --until-caught-up``. For each: wall time, and from pgcdc's log the
   seconds its batches took to apply (the rest: the process's start, the JVM's, reading each mirror before its
   first batch, decoding). The first round is reported apart (the warehouse's first restart); the median and
   the spread of the others.
3. A backlog (``--backlog``, changes): what piles up while pgcdc is stopped under an OLTP application —
   transactions of ~100 changes each touching 1-5 tables of skewed popularity (inserts, updates, deletes of old
   rows) — drained by pg_recvlogical from a twin slot, then caught up by a new ``pgcdc run --until-caught-up``,
   its start included; ``--backlog-runs`` times, each a new backlog.

A JSON line of the figures ends the output. ``--quick``: fewer tables, rounds and a smaller backlog.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from capture import recvlogical_drain  # the capture bench's peer (publication "pub")
from catchup import config_for, run_command, spread

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.lsn import Lsn

APPLIED = re.compile(r"applied (\d+) changes of \d+ transactions up to \S+ in ([\d.]+)s")


def create_tables(conn: psycopg.Connection, tables: int, rows: int) -> None:
    for i in range(tables):
        conn.execute(f"CREATE TABLE t{i} (id int PRIMARY KEY, v text, n numeric(12,2), ts timestamptz, j jsonb)")
        conn.execute(f"INSERT INTO t{i} SELECT g, 'v' || g, g * 1.5, now(), jsonb_build_object('a', g) "
                     f"FROM generate_series(1, {rows}) g")
    conn.execute("CREATE PUBLICATION pub FOR ALL TABLES")


def workload(conn: psycopg.Connection, tables: int, transactions: int, round_: int) -> None:
    """``transactions`` transactions, each inserting 50 rows into every table, updating a fifth of its rows and
    deleting an eleventh of them."""
    for k in range(transactions):
        step = round_ * transactions + k
        with conn.transaction():
            for i in range(tables):
                first = 100_000 + step * 100
                conn.execute(f"INSERT INTO t{i} SELECT g, 'w' || g, g, now(), '{{}}' "
                             f"FROM generate_series({first}, {first + 49}) g")
                conn.execute(f"UPDATE t{i} SET v = v || 'u', j = j || '{{\"b\": 1}}' WHERE id % 5 = {step % 5}")
                conn.execute(f"DELETE FROM t{i} WHERE id % 11 = {step % 11}")


BACKLOG_PROCEDURE = """
CREATE OR REPLACE PROCEDURE pgcdc_backlog(transactions int, tables int, first_id bigint) LANGUAGE plpgsql AS $$
DECLARE
    k int;
    t int;
    x int;
BEGIN
    FOR k IN 0 .. transactions - 1 LOOP
        -- 1-5 distinct tables, the low-numbered ones most often (a table's chance falls as its number grows)
        FOR t IN SELECT DISTINCT floor(tables * power(random(), 2))::int FROM generate_series(1, 1 + floor(random() * 5)::int) LOOP
            EXECUTE format('INSERT INTO t%s SELECT g, ''b'' || g, g, now(), ''{}'' FROM generate_series(%s, %s) g',
                           t, first_id + k * 20, first_id + k * 20 + 19);
            x := 1 + floor(random() * 490)::int;
            EXECUTE format('UPDATE t%s SET v = md5(v), n = n + 1 WHERE id BETWEEN %s AND %s', t, x, x + 9);
            EXECUTE format('DELETE FROM t%s WHERE id IN (SELECT id FROM t%s WHERE id >= 10000000 ORDER BY id LIMIT 3)',
                           t, t);
        END LOOP;
        COMMIT;
    END LOOP;
END $$
"""
BACKLOG_CHANGES_PER_TRANSACTION = 100  # ~3 tables a transaction, ~20 inserts, ~10 updates and 3 deletes each


def backlog(conn: psycopg.Connection, tables: int, changes: int, run: int) -> None:
    """About ``changes`` changes in transactions of ~100, each in its own commit (the server's procedure commits
    each; ``conn`` in autocommit)."""
    conn.execute(BACKLOG_PROCEDURE)
    transactions = max(1, changes // BACKLOG_CHANGES_PER_TRANSACTION)
    conn.execute("CALL pgcdc_backlog(%s, %s, %s)", (transactions, tables, 10_000_000 * (run + 1)))


def pgcdc_run(command: list[str], log_to: Path | None = None) -> tuple[float, int, list[float], int, int]:
    """A whole ``pgcdc run --until-caught-up`` process: its seconds, the changes it applied, each batch's apply
    seconds (from its log), and the most resident memory seen of pgcdc's Python process and of its JVM (sampled
    every 0.2 s). ``log_to``: a file its log is kept in."""
    import psutil

    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                   env={**os.environ, "PGCDC_LOG_LEVEL": "INFO"})
        python_rss = jvm_rss = 0
        watched = psutil.Process(process.pid)
        while process.poll() is None:
            try:
                python_rss = max(python_rss, watched.memory_info().rss)
                jvm_rss = max([jvm_rss, *(child.memory_info().rss for child in watched.children(recursive=True)
                                          if child.name() == "java")])
            except psutil.Error:
                pass
            time.sleep(0.2)
        seconds = time.perf_counter() - started
        err.seek(0)
        stderr = err.read()
    if log_to is not None:
        log_to.parent.mkdir(parents=True, exist_ok=True)
        log_to.write_text(stderr)
    if process.returncode:
        sys.exit(f"pgcdc run failed:\n{stderr[-3000:]}")
    batches = [(int(changes), float(took)) for changes, took in APPLIED.findall(stderr)]
    return seconds, sum(changes for changes, _ in batches), [took for _, took in batches], python_rss, jvm_rss


def catch_up_backlog(conn: psycopg.Connection, server: EmbeddedPostgres, command: list[str], tables: int,
                     changes: int, runs: int, logs: Path | None, python_rss: list[int],
                     jvm_rss: list[int]) -> dict[str, object]:
    """``runs`` backlogs of about ``changes`` changes, each drained by pg_recvlogical from a twin slot and caught
    up by a new ``pgcdc run --until-caught-up``: the figures."""
    walls, peers, rates, peer_rates, batch_counts = [], [], [], [], []
    for run in range(runs):
        peer = f"backlog_peer_{run}"
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (peer,))
        started = time.perf_counter()
        backlog(conn, tables, changes, run)
        written = time.perf_counter() - started
        end = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
        peer_seconds = recvlogical_drain(server, peer, end)
        conn.execute("SELECT pg_drop_replication_slot(%s)", (peer,))
        wall, applied, batches, rss, jvm = pgcdc_run(
            command, logs / f"backlog-{run + 1:02d}.log" if logs else None)
        python_rss.append(rss)
        jvm_rss.append(jvm)
        print(f"backlog {run + 1}: {applied:,} changes over {tables} tables (written in {written:.0f} s): pgcdc "
              f"{wall:.1f} s, {applied / wall:,.0f} changes/s, its start included ({len(batches)} batches applying "
              f"{sum(batches):.1f} s, median {statistics.median(batches or [0]):.2f} s); pg_recvlogical "
              f"{peer_seconds:.1f} s, {applied / peer_seconds:,.0f} changes/s: {peer_seconds / wall:.2f}x",
              flush=True)
        walls.append(wall)
        peers.append(peer_seconds)
        rates.append(applied / wall)
        peer_rates.append(applied / peer_seconds)
        batch_counts.append(len(batches))
    print(spread("backlog: pgcdc run --until-caught-up, whole process", walls))
    print(spread("backlog: pg_recvlogical draining the same changes", peers))
    return {"backlog_changes": changes, "backlog_s": round(statistics.median(walls), 2),
            "backlog_s_min": round(min(walls), 2), "backlog_s_max": round(max(walls), 2),
            "backlog_changes_per_s": round(statistics.median(rates)), "backlog_batches": batch_counts,
            "backlog_pg_recvlogical_changes_per_s": round(statistics.median(peer_rates)),
            "backlog_ratio_vs_pg_recvlogical": round(statistics.median(rates) / statistics.median(peer_rates), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="30 tables, 3 rounds")
    parser.add_argument("--tables", type=int, default=None, help="tables in the publication (default 100)")
    parser.add_argument("--rows", type=int, default=500, help="rows per table before the copy")
    parser.add_argument("--logs", type=Path, default=None, help="a directory to keep each pgcdc process's log in")
    parser.add_argument("--rounds", type=int, default=None, help="workload rounds (default 4)")
    parser.add_argument("--transactions", type=int, default=3, help="transactions per round, each touching "
                                                                     "every table")
    parser.add_argument("--backlog", type=int, default=None,
                        help="changes in the backlog caught up after the rounds (default 1,000,000; --quick "
                             "200,000; 0: none)")
    parser.add_argument("--backlog-runs", type=int, default=2, help="backlogs caught up, each a new process")
    parser.add_argument("--apply-workers", type=int, default=None,
                        help="mirrors of a batch applied at once (default: pgcdc's); 1: one after another")
    args = parser.parse_args()
    if args.apply_workers is not None:  # every pgcdc process this bench starts
        os.environ["PGCDC_APPLY_WORKERS"] = str(args.apply_workers)
    tables = args.tables or (30 if args.quick else 100)
    rounds = args.rounds if args.rounds is not None else (3 if args.quick else 4)
    backlog_changes = args.backlog if args.backlog is not None else (200_000 if args.quick else 1_000_000)
    figures: dict[str, object] = {"tables": tables, "rows_per_table": args.rows,
                                  "apply_workers": args.apply_workers or "default"}
    with EmbeddedPostgres() as server, tempfile.TemporaryDirectory(prefix="pgcdc-many-") as warehouse, \
            psycopg.connect(server.dsn, autocommit=True) as conn:
        create_tables(conn, tables, args.rows)
        config = config_for(server, warehouse, "many", "delta", "position")
        command = run_command(config)
        copy_seconds, _, _, _, _ = pgcdc_run(command, args.logs / "copy.log" if args.logs else None)
        print(f"initial copy of {tables} tables of {args.rows} rows: {copy_seconds:.1f} s "
              f"({copy_seconds / tables:.2f} s per table)", flush=True)
        figures.update(copy_s=round(copy_seconds, 2), copy_s_per_table=round(copy_seconds / tables, 3))
        walls, applies, peers, rates, peer_rates, python_rss, jvm_rss = [], [], [], [], [], [], []
        for round_ in range(rounds):
            peer = f"peer_{round_}"
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (peer,))
            workload(conn, tables, args.transactions, round_)
            end = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
            peer_seconds = recvlogical_drain(server, peer, end)
            conn.execute("SELECT pg_drop_replication_slot(%s)", (peer,))
            wall, changes, batches, rss, jvm = pgcdc_run(
                command, args.logs / f"round-{round_ + 1:02d}.log" if args.logs else None)
            apply = sum(batches)
            print(f"round {round_ + 1}: {changes:,} changes into {tables} mirrors: pgcdc {wall:.1f} s (its "
                  f"{len(batches)} batches applying {apply:.1f} s, {apply / max(1, len(batches)) / tables:.3f} s per "
                  f"table per batch; resident memory at most {rss / 2**20:.0f} MiB, its JVM {jvm / 2**20:.0f} MiB), "
                  f"pg_recvlogical {peer_seconds:.1f} s", flush=True)
            python_rss.append(rss)
            jvm_rss.append(jvm)
            walls.append(wall)
            applies.append(apply / max(1, len(batches)) / tables)
            peers.append(peer_seconds)
            rates.append(changes / wall)
            peer_rates.append(changes / peer_seconds)
        if rounds >= 2:
            print("first round (the warehouse's first restart) apart; the others:")
            for label, values in [("pgcdc run --until-caught-up, whole process", walls[1:]),
                                  ("pg_recvlogical draining the same changes", peers[1:])]:
                print(spread(label, values))
            figures.update(
                first_round_s=round(walls[0], 2), first_round_changes_per_s=round(rates[0]),
                round_s=round(statistics.median(walls[1:]), 2), round_s_min=round(min(walls[1:]), 2),
                round_s_max=round(max(walls[1:]), 2), changes_per_s=round(statistics.median(rates[1:])),
                apply_s_per_table_batch=round(statistics.median(applies[1:]), 3),
                pg_recvlogical_changes_per_s=round(statistics.median(peer_rates[1:])),
                ratio_vs_pg_recvlogical=round(statistics.median(rates[1:]) / statistics.median(peer_rates[1:]), 3))
        if backlog_changes:
            figures.update(catch_up_backlog(conn, server, command, tables, backlog_changes, args.backlog_runs,
                                            args.logs, python_rss, jvm_rss))
        figures.update(python_rss_mib=round(max(python_rss, default=0) / 2**20),
                       jvm_rss_mib=round(max(jvm_rss, default=0) / 2**20),
                       python_rss_kib_per_mirror=round(max(python_rss, default=0) / 1024 / tables, 1))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
