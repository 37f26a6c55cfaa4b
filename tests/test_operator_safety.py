"""What an operator runs must never hurt a mirror, and every failure must name its cause: the `pgcdc` command as a
user runs it (a subprocess) against a real server. None of these need Spark."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from cli_support import run_pgcdc
from conftest import TestDatabase
from pgcdc.spark.destination import Destination

_names = itertools.count(1)


def pgcdc(*args: str, timeout: float = 120, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess[str]:
    return run_pgcdc(*args, timeout=timeout, env={"COLUMNS": "200", **(env or {})}, cwd=cwd)


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def db(pg_module: TestDatabase) -> TestDatabase:
    """The module's one database: each test names its own tables, publications and slots."""
    return pg_module


def drop_slots(db: TestDatabase, *slots: str) -> None:
    """Drop the named slots where they exist (a test's clean-up, whatever it got to)."""
    db.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ANY(%s)",
               (list(slots),))


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
        drop_slots(db, "pgcdc", "mirrored")


@pytest.mark.long
def test_consume_refuses_a_slot_a_warehouse_records_unless_forced(db, spark, tmp_path):
    """A slot of any name backs mirrors when a warehouse's mirrors record it: --consume checks the warehouse
    (--warehouse, else ./warehouse where pgcdc run keeps it by default) and names the mirrors that would lose. It
    reads the mirrors' metadata itself, as a run's start does: no JVM starts for it."""
    from pgcdc.pipeline import Pipeline, PipelineConfig
    from start_support import JavaStarts

    table, publication = published_table(db)
    slot = fresh(db, "recorded")
    db.execute(f"INSERT INTO {table} VALUES (1, 'one')")
    try:
        # the mirrors that record the slot, in a warehouse of their own, made by this process's Spark: the command
        # under test is decode
        Pipeline(PipelineConfig(dsn=db.dsn, publication=publication, slot=slot, destination=Destination(
            warehouse=str(tmp_path / "warehouse"), catalog="recorded")), spark=spark).run(
            until_caught_up=True, handle_signals=False)
        db.execute(f"INSERT INTO {table} VALUES (2, 'two')")
        pending = peek_types(db, slot, publication)
        assert pending == ["Begin", "Relation", "Insert", "Commit"]

        java = JavaStarts(tmp_path)
        refused = pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "-p", publication, "--consume",
                        "--warehouse", str(tmp_path / "warehouse"), timeout=300, env=java.env)
        assert refused.returncode == 2, output(refused)
        message = " ".join(refused.stderr.split())
        assert f"mirror.public.{table}" in message.replace("`", "") and "--force" in message, message
        assert refused.stdout == "" and "Traceback" not in refused.stderr
        assert peek_types(db, slot, publication) == pending

        forced = pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "-p", publication, "--consume", "--force",
                       cwd=tmp_path, timeout=300, env=java.env)  # ./warehouse: found without --warehouse
        assert forced.returncode == 0, output(forced)
        warning = " ".join(forced.stderr.split()).replace("`", "")
        assert "warning" in warning and f"mirror.public.{table}" in warning and "--resnapshot" in warning, warning
        assert peek_types(db, slot, publication) == []
        assert java.starts() == []
    finally:
        drop_slots(db, slot)


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
        # the holder's walsender ends a moment after its connection closes; the slot is busy until then
        deadline = time.monotonic() + 30
        while db.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,))[0][0] \
                and time.monotonic() < deadline:
            time.sleep(0.1)
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


# -- errors that point at the cause -------------------------------------------------------------------------

def one_error_line(result: subprocess.CompletedProcess[str], *, code: int = 2) -> str:
    """The run failed with ``code`` and said why in one ``error:`` sentence, no traceback."""
    assert result.returncode == code, output(result)
    assert "Traceback" not in output(result) and "at org.apache" not in output(result)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return " ".join(result.stderr[result.stderr.index("error:"):].split())


