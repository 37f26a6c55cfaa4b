"""The mirror's key is what the server sends as a row's identity, and a change of identity is never applied
with the wrong key: a real server, the session's Spark, every row compared."""

from __future__ import annotations

import dataclasses

import pytest

from pgcdc.errors import ConfigError
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


def test_a_replica_identity_changed_while_streaming_is_refused_until_the_table_is_copied_again(pg, spark):
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, code text NOT NULL, v text)")
    pg.execute("CREATE UNIQUE INDEX t_code ON t (code)")
    pg.execute("INSERT INTO t SELECT i, 'c' || i, 'v' || i FROM generate_series(1, 100) i")
    pg.execute("CREATE PUBLICATION pub FOR TABLE t")
    config = pipeline_config(pg, spark, publication="pub")
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    with pg.connect() as conn:
        conn.execute("UPDATE t SET v = 'before' WHERE id <= 10")
        conn.execute("DELETE FROM t WHERE id = 11")
        conn.execute("ALTER TABLE t REPLICA IDENTITY USING INDEX t_code")  # the next Relation message says so
        conn.execute("DELETE FROM t WHERE id BETWEEN 20 AND 29")
        conn.execute("UPDATE t SET id = id + 1000 WHERE id BETWEEN 30 AND 39")
    refused = r"public\.t: its mirror .* is keyed on \(id\).* now identifies rows by \(code\).*pgcdc run --resnapshot"
    # the stream meets the new Relation message after changes under the old identity: refused, never applied
    with pytest.raises(ConfigError, match=refused):
        pipeline.run(until_caught_up=True, handle_signals=False)
    position = pipeline.mirrors.positions()[("public", "t")]
    identifier = pipeline.mirrors.identifier_for("public", "t")
    assert spark.table(identifier).where("v = 'before'").count() == 10  # what came before the change is in
    assert spark.table(identifier).where("id BETWEEN 20 AND 29").count() == 10  # nothing after it

    # a restart meets the mirror's recorded key: refused too, and the mirror stays where it was
    restarted = Pipeline(config, spark=spark)
    with pytest.raises(ConfigError, match=refused):
        restarted.run(until_caught_up=True, handle_signals=False)
    assert restarted.mirrors.positions()[("public", "t")] == position

    # the way out the error names: copied again, keyed on the new identity, and streamed on
    again = Pipeline(dataclasses.replace(config, resnapshot=True), spark=spark)
    again.run(until_caught_up=True, handle_signals=False)
    assert _recorded_key(again, "t") == "code"
    with pg.connect() as conn:
        conn.execute("DELETE FROM t WHERE id BETWEEN 40 AND 49")
        conn.execute("UPDATE t SET id = id + 1000 WHERE id BETWEEN 50 AND 59")
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    _assert_equal(again, pg.dsn)


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
