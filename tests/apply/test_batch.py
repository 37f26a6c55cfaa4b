"""Applying change tables to real Iceberg mirrors: every row compared, not counted."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import (
    ArrayType,
    DateType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from change_tables import ARROW, changes
from pgcdc.apply.batch import apply_changes
from pgcdc.change_table import ChangeColumns as C
from pgcdc.change_table import change_schema
from pgcdc.errors import ConfigError
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import MirrorCatalog, TableSpec
from pgcdc.mirrors.status import namespace_positions
from pgcdc.spark.arrow import plain_type
from pgcdc.spark.destination import Destination
from pgcdc.spark.iceberg_java import load_table
from pyiceberg_reader import assert_reads_alike, hadoop_table

SCHEMA = StructType([StructField("id", LongType()), StructField("name", StringType()),
                     StructField("big", StringType()), StructField("tags", ArrayType(StringType()))])
def rows_of(spark, identifier) -> list[tuple]:
    return sorted(tuple(r) for r in spark.table(identifier).select("id", "name", "big", "tags").collect())


def apply(spark, mirror, changes, **options):
    """``apply_changes``, the positions it committed recorded in the mirror, as the pipeline's applier does."""
    applied = apply_changes(spark, mirror, changes, **options)
    if applied.position is not None:
        mirror.position = applied.position
    if applied.changelog_position is not None:
        mirror.changelog_position = applied.changelog_position
    return applied


@pytest.fixture(params=["merge", "delta"])
def writer(request) -> str:
    """Every apply test runs with both writers: the row-delta writer must leave the rows the MERGE leaves."""
    return request.param


@pytest.fixture
def mirrors(spark, iceberg_namespace):
    return MirrorCatalog(spark, Destination(namespace=iceberg_namespace))


def test_insert_update_delete_key_change_and_toast(spark, mirrors, writer):
    mirror = mirrors.ensure(TableSpec("public", "items", SCHEMA, ("id",)))
    apply(spark, mirror, changes(
        ("I", 10, 0, {"id": 1, "name": "one", "big": "B1", "tags": ["a", None]}),
        ("I", 10, 1, {"id": 2, "name": "two", "big": "B2"}),
        ("I", 10, 2, {"id": 3, "name": "three", "big": "B3"}),
    ), lsn=Lsn(10), writer=writer)
    assert rows_of(spark, mirror.identifier) == [(1, "one", "B1", ["a", None]), (2, "two", "B2", None),
                                                 (3, "three", "B3", None)]
    apply(spark, mirror, changes(
        # unchanged TOAST kept from the mirror
        ("U", 20, 0, {"id": 1, "name": "uno"}, {"unchanged": ["big"]}),
        # the same row updated twice in the batch: the second keeps the value the first wrote
        ("U", 20, 1, {"id": 2, "name": "dos", "big": "B2-new"}),
        ("U", 21, 0, {"id": 2, "name": "zwei"}, {"unchanged": ["big"]}),
        # key change with unchanged TOAST: the value comes from the mirror's row under the old key
        ("U", 21, 1, {"id": 30, "name": "drei"}, {"unchanged": ["big"], "old_key": {"id": 3}}),
        # insert then delete in one batch
        ("I", 22, 0, {"id": 4, "name": "four", "big": "B4"}),
        ("D", 22, 1, {"id": 4}),
        # insert then key change then unchanged: followed back through the key change
        ("I", 23, 0, {"id": 5, "name": "five", "big": "B5"}),
        ("U", 23, 1, {"id": 50, "name": "fifty"}, {"unchanged": ["big"], "old_key": {"id": 5}}),
        ("U", 23, 2, {"id": 50, "name": "FIFTY"}, {"unchanged": ["big"]}),
    ), lsn=Lsn(23), writer=writer)
    assert rows_of(spark, mirror.identifier) == [
        (1, "uno", "B1", None), (2, "zwei", "B2-new", None), (30, "drei", "B3", None), (50, "FIFTY", "B5", None)]
    assert namespace_positions(mirrors)[("public", "items")] == Lsn(23)


def test_replay_is_a_no_op_and_truncate_mid_batch(spark, mirrors, writer):
    mirror = mirrors.ensure(TableSpec("public", "t", SCHEMA, ("id",)))
    batch = changes(("I", 5, 0, {"id": 1, "name": "a"}), ("I", 5, 1, {"id": 2, "name": "b"}))
    apply(spark, mirror, batch, lsn=Lsn(5), writer=writer)
    snapshots = spark.sql(f"SELECT count(*) AS n FROM {mirror.identifier}.snapshots").collect()[0].n
    assert apply(spark, mirror, batch, lsn=Lsn(5), writer=writer).changes == 0
    assert spark.sql(f"SELECT count(*) AS n FROM {mirror.identifier}.snapshots").collect()[0].n == snapshots

    # a fresh catalog (a restart) reads the position back and skips the replay too
    restarted = MirrorCatalog(spark, Destination(namespace=mirrors.namespace)).ensure(mirror.spec)
    assert restarted.position == Lsn(5)
    apply(spark, restarted, changes(
        ("I", 5, 0, {"id": 1, "name": "a"}),  # already applied: skipped
        ("I", 6, 0, {"id": 3, "name": "c"}),
        ("T", 7, 0, None),
        ("I", 8, 0, {"id": 9, "name": "after"}),
    ), lsn=Lsn(8), writer=writer)
    assert rows_of(spark, mirror.identifier) == [(9, "after", None, None)]
    assert namespace_positions(mirrors)[("public", "t")] == Lsn(8)


