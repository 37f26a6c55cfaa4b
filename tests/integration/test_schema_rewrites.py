"""Schema changes that change a table's existing values without logical decoding sending them.

``ALTER COLUMN ... TYPE`` rewrites every row through the cast (or its ``USING`` expression), and a table
dropped and created again under its name holds other rows; the stream carries none of those values, only the
new Relation message. pgcdc tells them by the source shape each mirror records (relation OID, column types)
and copies such a table again; a change that keeps every value (a wider integer, a longer varchar) only
evolves the mirror in place."""

from __future__ import annotations

import pytest

from pgcdc.pipeline import Pipeline
from pipeline_support import assert_mirrors_equal, catch_up_in_process, pipeline_config, run_cli

pytestmark = pytest.mark.slow

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, code char(3), price numeric(10, 2), qty int, at timestamp,
                    name varchar(10));
INSERT INTO items SELECT g, 'c' || (g % 10), g * 1.25, g, '2024-01-01 10:00:00.4'::timestamp + g * interval '1.3 s',
                         'n' || g
FROM generate_series(1, 40) g;
CREATE TABLE other (id int PRIMARY KEY, v int);
INSERT INTO other SELECT g, g FROM generate_series(1, 10) g;
CREATE PUBLICATION shop FOR TABLE items, other;
"""


def catch_up(config, spark) -> Pipeline:
    return catch_up_in_process(config, spark)


def assert_equal(pipeline: Pipeline, pg) -> None:
    assert_mirrors_equal(pipeline.config, pipeline.spark, pg.dsn)


def copied_again(pipeline: Pipeline) -> dict[str, str]:
    """The tables a run copied again while streaming, each with the kind of its reason
    (pgcdc.pipeline.copy_reasons.Why)."""
    return {table: why for table, why, _ in pipeline.progress.copies_again}


@pytest.mark.parametrize("change", [
    "ALTER TABLE items ALTER COLUMN code TYPE char(6)",  # pads every value
    "ALTER TABLE items ALTER COLUMN at TYPE timestamp(0)",  # rounds every value
    "ALTER TABLE items ALTER COLUMN qty TYPE text USING 'q' || qty",  # int to text through an expression
    "ALTER TABLE items ALTER COLUMN price TYPE numeric(10, 1)",  # rounds; the mirror's decimal cannot narrow
    "ALTER TABLE items ALTER COLUMN id TYPE bigint USING id + 1000",  # the key itself, rewritten
    "ALTER TABLE items ALTER COLUMN name TYPE varchar(20) USING upper(name)",  # a widening, and an expression
    "ALTER TABLE items ALTER COLUMN qty TYPE bigint",  # values kept, but a rewrite: a USING could have changed them
], ids=["char-padded", "timestamp-rounded", "using-expression", "numeric-rounded", "key-rewritten",
        "widened-through-expression", "widened-by-rewrite"])
def test_a_column_type_change_that_rewrites_values_copies_the_table_again(pg, spark, change):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop", binary=True)
    catch_up(config, spark)
    pg.execute(f"""
        UPDATE items SET qty = qty + 1 WHERE id = 1;  -- before the change, in the same batch
        {change};
        INSERT INTO items (id, code, price, qty, at) VALUES (5000, 'new', 9.99, 1, '2025-05-05 05:05:05.55');
        UPDATE items SET name = 'changed' WHERE id = 3;
        DELETE FROM items WHERE id = 4;
        UPDATE other SET v = -v WHERE id = 1;
    """)
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {"public.items": "REWRITTEN_TYPE"}
    # the mirror is whole again: later changes apply to it as to any other
    pg.execute("UPDATE items SET name = 'later' WHERE id = 5; DELETE FROM items WHERE id = 6")
    assert_equal(catch_up(config, spark), pg)


@pytest.mark.parametrize("change", [  # changes PostgreSQL makes without rewriting the table
    "ALTER TABLE items ALTER COLUMN name TYPE varchar(20)",
    "ALTER TABLE items ALTER COLUMN name TYPE text",
    "ALTER TABLE items ALTER COLUMN price TYPE numeric(14, 2)",
    "ALTER TABLE items ALTER COLUMN name TYPE varchar(20) USING name::varchar(20)",  # a cast that is no rewrite
], ids=["varchar-longer", "varchar-to-text", "numeric-wider", "using-plain-cast"])
def test_a_type_change_that_keeps_every_value_evolves_the_mirror_in_place(pg, spark, change):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute(f"""
        {change};
        INSERT INTO items (id, code, price, qty, name) VALUES (5000, 'new', 9.99, 1, 'n5000');
        UPDATE items SET qty = -qty WHERE id = 3;
    """)
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {}


@pytest.mark.parametrize("publication", ["FOR TABLE items, other", "FOR ALL TABLES"])
def test_a_table_dropped_and_created_again_under_its_name_is_copied_again(pg, spark, publication):
    pg.execute(SCHEMA.replace("FOR TABLE items, other", publication))
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("""
        DELETE FROM items WHERE id = 1;
        DROP TABLE items;
        CREATE TABLE items (id int PRIMARY KEY, code char(3), price numeric(10, 2), qty int, at timestamp,
                            name varchar(10));
        INSERT INTO items (id, name) SELECT g, 'again ' || g FROM generate_series(30, 35) g;
    """)
    if publication != "FOR ALL TABLES":  # the dropped table left the publication with it
        pg.execute("ALTER PUBLICATION shop ADD TABLE items")
    pg.execute("INSERT INTO items (id, name) VALUES (36, 'after'); UPDATE items SET qty = 1 WHERE id = 30")
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {"public.items": "RECREATED"}
    mirror = pipeline.mirrors.identifier_for("public", "items")
    assert sorted(r.id for r in spark.sql(f"SELECT id FROM {mirror}").collect()) == list(range(30, 37))


@pytest.mark.parametrize("change", [
    "ALTER TABLE items DROP COLUMN name; ALTER TABLE items ADD COLUMN name varchar(10)",  # the last column
    "ALTER TABLE items DROP COLUMN qty; ALTER TABLE items ADD COLUMN qty int DEFAULT 7",  # moved to the end
], ids=["same-place", "moved"])
def test_a_column_dropped_and_added_again_under_its_name_is_copied_again(pg, spark, change):
    """The existing rows hold NULL (or the new default) in the new column, which the stream never sends."""
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute(f"{change}; UPDATE items SET price = 0 WHERE id = 2; INSERT INTO items (id) VALUES (900)")
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {"public.items": "READDED_COLUMNS"}
    pg.execute("UPDATE items SET price = 1 WHERE id = 3")  # a later change: no copy
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {}


def test_a_column_added_while_streaming_is_known_by_its_number_from_then_on(pg, spark):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("ALTER TABLE items ADD COLUMN extra text; UPDATE items SET extra = 'e' WHERE id = 1")
    catch_up(config, spark)
    pg.execute("ALTER TABLE items DROP COLUMN extra; ALTER TABLE items ADD COLUMN extra text; "
               "UPDATE items SET price = 2 WHERE id = 2")
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {"public.items": "READDED_COLUMNS"}


@pytest.mark.parametrize("change", [
    "ALTER TABLE items ALTER COLUMN code TYPE char(6)",  # the mirror evolves in place, then is copied
    "ALTER TABLE items ALTER COLUMN price TYPE numeric(10, 1)",  # the mirror is made again, then copied
], ids=["evolved", "made-again"])
def test_killed_while_copying_after_a_type_change_copies_at_the_next_run(pg, spark, change):
    """The new source shape is recorded only with the copy that holds its values: a run killed before leaves
    the mirror asking for the copy again."""
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute(f"{change}; UPDATE items SET name = 'changed' WHERE id = 3")
    process = run_cli(config, "--until-caught-up", env={"PGCDC_INJECT": "snapshot.copy:1"})
    output, _ = process.communicate(timeout=300)
    assert process.returncode == -9, output[-3000:]  # killed at the instant aimed at
    assert_equal(catch_up(config, spark), pg)


def test_a_replay_after_a_crash_does_not_take_the_older_table_shape_for_a_change(pg, spark):
    """Killed after applying a batch that spans a type change, the next run reads that batch again: its
    changes under the older shape are held by the mirror already, and do not make the table look changed."""
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("UPDATE items SET price = 1 WHERE id = 1")
    pg.execute("ALTER TABLE items ALTER COLUMN price TYPE numeric(14, 2); UPDATE items SET price = 2 WHERE id = 2")
    process = run_cli(config, "--until-caught-up", env={"PGCDC_INJECT": "apply.before-confirm:1"})
    output, _ = process.communicate(timeout=300)
    assert process.returncode == -9, output[-3000:]
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {}


def test_a_table_swapped_in_under_its_name_is_copied_again(pg, spark):
    """A blue/green swap by renames (t to t_old, t_new to t) under FOR ALL TABLES: the mirror of t holds the
    new table's rows, and t_old gets a mirror of its own."""
    pg.execute(SCHEMA.replace("FOR TABLE items, other", "FOR ALL TABLES"))
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("""
        CREATE TABLE items_new (LIKE items INCLUDING ALL);
        INSERT INTO items_new (id, name) SELECT g, 'new ' || g FROM generate_series(100, 104) g;
        BEGIN;
        ALTER TABLE items RENAME TO items_old;
        ALTER TABLE items_new RENAME TO items;
        COMMIT;
        UPDATE items SET qty = 1 WHERE id = 100;
        UPDATE items_old SET qty = -1 WHERE id = 1;
    """)
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert "public.items" in copied_again(pipeline)


