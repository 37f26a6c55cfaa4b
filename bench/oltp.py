"""Streaming an OLTP mix over many tables: one long-running ``pgcdc run``, replication lag and changes/s.

1. Tables: N tables (default 200; ``--quick`` 30) of six shapes (ints and text; an order of numeric, text and
   timestamptz; jsonb events; numeric metrics of seven types; a text key; a wide one of 20 columns), all with a
   primary key, most small (100-2,000 rows), one in twenty large (50,000-200,000 rows; ``--quick`` 10,000-30,000),
   in one publication FOR ALL TABLES.
2. The initial copy: ``pgcdc run --until-caught-up``, a whole process as a user starts it (its JVM included).
3. Then ONE ``pgcdc run`` process, started with the default options as a user starts it, streams until the end.
   A first transaction updating one row of every table (the warm-up: Spark's start, every mirror opened and its
   key index read) is waited for and reported apart. Then a slot for the peer is created, and one writer
   connection commits transactions at ``--rate`` per second for ``--seconds``: each touches 1-5 tables chosen
   by a Zipf (s=1) popularity over a seeded shuffle of the tables, each touch one row: an update of a random
   existing key (50%), an insert (35%) or a delete (15%). Each transaction is one round trip (a simple-protocol
   query of several statements, one implicit transaction), so one writer holds the rate; the output says when it
   did not. Once the mirrors hold the last transaction, pgcdc is stopped with SIGINT (it exits with 130).
4. The peer: pg_recvlogical drains the twin slot, which holds the same changes, into /dev/null afterwards (the
   server decoding and sending them, nothing applied). Its rate is a drain's, its start included (a small
   backlog: mostly start); pgcdc's is bounded by the offered rate: the changes over the time from the mirrors
   holding the workload's first transaction to their holding its last (the offered rate when pgcdc keeps up and
   its lag stays level), and beside it from the first commit (the last transaction's lag included).

Lag, per source transaction: from its commit (the writer's call returning) to the moment pgcdc logs
``applied N changes of M transactions up to <commit LSN>`` for the batch that holds it. That line is written
once every mirror of the batch has committed to Iceberg and the slot has been confirmed (``collect`` in
pgcdc.pipeline.applier): the moment the mirrors hold the transaction. Each line is stamped when this bench reads
it from pgcdc's stderr (a pipe, read by a thread; the log's own clock prints whole seconds). A transaction is in
a batch when the batch's last commit LSN is at or past a position the writer read as the first statement of
the transaction (``pg_current_wal_insert_lsn()``): past the previous commit, not past its own, and with one
writer no other transaction commits between the two. The workload's first ``--warmup-seconds`` (20 by
default) are a warm-up, their lag reported apart: the JVM compiles the commit's code under load then (batches
took up to twice as long in those seconds); the lag figures and the thirds are of the ``--seconds`` after.

Goals, printed beside the figures (never asserted): 60 tables at 200 tx/s, lag p99 <= 2 s; 200 tables at
200 tx/s, p99 <= 5 s and p50 <= 2 s; lag does not grow over the run (the p99 of the last third of the run no
more than 1.5x the first third's). ``--store s3-jdbc``: the warehouse on a local S3 server behind Iceberg's JDBC
catalog (:mod:`pgcdc.local_object_store`), given to pgcdc as a user would: flags and a config file (0600) whose
``[spark]`` table holds the settings. Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import psutil
import psycopg
from capture import recvlogical_drain  # the capture bench's peer (publication "pub")
from many_tables import pgcdc_run  # a whole `pgcdc run --until-caught-up` process, timed

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.lsn import Lsn
from pipeline import BUCKET, percentile  # bench/pipeline.py

APPLIED = re.compile(r"applied (\d+) changes of (\d+) transactions up to (\S+) in ([\d.]+)s(?: over (\d+) mirrors)?")
SLOT, NAMESPACE, PUBLICATION = "oltp", "oltp", "pub"  # capture.recvlogical_drain reads publication "pub"
GROWTH_LIMIT = 1.5  # last third's p99 over the first third's: more than this, lag grows


@dataclass(frozen=True)
class Shape:
    """A table's columns; ``values`` are the row of key number ``g`` (a SQL expression of ``g``)."""

    columns: str
    values: str
    update: str  # SET clause; {r} is a random number
    text_key: bool = False

    def key(self, number: int) -> str:
        return f"'acct-{number}'" if self.text_key else str(number)