def test_a_start_loads_each_mirror_once_for_all_it_asks_before_opening_it(spark, mirrors, monkeypatch):
    """Before a batch opens its mirrors, a start asks of each whether it exists, where it stands and what columns it
    has: one load of its table, looked at side by side with the others', answers every question and the opening;
    a mirror not there yet is made when opened, and found readable after."""
    import collections

    import pgcdc.spark.iceberg_java as iceberg_java

    specs = [TableSpec("public", f"looked{i}", SCHEMA, ("id",)) for i in range(3)]
    for i, spec in enumerate(specs):  # the second keeps a change log too
        apply(spark, mirrors.ensure(spec), changes(("I", 10 + i, 0, {"id": 1, "name": "x"})), lsn=Lsn(10 + i),
              writer="delta", changelog=i == 1)
    loads: collections.Counter[str] = collections.Counter()
    load = iceberg_java.load_table

    def counted(session, identifier):
        loads[identifier] += 1
        return load(session, identifier)

    monkeypatch.setattr(iceberg_java, "load_table", counted)
    restarted = MirrorCatalog(spark, Destination(namespace=mirrors.namespace))
    asked: collections.Counter[str] = collections.Counter()  # whether a change log or __rejects table exists
    exists = restarted.positions.exists
    monkeypatch.setattr(restarted.positions, "exists", lambda identifier: asked.update([identifier]) or
                        exists(identifier))
    new = TableSpec("public", "not_yet", SCHEMA, ("id",))
    identifiers = [restarted.identifier_for("public", spec.source_table) for spec in [*specs, new]]
    from pgcdc.pipeline.workers import DaemonThreads

    pool = DaemonThreads("test-look", 4)
    try:  # from threads Spark did not start; the mirror not there yet is known absent from the namespace's
        # listing, without a load
        restarted.look_at([("public", spec.source_table) for spec in [*specs, new]], pool.run_all)
    finally:
        pool.shutdown()
    for i, spec in enumerate(specs):
        assert restarted.readable(identifiers[i])
        assert restarted.positions.read(identifiers[i], table=restarted.look(identifiers[i])) == Lsn(10 + i)
        assert restarted.columns_of("public", spec.source_table) == set(SCHEMA.names)
        opened = restarted.ensure(spec)
        assert opened.position == Lsn(10 + i) and opened.changelog_position == (Lsn(11) if i == 1 else None)
    # the listing told which mirrors have neither a change log nor a __rejects table: only the one with a change
    # log is asked about it
    assert asked == {restarted.changelog_identifier_for("public", "looked1"): 1}, asked
    assert not restarted.readable(identifiers[3]) and restarted.columns_of("public", "not_yet") is None
    assert restarted.ensure(new).position is None and restarted.readable(identifiers[3])
    changelog = restarted.changelog_identifier_for("public", "looked1")
    assert loads == {**{identifier: 1 for identifier in identifiers[:3]}, changelog: 1}, loads
    # a new start (the stream reconnected) looks again
    restarted.look_afresh()
    restarted.forget("public", "looked0")
    assert restarted.ensure(specs[0]).position == Lsn(10) and loads[identifiers[0]] == 2


def test_a_batch_to_a_mirror_nobody_else_changed_asks_its_table_once_and_follows_one_that_changed(spark, mirrors):
    """A batch asks of its mirror's table, refreshed, where it stands, its shape and whether it holds equality
    deletes in one call into the JVM: with the table as its last batch left it, nothing more is asked of the table's
    snapshots before the commit (each question was a round trip of its own, a mirror every batch). A commit someone
    else made in between is still followed: the batch after it applies on top of it."""
    from py4j.clientserver import ClientServerConnection

    mirror = mirrors.ensure(TableSpec("public", "asked_once", SCHEMA, ("id",)))
    for lsn in (10, 11):  # the writer's layout, the index and the small files of the last commit, as streaming has
        apply(spark, mirror, changes(("I", lsn, 0, {"id": lsn, "name": "x"}), ("U", lsn, 1, {"id": 10, "name": "y"})),
              lsn=Lsn(lsn), writer="delta")
    methods: list[str] = []
    send = ClientServerConnection.send_command

    def noted(connection, command):
        lines = command.split("\n")
        if lines[0] == "c":  # a method called on a Java object: its name
            methods.append(lines[2])
        return send(connection, command)

    ClientServerConnection.send_command = noted
    try:
        apply(spark, mirror, changes(("I", 12, 0, {"id": 12, "name": "z"}), ("U", 12, 1, {"id": 11, "name": "w"})),
              lsn=Lsn(12), writer="delta")
    finally:
        ClientServerConnection.send_command = send
    assert methods.count("refreshed") == 1, methods
    asked_again = {"refresh", "currentSnapshot", "snapshot", "snapshotId", "summary", "getOrDefault", "shape",
                   "manifests", "allManifests"}
    assert not asked_again & set(methods), methods
    # someone else's commit between two batches (an append through Spark): the next batch follows it
    spark.sql(f"INSERT INTO {mirror.identifier} VALUES (500, 'theirs', NULL, NULL)")
    apply(spark, mirror, changes(("U", 13, 0, {"id": 500, "name": "ours"}), ("D", 13, 1, {"id": 10})),
          lsn=Lsn(13), writer="delta")
    assert rows_of(spark, mirror.identifier) == [(11, "w", None, None), (12, "z", None, None),
                                                  (500, "ours", None, None)]


def test_the_row_delta_writer_puts_its_files_where_the_table_s_location_provider_says(spark, mirrors, tmp_path):
    """The writer's files go where the table's location provider puts them: under the table's data directory by
    default (built without asking the JVM for each file), under ``write.data.path`` once a user sets it, and where
    Iceberg's object-storage provider spreads them once it is enabled; every reader reads the rows each time."""
    mirror = mirrors.ensure(TableSpec("public", "placed", SCHEMA, ("id",)))
    identifier = mirror.identifier
    expected = {}

    def batch(lsn: int) -> set[str]:
        apply(spark, mirror, changes(("I", lsn, 0, {"id": lsn, "name": f"n{lsn}"})), lsn=Lsn(lsn), writer="delta")
        expected[lsn] = (lsn, f"n{lsn}", None, None)
        assert rows_of(spark, identifier) == sorted(expected.values())
        assert assert_reads_alike(spark, identifier, hadoop_table(spark, identifier)) == len(expected)
        return {r.file_path for r in spark.sql(f"SELECT file_path FROM {identifier}.files").collect()}

    location = str(load_table(spark, identifier).location())
    assert all(path.startswith(f"{location}/data/") and path.count("/") == location.count("/") + 2
               for path in batch(1))
    elsewhere = tmp_path / "elsewhere"
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ('write.data.path' = '{elsewhere.as_uri()}')")
    assert any(path.startswith(f"{elsewhere.as_uri()}/") or path.startswith(f"file:{elsewhere}/")
               for path in batch(2))
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ('write.object-storage.enabled' = 'true')")
    paths = batch(3)
    # the object-storage provider's: hashed directories between the data path and the file's name
    spread = [path for path in paths if "elsewhere" in path and path.count("/") > str(elsewhere).count("/") + 2]
    assert spread, paths


