"""ALTER TABLE ... ADD COLUMN with a default: the rows that existed get in the mirror what PostgreSQL gives them.

A non-volatile default is recorded in the catalog (``pg_attribute.attmissingval``) and never written into
the existing rows, so logical decoding never sends it: pgcdc fills it in. A volatile default rewrites the
table, whose new values logical decoding does not send either: pgcdc copies that table again."""

from __future__ import annotations

import pytest

from pgcdc.pipeline import Pipeline
from pgcdc.replication.published import _single_element
from pgcdc.verify import compare_publication
from pipeline_support import pipeline_config, run_cli

pytestmark = pytest.mark.slow

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, name text);
INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 50) g;
CREATE TABLE other (id int PRIMARY KEY, v int);
INSERT INTO other SELECT g, g FROM generate_series(1, 10) g;
CREATE PUBLICATION shop FOR TABLE items, other;
"""


def catch_up(config, spark) -> Pipeline:
    pipeline = Pipeline(config, spark=spark)
    pipeline.run(until_caught_up=True, handle_signals=False)
    return pipeline


def assert_equal(pipeline: Pipeline, pg) -> None:
    spark = pipeline.spark
    spark.catalog.clearCache()
    for result in compare_publication(pipeline, pg.dsn, "shop"):
        assert result.equal, result.describe()


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_existing_rows_get_a_non_volatile_default(pg, spark, binary):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop", binary=binary)
    catch_up(config, spark)
    pg.execute("""
        ALTER TABLE items ADD COLUMN qty int DEFAULT 42,
                          ADD COLUMN label text NOT NULL DEFAULT 'a "quoted", {braced} \\ label',
                          ADD COLUMN days date[] DEFAULT '{2020-02-29,NULL}',
                          ADD COLUMN since timestamptz DEFAULT '2001-02-03 04:05:06+07',
                          ADD COLUMN plain text;
        ALTER TABLE items ALTER COLUMN qty SET DEFAULT 7;  -- the existing rows keep 42
        INSERT INTO items (id, name, qty) VALUES (100, 'new', NULL);
        INSERT INTO items (id, name) VALUES (101, 'newer');
        UPDATE items SET name = 'changed' WHERE id = 3;
        UPDATE other SET v = -v WHERE id = 1;
    """)
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    mirror = pipeline.mirrors.identifier_for("public", "items")
    rows = {r.id: r for r in spark.sql(f"SELECT id, qty, label FROM {mirror}").collect()}
    assert rows[1].qty == 42 and rows[3].qty == 42 and rows[100].qty is None and rows[101].qty == 7
    assert rows[2].label == 'a "quoted", {braced} \\ label'
    # a second run finds nothing left to fill, and the mirror stays equal
    assert_equal(catch_up(config, spark), pg)


def test_a_volatile_default_copies_the_table_again(pg, spark):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("""
        UPDATE items SET name = 'before' WHERE id = 1;
        ALTER TABLE items ADD COLUMN token double precision DEFAULT random();
        UPDATE items SET name = 'after' WHERE id = 2;
        DELETE FROM items WHERE id = 4;
        UPDATE other SET v = 0 WHERE id = 2;
    """)
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    mirror = pipeline.mirrors.identifier_for("public", "items")
    assert spark.sql(f"SELECT count(*) AS n FROM {mirror} WHERE token IS NULL").collect()[0].n == 0


def test_a_renamed_column_keeps_its_values(pg, spark):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("ALTER TABLE items RENAME COLUMN name TO title; UPDATE items SET title = 'renamed' WHERE id = 1;")
    assert_equal(catch_up(config, spark), pg)


def test_killed_between_adding_the_columns_and_filling_them_fills_at_the_next_run(pg, spark):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("ALTER TABLE items ADD COLUMN qty int DEFAULT 42; INSERT INTO items VALUES (100, 'new', 1);")
    process = run_cli(config, "--until-caught-up", env={"PGCDC_INJECT": "apply.fill:1"})
    output, _ = process.communicate(timeout=300)
    assert process.returncode == -9, output[-3000:]  # killed at the instant aimed at
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)


@pytest.mark.parametrize(("stored", "value"), [
    ("{42}", "42"), ("{NULL}", None), ('{"a \\"quoted\\", {braced} \\\\ label"}', 'a "quoted", {braced} \\ label'),
    ('{"{2020-02-29,NULL}"}', "{2020-02-29,NULL}"), ('{""}', ""), ('{"NULL"}', "NULL"),
])
def test_the_catalog_missing_value_is_read_whole(stored, value):
    assert _single_element(stored) == value


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_a_default_is_read_exactly_whatever_the_servers_own_output_settings(pg, spark, binary):
    """The catalog's text of a default is read with the stream's settings, not the database's: floats with
    every digit, intervals and time zones as the stream prints them."""
    pg.execute(SCHEMA)
    pg.execute(f"ALTER DATABASE {pg.name} SET extra_float_digits = 0")
    pg.execute(f"ALTER DATABASE {pg.name} SET TimeZone = 'Asia/Kathmandu'")
    pg.execute(f"ALTER DATABASE {pg.name} SET IntervalStyle = 'postgres'")
    pg.execute(f"ALTER DATABASE {pg.name} SET DateStyle = 'SQL, DMY'")
    config = pipeline_config(pg, spark, publication="shop", binary=binary)
    catch_up(config, spark)
    pg.execute("""
        ALTER TABLE items ADD COLUMN third float8 DEFAULT 1 / 3.0,
                          ADD COLUMN took interval DEFAULT '1 day 02:03:04.5',
                          ADD COLUMN since timestamptz DEFAULT '2001-02-03 04:05:06+07',
                          ADD COLUMN spans tstzrange DEFAULT '[2020-01-01 00:00+00,2020-02-01 00:00+00)';
        INSERT INTO items (id, name) VALUES (100, 'new');
    """)
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    mirror = pipeline.mirrors.identifier_for("public", "items")
    thirds = {r.third for r in spark.sql(f"SELECT third FROM {mirror}").collect()}
    assert thirds == {1 / 3}


def test_names_and_defaults_that_mention_secrets_are_read_back_whole(pg, spark):
    """Spark redacts table properties whose value mentions a secret, a password or a token; the key and the
    default pgcdc records in the mirror's properties are read from Iceberg itself."""
    pg.execute("""
        CREATE TABLE tokens (api_token text PRIMARY KEY, password text);
        INSERT INTO tokens VALUES ('t1', 'p1'), ('t2', 'p2');
        CREATE PUBLICATION shop FOR TABLE tokens;
    """)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("ALTER TABLE tokens ADD COLUMN note text DEFAULT 'the secret token is hunter2'; "
               "UPDATE tokens SET password = 'p3' WHERE api_token = 't2'")
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    pg.execute("INSERT INTO tokens VALUES ('t3', 'p', 'n')")
    assert_equal(catch_up(config, spark), pg)