def test_type_changes_that_change_how_values_print_copy_the_tables_using_them(pg, spark):
    """Enums and composites are mirrored as PostgreSQL prints them: ALTER TYPE ... RENAME VALUE and ADD
    ATTRIBUTE change that text with no row change decoded. ADD VALUE changes no existing value."""
    pg.execute("""
        CREATE TYPE mood AS ENUM ('a', 'b');
        CREATE TYPE pair AS (n int, s text);
        CREATE DOMAIN moods AS mood[];
        CREATE TABLE feelings (id int PRIMARY KEY, m mood, ms moods);
        CREATE TABLE pairs (id int PRIMARY KEY, p pair);
        INSERT INTO feelings VALUES (1, 'a', '{a,b}'), (2, 'b', '{b}');
        INSERT INTO pairs VALUES (1, '(1,x)'), (2, NULL);
        CREATE PUBLICATION shop FOR TABLE feelings, pairs;
    """)
    config = pipeline_config(pg, spark, publication="shop")
    catch_up(config, spark)
    pg.execute("ALTER TYPE mood ADD VALUE 'c'")
    pg.execute("INSERT INTO feelings VALUES (3, 'c', '{c}'); INSERT INTO pairs VALUES (3, '(3,z)')")
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {}
    pg.execute("""
        ALTER TYPE mood RENAME VALUE 'b' TO 'bee';
        ALTER TYPE pair ADD ATTRIBUTE extra int;
        INSERT INTO feelings VALUES (4, 'a', NULL);
        INSERT INTO pairs VALUES (4, '(4,w,4)');
    """)
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    assert copied_again(pipeline) == {"public.feelings": "REPRINTED", "public.pairs": "REPRINTED"}


def test_the_change_log_keeps_a_column_whose_type_changed_beside_its_new_type(pg, spark):
    """A change log's row images cannot change a column's type in place either (int to text): the older
    values stay under ``<column>__<old type>``, and the column goes on with its new type."""
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop", changelog=True)
    catch_up(config, spark)
    pg.execute("UPDATE items SET qty = 5 WHERE id = 1")
    catch_up(config, spark)
    pg.execute("ALTER TABLE items ALTER COLUMN qty TYPE text USING 'q' || qty; UPDATE items SET qty = 'z' WHERE id = 2")
    pipeline = catch_up(config, spark)
    assert_equal(pipeline, pg)
    changes = pipeline.mirrors.changelog_identifier_for("public", "items")
    rows = spark.sql(f"SELECT op, after.qty__int AS older, after.qty AS newer FROM {changes} "
                     "ORDER BY commit_lsn_value").collect()
    assert [tuple(r) for r in rows] == [("U", 5, None), ("U", None, "z")]