def test_full_identity_without_key_matches_whole_rows(spark, mirrors, writer):
    mirror = mirrors.ensure(TableSpec("public", "log", SCHEMA, (), "f"))
    apply(spark, mirror, changes(
        ("I", 1, 0, {"id": 1, "name": "x"}), ("I", 1, 1, {"id": 1, "name": "x"}),
        ("I", 1, 2, {"id": 2, "name": "y", "big": "BIG"}),
    ), lsn=Lsn(1), writer=writer)
    apply(spark, mirror, changes(
        ("U", 2, 0, {"id": 2, "name": "y2"}, {"unchanged": ["big"],
                                              "before": {"id": 2, "name": "y", "big": "BIG", "tags": None}}),
        ("I", 2, 1, {"id": 3, "name": "z"}),
        ("D", 2, 2, {"id": 3, "name": "z"}, {"before": {"id": 3, "name": "z", "big": None, "tags": None}}),
    ), lsn=Lsn(2), writer=writer)
    assert rows_of(spark, mirror.identifier) == [(1, "x", None, None), (1, "x", None, None), (2, "y2", "BIG", None)]


# Dates and timestamps beyond Python's datetime (years 1-9999): PostgreSQL's far dates and the infinities'
# representation (the extremes of date32 and int64 microseconds) pass through every path of the apply.
FAR_DATES = [-2_440_588, 2_147_483_647, -2_147_483_648, 2_930_000_000 // 1000]  # 4714 BC, ±infinity, 10000+ AD
FAR_MICROS = [-210_866_803_200_000_000, 9_223_372_036_854_775_807, -9_223_372_036_854_775_808,
              9_000_000_000_000_000_000]
DATED_SCHEMA = StructType([StructField("d", DateType()), StructField("ts", TimestampType()),
                           StructField("note", StringType())])
DATED = pa.schema([("d", pa.date32()), ("ts", pa.timestamp("us", tz="UTC")), ("note", pa.string())])


def dated_changes(keys: tuple[str, ...], *events: tuple) -> pa.Table:
    rows = []
    for op, lsn, ordinal, row, options in events:
        rows.append({**{f.name: row.get(f.name) for f in DATED}, C.OP: op, C.LSN: lsn, C.ORDINAL: ordinal,
                     C.UNCHANGED: options.get("unchanged", []), C.OLD_KEY: options.get("old_key"),
                     C.XID: 1, C.COMMIT_TS: None, C.ORIGIN: None, C.BEFORE: options.get("before")})
    schema = change_schema(DATED, keys)
    plain = pa.schema([pa.field(f.name, plain_type(f.type)) for f in schema])
    return pa.Table.from_pylist(rows, schema=plain).cast(schema)


def dated_rows(spark, identifier) -> list[tuple]:
    return sorted(tuple(r) for r in spark.sql(
        f"SELECT unix_date(d), unix_micros(ts), note FROM {identifier}").collect())


def test_dates_beyond_python_datetime_through_keyless_and_toast_paths(spark, mirrors, writer):
    keyless = mirrors.ensure(TableSpec("public", "far_log", DATED_SCHEMA, (), "f"))
    inserts = [("I", 1, i, {"d": d, "ts": t, "note": f"n{i}"}, {}) for i, (d, t) in enumerate(
        zip(FAR_DATES, FAR_MICROS, strict=True))]
    apply(spark, keyless, dated_changes((), *inserts), lsn=Lsn(1), writer=writer)
    gone = {"d": FAR_DATES[1], "ts": FAR_MICROS[1], "note": "n1"}
    apply(spark, keyless, dated_changes(
        (),
        ("D", 2, 0, gone, {"before": gone}),
        ("U", 2, 1, {"d": FAR_DATES[2], "ts": FAR_MICROS[2], "note": None},
         {"unchanged": ["note"], "before": {"d": FAR_DATES[2], "ts": FAR_MICROS[2], "note": "n2"}}),
    ), lsn=Lsn(2), writer=writer)
    assert dated_rows(spark, keyless.identifier) == sorted(
        [(FAR_DATES[0], FAR_MICROS[0], "n0"), (FAR_DATES[2], FAR_MICROS[2], "n2"), (FAR_DATES[3], FAR_MICROS[3], "n3")])

    # keyed on a date: unchanged values followed back through a key change, within the batch and from the mirror
    keyed = mirrors.ensure(TableSpec("public", "far_keyed", DATED_SCHEMA, ("d",)))
    apply(spark, keyed, dated_changes(
        ("d",), ("I", 1, 0, {"d": FAR_DATES[0], "ts": FAR_MICROS[0], "note": "kept"}, {}),
        ("I", 1, 1, {"d": FAR_DATES[3], "ts": FAR_MICROS[3], "note": "also kept"}, {})), lsn=Lsn(1), writer=writer)
    apply(spark, keyed, dated_changes(
        ("d",),
        ("U", 2, 0, {"d": FAR_DATES[1], "ts": FAR_MICROS[1]}, {"unchanged": ["note"], "old_key": {"d": FAR_DATES[0]}}),
        ("I", 2, 1, {"d": FAR_DATES[2], "ts": FAR_MICROS[2], "note": "first"}, {}),
        ("U", 3, 0, {"d": FAR_DATES[2], "ts": FAR_MICROS[3]}, {"unchanged": ["note"]}),
    ), lsn=Lsn(3), writer=writer)
    assert dated_rows(spark, keyed.identifier) == sorted([
        (FAR_DATES[1], FAR_MICROS[1], "kept"), (FAR_DATES[2], FAR_MICROS[3], "first"),
        (FAR_DATES[3], FAR_MICROS[3], "also kept")])


def test_schema_evolution_and_refused_narrowing(spark, mirrors):
    base = StructType([StructField("id", LongType()), StructField("n", IntegerType()), StructField("gone", StringType())])
    mirrors.ensure(TableSpec("s", "evolve", base, ("id",)))
    wider = StructType([StructField("id", LongType()), StructField("n", LongType()), StructField("new", StringType())])
    mirror = mirrors.ensure(TableSpec("s", "evolve", wider, ("id",)))
    fields = {f.name: f.dataType for f in spark.table(mirror.identifier).schema.fields}
    assert fields == {"id": LongType(), "n": LongType(), "new": StringType()}
    # a fresh process reads the table back: smallint is stored as int, which is no change
    small = StructType([*wider.fields, StructField("s", ShortType())])
    mirrors.ensure(TableSpec("s", "evolve", small, ("id",)))
    reopened = MirrorCatalog(spark, Destination(namespace=mirrors.namespace))
    assert reopened.ensure(TableSpec("s", "evolve", small, ("id",))).schema["s"].dataType == IntegerType()
    narrower = StructType([StructField("id", LongType()), StructField("n", StringType()),
                           StructField("new", StringType())])
    with pytest.raises(ConfigError, match="resnapshot"):
        mirrors.ensure(TableSpec("s", "evolve", narrower, ("id",)))


def test_identifiers_survive_any_source_name(spark, mirrors):
    schema = StructType([StructField("id", LongType()), StructField('we"ird `col`', StringType())])
    for source_schema, table in [("Mixed Case", "Orders"), ("mixed case", "orders"), ("dots.and/slash", "t`q%")]:
        mirror = mirrors.ensure(TableSpec(source_schema, table, schema, ("id",)))
        spark.sql(f"INSERT INTO {mirror.identifier} VALUES (1, '{table}')")
    found = {(s, t) for s, t, _ in mirrors.source_tables()}
    assert found == {("Mixed Case", "Orders"), ("mixed case", "orders"), ("dots.and/slash", "t`q%")}
    values = spark.table(mirrors.identifier_for("dots.and/slash", "t`q%")).collect()
    assert [tuple(r) for r in values] == [(1, "t`q%")]


def test_change_log_records_every_change_once(spark, mirrors, writer):
    mirror = mirrors.ensure(TableSpec("public", "logged", SCHEMA, ("id",)))
    batch = changes(("I", 3, 0, {"id": 1, "name": "a"}), ("U", 4, 0, {"id": 1, "name": "b"},
                                                          {"before": {"id": 1, "name": "a", "big": None,
                                                                      "tags": None}}),
                    ("D", 5, 0, {"id": 1}, {"origin": "upstream"}))
    apply(spark, mirror, batch, lsn=Lsn(5), writer=writer, changelog=True)
    apply(spark, mirror, batch, lsn=Lsn(5), writer=writer, changelog=True)  # a replay adds nothing
    log = spark.sql(f"SELECT op, commit_lsn, ordinal, origin, before.name AS before_name, after.name AS after_name "
                    f"FROM {mirror.changelog_identifier} ORDER BY commit_lsn_value, ordinal").collect()
    assert [tuple(r) for r in log] == [("I", "0/3", 0, None, None, "a"), ("U", "0/4", 0, None, "a", "b"),
                                       ("D", "0/5", 0, "upstream", None, None)]
    assert rows_of(spark, mirror.identifier) == []


def test_merge_reads_only_the_key_range_of_its_batch():
    """The MERGE's extra condition spans the batch's keys (the events hold the old keys of key changes too, see
    the key change above), and only integer keys get one."""
    from pgcdc.apply.mirror_reads import key_ranges as _key_ranges

    events = pa.table({"id": pa.array([7, -3, 12], pa.int64()), "name": ["b", "a", "c"]})
    assert _key_ranges(events, ["id"]) == ["t.`id` BETWEEN -3 AND 12"]
    assert _key_ranges(events, ["id", "name"]) == ["t.`id` BETWEEN -3 AND 12"]
    assert _key_ranges(events, ["name"]) == []


def test_arrow_tables_become_dataframes_converted_in_tasks_and_the_session_conf_is_left_as_it_was(spark):
    """Change tables reach Spark as an RDD of Arrow batches (converted by tasks, not row by row on the driver),
    whatever the session's own threshold for that; the threshold itself is left as the session had it."""
    from pgcdc.spark.arrow import arrow_to_dataframe

    key = "spark.sql.execution.arrow.localRelationThreshold"
    table = pa.table({"id": pa.array(range(1000), pa.int64()), "name": [f"n{i}" for i in range(1000)],
                      "big": [None] * 1000, "tags": [["a", None]] * 1000}, schema=ARROW)
    for setting in (None, "123456"):
        if setting is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, setting)
        frame = arrow_to_dataframe(spark, table, SCHEMA)
        plan = frame._jdf.queryExecution().analyzed().toString()
        assert "LocalRelation" not in plan and "LogicalRDD" in plan, plan
        rows = sorted((r.id, r.name, r.big, list(r.tags)) for r in frame.collect())
        assert rows == [(i, f"n{i}", None, ["a", None]) for i in range(1000)]
        assert spark.conf.get(key, None) == setting
    spark.conf.unset(key)


