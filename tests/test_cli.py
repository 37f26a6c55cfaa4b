"""The `pgcdc` command, run as a user runs it: a subprocess against a real server."""

from __future__ import annotations

import json
import re
import subprocess

import psycopg
import pytest
import typer

from cli_support import run_pgcdc
from pgcdc.cli import app
from pgcdc.embedded import EmbeddedPostgres
from start_support import JavaStarts

SECRET = "s3cret-Passw0rd"


def pgcdc(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return run_pgcdc(*args, timeout=timeout, env={"COLUMNS": "200", **(env or {})})


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr


def test_help_teaches_every_command():
    result = pgcdc("--help")
    assert result.returncode == 0
    for command in ("run", "snapshot", "status", "decode", "slot", "check", "demo", "embedded"):
        assert command in result.stdout
    run_help = pgcdc("run", "--help")
    assert "--until-caught-up" in run_help.stdout and "PGCDC_DSN" in run_help.stdout


HELP_PANELS = {"Source and slot", "Copy (initial snapshot)", "Batches", "Destination", "Maintenance",
               "Failure policies", "Observability"}
# where a panel's row of names starts: near the border (a description's lines start far from it), after the mark
# of a required option if typer draws one, with the first long name
OPTION_ROW = re.compile(r" {0,4}(?:\* +)?(?:-\w, )?(--[\w-]+)")


def _panels(text: str) -> dict[str, list[str]]:
    """The panels a --help draws (``╭─ title ──╮``, ``│ line │`` ..., ``╰──╯``): each one's title and the lines
    inside its borders."""
    panels: dict[str, list[str]] = {}
    inside: list[str] | None = None
    for line in text.splitlines():
        line = line.rstrip()
        if top := re.fullmatch(r"╭─ (.+?) ─+╮", line):
            inside = panels.setdefault(top.group(1), [])
        elif line.startswith("╰"):
            inside = None
        elif inside is not None:
            assert line.startswith("│ ") and line.endswith(" │"), line
            inside.append(line[2:-2])
    return panels


def _listed(lines: list[str]) -> list[str]:
    """The options a panel lists: the long names its rows start with, up to the first column (two spaces or more
    apart) that is not names."""
    listed = []
    for line in lines:
        if OPTION_ROW.match(line):
            for column in re.split(r"\s{2,}", line.strip().removeprefix("*").strip()):
                if not column.startswith("-"):
                    break
                listed += re.findall(r"--[\w-]+", column)
    return listed


def test_run_help_groups_its_options_by_what_they_set_readable_at_80_columns():
    """At 80 columns `pgcdc run --help` lists every option once, in the panel of its kind, with its whole name and
    env var, and its description starts at least 30 columns before the panel's border (typer's one table of run's
    45 options left it 17)."""
    result = pgcdc("run", "--help", env={"COLUMNS": "80"})
    assert result.returncode == 0, _output(result)
    panels = _panels(result.stdout)
    assert set(panels) >= HELP_PANELS, list(panels)
    listed = {title: _listed(lines) for title, lines in panels.items()}
    for option, title in (("--dsn", "Source and slot"), ("--slot", "Source and slot"),
                          ("--two-phase", "Source and slot"), ("--snapshot-rows-per-task", "Copy (initial snapshot)"),
                          ("--resnapshot", "Copy (initial snapshot)"), ("--batch-rows", "Batches"),
                          ("--warehouse", "Destination"), ("--conf", "Destination"), ("--master", "Destination"),
                          ("--no-maintenance", "Maintenance"), ("--snapshot-retention-minutes", "Maintenance"),
                          ("--on-conversion-error", "Failure policies"), ("--metrics-port", "Observability")):
        assert option in listed[title], (option, title, listed)
    run = typer.main.get_command(app).commands["run"]  # type: ignore[attr-defined]
    names = {name for param in run.params for name in (*param.opts, *param.secondary_opts) if name.startswith("--")}
    assert sorted(name for names in listed.values() for name in names) == sorted(names | {"--help"})

    assert "…" not in result.stdout  # no name, metavar or env var cut short
    for param in run.params:
        assert not param.envvar or param.envvar in result.stdout, param.envvar
    widths = {}
    for lines in panels.values():
        for line in lines:
            row = OPTION_ROW.match(line)
            param = next((p for p in run.params if row and row.group(1) in p.opts and p.help), None)
            if param is not None:  # the description starts with the help's first word, after the names
                start = re.compile(rf"\s{{2,}}(?={re.escape(param.help.split()[0])})").search(line, row.end())
                assert start is not None, line
                widths[param.name] = len(line) - start.end()
    assert widths.keys() == {param.name for param in run.params if param.help}
    assert min(widths.values()) >= 30, widths


def test_an_option_sits_in_the_same_help_panel_in_every_command():
    """The options commands share (the source's, the destination's, the maintenance's ...) are grouped alike in the
    --help of each: one panel name for one kind of option."""
    panels_of: dict[str, set[str]] = {}
    for command in (["run"], ["snapshot"], ["maintain"], ["status"], ["check"], ["decode"], ["demo"],
                    ["slot", "create"], ["slot", "drop"], ["slot", "list"], ["embedded", "start"],
                    ["embedded", "stop"], ["embedded", "list"]):
        result = pgcdc(*command, "--help", env={"COLUMNS": "80"})
        assert result.returncode == 0, _output(result)
        for title, lines in _panels(result.stdout).items():
            assert title in HELP_PANELS | {"Options", "Arguments"}, (command, title)
            for option in _listed(lines):
                panels_of.setdefault(option, set()).add(title)
    assert {option: titles for option, titles in panels_of.items() if len(titles) > 1} == {}
    assert {option: titles.pop() for option, titles in panels_of.items() if option in (
        "--dsn", "--slot", "--publication", "--binary", "--warehouse", "--catalog", "--conf", "--resnapshot",
        "--snapshot-writer", "--snapshot-retention-minutes", "--orphan-age-hours", "--json", "--help")} == {
        "--dsn": "Source and slot", "--slot": "Source and slot", "--publication": "Source and slot",
        "--binary": "Source and slot", "--warehouse": "Destination", "--catalog": "Destination",
        "--conf": "Destination", "--resnapshot": "Copy (initial snapshot)",
        "--snapshot-writer": "Copy (initial snapshot)", "--snapshot-retention-minutes": "Maintenance",
        "--orphan-age-hours": "Maintenance", "--json": "Options", "--help": "Options"}


def test_the_command_line_starts_without_the_pipeline_arrow_or_spark():
    """Commands that need neither (--help, status, check, slot) do not pay for importing them: the packages load
    their names on first use, and those names still resolve."""
    import sys

    probe = ("import sys, pgcdc.cli\n"
             "heavy = ('pyarrow', 'numpy', 'pyspark', 'pgcdc.pipeline.loop', 'pgcdc.types.convert')\n"
             "print(sorted(name for name in heavy if name in sys.modules))\n"
             "from pgcdc.pipeline import Pipeline\n"
             "from pgcdc.replication import SlotManager\n"
             "import pgcdc.types\n"
             "print(Pipeline.__module__, SlotManager.__module__, pgcdc.types.TableConverter.__module__)\n"
             "try:\n    pgcdc.types.NoSuchName\nexcept AttributeError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["[]", "pgcdc.pipeline.loop pgcdc.replication.slots pgcdc.types.convert",
                                "module 'pgcdc.types' has no attribute 'NoSuchName'"], out


def test_unreachable_dsn_is_one_clear_line_without_password():
    dsn = f"host=127.0.0.1 port=1 user=cdc password={SECRET} dbname=nowhere connect_timeout=3"
    result = pgcdc("check", "--dsn", dsn, "--publication", "pub")
    assert result.returncode == 2
    text = _output(result)
    assert "cannot connect to PostgreSQL" in text and "--dsn" in text
    assert SECRET not in text
    assert "Traceback" not in text
    debug = pgcdc("--debug", "check", "--dsn", dsn, "--publication", "pub")
    assert "Traceback" in _output(debug) and SECRET not in _output(debug)


def test_wrong_password_never_echoed(pg):
    pg.execute(f"CREATE ROLE cdc LOGIN PASSWORD '{SECRET}x'")
    uri = f"postgresql://cdc:{SECRET}@127.0.0.1:{psycopg.conninfo.conninfo_to_dict(pg.dsn)['port']}/{pg.name}"
    result = pgcdc("status", "--dsn", uri)
    assert SECRET not in _output(result)


def test_bad_option_values_exit_2():
    for args in (["decode", "--file", "x", "--proto-version", "7"], ["--log-format", "yaml", "slot", "list",
                                                                       "--dsn", "host=x"]):
        result = pgcdc(*args)
        assert result.returncode == 2, _output(result)
        assert "Traceback" not in _output(result)


def test_check_reports_problems_with_fixes_and_exit_3(pg):
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
    pg.execute("CREATE TABLE nokey (v text)")
    pg.execute("ALTER TABLE nokey REPLICA IDENTITY NOTHING")
    missing = pgcdc("check", "--dsn", pg.dsn, "--publication", "nope")
    assert missing.returncode == 3
    assert "nope" in missing.stdout and "CREATE PUBLICATION" in missing.stdout

    # a table without a replica identity is mirrored append-only (PostgreSQL refuses UPDATE and DELETE on it):
    # worth a warning, not a refusal
    pg.execute("CREATE PUBLICATION pub FOR TABLE items, nokey")
    result = pgcdc("check", "--dsn", pg.dsn, "--publication", "pub", "--json")
    assert result.returncode == 0, _output(result)
    found = json.loads(result.stdout)
    warned = [p for p in found if "nokey" in p["problem"]]
    assert warned and warned[0]["severity"] == "warning" and "append-only" in warned[0]["problem"]
    assert all(p["fix"] for p in found)
    ok = pgcdc("check", "--dsn", pg.dsn, "--publication", "pub")
    assert ok.returncode == 0, _output(ok)
    assert "ready" in ok.stdout and "append-only" in ok.stdout


@pytest.mark.postgres  # a server of its own
def test_check_names_wal_level_on_a_server_without_logical_decoding():
    with EmbeddedPostgres(settings={"wal_level": "replica"}) as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY)")
            conn.execute("CREATE PUBLICATION pub FOR TABLE t")
        result = pgcdc("check", "--dsn", server.dsn, "--publication", "pub")
    assert result.returncode == 3
    assert "wal_level" in result.stdout and "logical" in result.stdout


