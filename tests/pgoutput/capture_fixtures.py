"""Capture what a real PostgreSQL sends, for the codec tests: ``python tests/pgoutput/capture_fixtures.py``.

Runs each scenario's workload on a fresh embedded PostgreSQL 18 and reads the slot through the SQL
interface (the same pgoutput bytes the walsender sends, one message per row), for protocol versions
1 to 4. Writes ``fixtures/pg18.jsonl``: one line per scenario with the messages (hex) and what the
workload did (xids from txid_current(), gids, names), which the tests assert against.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg

FIXTURES = Path(__file__).parent / "fixtures" / "pg18.jsonl"

SCHEMA = """
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE TYPE pair AS (a int, b text);
CREATE TABLE items (id int PRIMARY KEY, name text, feeling mood, both_ pair, big text);
ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE full_rows (id int, note text);
ALTER TABLE full_rows REPLICA IDENTITY FULL;
CREATE TABLE by_index (a int NOT NULL, b int NOT NULL, c text);
CREATE UNIQUE INDEX by_index_ab ON by_index (a, b);
ALTER TABLE by_index REPLICA IDENTITY USING INDEX by_index_ab;
CREATE TABLE parent (id serial PRIMARY KEY);
CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent (id));
CREATE PUBLICATION pub FOR ALL TABLES;
"""


def _xid(conn: psycopg.Connection) -> int:
    return int(conn.execute("SELECT txid_current() % 4294967296").fetchone()[0])


def basic(conn: psycopg.Connection) -> dict:
    done: dict = {"relations": ["items", "full_rows", "by_index", "parent", "child"], "enum": "mood",
                  "composite": "pair", "prefix": "pgcdc", "origin": "upstream"}
    with conn.transaction():
        done["insert_xid"] = _xid(conn)
        conn.execute("INSERT INTO items VALUES (1, 'one', 'happy', ROW(1, 'x'), repeat('big', 2000)), "
                     "(2, 'two', NULL, NULL, NULL)")
        conn.execute("INSERT INTO full_rows VALUES (1, 'a'), (2, 'b')")
        conn.execute("INSERT INTO by_index VALUES (1, 1, 'c')")
        conn.execute("INSERT INTO parent DEFAULT VALUES")
        conn.execute("INSERT INTO child VALUES (1, 1)")
    conn.execute("UPDATE items SET name = 'uno' WHERE id = 1")  # big unchanged: 'u'
    conn.execute("UPDATE items SET id = 20 WHERE id = 2")  # key change: 'K'
    conn.execute("UPDATE full_rows SET note = 'aa' WHERE id = 1")  # 'O'
    conn.execute("UPDATE by_index SET b = 2")  # index key change: 'K'
    conn.execute("DELETE FROM items WHERE id = 20")
    conn.execute("DELETE FROM full_rows WHERE id = 2")
    conn.execute("DELETE FROM by_index")
    conn.execute("TRUNCATE parent, child RESTART IDENTITY CASCADE")
    with conn.transaction():
        conn.execute("SELECT pg_logical_emit_message(true, 'pgcdc', 'in a transaction')")
        conn.execute("INSERT INTO items (id) VALUES (3)")
    conn.execute("SELECT pg_logical_emit_message(false, 'pgcdc', '\\x00ff'::bytea)")
    conn.execute("SELECT pg_replication_origin_create('upstream') WHERE NOT EXISTS "
                 "(SELECT 1 FROM pg_replication_origin WHERE roname = 'upstream')")
    conn.execute("SELECT pg_replication_origin_session_setup('upstream')")
    with conn.transaction():
        conn.execute("SELECT pg_replication_origin_xact_setup('0/ABCDEF', now())")
        conn.execute("INSERT INTO items (id) VALUES (4)")
    conn.execute("SELECT pg_replication_origin_session_reset()")
    return done


def streamed(conn: psycopg.Connection) -> dict:
    done: dict = {}
    with conn.transaction():
        done["commit_xid"] = _xid(conn)
        conn.execute("INSERT INTO items (id, name) SELECT i, 'row ' || i FROM generate_series(100, 1100) i")
        conn.execute("SAVEPOINT s1")
        conn.execute("INSERT INTO items (id, name) SELECT i, 'undone' FROM generate_series(5000, 6000) i")
        conn.execute("ROLLBACK TO SAVEPOINT s1")
        conn.execute("UPDATE items SET name = 'after' WHERE id BETWEEN 100 AND 200")
    conn.execute("BEGIN")
    done["abort_xid"] = _xid(conn)
    conn.execute("INSERT INTO items (id, name) SELECT i, 'aborted' FROM generate_series(7000, 8500) i")
    conn.execute("ROLLBACK")
    return done


def two_phase(conn: psycopg.Connection) -> dict:
    done: dict = {"committed_gid": "pgcdc-commit", "rolled_back_gid": "pgcdc-rollback",
                  "streamed_gid": "pgcdc-streamed"}
    conn.execute("BEGIN")
    done["committed_xid"] = _xid(conn)
    conn.execute("INSERT INTO items (id) VALUES (9001)")
    conn.execute("PREPARE TRANSACTION 'pgcdc-commit'")
    conn.execute("COMMIT PREPARED 'pgcdc-commit'")
    conn.execute("BEGIN")
    conn.execute("INSERT INTO items (id) VALUES (9002)")
    conn.execute("PREPARE TRANSACTION 'pgcdc-rollback'")
    conn.execute("ROLLBACK PREPARED 'pgcdc-rollback'")
    conn.execute("BEGIN")
    done["streamed_xid"] = _xid(conn)
    conn.execute("INSERT INTO items (id, name) SELECT i, 'prepared' FROM generate_series(10000, 11500) i")
    conn.execute("PREPARE TRANSACTION 'pgcdc-streamed'")
    conn.execute("COMMIT PREPARED 'pgcdc-streamed'")
    return done


SCENARIOS: list[tuple[str, Callable[[psycopg.Connection], dict], int, dict[str, str]]] = [
    ("basic", basic, 1, {}),
    ("basic_binary", basic, 1, {"binary": "true"}),
    ("basic", basic, 2, {}),
    ("streamed", streamed, 2, {"streaming": "on"}),
    ("streamed", streamed, 3, {"streaming": "on"}),
    ("two_phase", two_phase, 3, {"two_phase": "true", "streaming": "on"}),
    ("streamed_parallel", streamed, 4, {"streaming": "parallel"}),
    ("two_phase", two_phase, 4, {"two_phase": "true", "streaming": "parallel"}),
    ("basic", basic, 4, {"binary": "true", "streaming": "parallel"}),
]


def capture(dsn: str, name: str, workload: Callable, proto: int, extra: dict[str, str]) -> dict:
    """Run one scenario in its own database; returns the fixture record."""
    database = f"capture_{name}_{proto}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {database}")
    target = psycopg.conninfo.make_conninfo(dsn, dbname=database)
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute(SCHEMA)
        two_phase_slot = "true" if "two_phase" in extra else "false"
        conn.execute("SELECT pg_create_logical_replication_slot('capture', 'pgoutput', false, %s)", (two_phase_slot,))
        done = workload(conn)
        options = {"proto_version": str(proto), "publication_names": "pub", "messages": "true", **extra}
        conn.execute("SET logical_decoding_work_mem = '64kB'")
        arguments = [v for pair in options.items() for v in pair]
        rows = conn.execute(
            f"SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes('capture', NULL, NULL, "
            f"{', '.join(['%s'] * len(arguments))})", arguments).fetchall()
        conn.execute("SELECT pg_drop_replication_slot('capture')")
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE {database} WITH (FORCE)")
    return {"scenario": name, "proto_version": proto, "options": options, "workload": done,
            "messages": [{"lsn": lsn, "hex": bytes(data).hex()} for lsn, data in rows]}


def capture_all(dsn: str) -> list[dict]:
    return [capture(dsn, name, workload, proto, extra) for name, workload, proto, extra in SCENARIOS]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from pgcdc.embedded import EmbeddedPostgres

    with EmbeddedPostgres() as server:
        records = capture_all(server.dsn)
    FIXTURES.parent.mkdir(exist_ok=True)
    with open(FIXTURES, "w") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")
    print(f"wrote {sum(len(r['messages']) for r in records)} messages of {len(records)} scenarios to {FIXTURES}")


if __name__ == "__main__":
    main()