def last_summary(spark, identifier) -> dict:
    return spark.sql(f"SELECT summary FROM {identifier}.snapshots ORDER BY committed_at DESC LIMIT 1").collect()[0][0]


FLAT = StructType([StructField("id", LongType()), StructField("name", StringType()), StructField("n", ShortType())])
FLAT_ARROW = pa.schema([("id", pa.int64()), ("name", pa.string()), ("n", pa.int16())])


def flat_changes(keys: tuple[str, ...], *events: tuple) -> pa.Table:
    rows = [{**{f.name: row.get(f.name) for f in FLAT_ARROW}, C.OP: op, C.LSN: lsn, C.ORDINAL: ordinal,
             C.UNCHANGED: [], C.OLD_KEY: None, C.XID: 1, C.COMMIT_TS: None, C.ORIGIN: None,
             C.BEFORE: before}
            for op, lsn, ordinal, row, before in events]
    return pa.Table.from_pylist(rows, schema=change_schema(FLAT_ARROW, keys))


@pytest.fixture
def no_folding(monkeypatch):
    """Each batch's rows in a data file of its own, its deletes in a delete file (no small file folded in:
    tests of folding are below)."""
    from pgcdc.apply import fold

    monkeypatch.setattr(fold, "FOLD_MAX_ROWS", 0)