WIDE_COLUMNS = ", ".join([f"c{i} int" for i in range(1, 6)] + [f"c{i} text" for i in range(6, 10)]
                         + [f"c{i} numeric(12,2)" for i in range(10, 13)] + ["c13 timestamptz", "c14 timestamptz",
                                                                             "c15 float8", "c16 float8", "c17 bool",
                                                                             "c18 jsonb", "c19 date"])
WIDE_VALUES = ", ".join(["g"] + [f"(g % {97 * i})::int" for i in range(1, 6)]
                        + [f"'text {i} ' || g" for i in range(6, 10)] + [f"g * {i}.25" for i in range(10, 13)]
                        + ["now()", "now() - interval '1 day'", "g / 7.0", "g / 3.0", "g % 2 = 0",
                           "jsonb_build_object('g', g, 'w', true)", "date '2024-01-01' + (g % 365)::int"])
SHAPES = {
    "kv": Shape("id bigint PRIMARY KEY, n int, v text", "g, (g % 1000)::int, 'value ' || g", "n = n + 1, v = 'u{r}'"),
    "orders": Shape("id bigint PRIMARY KEY, customer int, amount numeric(12,2), status text, placed timestamptz",
                    "g, (g % 5000)::int, (g % 10000) * 1.25, 'new', now()",
                    "status = 'shipped', amount = amount + 1, placed = now()"),
    "events": Shape("id bigint PRIMARY KEY, kind text, payload jsonb, at timestamptz",
                    "g, 'kind ' || (g % 7), jsonb_build_object('k', g, 'tags', jsonb_build_array('a', 'b')), now()",
                    "payload = payload || jsonb_build_object('seen', {r}), at = now()"),
    "metrics": Shape("id bigint PRIMARY KEY, a int, b bigint, c float8, d numeric(10,3), ok bool, day date",
                     "g, (g % 100)::int, g * 1000, g / 3.0, g / 7.0, g % 2 = 0, date '2024-01-01' + (g % 365)::int",
                     "a = a + 1, c = c * 1.01, ok = NOT ok"),
    "accounts": Shape("id text PRIMARY KEY, email text, balance numeric(14,2), updated timestamptz",
                      "'acct-' || g, 'user' || g || '@example.com', g * 0.5, now()",
                      "balance = balance + {r} / 100.0, updated = now()", text_key=True),
    "wide": Shape(f"id bigint PRIMARY KEY, {WIDE_COLUMNS}", WIDE_VALUES, "c1 = c1 + 1, c6 = 'u{r}', c13 = now()"),
}
SHAPE_WEIGHTS = {"kv": 30, "orders": 20, "events": 20, "metrics": 15, "accounts": 10, "wide": 5}


@dataclass
class Table:
    name: str
    shape: Shape
    keys: list[int]  # the live keys, by number
    next_key: int