def test_slot_lifecycle_and_decode_peeks_without_consuming(pg):
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE items")
    created = pgcdc("slot", "create", "inspect", "--dsn", pg.dsn)
    assert created.returncode == 0, _output(created)
    pg.execute("INSERT INTO items VALUES (1, 'one'), (2, 'two')")

    listed = pgcdc("slot", "list", "--dsn", pg.dsn, "--json")
    assert [s["slot"] for s in json.loads(listed.stdout)] == ["inspect"]

    for _ in range(2):  # peeking twice shows the same messages
        decoded = pgcdc("decode", "--dsn", pg.dsn, "--slot", "inspect", "--publication", "pub", "--json")
        assert decoded.returncode == 0, _output(decoded)
        lines = [json.loads(line) for line in decoded.stdout.splitlines()]
        assert [m["type"] for m in lines] == ["Begin", "Relation", "Insert", "Insert", "Commit"]
        assert lines[1]["name"] == "items"
        assert lines[2]["new"] == ["1", "one"]

    consumed = pgcdc("decode", "--dsn", pg.dsn, "--slot", "inspect", "--publication", "pub", "--consume")
    assert consumed.returncode == 0 and "Insert" in consumed.stdout
    after = pgcdc("decode", "--dsn", pg.dsn, "--slot", "inspect", "--publication", "pub")
    assert after.stdout.strip() == ""

    status = pgcdc("status", "--dsn", pg.dsn, "--json")
    assert json.loads(status.stdout)["slots"][0]["slot"] == "inspect"
    dropped = pgcdc("slot", "drop", "inspect", "--dsn", pg.dsn)
    assert dropped.returncode == 0
    assert pg.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'inspect'") == [(0,)]