@pytest.mark.parametrize("deletes", ["position", "equality"])
def test_delta_writer_commits_one_row_delta_replacing_each_key_once(spark, mirrors, deletes, no_folding):
    """Inserted, replaced, re-keyed and deleted in one commit each: a data file and a delete file — by position,
    the rows the batch replaces or removes; by equality, every key it touches (the row written in the same commit
    as the delete of its key survives it, older rows under it do not). PyIceberg reads what Spark reads."""
    mirror = mirrors.ensure(TableSpec("public", f"delta_keyed_{deletes}", FLAT, ("id",)))
    apply(spark, mirror, flat_changes(("id",), *[("I", 1, i, {"id": i, "name": f"v{i}", "n": i}, None)
                                                      for i in range(5)]), lsn=Lsn(1), writer="delta", deletes=deletes)
    apply(spark, mirror, flat_changes(
        ("id",),
        ("U", 2, 0, {"id": 1, "name": "v1-new", "n": 10}, None),
        ("D", 2, 1, {"id": 2}, None),
        ("I", 2, 2, {"id": 2, "name": "back", "n": 20}, None),  # deleted and inserted again in one batch
        ("D", 2, 3, {"id": 3}, None),
        ("I", 3, 0, {"id": 7, "name": "new", "n": None}, None),
    ), lsn=Lsn(3), writer="delta", deletes=deletes)
    summary = last_summary(spark, mirror.identifier)
    assert summary["pgcdc.lsn"] == "0/3" and summary["added-data-files"] == "1"
    if deletes == "position":  # the rows under 1, 2 and 3; 7 had none
        assert summary["added-position-delete-files"] == "1" and summary["added-position-deletes"] == "3"
    else:  # every key the batch touched: 1, 2, 3, 7
        assert summary["added-equality-delete-files"] == "1" and summary["added-equality-deletes"] == "4"
    rows = sorted(tuple(r) for r in spark.table(mirror.identifier).collect())
    assert rows == [(0, "v0", 0), (1, "v1-new", 10), (2, "back", 20), (4, "v4", 4), (7, "new", None)]
    snapshots = spark.sql(f"SELECT count(*) AS n FROM {mirror.identifier}.snapshots").collect()[0].n
    assert snapshots == 2  # one commit per batch
    if deletes == "position":
        assert assert_reads_alike(spark, mirror.identifier, hadoop_table(spark, mirror.identifier)) == 5


@pytest.mark.parametrize("deletes", ["position", "equality"])
def test_delta_writer_deletes_one_of_identical_rows_of_tables_without_a_key_null_matching_null(spark, mirrors,
                                                                                                 deletes, no_folding):
    mirror = mirrors.ensure(TableSpec("public", f"delta_full_{deletes}", FLAT, (), "f"))
    apply(spark, mirror, flat_changes(
        (), ("I", 1, 0, {"id": 1, "name": None, "n": 1}, None), ("I", 1, 1, {"id": 1, "name": None, "n": 1}, None),
        ("I", 1, 2, {"id": 1, "name": None, "n": 2}, None), ("I", 1, 3, {"id": 2, "name": "x", "n": None}, None),
    ), lsn=Lsn(1), writer="delta", deletes=deletes)
    apply(spark, mirror, flat_changes(
        (),
        ("D", 2, 0, {"id": 1, "name": None, "n": 1}, {"id": 1, "name": None, "n": 1}),
        ("U", 2, 1, {"id": 2, "name": "y", "n": None}, {"id": 2, "name": "x", "n": None}),
    ), lsn=Lsn(2), writer="delta", deletes=deletes)
    summary = last_summary(spark, mirror.identifier)
    if deletes == "position":  # exactly the one copy deleted, and the row updated
        assert summary["added-position-deletes"] == "2"
    else:  # every copy, and the copy that stays written again
        assert summary["added-equality-delete-files"] == "1"
    # a delete of one of two identical rows (NULL matching NULL) leaves the other, as in the source
    assert sorted(tuple(r) for r in spark.table(mirror.identifier).collect()) == [
        (1, None, 1), (1, None, 2), (2, "y", None)]
    if deletes == "position":
        assert assert_reads_alike(spark, mirror.identifier, hadoop_table(spark, mirror.identifier)) == 3


def test_delta_writer_hands_what_it_cannot_write_to_the_merge(spark, mirrors, caplog):
    """Rows matched on a nested column (a table without a key that has an array column) cannot be named by an
    equality delete: deleting by equality, the MERGE applies that batch, and says so; by position the row-delta
    writer applies it."""
    mirror = mirrors.ensure(TableSpec("public", "nested_full", SCHEMA, (), "f"))
    with caplog.at_level("INFO", logger="pgcdc.apply.batch"):
        apply(spark, mirror, changes(("I", 1, 0, {"id": 1, "name": "x", "tags": ["a"]})), lsn=Lsn(1),
              writer="delta", deletes="equality")
    assert "MERGE writer applies this batch" in caplog.text and "tags" in caplog.text
    assert rows_of(spark, mirror.identifier) == [(1, "x", None, ["a"])]
    caplog.clear()
    with caplog.at_level("INFO", logger="pgcdc.apply.batch"):
        apply(spark, mirror, changes(("D", 2, 0, None, {"before": {"id": 1, "name": "x", "big": None, "tags": ["a"]}}),
                                     ("I", 2, 1, {"id": 3, "name": "y", "tags": ["b", None]})),
              lsn=Lsn(2), writer="delta")
    assert "MERGE writer" not in caplog.text
    summary = last_summary(spark, mirror.identifier)  # the row deleted by its place: folded out of its small file
    assert "added-equality-delete-files" not in summary and summary["deleted-data-files"] == "1"
    assert rows_of(spark, mirror.identifier) == [(3, "y", None, ["b", None])]
    assert assert_reads_alike(spark, mirror.identifier, hadoop_table(spark, mirror.identifier)) == 1
    with pytest.raises(ValueError, match="apply writer"):
        apply(spark, mirror, changes(("I", 2, 0, {"id": 2})), lsn=Lsn(2), writer="fast")