def test_a_warehouse_that_cannot_be_one_is_refused_before_anything_starts(db, tmp_path):
    _, publication = published_table(db)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for warehouse, cause in ((a_file, "is a file"), (a_file / "below", f"lies under {a_file}, which is a file")):
        slot = fresh(db, "never")
        for command in ("run", "snapshot"):
            result = pgcdc(command, "--dsn", db.dsn, "-p", publication, "--slot", slot, "--warehouse", str(warehouse))
            assert cause in one_error_line(result), output(result)
        assert db.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)) == []

    missing = tmp_path / "no-such-warehouse"
    status = pgcdc("status", "--dsn", db.dsn, "--warehouse", str(missing))
    assert "does not exist" in one_error_line(status)
    assert not missing.exists()  # status never writes


def test_usage_errors_name_the_flag_and_the_fix(db, tmp_path):
    import socket

    _, publication = published_table(db)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = pgcdc("run", "--dsn", db.dsn, "-p", publication, "--warehouse", str(tmp_path / "wh"),
                       "--metrics-port", str(port))
        assert f"port {port}" in one_error_line(result) and "--metrics-port" in result.stderr

    assert "--log-level must be one of debug, info" in one_error_line(
        pgcdc("--log-level", "bogus", "slot", "list", "--dsn", db.dsn))

    config = tmp_path / "pgcdc.toml"
    config.write_text(f'publicaton = "{publication}"\n')
    assert "unknown key 'publicaton'; did you mean 'publication'?" in one_error_line(
        pgcdc("--config", str(config), "check", "--dsn", db.dsn, "-p", publication))
    config.write_text('[sprak]\n"spark.ui.enabled" = "false"\n')
    assert "[sprak] is not a known table" in one_error_line(pgcdc("--config", str(config), "slot", "list",
                                                                  "--dsn", db.dsn))

    slot = fresh(db, "look")
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    try:
        assert "publication 'nosuchpub' does not exist" in one_error_line(
            pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "-p", "nosuchpub"))
        assert "replication slot 'nosuchslot' does not exist" in one_error_line(
            pgcdc("decode", "--dsn", db.dsn, "--slot", "nosuchslot", "-p", publication))
    finally:
        db.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    assert f"--file {tmp_path / 'missing'} does not exist" in one_error_line(
        pgcdc("decode", "--file", str(tmp_path / "missing")))

    # a slot name PostgreSQL would refuse: the same words and exit code from slot create as from run
    from_slot = one_error_line(pgcdc("slot", "create", "Bad-Name", "--dsn", db.dsn))
    from_run = one_error_line(pgcdc("run", "--dsn", db.dsn, "-p", publication, "--slot", "Bad-Name"))
    assert "replication slot names are 1-63 lower-case letters" in from_slot
    assert from_slot == from_run


def test_global_options_after_the_command_and_version():
    version = pgcdc("--version")
    assert version.returncode == 0 and version.stdout.startswith("pgcdc "), output(version)
    after = pgcdc("decode", "--file", "/nonexistent", "--log-format", "json", "--debug")
    assert after.returncode == 2, output(after)
    assert "No such option" not in output(after) and "does not exist" in output(after)
    assert "Traceback" in after.stderr  # --debug after the command took effect
    refused = pgcdc("slot", "list", "--dsn", "host=x", "--log-format", "yaml")
    assert "--log-format must be text or json" in one_error_line(refused)


def test_a_server_that_never_answers_is_waited_for_a_bounded_time():
    import socket

    with socket.socket() as silent:  # accepts TCP (the kernel's backlog) and never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        dsn = f"host=127.0.0.1 port={port} dbname=x user=x"
        for command in (["check", "-p", "x"], ["slot", "list"]):
            result = pgcdc("--connect-timeout", "2", *command, "--dsn", dsn, timeout=60)
            line = one_error_line(result)
            assert "did not answer a connection attempt within 2 s" in line and "--connect-timeout" in line