def make_tables(conn: psycopg.Connection, count: int, quick: bool, rng: random.Random) -> list[Table]:
    """``count`` tables of varied shapes and sizes, filled, and the publication of them all."""
    large = set(rng.sample(range(count), max(2 if quick else 1, count // 20)))
    names = list(SHAPES)
    shapes = rng.choices(names, weights=[SHAPE_WEIGHTS[n] for n in names], k=count)
    shapes[rng.randrange(count)] = "wide"  # at least one
    tables = []
    for i, shape_name in enumerate(shapes):
        shape = SHAPES[shape_name]
        if i in large:
            rows = rng.randint(10_000, 30_000) if quick else rng.randint(50_000, 200_000)
        else:
            rows = round(math.exp(rng.uniform(math.log(100), math.log(2000))))
        name = f"t{i:03d}_{shape_name}"
        conn.execute(f"CREATE TABLE {name} ({shape.columns})")
        conn.execute(f"INSERT INTO {name} SELECT {shape.values} FROM generate_series(1, {rows}) g")
        tables.append(Table(name, shape, list(range(1, rows + 1)), rows + 1))
    conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR ALL TABLES")
    conn.execute("VACUUM ANALYZE")
    return tables


class Workload:
    """Transactions of 1-5 touches over tables of Zipf-like popularity (seeded): the SQL of each, one round
    trip, its first statement the WAL position before its changes."""

    def __init__(self, tables: list[Table], rng: random.Random) -> None:
        self.tables, self.rng = tables, rng
        order = list(range(len(tables)))
        rng.shuffle(order)  # popularity independent of shape and size
        weights = [0.0] * len(tables)
        for rank, index in enumerate(order):
            weights[index] = 1.0 / (rank + 1)
        self.cumulative = [sum(weights[:i + 1]) for i in range(len(weights))]
        self.hottest = tables[order[0]].name
        self.hottest_share = weights[order[0]] / self.cumulative[-1]
        self.ops = {"insert": 0, "update": 0, "delete": 0}

    def touch(self, table: Table) -> str:
        draw = self.rng.random()
        op = "update" if draw < 0.5 else "insert" if draw < 0.85 or len(table.keys) < 10 else "delete"
        self.ops[op] += 1
        if op == "insert":
            number = table.next_key
            table.next_key += 1
            table.keys.append(number)
            return f"INSERT INTO {table.name} SELECT {table.shape.values} FROM (SELECT {number}::bigint AS g) s"
        index = self.rng.randrange(len(table.keys))
        number = table.keys[index]
        key = table.shape.key(number)
        if op == "update":
            sets = table.shape.update.format(r=self.rng.randrange(1_000_000))
            return f"UPDATE {table.name} SET {sets} WHERE id = {key}"
        table.keys[index] = table.keys[-1]
        table.keys.pop()
        return f"DELETE FROM {table.name} WHERE id = {key}"

    def transaction(self) -> tuple[str, int]:
        wanted = self.rng.randint(1, min(5, len(self.tables)))
        chosen: list[int] = []
        while len(chosen) < wanted:
            index = bisect.bisect_left(self.cumulative, self.rng.random() * self.cumulative[-1])
            if index not in chosen:
                chosen.append(min(index, len(self.tables) - 1))
        statements = ["SELECT pg_current_wal_insert_lsn()::text"]
        statements += [self.touch(self.tables[index]) for index in chosen]
        return "; ".join(statements), wanted


class Writer(threading.Thread):
    """One connection committing the workload's transactions paced at ``rate`` per second for ``seconds``;
    records (commit time, WAL position before its changes, changes) of each."""

    def __init__(self, dsn: str, workload: Workload, rate: float, seconds: float) -> None:
        super().__init__(daemon=True)
        self.dsn, self.workload, self.rate, self.seconds = dsn, workload, rate, seconds
        self.commits: list[tuple[float, Lsn, int]] = []
        self.started = 0.0
        self.ended = 0.0
        self.late = 0  # transactions started more than 100 ms after their due time
        self.most_behind = 0.0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                self.started = time.monotonic()
                total = int(self.rate * self.seconds)
                for number in range(total):
                    if self.stop.is_set():
                        break
                    query, changes = self.workload.transaction()
                    due = self.started + number / self.rate
                    behind = time.monotonic() - due
                    if behind < 0:
                        time.sleep(-behind)
                    elif behind > 0.1:
                        self.late += 1
                        self.most_behind = max(self.most_behind, behind)
                    position = conn.execute(query).fetchone()[0]  # type: ignore[index]
                    self.commits.append((time.monotonic(), Lsn.parse(position), changes))
                self.ended = time.monotonic()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
            self.ended = time.monotonic()


@dataclass
class Batch:
    at: float  # when this bench read the log line
    changes: int
    transactions: int
    upto: Lsn
    seconds: float
    mirrors: int  # 0: not logged


@dataclass
class Streaming:
    """The long-running ``pgcdc run``: its applied batches, read from its log as it writes them."""

    process: subprocess.Popen
    batches: list[Batch] = field(default_factory=list)
    tail: deque = field(default_factory=lambda: deque(maxlen=60))
    python_rss: int = 0
    jvm_rss: int = 0
    log: TextIO | None = None  # where every line of its log is kept too (--log)

    @classmethod
    def start(cls, command: list[str], stdout, log: Path | None = None) -> Streaming:
        process = subprocess.Popen(command, stdout=stdout, stderr=subprocess.PIPE, text=True, bufsize=1)
        streaming = cls(process, log=log.open("w") if log is not None else None)
        threading.Thread(target=streaming._read, daemon=True).start()
        threading.Thread(target=streaming._sample, daemon=True).start()
        return streaming

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            at = time.monotonic()
            self.tail.append(line.rstrip())
            if self.log is not None:
                self.log.write(f"{time.strftime('%H:%M:%S')} {line}")
                self.log.flush()
            match = APPLIED.search(line)
            if match is None:
                continue
            with contextlib.suppress(ValueError):  # a batch without a commit: nothing to place
                self.batches.append(Batch(at, int(match.group(1)), int(match.group(2)), Lsn.parse(match.group(3)),
                                          float(match.group(4)), int(match.group(5) or 0)))

    def _sample(self) -> None:
        watched = psutil.Process(self.process.pid)
        while self.process.poll() is None:
            with contextlib.suppress(psutil.Error):
                self.python_rss = max(self.python_rss, watched.memory_info().rss)
                for child in watched.children(recursive=True):
                    if child.name() == "java":
                        self.jvm_rss = max(self.jvm_rss, child.memory_info().rss)
            time.sleep(1)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of pgcdc's Python process, its JVM, and the rest of its process tree."""
        used = {"python": 0.0, "jvm": 0.0, "other": 0.0}
        with contextlib.suppress(psutil.Error):
            watched = psutil.Process(self.process.pid)
            times = watched.cpu_times()
            used["python"] = times.user + times.system
            for child in watched.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    times = child.cpu_times()
                    used["jvm" if child.name() == "java" else "other"] += times.user + times.system
        return used

    def held_at(self, position: Lsn) -> float | None:
        """When the mirrors first held everything before ``position``."""
        batch = next((b for b in self.batches if b.upto >= position), None)
        return None if batch is None else batch.at

    def wait_for(self, position: Lsn, timeout: float, what: str) -> float:
        deadline = time.monotonic() + timeout
        while (held := self.held_at(position)) is None:
            self.check_alive()
            if time.monotonic() > deadline:
                sys.exit(f"the mirrors did not hold {what} within {timeout:.0f} s; pgcdc's log ends:\n"
                         + "\n".join(self.tail))
            time.sleep(0.05)
        return held

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            time.sleep(0.5)  # the reader thread takes the last lines
            sys.exit(f"pgcdc run exited with {self.process.returncode}; its log ends:\n" + "\n".join(self.tail))


def pgcdc_command(dsn: str, store_args: list[str], config_file: str | None, *, until_caught_up: bool) -> list[str]:
    """``pgcdc run`` as a user starts it: the source, the warehouse, and nothing else (the default options)."""
    command = [sys.executable, "-m", "pgcdc.cli"]
    if config_file:
        command += ["--config", config_file]
    command += ["run", "--dsn", dsn, "--publication", PUBLICATION, "--slot", SLOT, "--namespace", NAMESPACE,
                *store_args]
    return command + (["--until-caught-up"] if until_caught_up else [])


def lags_of(commits: list[tuple[float, Lsn, int]], streaming: Streaming) -> list[float]:
    uptos = [batch.upto for batch in streaming.batches]
    lags = []
    for committed_at, position, _ in commits:
        index = bisect.bisect_left(uptos, position)
        lags.append(max(0.0, streaming.batches[index].at - committed_at))
    return lags


def warm_up(conn: psycopg.Connection, tables: list[Table]) -> Lsn:
    """One transaction updating one row of every table; the WAL position before it."""
    statements = ["SELECT pg_current_wal_insert_lsn()::text"]
    for table in tables:
        statements.append(f"UPDATE {table.name} SET {table.shape.update.format(r=0)} "
                          f"WHERE id = {table.shape.key(table.keys[0])}")
    return Lsn.parse(conn.execute("; ".join(statements)).fetchone()[0])  # type: ignore[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 tables (large ones 10,000-30,000 rows), 60 s")
    parser.add_argument("--tables", type=int, help="tables in the publication (default 200; --quick 30)")
    parser.add_argument("--rate", type=float, default=200.0, help="transactions per second (default 200)")
    parser.add_argument("--seconds", type=float, help="seconds of workload measured (default 300; --quick 60)")
    parser.add_argument("--warmup-seconds", type=float, default=20.0,
                        help="seconds of the same workload before those measured, whose lag is reported apart "
                             "(the JVM compiling the commit's code; default 20)")
    parser.add_argument("--apply-workers", type=int, default=None,
                        help="PGCDC_APPLY_WORKERS for the pgcdc processes (default: pgcdc's); 1: one mirror after "
                             "another")
    parser.add_argument("--store", choices=("local", "s3-jdbc"), default="local",
                        help="the warehouse: a local directory (default), or a local S3 server behind Iceberg's "
                             "JDBC catalog on the bench's PostgreSQL")
    parser.add_argument("--seed", type=int, default=7, help="the workload's random seed")
    parser.add_argument("--log", type=Path, default=None, help="a file to keep the streaming run's log in")
    args = parser.parse_args()
    tables_count = args.tables or (30 if args.quick else 200)
    seconds = args.seconds or (60.0 if args.quick else 300.0)
    if tables_count < 1 or args.rate <= 0 or seconds <= 0:
        parser.error("--tables, --rate and --seconds take positive numbers")
    if args.apply_workers is not None:  # every pgcdc process this bench starts
        os.environ["PGCDC_APPLY_WORKERS"] = str(args.apply_workers)
    rng = random.Random(args.seed)
    figures: dict[str, object] = {"tables": tables_count, "rate_tx_per_s": args.rate, "seconds": seconds,
                                  "apply_workers": args.apply_workers or "default", "store": args.store}
    notes: list[str] = []
    with EmbeddedPostgres(settings={"max_wal_size": "8GB"}) as server, contextlib.ExitStack() as stack, \
            psycopg.connect(server.dsn, autocommit=True) as conn:
        work = stack.enter_context(tempfile.TemporaryDirectory(prefix="pgcdc-oltp-"))
        config_file = None
        if args.store == "s3-jdbc":
            from pgcdc.local_object_store import s3_jdbc_store

            s3, setup = stack.enter_context(s3_jdbc_store(server.dsn, BUCKET))
            store_args = ["--catalog", setup.catalog, "--catalog-type", setup.catalog_type, "--catalog-uri",
                          setup.catalog_uri, "--warehouse", setup.warehouse]
            config_file = os.path.join(work, "pgcdc.toml")  # the secrets in a file only this user reads
            with open(os.open(config_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as toml:
                toml.write("[spark]\n" + "".join(f"{json.dumps(k)} = {json.dumps(v)}\n"
                                                 for k, v in setup.spark_conf.items()))
            print(f"store: {setup.warehouse} on a local S3 server ({s3.endpoint}), Iceberg's JDBC catalog",
                  flush=True)
        else:
            store_args = ["--warehouse", os.path.join(work, "warehouse")]

        started = time.perf_counter()
        tables = make_tables(conn, tables_count, args.quick, rng)
        rows = sum(len(t.keys) for t in tables)
        sizes = sorted(len(t.keys) for t in tables)
        shapes = {name: sum(1 for t in tables if t.shape is shape) for name, shape in SHAPES.items()}
        print(f"{tables_count} tables, {rows:,} rows (median {statistics.median(sizes):,.0f}, largest "
              f"{sizes[-1]:,}); shapes: {', '.join(f'{n} {c}' for n, c in shapes.items() if c)}; made in "
              f"{time.perf_counter() - started:.1f} s", flush=True)
        figures.update(rows=rows)

        copy_seconds = pgcdc_run(pgcdc_command(server.dsn, store_args, config_file, until_caught_up=True))[0]
        figures.update(copy_s=round(copy_seconds, 1))
        print(f"initial copy, `pgcdc run --until-caught-up` (a whole process, its JVM included): "
              f"{copy_seconds:.1f} s", flush=True)

        stdout = stack.enter_context(open(os.path.join(work, "stdout"), "w+"))
        process_started = time.monotonic()
        streaming = Streaming.start(pgcdc_command(server.dsn, store_args, config_file, until_caught_up=False),
                                    stdout, args.log)
        try:
            warm = streaming.wait_for(warm_up(conn, tables), 600, "the warm-up transaction")
            warmup_s = warm - process_started
            print(f"`pgcdc run` started; its first batch (one row of every table: Spark's start, every mirror "
                  f"opened) held {warmup_s:.1f} s after its start", flush=True)
            figures.update(warmup_first_batch_s=round(warmup_s, 1))
            conn.execute("SELECT pg_create_logical_replication_slot('peer', 'pgoutput')")
            workload = Workload(tables, rng)
            writer = Writer(server.dsn, workload, args.rate, args.warmup_seconds + seconds)
            cpu_before, load_before = streaming.cpu(), os.getloadavg()[0]
            writer.start()
            every = 15 if seconds <= 120 else 30
            shown = time.monotonic()
            while writer.is_alive():
                writer.join(timeout=0.5)
                if writer.is_alive() and streaming.process.poll() is not None:
                    writer.stop.set()
                    streaming.check_alive()
                if time.monotonic() - shown >= every and writer.commits:
                    shown = time.monotonic()
                    held = streaming.batches[-1].upto if streaming.batches else Lsn(0)
                    waiting = [c for c in writer.commits if c[1] > held]
                    oldest = shown - waiting[0][0] if waiting else 0.0
                    print(f"  {shown - writer.started:5.0f} s: {len(writer.commits):,} transactions committed, "
                          f"{len(waiting):,} not yet in the mirrors (the oldest {oldest:.1f} s ago), "
                          f"{len(streaming.batches)} batches", file=sys.stderr, flush=True)
            if writer.error is not None:
                raise writer.error
            end = Lsn.parse(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])  # type: ignore[index]
            last = writer.commits[-1]
            held = streaming.wait_for(last[1], max(600.0, seconds * 2), "the workload's last transaction")
            cpu_after, load_after = streaming.cpu(), os.getloadavg()[0]
            tail_s = held - writer.ended
            stopping = time.monotonic()
            streaming.process.send_signal(signal.SIGINT)
            try:
                exit_code = streaming.process.wait(timeout=180)
            except subprocess.TimeoutExpired:
                streaming.process.kill()
                exit_code = streaming.process.wait()
                notes.append("pgcdc did not stop within 180 s of SIGINT: killed")
            stop_s = time.monotonic() - stopping
        finally:
            if streaming.process.poll() is None:
                streaming.process.kill()
                streaming.process.wait()
        if exit_code != 130:
            notes.append(f"pgcdc exited with {exit_code} at SIGINT (130 expected); its log ends: "
                         + " | ".join(list(streaming.tail)[-5:]))

        transactions = len(writer.commits)
        changes = sum(c[2] for c in writer.commits)
        written_for = writer.ended - writer.started
        peer_seconds = recvlogical_drain(server, "peer", end)
        conn.execute("SELECT pg_drop_replication_slot('peer')")

    every_lag = lags_of(writer.commits, streaming)
    # the warm-up apart: the transactions of its first seconds, while the JVM compiles the commit's code
    warming = [lag for (at, _, _), lag in zip(writer.commits, every_lag, strict=True)
               if at - writer.started < args.warmup_seconds]
    measured = [(at, lag) for (at, _, _), lag in zip(writer.commits, every_lag, strict=True)
                if at - writer.started >= args.warmup_seconds]
    lags = [lag for _, lag in measured] or every_lag
    measured_from = writer.started + args.warmup_seconds
    third = (writer.ended - measured_from) / 3
    firsts = [lag for at, lag in measured if at - measured_from < third]
    lasts = [lag for at, lag in measured if at - measured_from >= 2 * third]
    first_p99, last_p99 = percentile(firsts or lags, 0.99), percentile(lasts or lags, 0.99)
    growth = last_p99 / first_p99 if first_p99 > 0 else float("inf")
    window = [b for b in streaming.batches if writer.started <= b.at <= held]
    applied = sum(b.changes for b in window)
    if applied != changes:
        notes.append(f"pgcdc's batches during the workload applied {applied:,} changes; the writer committed "
                     f"{changes:,}")
    # the rate at which the mirrors took the workload in: from holding its first transaction to holding its last
    # (the offered rate when pgcdc keeps up and its lag stays level); beside it, from the first commit
    first_held = streaming.held_at(writer.commits[0][1]) or held
    sustained = changes / max(held - first_held, 1e-3)
    commit_to_held = changes / (held - writer.started)
    peer_rate = changes / peer_seconds
    written_rate = transactions / written_for
    # held: the rate reached, and never more than a second behind the schedule (a late start is caught up on at
    # once; each lag counts from the actual commit)
    kept = written_rate >= 0.97 * args.rate and writer.most_behind <= 1.0
    late = (f"{writer.late:,} transactions started more than 100 ms after their time (at most "
            f"{writer.most_behind:.1f} s)")
    if not kept:
        notes.append(f"the writer could not keep the rate: {written_rate:.1f} tx/s of {args.rate:g}, {late}")
    cpu = {k: (cpu_after[k] - cpu_before[k]) / (held - writer.started) for k in cpu_before}
    p50, p90, p99 = (percentile(lags, f) for f in (0.5, 0.9, 0.99))
    worst = max(lags)
    batch_seconds = [b.seconds for b in window] or [0.0]
    batch_changes = [b.changes for b in window] or [0]
    # a batch's apply per mirror it touched: the median over the batches (the goal's "per-mirror cost of a batch")
    batch_mirrors = [b.mirrors for b in window if b.mirrors]
    per_mirror_ms = statistics.median(1000 * b.seconds / b.mirrors for b in window if b.mirrors) if batch_mirrors \
        else 0.0
    gaps = [b.at - a.at for a, b in itertools.pairwise(window)] or [0.0]

    ops = workload.ops
    print()
    print(f"workload: {transactions:,} transactions in {written_for:.1f} s ({written_rate:.1f} tx/s of {args.rate:g} "
          f"asked{'' if kept else ': THE WRITER COULD NOT KEEP THE RATE'}; {late}), {changes:,} changes "
          f"({changes / transactions:.2f} a transaction: {ops['update']:,} updates, {ops['insert']:,} inserts, "
          f"{ops['delete']:,} deletes); hottest table {workload.hottest} ({workload.hottest_share:.0%} of picks)")
    print(f"machine load {load_before:.1f} at the start, {load_after:.1f} at the end, on {os.cpu_count()} cores; "
          f"pgcdc used {cpu['python']:.2f} cores (Python) + {cpu['jvm']:.2f} (JVM)"
          + (f" + {cpu['other']:.2f} (other)" if cpu["other"] > 0.005 else "")
          + f"; resident memory at most {streaming.python_rss / 2**20:.0f} MiB (Python), "
            f"{streaming.jvm_rss / 2**20:.0f} MiB (JVM)")
    print()
    print(f"{'measured':<64} {'figure':>14}")
    rows_out = [
        ("initial copy (run --until-caught-up, whole process)", f"{copy_seconds:.1f} s"),
        ("first batch of the streaming run (warm-up, apart)", f"{warmup_s:.1f} s"),
        (f"lag p99 of the workload's first {args.warmup_seconds:g} s (warm-up, apart)",
         f"{percentile(warming, 0.99):.2f} s" if warming else "-"),
        (f"lag p50, the {seconds:g} s after", f"{p50:.2f} s"), ("lag p90", f"{p90:.2f} s"),
        ("lag p99", f"{p99:.2f} s"),
        ("lag max", f"{worst:.2f} s"),
        ("lag p99, first third of those", f"{first_p99:.2f} s"),
        ("lag p99, last third of those", f"{last_p99:.2f} s"),
        ("  last third / first third", f"{growth:.2f}x"),
        ("changes/s offered by the writer", f"{changes / written_for:,.0f}"),
        ("pgcdc changes/s (mirrors holding first to last transaction)", f"{sustained:,.0f}"),
        ("  from the first commit to the mirrors holding the last", f"{commit_to_held:,.0f}"),
        ("pg_recvlogical changes/s, draining the twin slot afterwards", f"{peer_rate:,.0f}"),
        ("  pgcdc / pg_recvlogical", f"{sustained / peer_rate:.3f}"),
        ("pgcdc batches during the workload", f"{len(window):,}"),
        ("  median apply seconds (max)", f"{statistics.median(batch_seconds):.2f} ({max(batch_seconds):.2f})"),
        ("  median changes a batch, median seconds between batches",
         f"{statistics.median(batch_changes):,.0f}, {statistics.median(gaps):.2f}"),
        ("  median mirrors a batch, a batch's apply per mirror (goal <= 20 ms)",
         f"{statistics.median(batch_mirrors):,.0f}, {per_mirror_ms:.1f} ms" if batch_mirrors else "not logged"),
        ("caught up after the writer stopped", f"{tail_s:.2f} s"),
        ("stop at SIGINT (exit code)", f"{stop_s:.1f} s ({exit_code})"),
    ]
    for label, value in rows_out:
        print(f"{label:<64} {value:>14}")
    print()
    goals = [("60 tables at 200 tx/s: lag p99 <= 2 s", p99 <= 2.0),
             ("200 tables at 200 tx/s: lag p99 <= 5 s and p50 <= 2 s", p99 <= 5.0 and p50 <= 2.0)]
    here = f"{tables_count} tables at {written_rate:.0f} tx/s"
    for goal, met in goals:
        print(f"goal, {goal}: {'met' if met else 'NOT met'} by this run ({here})")
    print(f"goal, lag does not grow over the run (last third's p99 <= {GROWTH_LIMIT:g}x the first's): "
          f"{'met' if growth <= GROWTH_LIMIT else 'NOT met'} ({growth:.2f}x)")
    for note in notes:
        print(f"note: {note}")
    figures.update(
        warmup_first_batch_s=round(warmup_s, 1), warmup_seconds=args.warmup_seconds,
        lag_p99_warmup_s=round(percentile(warming, 0.99), 2) if warming else None,
        transactions=transactions, changes=changes,
        written_tx_per_s=round(written_rate, 1), writer_kept_rate=kept,
        lag_p50_s=round(p50, 2), lag_p90_s=round(p90, 2), lag_p99_s=round(p99, 2), lag_max_s=round(worst, 2),
        lag_p99_first_third_s=round(first_p99, 2), lag_p99_last_third_s=round(last_p99, 2),
        lag_p99_growth_ratio=round(growth, 2), offered_changes_per_s=round(changes / written_for),
        changes_per_s=round(sustained), changes_per_s_from_first_commit=round(commit_to_held), pg_recvlogical_changes_per_s=round(peer_rate),
        ratio_vs_pg_recvlogical=round(sustained / peer_rate, 3), batches=len(window),
        batch_apply_median_s=round(statistics.median(batch_seconds), 2),
        batch_changes_median=statistics.median(batch_changes), caught_up_after_writer_s=round(tail_s, 2),
        batch_mirrors_median=statistics.median(batch_mirrors) if batch_mirrors else None,
        batch_ms_per_mirror=round(per_mirror_ms, 1) if batch_mirrors else None,
        stop_s=round(stop_s, 1), exit_code=exit_code, pgcdc_python_cores=round(cpu["python"], 2),
        pgcdc_jvm_cores=round(cpu["jvm"], 2), python_rss_mib=round(streaming.python_rss / 2**20),
        jvm_rss_mib=round(streaming.jvm_rss / 2**20), load=round(load_after, 1), notes=notes)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
