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