def test_position_deletes_resolved_before_a_compaction_fail_validation_and_are_resolved_again(spark, mirrors):
    """A compaction commits between the moment a batch resolved its rows' positions and its commit: the commit
    names data files that are gone, Iceberg's validation refuses it (never a delete against a removed file, which
    would bring the row back), and applied again it resolves the rows in the compacted file."""
    from pgcdc.apply.batch import _index
    from pgcdc.apply.mirror_reads import position_deletes, positioned
    from pgcdc.apply.reduce import ordered, reduce_changes
    from pgcdc.apply.row_delta import RowDeltaWriter
    from pgcdc.positions import commit_properties
    from pgcdc.spark.iceberg_java import is_commit_conflict

    mirror = mirrors.ensure(TableSpec("public", "raced_positions", FLAT, ("id",)))
    for lsn in (1, 2):  # two data files, for the compaction to rewrite into one
        apply(spark, mirror, flat_changes(("id",), ("I", lsn, 0, {"id": lsn, "name": "old", "n": 0}, None)),
              lsn=Lsn(lsn), writer="delta")
    batch = flat_changes(("id",), ("U", 3, 0, {"id": 1, "name": "new", "n": 5}, None))
    target = RowDeltaWriter(spark, load_table(spark, mirror.identifier))
    index = _index(mirror, target, None)
    reduction = reduce_changes(ordered(batch), list(FLAT.names), ("id",), append_only=False, position=mirror.position)
    rows, located = positioned(mirror, reduction, index, target.schema)
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{mirror.identifier}', "
              "options => map('rewrite-all', 'true'))").collect()
    summary, properties = commit_properties(Lsn(3))
    with pytest.raises(Exception) as refused:
        target.commit(rows, position_deletes(index, located), summary, table_properties=properties,
                      validate_from=index.snapshot_id)
    assert is_commit_conflict(refused.value)
    assert sorted(tuple(r) for r in spark.table(mirror.identifier).collect()) == [(1, "old", 0), (2, "old", 0)]
    apply(spark, mirror, batch, lsn=Lsn(3), writer="delta")  # the index follows the compaction first
    assert sorted(tuple(r) for r in spark.table(mirror.identifier).collect()) == [(1, "new", 5), (2, "old", 0)]
    assert assert_reads_alike(spark, mirror.identifier, hadoop_table(spark, mirror.identifier)) == 2


def test_a_batch_landing_on_top_of_a_compaction_of_other_files_leaves_the_index_following_both(spark, mirrors,
                                                                                              no_folding):
    """A compaction of files a batch's deletes do not name commits between the moment the batch resolved its
    positions and its commit: Iceberg commits the batch on top of it (nothing it names is gone), and the key index
    follows the compaction as well as the batch — a later update of a row the compaction moved finds it in its new
    file, leaving no second copy."""
    from pgcdc.apply.batch import _follow_commit, _index
    from pgcdc.apply.mirror_reads import position_deletes, positioned
    from pgcdc.apply.reduce import ordered, reduce_changes
    from pgcdc.apply.row_delta import RowDeltaWriter
    from pgcdc.positions import commit_properties

    mirror = mirrors.ensure(TableSpec("public", "raced_others", FLAT, ("id",)))
    for lsn in (1, 2, 3):  # a data file each
        apply(spark, mirror, flat_changes(("id",), ("I", lsn, 0, {"id": lsn, "name": "old", "n": 0}, None)),
              lsn=Lsn(lsn), writer="delta")
    batch = flat_changes(("id",), ("U", 4, 0, {"id": 3, "name": "new", "n": 5}, None))
    target = RowDeltaWriter(spark, load_table(spark, mirror.identifier))
    index = _index(mirror, target, None)
    indexed = index.snapshot_id
    reduction = reduce_changes(ordered(batch), list(FLAT.names), ("id",), append_only=False, position=mirror.position)
    rows, located = positioned(mirror, reduction, index, target.schema)
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{mirror.identifier}', where => 'id <= 2', "
              "options => map('rewrite-all', 'true'))").collect()
    summary, properties = commit_properties(Lsn(4))
    committed = target.commit(rows, position_deletes(index, located), summary, table_properties=properties,
                              validate_from=indexed)
    assert committed.parent_id != indexed  # Iceberg retried it on top of the compaction
    _follow_commit(index, indexed, committed, located, rows, target, truncated=False, fold=None)
    assert index.snapshot_id == committed.snapshot_id
    mirror.position = Lsn(4)
    apply(spark, mirror, flat_changes(("id",), ("U", 5, 0, {"id": 1, "name": "moved", "n": 7}, None)),
          lsn=Lsn(5), writer="delta")
    assert sorted(tuple(r) for r in spark.table(mirror.identifier).collect()) == [
        (1, "moved", 7), (2, "old", 0), (3, "new", 5)]
    assert assert_reads_alike(spark, mirror.identifier, hadoop_table(spark, mirror.identifier)) == 3


def test_an_index_built_from_many_files_read_at_once_finds_each_live_row_where_iceberg_reads_it(spark, mirrors,
                                                                                                no_folding):
    """The index of a mirror of more data files than are read at once (READ_AHEAD), some of their rows deleted
    by later batches' position deletes: built afresh, each live key is found at the file and position Iceberg's
    own reader gives it (its _file and _pos columns), and no deleted row is."""
    from pgcdc.index.mirror_index import READ_AHEAD, index_for
    from pgcdc.spark.iceberg_java import parquet_layout

    mirror = mirrors.ensure(TableSpec("public", "many_files", FLAT, ("id",)))
    files = READ_AHEAD * 2 + 3
    for lsn in range(1, files + 1):  # a data file each; from the third on, each batch also updates a key of the
        events = [("I", lsn, 0, {"id": lsn, "name": "new", "n": 0}, None)]  # batch before last
        if lsn > 2:
            events.append(("U", lsn, 1, {"id": lsn - 2, "name": "updated", "n": 1}, None))
        apply(spark, mirror, flat_changes(("id",), *events), lsn=Lsn(lsn), writer="delta")
    table = load_table(spark, mirror.identifier)
    assert len([row for row in spark.sql(f"SELECT 1 FROM {mirror.identifier}.files").collect()]) > READ_AHEAD
    layout = pa.schema([pa.field(name, field_type, metadata={b"PARQUET:field_id": str(field_id).encode()})
                        for name, (field_id, field_type) in parquet_layout(table)])
    index = index_for(None, table, ["id"], layout, multiset=False, budget=None)

    where = {row.id: (row.file, row.pos) for row in spark.sql(
        f"SELECT id, _file AS file, _pos AS pos FROM {mirror.identifier}").collect()}
    assert sorted(where) == list(range(1, files + 1))
    keys = pa.table({"id": pa.array(sorted(where), pa.int64())})
    located = index.keys.find(keys)
    found = {key: (index.keys.path(int(file_id)), int(position))
             for key, file_id, position in zip(sorted(where), located.file_ids, located.positions, strict=True)}
    assert found == where
    assert index.keys.rows == files


