"""`pgcdc demo`: a real PostgreSQL, a workload that shows what pgcdc handles, Spark + Iceberg, and proof.

The workload is what CDC tools usually get wrong: a transaction too large for the
server's memory (streamed in chunks, protocol 2+) with a rolled-back savepoint,
two-phase commit and rollback (protocol 3+), unchanged TOAST values, key-changing
updates, TRUNCATE, and a schema change, all on tables with many column types.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from pathlib import Path

import psycopg
from rich.console import Console
from rich.table import Table

from pgcdc.embedded import EmbeddedPostgres

log = logging.getLogger("pgcdc.demo")

SCHEMA = """
CREATE SCHEMA shop;
CREATE TYPE shop.order_status AS ENUM ('new', 'paid', 'shipped', 'cancelled');
CREATE TABLE shop.customers (
    id bigint PRIMARY KEY,
    name text NOT NULL,
    email varchar(200),
    balance numeric(12, 2),
    tags text[],
    created_at timestamptz NOT NULL DEFAULT now(),
    profile jsonb,
    active boolean
);
CREATE TABLE shop.orders (
    id bigint PRIMARY KEY,
    customer_id bigint,
    total numeric(12, 2),
    status shop.order_status,
    placed_on date,
    notes text,
    ref uuid
);
CREATE TABLE shop.events (
    id bigint PRIMARY KEY,
    payload bytea,
    at timestamp,
    score double precision,
    took interval
);
CREATE TABLE shop.audit (who text, what text, at timestamptz);
ALTER TABLE shop.audit REPLICA IDENTITY FULL;
CREATE DOMAIN shop.positive_int AS integer CHECK (VALUE > 0);
CREATE TYPE shop.dimensions AS (width numeric, height numeric);
CREATE TABLE shop.kinds (
    id int PRIMARY KEY,
    i2 smallint, i8 bigint, f4 real, f8 double precision, n numeric, n10 numeric(10, 3),
    vc varchar(20), ch char(5), raw bytea, d date, t time, ttz timetz, ts timestamp, tstz timestamptz,
    iv interval, u uuid, j json, jb jsonb, ints int[], grid int[][], texts text[],
    status shop.order_status, qty shop.positive_int, ip inet, net cidr, mac macaddr, price money,
    flags bit(4), vbits varbit, doc tsvector, span int4range, dims shop.dimensions
);
CREATE PUBLICATION shop FOR TABLE shop.customers, shop.orders, shop.events, shop.audit, shop.kinds;
"""

_KINDS_ROWS = """
INSERT INTO shop.kinds VALUES
 (1, -32768, 9223372036854775807, 'NaN', 'Infinity', 'NaN', 1234567.891, 'héllo wörld', 'ab', '\\x00ff10',
  '2024-02-29', '23:59:59.999999', '12:00+05:30', '2024-01-01 12:34:56.789', '2024-06-30 23:00:00+02',
  '1 year 2 mons 3 days 04:05:06.7', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{{"a": [1, 2]}}', '{{"b": {{"c": null}}}}',
  '{{1,NULL,3}}', '{{{{1,2}},{{3,4}}}}', '{{"x y",NULL,"q\\"uote"}}', 'paid', 5, '192.168.0.1/24', '10.0.0.0/8',
  '08:00:2b:01:02:03', '12.34', B'1010', B'101', 'fat cat sat', '[1,10)', ROW(1.5, 2.25)),
 (2, 0, -1, '-Infinity', -0.5, '123456789012345678901234567890.123456789', NULL, NULL, NULL, NULL,
  '0001-01-01', '00:00', '00:00+00', '1999-12-31 23:59:59', '2000-01-01 00:00:00+00',
  '-1 days -00:00:01', NULL, NULL, '[]', '{{}}', NULL, NULL, 'new', NULL, '::1', '::/0', NULL, '-1.00',
  B'0000', B'', '', 'empty', NULL),
 (3, NULL, NULL, NULL, NULL, '-0.000001', -0.001, '', '', '\\x', NULL, NULL, NULL, NULL, NULL,
  NULL, NULL, 'null', '"text"', NULL, NULL, '{{}}', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
  '(,5]', ROW(NULL, NULL));
"""

_EXISTING_ROWS = """  -- {rows} rows per table
INSERT INTO shop.customers
SELECT i, 'customer ' || i, 'c' || i || '@example.com', (i * 13.37)::numeric(12, 2),
       ARRAY['t' || (i % 5), NULL, 'x'], timestamptz '2024-01-01 00:00+00' + i * interval '1 minute',
       jsonb_build_object('i', i, 'nested', jsonb_build_array(i, 'two')), i % 2 = 0
FROM generate_series(1, {rows}) AS i;
INSERT INTO shop.orders
SELECT i, 1 + i % {rows}, (i * 3.5)::numeric(12, 2), 'new', date '2024-02-01' + i % 300,
       -- notes large and incompressible enough to be stored out of line (TOAST)
       CASE WHEN i % 10 = 0 THEN (SELECT string_agg(md5((i * 1000 + g)::text), '') FROM generate_series(1, 300) g)
            ELSE 'short note ' || i END,
       md5(i::text)::uuid