# -- secrets ------------------------------------------------------------------------------------------------

SECRET = "Tr0ub4dor"


def dsn_shapes(port: int) -> list[tuple[str, str]]:
    """(what, DSN) holding SECRET as its password: URI and keyword forms, quoted, escaped, encoded, malformed."""
    return [
        ("uri", f"postgresql://cdc:{SECRET}@127.0.0.1:{port}/db"),
        ("uri, percent-encoded password", f"postgresql://cdc:{SECRET}%40x%2F@127.0.0.1:{port}/db"),
        ("uri, password parameter", f"postgres://127.0.0.1:{port}/db?sslmode=disable&password={SECRET}"),
        ("uri, malformed host", f"postgres://u:{SECRET}@[bad/db"),
        ("uri, port not a number", f"postgresql://u:{SECRET}@127.0.0.1:notaport/db"),
        ("keyword", f"host=127.0.0.1 port={port} user=cdc password={SECRET}"),
        ("keyword, spaced", f"host=127.0.0.1 port={port} password = {SECRET}"),
        ("keyword, quoted", f"host=127.0.0.1 port={port} password='{SECRET} with space'"),
        ("keyword, escaped quote", f"host=127.0.0.1 port={port} password='it\\'s{SECRET}'"),
        ("keyword, malformed", f"host=127.0.0.1 password={SECRET} port"),
        ("keyword, unterminated quote", f"host=127.0.0.1 port={port} password='{SECRET}"),
    ]


def every_command() -> list[list[str]]:
    return [["check", "-p", "pub"], ["status"], ["slot", "list"], ["slot", "create", "s"], ["slot", "drop", "s"],
            ["decode", "--slot", "s", "-p", "pub"], ["run", "-p", "pub"], ["snapshot", "-p", "pub"]]


def test_passwords_never_shown_for_any_dsn_shape_through_any_command(tmp_path):
    import socket

    with socket.socket() as probe:  # a port nothing listens on: every connection is refused at once
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shapes = dsn_shapes(port)
    commands = every_command()
    malformed_exit: set[int] = set()
    # every shape through two commands, every command with two shapes: each pairing costs a process
    runs = [(what, dsn, command) for what, dsn in shapes for command in (commands[0], commands[6])]
    runs += [(what, dsn, command) for what, dsn in (shapes[3], shapes[5]) for command in commands]
    for what, dsn, command in runs:
        warehouse = ["--warehouse", str(tmp_path / "wh")] if command[0] in ("run", "snapshot") else []
        result = pgcdc("--debug", *command, *warehouse, "--dsn", dsn)
        text = output(result)
        assert SECRET not in text, (what, command, text)
        assert result.returncode == 2, (what, command, text)
        assert "Traceback" in text  # --debug shows the chain, redacted
        if "malformed" in what or "unterminated" in what:
            assert "--dsn is not a valid connection string (libpq:" in text, (what, command, text)
            assert "PostgreSQL said" not in text
            malformed_exit.add(result.returncode)
    assert malformed_exit == {2}  # one exit code for a malformed DSN, whatever the command


def test_passwords_never_shown_by_the_python_api():
    import traceback

    from pgcdc import ConfigError
    from pgcdc.pipeline import Pipeline, PipelineConfig

    for what, dsn in dsn_shapes(1):
        try:
            Pipeline(PipelineConfig(dsn=dsn, publication="pub",
                                    destination=Destination(warehouse="/nonexistent"))).check()
        except Exception as exc:  # any failure: its whole chain must be free of the password
            shown = "".join(traceback.format_exception(exc)) + str(exc) + repr(exc)
            assert SECRET not in shown, (what, shown)
            if "malformed" in what or "unterminated" in what:
                assert isinstance(exc, ConfigError) and "--dsn is not a valid connection string" in str(exc)
        else:
            raise AssertionError(f"{what}: a pipeline on a closed port did not fail")