def test_an_equality_delta_racing_a_compaction_is_retried_and_lands_once(spark, mirrors):
    """Deleting by equality, a compaction commits between the moment the batch read the mirror and its commit:
    the row delta is retried on the compacted table with the same files, its equality deletes reach the rewritten
    rows, and the position lands once."""
    from pgcdc.apply.row_delta import RowDeltaWriter

    mirror = mirrors.ensure(TableSpec("public", "raced", FLAT, ("id",)))
    for lsn in (1, 2):  # two data files, for the compaction to rewrite into one
        apply(spark, mirror, flat_changes(("id",), ("I", lsn, 0, {"id": lsn, "name": "old", "n": 0}, None)),
              lsn=Lsn(lsn), writer="delta", deletes="equality")
    target = RowDeltaWriter(spark, load_table(spark, mirror.identifier))
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{mirror.identifier}', "
              "options => map('rewrite-all', 'true'))").collect()
    assert last_summary(spark, mirror.identifier).get("pgcdc.lsn") is None  # the compaction's own commit
    # equality deletes name keys, not files: the commit lands on the compacted table
    rows = pa.table({"id": pa.array([1], pa.int64()), "name": ["new"], "n": pa.array([5], pa.int16())})
    target.commit(rows, rows.select(["id"]), {"pgcdc.lsn": "0/3"})
    assert sorted(tuple(r) for r in spark.table(mirror.identifier).collect()) == [(1, "new", 5), (2, "old", 0)]
    operations = [r.operation for r in spark.sql(
        f"SELECT operation FROM {mirror.identifier}.snapshots ORDER BY committed_at").collect()]
    assert operations == ["overwrite", "overwrite", "replace", "overwrite"]
    assert MirrorCatalog(spark, Destination(namespace=mirrors.namespace)).positions.read(mirror.identifier) == Lsn(3)


def test_a_mirror_whose_index_does_not_fit_in_memory_keeps_it_on_disk_through_restarts_kills_and_compactions(
        spark, mirrors, tmp_path, caplog, monkeypatch):
    """--index-memory-mb bounds the key indexes' memory: an index that does not fit is kept on disk, and the mirror
    goes on deleting by position (PyIceberg reads it after every batch; no equality delete is ever written). A
    clean stop saves it: the next start opens it without reading a data file. After a kill (nothing saved since
    the build) and a foreign compaction, the next start reads only what changed, and a damaged index is built
    again, never trusted; a TRUNCATE starts it over."""
    import numpy as np

    from pgcdc.index import mirror_index
    from pgcdc.index.mirror_index import IndexBudget

    caplog.set_level("INFO", logger="pgcdc.index.mirror_index")
    monkeypatch.setattr(mirror_index, "CHUNK_ROWS", 700)  # files of more rows are read in chunks, as a large one
    read = []  # every file of the mirror opened with Arrow: data files and delete files
    real_open = mirror_index.FileReader._open
    monkeypatch.setattr(mirror_index.FileReader, "_open",
                        lambda self, location: read.append(location) or real_open(self, location))
    mirror = mirrors.ensure(TableSpec("public", "index_on_disk", FLAT, ("id",)))
    expected: dict[int, tuple] = {}
    rng = np.random.default_rng(7)
    lsn = 0

    def batch(budget, inserts=0, updates=0, deletes=0, truncate=False):
        nonlocal lsn
        lsn += 1
        events = [("T", lsn, 0, {}, None)] if truncate else []
        if truncate:
            expected.clear()
        for i in range(inserts):
            key = len(expected) + 1_000_000 * lsn + i
            events.append(("I", lsn, len(events), {"id": key, "name": "new", "n": i % 100}, None))
            expected[key] = (key, "new", i % 100)
        for key in rng.choice(sorted(expected), updates + deletes, replace=False).tolist():
            if updates:
                updates -= 1
                events.append(("U", lsn, len(events), {"id": key, "name": f"u{lsn}", "n": lsn}, None))
                expected[key] = (key, f"u{lsn}", lsn)
            else:
                events.append(("D", lsn, len(events), {"id": key}, None))
                del expected[key]
        apply(spark, mirror, flat_changes(("id",), *events), lsn=Lsn(lsn), writer="delta", budget=budget)
        assert assert_reads_alike(spark, mirror.identifier, hadoop_table(spark, mirror.identifier)) == len(expected)
        assert sorted(tuple(r) for r in spark.table(mirror.identifier).collect()) == sorted(expected.values())
        assert last_summary(spark, mirror.identifier).get("total-equality-deletes", "0") == "0"

    budget = IndexBudget(1, tmp_path)  # a byte: every index is kept on disk
    batch(budget, inserts=2000)
    batch(budget, inserts=1500, updates=300, deletes=200)
    assert mirror.deletes != "equality" and mirror.index is not None and mirror.index.disk is not None
    assert mirror.index.keys.disk_bytes > 0
    batch(budget, updates=400, deletes=100)

    # a clean stop saves the index; the next start opens it and reads no data file to know where each row is
    budget.close(save=True)
    assert read  # the build's reads are seen
    mirror.index, read[:] = None, []
    budget = IndexBudget(1, tmp_path)
    batch(budget, updates=50, deletes=50)
    assert read == [] and "opened its index of" in caplog.text

    # a kill: nothing saved since the build; then someone compacts the mirror
    mirror.index.disk.close()  # the killed process's lock goes with it
    mirror.index = None
    caplog.clear()
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{mirror.identifier}', "
              "options => map('rewrite-all', 'true'))").collect()
    budget = IndexBudget(1, tmp_path)
    batch(budget, inserts=100, updates=200, deletes=100)
    assert "data files added and" in caplog.text and "indexed" not in caplog.text  # caught up, not rebuilt

    # a damaged run is never trusted: built again
    budget.close(save=True)
    mirror.index = None
    run = next(path for path in (tmp_path).rglob("run-*.loc"))
    with open(run, "r+b") as file:
        file.seek(8)
        file.write(b"\xff" * 8)
    caplog.clear()
    budget = IndexBudget(1, tmp_path)
    batch(budget, updates=100, deletes=100)
    assert "cannot be trusted" in caplog.text and "indexed" in caplog.text

    # a TRUNCATE replaces every row: the index on disk starts over from the new rows
    batch(budget, truncate=True, inserts=300)
    batch(budget, updates=100, deletes=50)
    assert mirror.index.disk is not None and mirror.index.keys.rows == len(expected)