FROM generate_series(1, {rows}) AS i;
INSERT INTO shop.events
SELECT i, decode(md5(i::text), 'hex'), timestamp '2024-03-01' + i * interval '1 second', i / 7.0,
       make_interval(days => i % 40, secs => i % 3600)
FROM generate_series(1, {rows}) AS i;
INSERT INTO shop.audit SELECT 'system', 'seed ' || i, now() FROM generate_series(1, 50) AS i;
"""


def seed_rows(rows: int) -> str:
    """SQL inserting ``rows`` existing rows per table (and the row kinds of every supported type)."""
    return _EXISTING_ROWS.format(rows=int(rows)) + _KINDS_ROWS.format()


def workload(conn: psycopg.Connection, rows: int, large_rows: int) -> list[str]:
    """Changes made after the snapshot; returns what was done, for the summary."""
    done = []
    conn.execute("UPDATE shop.customers SET balance = balance + 1, tags = tags || 'vip'::text WHERE id % 7 = 0")
    conn.execute("DELETE FROM shop.customers WHERE id % 11 = 0")
    conn.execute("INSERT INTO shop.customers (id, name, email, balance, active) "
                 "SELECT i, 'new ' || i, NULL, NULL, true FROM generate_series(%s::bigint, %s::bigint) i",
                 (rows + 1, rows + 100))
    done.append("updates, deletes and inserts in small transactions")

    conn.execute("UPDATE shop.customers SET id = id + 1000000 WHERE id IN (2, 4, 6)")
    done.append("updates that change the primary key")

    conn.execute("UPDATE shop.orders SET status = 'shipped' WHERE id % 10 = 0")
    done.append("updates leaving TOASTed notes unchanged (sent as 'unchanged', kept from the mirror)")

    with conn.transaction():
        conn.execute("INSERT INTO shop.events (id, payload, at, score, took) SELECT i, "
                     "decode(md5(i::text), 'hex'), now()::timestamp, i, interval '1 hour' "
                     "FROM generate_series(%s::bigint, %s::bigint) i", (10_000_000, 10_000_000 + large_rows - 1))
        conn.execute("SAVEPOINT undo_me")
        conn.execute("INSERT INTO shop.events (id) SELECT i FROM generate_series(20000000, 20000999) i")
        conn.execute("ROLLBACK TO SAVEPOINT undo_me")
        conn.execute("UPDATE shop.events SET score = -score WHERE id < 100")
    done.append(f"a {large_rows:,}-row transaction streamed before commit, with a rolled-back savepoint")

    conn.execute("BEGIN")
    conn.execute("UPDATE shop.orders SET status = 'paid', total = total * 2 WHERE id <= 20")
    conn.execute("PREPARE TRANSACTION 'demo-commit'")
    conn.execute("COMMIT PREPARED 'demo-commit'")
    conn.execute("BEGIN")
    conn.execute("DELETE FROM shop.orders WHERE id > 20 AND id <= 40")
    conn.execute("PREPARE TRANSACTION 'demo-rollback'")
    conn.execute("ROLLBACK PREPARED 'demo-rollback'")
    done.append("two-phase commit: one prepared transaction committed, one rolled back")

    conn.execute("TRUNCATE shop.audit")
    conn.execute("INSERT INTO shop.audit VALUES ('demo', 'after truncate', now())")
    done.append("TRUNCATE, then new rows")

    conn.execute("UPDATE shop.kinds SET f8 = 'NaN', n = '-Infinity', tstz = 'infinity', ints = '[0:1]={7,8}', "
                 "grid = '{{{1},{2}},{{3},{4}}}' WHERE id = 1")
    conn.execute("INSERT INTO shop.kinds (id, d, ts, iv) VALUES (4, '4713-01-01 BC', '-infinity', '-178000000 years')")
    conn.execute("UPDATE shop.kinds SET id = 30 WHERE id = 3")
    done.append("values at the edges of every column type: NaN, infinity, BC dates, n-D arrays, lower bounds")

    conn.execute("ALTER TABLE shop.customers ADD COLUMN loyalty integer")
    conn.execute("UPDATE shop.customers SET loyalty = id % 100 WHERE id <= 50")
    conn.execute("INSERT INTO shop.customers (id, name, loyalty) VALUES (5000000, 'after alter', 7)")
    done.append("ALTER TABLE ... ADD COLUMN, then rows using it")
    return done


OBJECT_STORE_BUCKET = "pgcdc-demo"


def object_store_problem() -> str | None:
    """Why ``pgcdc demo --object-store`` cannot run here (a part not installed), or None."""
    from pgcdc.local_object_store import missing_parts

    missing = missing_parts()
    if not missing:
        return None
    return (f"pgcdc demo --object-store keeps its mirrors on a local S3 server behind Iceberg's JDBC catalog, and "
            f"this machine lacks {'; '.join(missing)}. These parts are not in pgcdc's default install: run "
            "make demo-object-store, which installs them into .venv (the JDBC driver with apt-get) and then runs "
            "this demo.")


def run_demo(out: Console, *, warehouse: Path | None = None, rows: int = 2000,
             large_transaction_rows: int = 20000, object_store: bool = False) -> bool:
    """Run the demo end to end; returns True when every mirror equals its source. With ``object_store`` the
    mirrors live on a local S3 server (s3a) behind Iceberg's JDBC catalog in a database of the demo's
    PostgreSQL, and ``warehouse`` must be None (both go away with the demo)."""
    from pgcdc.errors import ConfigError

    if object_store:
        if warehouse is not None:
            raise ConfigError("--warehouse keeps a local warehouse; with --object-store the mirrors live on the "
                              "demo's own S3 server, which stops when the demo ends: give one or the other")
        problem = object_store_problem()
        if problem:
            raise ConfigError(problem)
    started = time.monotonic()
    settings = {"logical_decoding_work_mem": "64kB"}  # small, so the large transaction streams in chunks
    with EmbeddedPostgres(settings=settings) as server, contextlib.ExitStack() as stack:
        if object_store:
            from pgcdc.local_object_store import s3_jdbc_store

            s3, setup = stack.enter_context(s3_jdbc_store(server.dsn, OBJECT_STORE_BUCKET, catalog="pgcdc"))
            store = setup.config_overrides()
            where = [f"mirrors in [cyan]{setup.warehouse}[/cyan], written through Hadoop's s3a to a local S3 "
                     f"server (moto_server at {s3.endpoint}; gone when the demo ends)",
                     f"their catalog: Iceberg's JDBC catalog [cyan]{setup.catalog}[/cyan], its tables in the "
                     f"PostgreSQL database [cyan]{setup.catalog_uri}[/cyan]"]
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pgcdc-demo-"))
            warehouse_dir = Path(warehouse) if warehouse else Path(tmp) / "warehouse"
            store = {"warehouse": str(warehouse_dir)}
            where = [f"warehouse kept at {warehouse_dir}"] if warehouse else []
        return _demo(out, server, store, where, rows, large_transaction_rows, started)


def _demo(out: Console, server: EmbeddedPostgres, store: dict, where: list[str], rows: int,
          large_transaction_rows: int, started: float) -> bool:
    """The demo on a running server, its mirrors where ``store`` (Destination fields) says; ``where`` are the
    summary's lines about that place."""
    from pgcdc.pipeline import Pipeline, PipelineConfig
    from pgcdc.spark.destination import Destination
    from pgcdc.verify import compare_publication

    out.print(f"[bold]1.[/bold] PostgreSQL 18 running at [cyan]{server.dsn}[/cyan]")
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute(seed_rows(rows))
    out.print(f"   schema [cyan]shop[/cyan]: 5 tables, {rows:,} existing rows each, publication [cyan]shop[/cyan]")

    config = PipelineConfig(dsn=server.dsn, publication="shop", slot="pgcdc_demo", batch_max_seconds=2.0,
                            destination=Destination(**store))
    pipeline = Pipeline(config)
    out.print("[bold]2.[/bold] starting Spark with Iceberg, creating the slot, copying existing rows")
    copied = pipeline.snapshot()
    out.print(f"   snapshot: {sum(copied.values()):,} rows in {len(copied)} tables")

    out.print("[bold]3.[/bold] workload on the source:")
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        for line in workload(conn, rows, large_transaction_rows):
            out.print(f"   - {line}")

    out.print("[bold]4.[/bold] streaming changes into Iceberg until caught up")
    progress = pipeline.run(until_caught_up=True, handle_signals=False)
    out.print(f"   applied {progress.rows_applied:,} changes of {progress.transactions_applied:,} transactions "
              f"in {progress.batches_applied} batches; slot confirmed at {progress.confirmed_lsn}")

    out.print("[bold]5.[/bold] source vs mirror")
    results = compare_publication(pipeline, server.dsn, "shop")
    table = Table()
    for column in ("table", "source rows", "mirror rows", "source checksum", "mirror checksum", "equal"):
        table.add_column(column)
    for result in results:
        table.add_row(result.table, f"{result.source_rows:,}", f"{result.mirror_rows:,}",
                      result.source_checksum, result.mirror_checksum,
                      "[green]yes[/green]" if result.equal else "[red]NO[/red]")
    out.print(table)
    equal = all(r.equal for r in results)
    identifiers = [pipeline.mirrors.identifier_for("shop", t) for t in ("customers", "orders")]
    out.print("[bold]6.[/bold] query the mirrors with Spark SQL, e.g.:")
    out.print(f"   spark.sql(\"SELECT status, count(*) FROM {identifiers[1]} GROUP BY status\").show()")
    out.print(f"   spark.sql(\"SELECT * FROM {identifiers[0]}.snapshots\").show()  "
              "# summary['pgcdc.lsn'] is each commit's position")
    for line in where:
        out.print(f"   {line}")
    verdict = "[green]every mirror equals its source[/green]" if equal else "[red]mirrors differ[/red]"
    out.print(f"{verdict} ({time.monotonic() - started:.0f}s)")
    pipeline.spark.stop()
    return equal