# -- what the README promises -------------------------------------------------------------------------------

def test_readme_metric_names_are_what_metrics_serves():
    import socket
    import urllib.request
    from pathlib import Path

    from pgcdc.lsn import Lsn
    from pgcdc.observability import MetricsServer
    from pgcdc.pipeline import Progress

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics = MetricsServer(port)
    metrics.update(Progress(phase="streaming", rows_applied=3, batches_applied=1, applied_lsn=Lsn(16),
                            received_lsn=Lsn(16), server_lsn=Lsn(32), wal_retained_bytes=64))
    served = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    names = {line.split("{")[0].split(" ")[0] for line in served.splitlines() if line.startswith("pgcdc_")}
    names = {name for name in names if not name.endswith("_created")}  # the client library's own timestamps

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    paragraph = readme[readme.index("serves Prometheus metrics"):]
    documented = set(re.findall(r"`(pgcdc_\w+)`", paragraph[:paragraph.index(")")]))
    assert documented == names


def test_decode_text_names_tables_and_columns_and_writes_lsns_as_postgresql_does(db):
    table, publication = published_table(db)
    slot = fresh(db, "text")
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
    try:
        db.execute(f"INSERT INTO {table} VALUES (1, 'one')")
        db.execute(f"UPDATE {table} SET v = 'uno' WHERE id = 1")
        db.execute(f"DELETE FROM {table}")
        result = pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "-p", publication)
        assert result.returncode == 0, output(result)
        lines = [" ".join(line.split()) for line in result.stdout.splitlines()]
        lsn = r"[0-9A-F]+/[0-9A-F]+"
        assert all(re.match(lsn + " ", line) for line in lines), lines
        assert f"Relation public.{table} columns: id(key) v" in lines[1]
        assert lines[2].endswith(f'Insert public.{table} new: id="1" v="one"')
        assert lines[5].endswith(f'Update public.{table} new: id="1" v="uno"')
        assert lines[8].endswith(f'Delete public.{table} key: id="1"')
        as_json = [json.loads(line) for line in pgcdc("decode", "--dsn", db.dsn, "--slot", slot, "-p", publication,
                                                      "--json").stdout.splitlines()]
        assert as_json[2]["table"] == f"public.{table}" and re.fullmatch(lsn, as_json[2]["lsn"])
    finally:
        db.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def readme_python_blocks() -> list[str]:
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", readme, re.DOTALL)


def substituted(block: str, replacements: dict[str, str]) -> str:
    for old, new in replacements.items():
        assert old in block, f"the README's example no longer holds {old!r}: update this test with it"
        block = block.replace(old, new)
    return block


def test_readme_python_blocks_run_with_a_users_own_session(db, spark, capsys):
    from urllib.parse import unquote, urlparse

    from pgcdc.pgoutput import Begin, encode

    from_python, codec, consistent = readme_python_blocks()
    warehouse = unquote(urlparse(spark.conf.get("spark.sql.catalog.pgcdc.warehouse")).path)
    namespace = f"readme_{os.getpid()}"
    db.execute("CREATE TABLE customers (id int PRIMARY KEY, name text)")
    db.execute("INSERT INTO customers VALUES (1, 'Ada'), (2, 'Grace')")
    db.execute("CREATE SCHEMA shop")
    db.execute("CREATE TABLE shop.orders (order_id int PRIMARY KEY, customer_id int)")
    db.execute("CREATE TABLE shop.order_items (item_id int PRIMARY KEY, order_id int, amount int)")
    db.execute("INSERT INTO shop.orders VALUES (1, 1), (2, 2), (3, 1)")
    db.execute("INSERT INTO shop.order_items VALUES (1, 1, 10), (2, 1, 20), (3, 2, 7), (4, 3, 1000)")
    db.execute("CREATE PUBLICATION shop FOR TABLE customers, shop.orders, shop.order_items")
    try:
        scope: dict = {}
        exec(substituted(from_python, {  # the README's own code, run as a reader would
            '"host=db dbname=shop user=cdc"': repr(db.dsn),
            '"/data/iceberg"': repr(warehouse),
            'Destination(warehouse=': f'Destination(namespace={namespace!r}, warehouse=',
            "pgcdc.mirror.": f"pgcdc.{namespace}.",
        }), scope)
        shown = capsys.readouterr().out
        assert "Ada" in shown and "Grace" in shown
        exec(substituted(consistent, {'"mirror"': repr(namespace)}), scope)  # the initial copy's moment
        shown = capsys.readouterr().out
        assert re.search(r"\|\s*1\s*\|\s*1030\s*\|", shown) and re.search(r"\|\s*2\s*\|\s*7\s*\|", shown), shown
    finally:
        db.execute("SELECT pg_drop_replication_slot('pgcdc')")

    scope = {"payload": encode(Begin(final_lsn=16, commit_ts=0, xid=7), proto_version=4, in_stream=False)}
    exec(codec, scope)
    assert scope["message"] == Begin(final_lsn=16, commit_ts=0, xid=7)