@pytest.mark.parametrize("fold_max_rows", [None, 40], ids=["one-small-file", "small-files-graduate"])
def test_a_streaming_mirror_folds_its_newest_rows_in_each_commit_and_every_reader_reads_it(
        spark, mirrors, iceberg_namespace, monkeypatch, commit_steps_chosen, fold_max_rows):
    """Each batch's commit rewrites the small file of the commit before it (its rows still live) into the batch's
    own data file, and its small delete file into the batch's — the commit before a restart's too, read back from
    storage: a mirror fed by small batches holds one data file and no delete file. Past FOLD_MAX_ROWS the small file stays, and the batch's deletes of its rows are written as
    deletes, folded in turn while they are few. Every reader reads the source's rows after every batch.
    A commit runs its steps in its own thread, or on Iceberg's worker pool once it would read many manifests for the
    files it removes: both ways land the same rows. A commit is one call into the JVM (pgcdc.iceberg.Commits), or,
    in a session without pgcdc's jar, made call by call (the first case): both land the same rows."""
    from pgcdc.apply import fold
    from pgcdc.spark import iceberg_java as iceberg

    if fold_max_rows is None:
        monkeypatch.setattr(iceberg.iceberg_classes(), "commits", None)
    else:
        monkeypatch.setattr(fold, "FOLD_MAX_ROWS", fold_max_rows)
        monkeypatch.setattr(iceberg, "MANIFESTS_READ_IN_TURN", 3)  # files graduate: the pool's turn comes
    spec = TableSpec("public", f"folded_{fold_max_rows or 'all'}", FLAT, ("id",), "d")
    mirror = mirrors.ensure(spec)
    expected: dict[int, tuple] = {}
    lsn = 0
    for batch in range(15):
        if batch in (6, 7, 11):  # a new process: it folds into the small files of the last one's last commit
            mirror = MirrorCatalog(spark, Destination(namespace=iceberg_namespace)).ensure(spec)
            assert mirror.small_files is None and mirror.index is None
        lsn += 1
        events = []
        for i in range(5):  # new rows, and an update and a delete of older ones
            key = batch * 5 + i
            events.append(("I", lsn, i, {"id": key, "name": f"v{batch}", "n": i}, None))
            expected[key] = (key, f"v{batch}", i)
        if batch:
            updated, gone = (batch - 1) * 5, batch * 3 - 2
            events.append(("U", lsn, 5, {"id": updated, "name": f"u{batch}", "n": 9}, None))
            events.append(("D", lsn, 6, {"id": gone}, None))
            expected[updated] = (updated, f"u{batch}", 9)
            expected.pop(gone, None)
        apply(spark, mirror, flat_changes(("id",), *events), lsn=Lsn(lsn), writer="delta")
        assert sorted(tuple(r) for r in spark.table(mirror.identifier).collect()) == sorted(expected.values())
        assert last_summary(spark, mirror.identifier).get("added-equality-deletes") is None
        if fold_max_rows is not None:  # the files read back (pgcdc's jar) know the manifest that added them
            small, table = mirror.small_files, load_table(spark, mirror.identifier)
            snapshot = table.currentSnapshot()
            added_now = [str(m.path()) for m in snapshot.allManifests(table.io())
                         if int(m.snapshotId()) == int(snapshot.snapshotId()) and m.hasAddedFiles()]
            written = {str(m.path()) for s in table.snapshots() for m in s.allManifests(table.io())}
            if small.data is not None and not small.data.read_back:  # this batch's own data file
                assert str(small.data.java.manifestLocation()) in added_now
                # its rows, carried to the next fold, in one chunk however many folds they went through
                assert all(column.num_chunks <= 1 for column in small.data.rows.columns)
            if small.deletes is not None:  # this batch's, or one an earlier batch kept
                assert str(small.deletes.java.manifestLocation()) in written
        files = spark.sql(f"SELECT content, record_count FROM {mirror.identifier}.files").collect()
        data = [f.record_count for f in files if f.content == 0]
        deletes = [f for f in files if f.content != 0]
        if fold_max_rows is None:  # one small file holds the mirror's rows; every delete was applied to it
            assert len(data) == 1 and not deletes, files
        else:  # files of at most about FOLD_MAX_ROWS rows, one delete file at a time unless past the bound
            assert all(rows < 2 * fold_max_rows for rows in data) and len(deletes) <= 2, files
        if batch % 5 == 4:
            assert assert_reads_alike(spark, mirror.identifier, hadoop_table(spark, mirror.identifier)) == len(expected)
    folded = last_summary(spark, mirror.identifier)
    assert folded["pgcdc.lsn"] and int(folded.get("deleted-data-files", "0")) >= (1 if fold_max_rows is None else 0)
    # one small file folded at each batch keeps the manifests few: every commit in its own thread
    assert set(commit_steps_chosen) == ({True} if fold_max_rows is None else {True, False}), commit_steps_chosen
    # the index followed each fold: a batch now updates and deletes the oldest rows by position
    apply(spark, mirror, flat_changes(("id",), ("U", lsn + 1, 0, {"id": 2, "name": "last", "n": 0}, None),
                                      ("D", lsn + 1, 1, {"id": 3}, None)), lsn=Lsn(lsn + 1), writer="delta")
    expected[2], _ = (2, "last", 0), expected.pop(3)
    assert last_summary(spark, mirror.identifier).get("added-equality-deletes") is None
    assert sorted(tuple(r) for r in spark.table(mirror.identifier).collect()) == sorted(expected.values())
    assert assert_reads_alike(spark, mirror.identifier, hadoop_table(spark, mirror.identifier)) == len(expected)
