"""The suite's databases (conftest.py): a finished test's database is handed to the next test only when it is
again as CREATE DATABASE made it; anything of the test that emptying cannot remove gets it dropped instead."""

from __future__ import annotations

import psycopg
import pytest

from conftest import TestServer, drop_database, fresh_database


def without_spares(server: TestServer) -> None:
    """The test starts with no spare database (those of earlier tests dropped)."""
    while server.spare_databases:
        drop_database(server, server.spare_databases.pop())


def objects_of(database) -> list[tuple]:
    return database.execute(
        "SELECT relname FROM pg_class WHERE relnamespace NOT IN (SELECT oid FROM pg_namespace WHERE nspname "
        "LIKE 'pg\\_%' OR nspname = 'information_schema')")


def test_an_emptied_database_is_handed_out_again_under_a_new_name_and_empty(pg_server: TestServer):
    without_spares(pg_server)
    with fresh_database(pg_server) as first:
        first.execute("CREATE SCHEMA shop")
        first.execute("CREATE TABLE shop.orders (id int PRIMARY KEY, note text)")
        first.execute("CREATE TYPE mood AS ENUM ('ok', 'sad')")
        first.execute("CREATE PUBLICATION everything FOR ALL TABLES")
        first.execute("SELECT pg_create_logical_replication_slot('first_slot', 'pgoutput')")
        first.execute(f"ALTER DATABASE {first.name} SET DateStyle = 'SQL, DMY'")
        oid = first.execute("SELECT oid FROM pg_database WHERE datname = current_database()")[0][0]
    assert pg_server.spare_databases == [first.name]
    with fresh_database(pg_server) as second:
        assert second.name != first.name
        assert second.execute("SELECT oid FROM pg_database WHERE datname = current_database()")[0][0] == oid
        assert objects_of(second) == []
        assert second.execute("SELECT count(*) FROM pg_publication")[0][0] == 0
        assert second.execute("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
                              )[0][0] == 0
        assert second.execute("SHOW DateStyle")[0][0] == "ISO, MDY"
        second.execute("CREATE TABLE public.t (id int)")  # the public schema is usable as a new one
    assert pg_server.spare_databases == [second.name]


@pytest.mark.parametrize("leftover", [
    "CREATE CAST (money AS bytea) WITH INOUT",
    "ALTER ROLE CURRENT_USER IN DATABASE {name} SET work_mem = '8MB'",
    "COMMENT ON DATABASE {name} IS 'a test was here'",
    "GRANT CONNECT ON DATABASE {name} TO PUBLIC",
    "CREATE TEMP TABLE scratch (id int)",
    "SELECT lo_create(0)",
], ids=["cast", "role setting", "comment", "grant", "temporary schema", "large object"])
def test_a_database_with_what_emptying_cannot_remove_is_dropped(pg_server: TestServer, leftover: str):
    without_spares(pg_server)
    with fresh_database(pg_server) as database, database.connect() as conn:
        conn.execute(leftover.format(name=database.name))
    assert pg_server.spare_databases == []
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        assert admin.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (database.name,)
                             ).fetchone()[0] == 0