def test_decode_file_of_hex_payloads(tmp_path):
    from pgcdc.lsn import Lsn
    from pgcdc.pgoutput import Begin, Commit, encode

    path = tmp_path / "messages.hex"
    begin = encode(Begin(Lsn("0/16B3748"), 0, 731), proto_version=1, in_stream=False)
    commit = encode(Commit(0, Lsn("0/16B3748"), Lsn("0/16B3778"), 0), proto_version=1, in_stream=False)
    path.write_text(f"{begin.hex()}\n0/16B3748\t{commit.hex()}\n")
    result = pgcdc("decode", "--file", str(path), "--json")
    assert result.returncode == 0, _output(result)
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    assert first["type"] == "Begin" and first["xid"] == 731 and first["final_lsn"] == "0/16B3748"
    assert second["lsn"] == "0/16B3748" and second["end_lsn"] == "0/16B3778"

    bad = tmp_path / "bad.hex"
    bad.write_text(begin[:-2].hex() + "\n")
    result = pgcdc("decode", "--file", str(bad))
    assert result.returncode == 1
    assert "Begin" in result.stderr and "offset" in result.stderr


@pytest.mark.postgres  # `pgcdc embedded start` starts one
def test_embedded_start_and_stop():
    started = pgcdc("embedded", "start")
    assert started.returncode == 0, _output(started)
    dsn = started.stdout.strip()
    try:
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SHOW wal_level").fetchone()[0] == "logical"
    finally:
        port = psycopg.conninfo.conninfo_to_dict(dsn)["port"]
        stopped = pgcdc("embedded", "stop", "--port", str(port))
    assert stopped.returncode == 0, _output(stopped)
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn, connect_timeout=2)