def test_a_users_session_gets_the_configured_catalog(db, spark, tmp_path):
    from pgcdc.pipeline import Pipeline, PipelineConfig

    catalog = f"notebook_{os.getpid()}"
    assert spark.conf.get(f"spark.sql.catalog.{catalog}", None) is None  # a session that lacks the catalog
    Pipeline(PipelineConfig(dsn=db.dsn, publication="any",
                            destination=Destination(warehouse=str(tmp_path / "wh"), catalog=catalog)), spark=spark)
    spark.sql(f"CREATE NAMESPACE {catalog}.probe")
    assert (tmp_path / "wh" / "probe").is_dir()  # the catalog lives on the config's warehouse


# -- the initial copy -------------------------------------------------------------------------------------

@pytest.mark.long
def test_the_initial_copy_shows_totals_percentages_and_time_left(db, tmp_path):
    tables = [fresh(db, "bulk"), fresh(db, "bulk")]
    publication = fresh(db, "pub")
    for table in tables:
        db.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        db.execute(f"INSERT INTO {table} SELECT g, 'row ' || g FROM generate_series(1, 30000) g")
        db.execute(f"ANALYZE {table}")
    db.execute(f"CREATE PUBLICATION {publication} FOR TABLE {', '.join(tables)}")
    slots = [fresh(db, "copy"), fresh(db, "copy")]
    try:
        snapshot = pgcdc("snapshot", "--dsn", db.dsn, "-p", publication, "--slot", slots[0],
                         "--warehouse", str(tmp_path / "a"), timeout=600)
        assert snapshot.returncode == 0, output(snapshot)
        bars = " ".join(snapshot.stderr.split())
        for table in tables:
            assert f"public.{table}" in bars and "30,000 of ~30,000 rows" in bars, bars
        assert "all tables" in bars and "60,000 of ~60,000 rows" in bars and "100%" in bars, bars

        run = pgcdc("run", "--dsn", db.dsn, "-p", publication, "--slot", slots[1], "--warehouse",
                    str(tmp_path / "b"), "--until-caught-up", timeout=600)
        assert run.returncode == 0, output(run)
        status_lines = [line for line in run.stderr.splitlines() if "pgcdc.status" in line and "snapshot:" in line]
        assert status_lines, run.stderr
        assert any(re.search(r"snapshot: [\d,]+ of ~60,000 rows \(\d+%\), 2 tables", line) for line in status_lines), \
            status_lines
    finally:
        drop_slots(db, *slots)


def committed_data_files(table_location) -> int:
    """The data files the table's current snapshot holds, from its Iceberg metadata."""
    from pyiceberg_reader import newest_metadata

    metadata = json.loads(Path(newest_metadata(str(table_location))).read_text())
    current = next(s for s in metadata["snapshots"] if s["snapshot-id"] == metadata["current-snapshot-id"])
    return int(current["summary"]["total-data-files"])


