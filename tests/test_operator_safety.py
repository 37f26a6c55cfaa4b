"""What an operator runs must never hurt a mirror, and every failure must name its cause: the `pgcdc` command as a
user runs it (a subprocess) against a real server. None of these need Spark."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from conftest import TestDatabase, TestServer, drop_database

_names = itertools.count(1)


def pgcdc(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgcdc.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "COLUMNS": "200", **(env or {})})


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def db(pg_server: TestServer) -> Iterator[TestDatabase]:
    """One database for the module: each test names its own tables, publications and slots."""
    name = f"pgcdc_ops_{os.getpid()}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield TestDatabase(pg_server, name)
    finally:
        drop_database(pg_server, name)


def fresh(db: TestDatabase, what: str) -> str:
    """A name no other test in the module uses."""
    return f"{what}_{next(_names)}"


def published_table(db: TestDatabase) -> tuple[str, str]:
    table, publication = fresh(db, "items"), fresh(db, "pub")
    db.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    db.execute(f"CREATE PUBLICATION {publication} FOR TABLE {table}")
    return table, publication


def peek_types(db: TestDatabase, slot: str, publication: str) -> list[str]:
    result = pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "--publication", publication, "--json")
    assert result.returncode == 0, output(result)
    return [json.loads(line)["type"] for line in result.stdout.splitlines()]


def test_consume_advances_only_past_transactions_printed_whole(db):
    table, publication = published_table(db)
    slot = fresh(db, "look")
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    db.execute(f"INSERT INTO {table} VALUES (1, 'one')")
    with db.connect() as conn, conn.transaction():
        conn.execute(f"INSERT INTO {table} VALUES (2, 'two')")
        conn.execute(f"UPDATE {table} SET v = 'uno' WHERE id = 1")
        conn.execute(f"DELETE FROM {table} WHERE id = 2")
    whole = ["Begin", "Relation", "Insert", "Commit", "Begin", "Insert", "Update", "Delete", "Commit"]
    assert peek_types(db, slot, publication) == whole

    # two messages: the first transaction is not printed whole, so nothing may be consumed
    partial = pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "-p", publication, "--consume", "-n", "2")
    assert partial.returncode == 0, output(partial)
    assert len(partial.stdout.splitlines()) == 2
    assert "not advanced" in partial.stderr
    assert peek_types(db, slot, publication) == whole

    # six messages: the first transaction whole and two of the second; only the first is consumed
    six = pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "-p", publication, "--consume", "-n", "6")
    assert six.returncode == 0, output(six)
    assert "advanced" in six.stderr and "2 printed messages" in six.stderr
    assert peek_types(db, slot, publication) == ["Begin", "Relation", "Insert", "Update", "Delete", "Commit"]

    everything = pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "-p", publication, "--consume")
    assert everything.returncode == 0, output(everything)
    assert peek_types(db, slot, publication) == []


def test_consume_refuses_the_slot_mirrors_stream_from_unless_forced(db, tmp_path):
    table, publication = published_table(db)
    db.execute("SELECT pg_create_logical_replication_slot('pgcdc', 'pgoutput')")
    try:
        db.execute(f"INSERT INTO {table} VALUES (1, 'one')")
        refused = pgcdc("decode", "--dsn", db.dsn, "--slot", "pgcdc", "-p", publication, "--consume")
        assert refused.returncode == 2, output(refused)
        assert "mirrors" in refused.stderr and "--force" in refused.stderr and "Traceback" not in refused.stderr
        assert refused.stdout == ""
        assert peek_types(db, "pgcdc", publication) == ["Begin", "Relation", "Insert", "Commit"]

        # the slot named in the config file or PGCDC_SLOT is pgcdc's too
        db.execute("SELECT pg_create_logical_replication_slot('mirrored', 'pgoutput')")
        config = tmp_path / "pgcdc.toml"
        config.write_text('slot = "mirrored"\n')
        by_config = pgcdc("--config", str(config), "decode", "--dsn", db.dsn, "--slot", "mirrored", "-p",
                          publication, "--consume")
        assert by_config.returncode == 2 and "--force" in by_config.stderr, output(by_config)
        by_env = pgcdc("decode", "--dsn", db.dsn, "--slot", "mirrored", "-p", publication, "--consume",
                       env={"PGCDC_SLOT": "mirrored"})
        assert by_env.returncode == 2 and "--force" in by_env.stderr, output(by_env)

        forced = pgcdc("decode", "--dsn", db.dsn, "--slot", "pgcdc", "-p", publication, "--consume", "--force")
        assert forced.returncode == 0, output(forced)
        assert peek_types(db, "pgcdc", publication) == []
    finally:
        for slot in ("pgcdc", "mirrored"):
            db.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,))


def test_second_run_on_a_busy_slot_fails_before_copying_anything(db, tmp_path):
    import psycopg2
    import psycopg2.extras

    table, publication = published_table(db)
    db.execute(f"INSERT INTO {table} SELECT g, 'x' FROM generate_series(1, 100) g")
    slot = fresh(db, "busy")
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    holder = psycopg2.connect(db.dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        holder.cursor().start_replication(slot_name=slot, decode=False,
                                          options={"proto_version": "1", "publication_names": publication})
        warehouse = tmp_path / "warehouse"
        result = pgcdc("run", "--dsn", db.dsn, "-p", publication, "--slot", slot, "--warehouse", str(warehouse),
                       "--until-caught-up")
        assert result.returncode == 2, output(result)
        assert f"slot {slot!r} is in use by another process" in result.stderr and "Traceback" not in result.stderr
        assert not warehouse.exists() or not any(p.is_file() for p in warehouse.rglob("*"))
    finally:
        holder.close()
        db.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def test_first_run_that_fails_before_mirroring_drops_the_slot_it_created(db, tmp_path):
    _, publication = published_table(db)
    slot = fresh(db, "first")
    warehouse = tmp_path / "warehouse"
    warehouse.mkdir()
    (warehouse / "mirror").write_text("a file where the mirrors' namespace would go")  # fails after the slot
    result = pgcdc("run", "--dsn", db.dsn, "-p", publication, "--slot", slot, "--warehouse", str(warehouse),
                   "--until-caught-up", timeout=600)
    assert result.returncode != 0, output(result)
    assert f"dropped slot {slot} again" in result.stderr
    assert db.execute("SELECT slot_name FROM pg_replication_slots WHERE slot_name = %s", (slot,)) == []


def test_status_and_check_flag_inactive_slots_that_retain_wal(db):
    _, publication = published_table(db)
    slot = fresh(db, "forgotten")
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    try:
        db.execute("SELECT pg_switch_wal()")  # something to retain
        status = pgcdc("status", "--dsn", db.dsn)
        assert status.returncode == 0, output(status)
        text = " ".join(status.stdout.split())
        assert f"slot {slot} is inactive and retains" in text and f"pgcdc slot drop {slot}" in text
        as_json = json.loads(pgcdc("status", "--dsn", db.dsn, "--json").stdout)
        assert slot in [w["slot"] for w in as_json["warnings"]]

        check = pgcdc("check", "--dsn", db.dsn, "-p", publication)
        assert check.returncode == 0, output(check)  # a warning, the source is still ready
        text = " ".join(check.stdout.split())
        assert f"slot {slot} is inactive and retains" in text and "ready" in text
        entries = json.loads(pgcdc("check", "--dsn", db.dsn, "-p", publication, "--json").stdout)
        assert [e["severity"] for e in entries if slot in e["problem"]] == ["warning"]
    finally:
        db.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def test_check_and_slot_create_tell_full_slots_and_missing_replication_apart_from_a_bad_dsn(db):
    _, publication = published_table(db)
    limit, used = db.execute("SELECT current_setting('max_replication_slots')::int, "
                             "(SELECT count(*) FROM pg_replication_slots)")[0]
    fillers = [fresh(db, "filler") for _ in range(limit - used)]
    try:
        for filler in fillers:
            db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (filler,))
        check = pgcdc("check", "--dsn", db.dsn, "-p", publication)
        assert check.returncode == 3, output(check)
        assert f"all {limit} replication slots are taken" in " ".join(check.stdout.split())
        # the slot pgcdc streams exists already: no new one is needed
        assert pgcdc("check", "--dsn", db.dsn, "-p", publication, "--slot", fillers[0]).returncode == 0
        create = pgcdc("slot", "create", "one_too_many", "--dsn", db.dsn)
        assert create.returncode == 2, output(create)
        assert "max_replication_slots" in create.stderr and "check --dsn" not in create.stderr
    finally:
        for filler in fillers:
            db.execute("SELECT pg_drop_replication_slot(%s)", (filler,))

    role = fresh(db, "norep")
    db.execute(f"CREATE ROLE {role} LOGIN")
    dsn = psycopg.conninfo.make_conninfo(db.dsn, user=role)
    create = pgcdc("slot", "create", fresh(db, "denied"), "--dsn", dsn)
    assert create.returncode == 2, output(create)
    assert "REPLICATION" in create.stderr and "check --dsn" not in create.stderr
    check = pgcdc("check", "--dsn", dsn, "-p", publication)
    assert check.returncode == 3 and f"role {role} lacks the REPLICATION attribute" in check.stdout