def test_config_file_and_environment_feed_options(pg, tmp_path):
    pg.execute("CREATE TABLE items (id int PRIMARY KEY)")
    pg.execute("CREATE PUBLICATION from_file FOR TABLE items")
    config = tmp_path / "pgcdc.toml"
    config.write_text('publication = "from_file"\n')
    result = pgcdc("--config", str(config), "check", env={"PGCDC_DSN": pg.dsn})
    assert result.returncode == 0, _output(result)
    flag_wins = pgcdc("--config", str(config), "check", "--publication", "other", env={"PGCDC_DSN": pg.dsn})
    assert flag_wins.returncode == 3 and "other" in flag_wins.stdout


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.spark  # `pgcdc demo` starts both
def test_demo_reports_every_mirror_equal(tmp_path):
    result = pgcdc("demo", "--rows", "200", "--large-transaction-rows", "3000", timeout=900)
    assert result.returncode == 0, _output(result)[-4000:]
    assert "every mirror equals its source" in result.stdout
    assert "NO" not in result.stdout.split("source vs mirror")[1]


def test_run_logs_json_lines_and_never_prints_the_password(pg, spark):
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, note text)")
    pg.execute("INSERT INTO items SELECT i, 'n' FROM generate_series(1, 20) i")
    pg.execute("CREATE PUBLICATION pub FOR TABLE items")
    warehouse = spark.conf.get("spark.sql.catalog.pgcdc.warehouse")
    dsn = pg.dsn + f" password={SECRET}"  # the embedded server trusts local users: the password is only carried
    result = pgcdc("--log-format", "json", "run", "--dsn", dsn, "--publication", "pub", "--slot", "json_run",
                   "--warehouse", warehouse, "--namespace", f"cli_{pg.name}", "--until-caught-up", timeout=600)
    assert result.returncode == 0, _output(result)[-3000:]
    assert SECRET not in _output(result)
    # every line is JSON, Spark's JVM's own included (relayed through pgcdc's logging), with the event's fields as
    # keys of their own
    entries = [json.loads(line) for line in result.stderr.splitlines()]
    assert any(e["logger"].startswith("pgcdc") and e["level"] == "info" for e in entries)
    assert all({"ts", "level", "logger", "message"} <= set(e) for e in entries)
    copied = [e for e in entries if e.get("event") == "snapshot.copied"]
    assert copied and copied[0]["table"] == "public.items" and copied[0]["rows"] == 20, copied
    assert re.fullmatch(r"[0-9A-F]+/[0-9A-F]+", copied[0]["lsn"]) and copied[0]["seconds"] >= 0, copied
    assert "applied" in result.stdout


def test_metrics_endpoint_serves_pipeline_progress():
    import urllib.request

    from pgcdc.embedded import free_port
    from pgcdc.lsn import Lsn
    from pgcdc.observability import MetricsServer
    from pgcdc.pipeline import Progress

    port = free_port()
    metrics = MetricsServer(port)
    metrics.update(Progress(rows_applied=1500, batches_applied=3, applied_lsn=Lsn("0/100"),
                            server_lsn=Lsn("0/180"), wal_retained_bytes=4096))
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "pgcdc_rows_applied_total 1500.0" in body
    assert "pgcdc_batches_applied_total 3.0" in body
    assert "pgcdc_lag_bytes 128.0" in body
    assert "pgcdc_wal_retained_bytes 4096.0" in body


