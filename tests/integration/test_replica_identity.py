"""The mirror's key is what the server sends as a row's identity, and a change of identity is never applied
with the wrong key: a real server, the session's Spark, every row compared."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from pgcdc.errors import IdentityChangedError
from pgcdc.mirrors.status import namespace_positions
from pgcdc.pipeline import Pipeline
from pgcdc.verify import compare_publication
from pipeline_support import pipeline_config

pytestmark = pytest.mark.slow


def _assert_equal(pipeline: Pipeline, dsn: str) -> None:
    pipeline.spark.catalog.clearCache()
    results = compare_publication(pipeline, dsn, pipeline.config.publication)
    assert results and all(r.equal for r in results), [r.describe() for r in results]


def _recorded_key(pipeline: Pipeline, table: str) -> str:
    identifier = pipeline.mirrors.identifier_for("public", table)
    return pipeline.spark.sql(f"SHOW TBLPROPERTIES {identifier} ('pgcdc.key')").collect()[0].value


def test_replica_identity_using_index_keys_the_mirror_on_the_index_not_the_primary_key(pg, spark):
    pg.execute("CREATE TABLE ri (id int PRIMARY KEY, code text NOT NULL, tenant int NOT NULL, v text)")
    pg.execute("CREATE UNIQUE INDEX ri_identity ON ri (code, tenant)")
    pg.execute("ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_identity")
    pg.execute("INSERT INTO ri SELECT i, 'c' || (i % 10), i / 10, 'v' || i FROM generate_series(1, 200) i")
    pg.execute("CREATE TABLE kept (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO kept SELECT i, 'v' || i FROM generate_series(1, 50) i")
    pg.execute("CREATE PUBLICATION pub FOR TABLE ri, kept")
    pipeline = Pipeline(pipeline_config(pg, spark, publication="pub"), spark=spark)
    pipeline.snapshot()
    assert _recorded_key(pipeline, "ri") == "code,tenant"

    with pg.connect() as conn:
        conn.execute("INSERT INTO ri SELECT i, 'c' || (i % 10), i / 10, 'new' FROM generate_series(201, 260) i")
        conn.execute("UPDATE ri SET id = id + 1000 WHERE id % 7 = 0")  # the primary key changes, the identity not
        conn.execute("UPDATE ri SET v = 'changed' WHERE id % 5 = 0")
        conn.execute("UPDATE ri SET tenant = tenant + 100 WHERE id % 11 = 0")  # the identity changes: old one sent
        conn.execute("DELETE FROM ri WHERE id % 3 = 0")  # deletes carry only (code, tenant)
        with conn.transaction():  # one row re-keyed both ways, then deleted, in one transaction
            conn.execute("UPDATE ri SET id = 5000, code = 'moved' WHERE id = 1")
            conn.execute("DELETE FROM ri WHERE id = 5000")
            conn.execute("UPDATE ri SET id = 6000 WHERE id = 2")
        # a new replica identity that keeps the key (FULL beside a primary key) is followed
        conn.execute("UPDATE kept SET v = 'default' WHERE id <= 10")
        conn.execute("ALTER TABLE kept REPLICA IDENTITY FULL")
        conn.execute("UPDATE kept SET id = id + 100, v = 'full' WHERE id BETWEEN 5 AND 15")
        conn.execute("DELETE FROM kept WHERE id BETWEEN 20 AND 24")
    progress = pipeline.run(until_caught_up=True, handle_signals=False)
    assert progress.rows_applied > 100
    _assert_equal(pipeline, pg.dsn)
    assert _recorded_key(pipeline, "kept") == "id"
    remaining = pg.execute("SELECT count(*) FROM ri")[0][0]
    assert spark.table(pipeline.mirrors.identifier_for("public", "ri")).count() == remaining


IDENTITY_SCHEMA = """
CREATE TABLE a (id int PRIMARY KEY, code text NOT NULL, v text);
CREATE UNIQUE INDEX a_code_key ON a (code);
INSERT INTO a SELECT i, 'c' || i, 'v' || i FROM generate_series(1, 100) i;
CREATE TABLE b (id int PRIMARY KEY, v text);
INSERT INTO b SELECT i, 'v' || i FROM generate_series(1, 50) i;
CREATE PUBLICATION pub FOR TABLE a, b;
"""


def _change_identity_while_b_streams(conn) -> None:
    conn.execute("UPDATE a SET v = 'before' WHERE id <= 10")
    conn.execute("DELETE FROM a WHERE id = 11")
    conn.execute("UPDATE b SET v = 'b before' WHERE id <= 5")
    conn.execute("ALTER TABLE a REPLICA IDENTITY USING INDEX a_code_key")  # the next Relation message says so
    conn.execute("UPDATE a SET id = id + 1000 WHERE id BETWEEN 30 AND 39")  # updates that change id
    conn.execute("DELETE FROM a WHERE code IN ('c20', 'c21', 'c22')")  # deletes carry only the code
    conn.execute("UPDATE b SET v = 'b after' WHERE id > 45")


def test_a_replica_identity_changed_while_streaming_keys_that_one_mirror_again(pg, spark):
    """The table whose identity changed is copied again at a fresh consistent point, keyed on its new identity,
    with no operator action, while the other table goes on streaming; later changes by the new key apply."""
    pg.execute(IDENTITY_SCHEMA)
    config = pipeline_config(pg, spark, publication="pub")
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    b_position = namespace_positions(pipeline.mirrors)[("public", "b")]
    with pg.connect() as conn:
        _change_identity_while_b_streams(conn)
    pipeline.run(until_caught_up=True, handle_signals=False)
    assert _recorded_key(pipeline, "a") == "code" and _recorded_key(pipeline, "b") == "id"
    assert namespace_positions(pipeline.mirrors)[("public", "b")] > b_position  # b streamed on, it was not copied
    _assert_equal(pipeline, pg.dsn)
    with pg.connect() as conn:
        conn.execute("UPDATE a SET id = id + 2000, v = 'again' WHERE id BETWEEN 40 AND 49")
        conn.execute("DELETE FROM a WHERE code = 'c50'")
    restarted = Pipeline(config, spark=spark)
    restarted.run(until_caught_up=True, handle_signals=False)
    _assert_equal(restarted, pg.dsn)


def test_on_identity_change_stop_refuses_without_applying_and_exits_1(pg, spark):
    pg.execute(IDENTITY_SCHEMA)
    config = pipeline_config(pg, spark, publication="pub", on_identity_change="stop")
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    copied_at = namespace_positions(pipeline.mirrors)[("public", "a")]
    with pg.connect() as conn:
        _change_identity_while_b_streams(conn)
    refused = (r"public\.a: its replica identity now identifies rows by \(code\), but its mirror is keyed on "
               r"\(id\).*--on-identity-change copy")
    with pytest.raises(IdentityChangedError, match=refused):
        pipeline.run(until_caught_up=True, handle_signals=False)
    # refused before the batch touched a mirror: nothing after the change was applied by the old key
    assert namespace_positions(pipeline.mirrors)[("public", "a")] == copied_at
    assert spark.table(pipeline.mirrors.identifier_for("public", "a")).where("id > 1000").count() == 0
    from pgcdc.cli import _explain

    assert _explain(IdentityChangedError("x"))[1] == 1  # a runtime stop, not bad usage (2)
    # the way out the error names
    Pipeline(dataclasses.replace(config, on_identity_change="copy"), spark=spark).run(
        until_caught_up=True, handle_signals=False)
    _assert_equal(pipeline, pg.dsn)


def test_an_insert_only_table_without_replica_identity_is_mirrored_append_only_then_keyed(pg, spark, caplog):
    """pgbench_history's shape: no primary key, REPLICA IDENTITY DEFAULT, insert-only. PostgreSQL publishes it
    and refuses only UPDATE and DELETE on it: mirrored append-only with a warning; once it gets a key, its
    mirror is keyed again by itself."""
    pg.execute("""
        CREATE TABLE history (tid int, bid int, aid int NOT NULL, delta int, mtime timestamp, filler char(22));
        INSERT INTO history SELECT i % 10, i % 3, i, i * 2, '2024-01-01', NULL FROM generate_series(1, 200) i;
        INSERT INTO history SELECT 1, 1, 7, 14, '2024-01-01', NULL;  -- the same row twice: no key, kept twice
        CREATE TABLE accounts (aid int PRIMARY KEY, abalance int);
        INSERT INTO accounts SELECT i, 0 FROM generate_series(1, 20) i;
        CREATE PUBLICATION pub FOR TABLE history, accounts;
    """)
    config = pipeline_config(pg, spark, publication="pub")
    pipeline = Pipeline(config, spark=spark)
    with caplog.at_level("WARNING", logger="pgcdc"):
        pipeline.run(until_caught_up=True, handle_signals=False)
    assert any("history" in r.getMessage() and "append-only" in r.getMessage() for r in caplog.records)
    with pg.connect() as conn:
        conn.execute("INSERT INTO history SELECT 2, 2, i, -i, '2024-02-01', 'x' FROM generate_series(201, 300) i")
        conn.execute("UPDATE accounts SET abalance = abalance + 5 WHERE aid <= 10")
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):  # what PostgreSQL itself refuses
            conn.execute("DELETE FROM history WHERE aid = 1")
    pipeline.run(until_caught_up=True, handle_signals=False)
    _assert_equal(pipeline, pg.dsn)
    assert _recorded_key(pipeline, "history") == ""

    with pg.connect() as conn:  # a key later: the mirror is keyed on it, and updates and deletes apply
        conn.execute("ALTER TABLE history REPLICA IDENTITY FULL")
        conn.execute("DELETE FROM history WHERE ctid = (SELECT max(ctid) FROM history WHERE aid = 7)")
        conn.execute("ALTER TABLE history ADD PRIMARY KEY (aid)")
        conn.execute("UPDATE history SET delta = 0 WHERE aid <= 50")
        conn.execute("DELETE FROM history WHERE aid > 280")
    pipeline.run(until_caught_up=True, handle_signals=False)
    _assert_equal(pipeline, pg.dsn)
    assert _recorded_key(pipeline, "history") == "aid"


@pytest.mark.parametrize("writer", ["delta", "merge"])
def test_keys_of_types_iceberg_cannot_take_as_identifier_fields_still_key_the_mirror(pg, spark, writer):
    """Floating-point, interval and array keys are valid PostgreSQL keys that Iceberg refuses as identifier
    fields: the mirror is keyed on them all the same (NaN, -0 and infinity among them)."""
    pg.execute("""
        CREATE TABLE by_float (k float8 PRIMARY KEY, v int);
        CREATE TABLE by_interval (k interval PRIMARY KEY, v int);
        CREATE TABLE by_array (k int[], n real, v int, PRIMARY KEY (k, n));
        INSERT INTO by_float VALUES ('NaN', 1), ('-0', 2), (1.5, 3), ('Infinity', 4), (2.5, 5);
        INSERT INTO by_interval VALUES ('1 day', 1), ('-1 mon 2 us', 2), ('infinity', 3);
        INSERT INTO by_array VALUES ('{1,2}', 0.5, 1), ('{}', 'NaN', 2), ('{NULL,3}', 1, 3);
        CREATE PUBLICATION pub FOR TABLE by_float, by_interval, by_array;
    """)
    pipeline = Pipeline(pipeline_config(pg, spark, publication="pub", apply_writer=writer), spark=spark)
    pipeline.snapshot()
    pg.execute("""
        UPDATE by_float SET v = 20 WHERE k = 'NaN';
        UPDATE by_float SET k = 3.5 WHERE k = 2.5;
        DELETE FROM by_float WHERE k = 0;
        INSERT INTO by_float VALUES ('-Infinity', 6);
        UPDATE by_interval SET v = -v WHERE k = 'infinity';
        UPDATE by_interval SET k = '2 days' WHERE k = '1 day';
        DELETE FROM by_interval WHERE v = 2;
        UPDATE by_array SET v = 30 WHERE k = '{NULL,3}';
        UPDATE by_array SET k = '{9}' WHERE n = 'NaN';
        DELETE FROM by_array WHERE k = '{1,2}';
    """)
    pipeline.run(until_caught_up=True, handle_signals=False)
    _assert_equal(pipeline, pg.dsn)
    for table, rows in (("by_float", 5), ("by_interval", 2), ("by_array", 2)):
        assert spark.table(pipeline.mirrors.identifier_for("public", table)).count() == rows


@pytest.mark.parametrize("writer", ["delta", "merge"])
def test_deleting_one_of_identical_rows_of_a_keyless_table_deletes_that_one_alone(pg, spark, writer):
    """Without a key, REPLICA IDENTITY FULL matches rows on every column, and a table may hold the same row
    several times: a DELETE or UPDATE of one of them leaves the others, in the mirror as in the table."""
    pg.execute("""
        CREATE TABLE log (kind text, n int, note text);
        ALTER TABLE log REPLICA IDENTITY FULL;
        INSERT INTO log SELECT 'a', 1, NULL FROM generate_series(1, 5);
        INSERT INTO log SELECT 'b', 2, 'x' FROM generate_series(1, 3);
        CREATE PUBLICATION pub FOR TABLE log;
    """)
    pipeline = Pipeline(pipeline_config(pg, spark, publication="pub", apply_writer=writer), spark=spark)
    pipeline.snapshot()
    one = "ctid = (SELECT min(ctid) FROM log WHERE kind = {!r} AND n = {})"
    with pg.connect() as conn:
        conn.execute(f"DELETE FROM log WHERE {one.format('a', 1)}")
        conn.execute(f"DELETE FROM log WHERE {one.format('a', 1)}")
        conn.execute(f"UPDATE log SET n = 3 WHERE {one.format('b', 2)}")
        conn.execute("BEGIN; INSERT INTO log VALUES ('b', 2, 'x'), ('c', 0, NULL); "
                     f"DELETE FROM log WHERE {one.format('b', 2)}; COMMIT")
    pipeline.run(until_caught_up=True, handle_signals=False)
    _assert_equal(pipeline, pg.dsn)
    with pg.connect() as conn:  # every copy of a row, in a later batch: the mirror holds none of it either
        conn.execute("DELETE FROM log WHERE kind = 'a'")
        conn.execute(f"DELETE FROM log WHERE {one.format('b', 2)}")
    pipeline.run(until_caught_up=True, handle_signals=False)
    _assert_equal(pipeline, pg.dsn)
    rows = pipeline.spark.sql(f"SELECT kind, n, count(*) FROM {pipeline.mirrors.identifier_for('public', 'log')} "
                              "GROUP BY kind, n ORDER BY kind, n").collect()
    assert [tuple(r) for r in rows] == [("b", 2, 1), ("b", 3, 1), ("c", 0, 1)]