def written_whole(path: Path) -> bool:
    """Whether a Parquet file has its footer: ends with the magic bytes it also starts with."""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            if file.tell() < 12:
                return False
            file.seek(-4, os.SEEK_END)
            return file.read(4) == b"PAR1"
    except FileNotFoundError:
        return False


@pytest.mark.long
def test_ctrl_c_during_the_initial_copy_ends_in_one_line_and_the_next_run_copies_cleanly(db, tmp_path):
    import signal
    import time

    import pyarrow.compute as pc
    from pyiceberg.table import StaticTable

    from pyiceberg_reader import newest_metadata

    table, publication = published_table(db)
    # two tasks of the copy (250,000 rows each): the short one has written its whole file while the other writes
    db.execute(f"INSERT INTO {table} SELECT g, repeat('x', 200) FROM generate_series(1, 300000) g")
    db.execute(f"ANALYZE {table}")
    slot, warehouse = fresh(db, "interrupted"), tmp_path / "wh"
    args = [sys.executable, "-m", "pgcdc.cli", "snapshot", "--dsn", db.dsn, "-p", publication, "--slot", slot,
            "--warehouse", str(warehouse)]
    copying = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**os.environ, "COLUMNS": "200"})
    data = warehouse / "mirror" / "public" / table / "data"
    try:
        # a task has written a whole file (a file being written when the copy stops is removed by its task)
        while copying.poll() is None and not any(map(written_whole, data.glob("*.parquet"))):
            time.sleep(0.05)
        os.killpg(copying.pid, signal.SIGINT)  # the whole process group, as a terminal does
        _, stderr = copying.communicate(timeout=300)
    finally:
        if copying.poll() is None:
            os.killpg(copying.pid, signal.SIGKILL)
    assert copying.returncode == 130, stderr
    assert stderr.rstrip().splitlines()[-1] == "interrupted", stderr
    for noise in ("Traceback", "Py4J", "\tat ", "KeyboardInterrupt", "ERROR"):
        assert noise not in stderr, stderr
    # nothing was committed: the slot this run created is gone again; the files written so far are orphans
    assert db.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)) == []
    orphans = set(data.glob("*.parquet"))
    assert orphans

    again = pgcdc("snapshot", "--dsn", db.dsn, "-p", publication, "--slot", slot, "--warehouse", str(warehouse),
                  timeout=600)
    try:
        assert again.returncode == 0, output(again)
        assert f"{table}: 300000 rows" in again.stdout
        assert not orphans & set(data.glob("*.parquet"))  # removed before the table was copied again
        assert len(list(data.glob("*.parquet"))) == committed_data_files(warehouse / "mirror" / "public" / table)
        # a reader that is not pgcdc finds every row once, in the committed files only (status's own count of a
        # copied mirror: tests/test_cli.py)
        mirror = StaticTable.from_metadata(newest_metadata(str(warehouse / "mirror" / "public" / table)))
        ids = mirror.scan(selected_fields=("id",)).to_arrow().column("id")
        assert len(ids) == 300000 and pc.count_distinct(ids).as_py() == 300000
        assert (pc.min(ids).as_py(), pc.max(ids).as_py()) == (1, 300000)
    finally:
        drop_slots(db, slot)


def test_an_error_in_json_logs_carries_its_fields_as_keys(db):
    """A failing command's error, with JSON logs, is one JSON line whose fields are keys of their own (a run's
    JSON lines, the copy's event among them: tests/test_cli.py)."""
    failed = pgcdc("slot", "drop", "no_such_slot", "--dsn", db.dsn, "--log-format", "json")
    assert failed.returncode == 2
    error = json.loads(failed.stderr.strip())
    assert error["event"] == "error" and "does not exist" in error["error"] and error["exit_code"] == 2