@pytest.mark.long
def test_snapshot_then_status_shows_each_mirror_position(pg, spark, tmp_path):
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, note text)")
    pg.execute("INSERT INTO items SELECT i, 'n' FROM generate_series(1, 30) i")
    pg.execute("CREATE PUBLICATION pub FOR TABLE items")
    warehouse = spark.conf.get("spark.sql.catalog.pgcdc.warehouse")
    namespace = f"cli_snap_{pg.name}"
    copied = pgcdc("snapshot", "--dsn", pg.dsn, "--publication", "pub", "--slot", "snap_cli", "--warehouse",
                   warehouse, "--namespace", namespace, timeout=600)
    assert copied.returncode == 0, _output(copied)[-3000:]
    assert "public.items: 30 rows" in copied.stdout
    again = pgcdc("snapshot", "--dsn", pg.dsn, "--publication", "pub", "--slot", "snap_cli", "--warehouse",
                  warehouse, "--namespace", namespace, timeout=600)
    assert "nothing to copy" in again.stdout
    # a copy leaves no delete file: status reads the counts in the mirrors' metadata, without a JVM
    java = JavaStarts(tmp_path)
    status = pgcdc("status", "--dsn", pg.dsn, "--slot", "snap_cli", "--warehouse", warehouse, "--namespace",
                   namespace, "--json", timeout=600, env=java.env)
    assert status.returncode == 0, _output(status)[-3000:]
    assert java.starts() == [], _output(status)[-3000:]
    report = json.loads(status.stdout)
    [slot] = report["slots"]
    [mirror] = report["mirrors"]
    assert slot["slot"] == "snap_cli" and mirror["source"] == "public.items" and mirror["rows"] == 30
    assert mirror["lsn"] == slot["confirmed_flush_lsn"]  # the copy holds exactly the slot's start


def test_apply_writer_is_chosen_by_flag_environment_or_config_file_and_checked(tmp_path):
    """--apply, PGCDC_APPLY and ``apply`` in the TOML file all reach the pipeline's config, which refuses a writer
    it does not have before anything connects."""
    config = tmp_path / "pgcdc.toml"
    config.write_text('apply = "fastest"\n')
    for args, env in ((["--apply", "fast"], {}), ([], {"PGCDC_APPLY": "quick"}),
                      (["--config", str(config)], {})):
        result = pgcdc(*args[:2] if args and args[0] == "--config" else (), "run", "--dsn", "host=127.0.0.1 port=1",
                       "-p", "pub", *(args if args and args[0] == "--apply" else ()), env=env)
        assert result.returncode == 2, _output(result)
        assert "must be delta or merge" in _output(result) and "Traceback" not in _output(result)
        wanted = {"fast", "quick", "fastest"} & set(_output(result).replace("'", " ").split())
        assert wanted, _output(result)


def test_partition_by_is_read_from_flags_and_config_files_and_bad_ones_refused_before_connecting(tmp_path):
    """--partition-by TABLE=TRANSFORMS (repeated) and a config file's [partition-by] table reach the pipeline's
    config; a spec it cannot read, or a table not named with its schema, is refused, saying which and why."""
    from pgcdc.cli import _config_defaults, _partition_specs
    from pgcdc.pipeline import PipelineConfig

    specs = _partition_specs(["shop.orders=days(created_at), bucket(16, tenant)", '"Sales"."Order Lines"=id'])
    config = PipelineConfig(dsn="host=h", publication="p", partition_by=specs)
    assert {table: [str(t) for t in transforms] for table, transforms in config.partition_specs.items()} == {
        ("shop", "orders"): ["day(created_at)", "bucket(16, tenant)"], ("Sales", "Order Lines"): ["id"]}
    file = tmp_path / "pgcdc.toml"
    file.write_text('[partition-by]\n"shop.orders" = "days(created_at)"\n"shop.lines" = ["bucket(4, id)", "v"]\n')
    defaults = _config_defaults(["--config", str(file), "run"])
    assert defaults is not None and sorted(defaults["run"]["partition_by"]) == [
        "shop.lines=bucket(4, id), v", "shop.orders=days(created_at)"]
    for given, message in ((["orders=days(at)"], "not a table named with its schema"),
                           (["shop.orders=weeks(at)"], "is not a partition transform"),
                           (["shop.orders"], "give SCHEMA.TABLE=TRANSFORMS"),
                           (["shop.orders=a", "shop.orders=b"], "twice"),
                           (["Shop.Orders=a", "shop.orders=b"], "one table")):
        result = pgcdc("run", "--dsn", "host=127.0.0.1 port=1", "-p", "pub",
                       *[f"--partition-by={g}" for g in given])
        assert result.returncode == 2 and message in _output(result), _output(result)
        assert "Traceback" not in _output(result)
