"""A mirror holds what its publication publishes, from the initial copy on: only the rows its row filter keeps
(rows moved out of the filter later are removed, rows moved in are added), only the columns of its column list,
and the generated columns it publishes. A real server, the session's Spark, every row compared."""

from __future__ import annotations

import json
import logging

import pytest

from cli_support import run_pgcdc
from pgcdc.mirrors.status import namespace_positions
from pgcdc.pipeline import Pipeline
from pipeline_support import assert_mirrors_equal, catalog_arguments, pipeline_config

pytestmark = pytest.mark.slow

SCHEMA = """
CREATE TABLE by_key (id int PRIMARY KEY, v text);
CREATE TABLE by_region (id int, region text, amount int);
ALTER TABLE by_region REPLICA IDENTITY FULL;
CREATE TABLE some_columns (id int PRIMARY KEY, a int, doubled int GENERATED ALWAYS AS (a * 2) STORED,
                           hidden text);
CREATE TABLE generated (id int PRIMARY KEY, a int, tripled int GENERATED ALWAYS AS (a * 3) STORED);
INSERT INTO by_key SELECT i, 'v' || i FROM generate_series(1, 40) i;
INSERT INTO by_region SELECT i, CASE WHEN i % 3 = 0 THEN 'eu' ELSE 'us' END, i FROM generate_series(1, 40) i;
INSERT INTO some_columns (id, a, hidden) SELECT i, i, 'secret ' || i FROM generate_series(1, 20) i;
INSERT INTO generated (id, a) SELECT i, i FROM generate_series(1, 20) i;
CREATE PUBLICATION shapes FOR TABLE by_key WHERE (id % 2 = 0), by_region WHERE (region = 'eu'),
                               some_columns (id, a, doubled);
CREATE PUBLICATION generated_too FOR TABLE generated WITH (publish_generated_columns = stored);
"""
CHANGES = """
INSERT INTO by_key SELECT i, 'new ' || i FROM generate_series(41, 50) i;
UPDATE by_key SET id = id + 1001 WHERE id BETWEEN 2 AND 10 AND id % 2 = 0;  -- even to odd: out of the filter
UPDATE by_key SET id = id + 1001 WHERE id BETWEEN 11 AND 19 AND id % 2 = 1; -- odd to even: into it
UPDATE by_key SET v = 'changed' WHERE id > 20;
DELETE FROM by_key WHERE id BETWEEN 30 AND 35;
UPDATE by_region SET region = 'us' WHERE id IN (3, 6, 9);    -- out of the filter
UPDATE by_region SET region = 'eu' WHERE id IN (1, 2, 4);    -- into it
UPDATE by_region SET amount = -amount WHERE region = 'eu';
DELETE FROM by_region WHERE id IN (12, 13);
INSERT INTO by_region VALUES (100, 'eu', 100), (101, 'us', 101);
UPDATE some_columns SET a = a + 100, hidden = 'changed' WHERE id <= 5;
DELETE FROM some_columns WHERE id = 20;
UPDATE generated SET a = -a WHERE id <= 5;
"""


def mirror_rows(spark, pipeline: Pipeline, table: str) -> list[tuple]:
    identifier = pipeline.mirrors.identifier_for("public", table)
    return sorted(tuple(row) for row in spark.table(identifier).collect())


def test_row_filters_column_lists_and_generated_columns_hold_from_the_copy_on(pg, spark):
    pg.server.require(18, "generated columns in publications")
    pg.execute(SCHEMA)
    shapes = pipeline_config(pg, spark, publication="shapes", slot="shapes")
    generated = pipeline_config(pg, spark, publication="generated_too", slot="generated_too")
    pipelines = [Pipeline(shapes, spark=spark), Pipeline(generated, spark=spark)]
    for pipeline in pipelines:
        pipeline.snapshot()

    def expect_what_the_publications_publish() -> None:
        shaped, whole = pipelines
        assert mirror_rows(spark, shaped, "by_key") == sorted(
            pg.execute("SELECT id, v FROM by_key WHERE id % 2 = 0"))
        assert mirror_rows(spark, shaped, "by_region") == sorted(
            pg.execute("SELECT id, region, amount FROM by_region WHERE region = 'eu'"))
        assert mirror_rows(spark, shaped, "some_columns") == sorted(
            pg.execute("SELECT id, a, a * 2 FROM some_columns"))
        assert mirror_rows(spark, whole, "generated") == sorted(pg.execute("SELECT id, a, a * 3 FROM generated"))
        assert_mirrors_equal(shapes, spark, pg.dsn, {"public.by_key", "public.by_region", "public.some_columns"})
        assert_mirrors_equal(generated, spark, pg.dsn, {"public.generated"})

    expect_what_the_publications_publish()
    pg.execute(CHANGES)
    for pipeline in pipelines:
        pipeline.run(until_caught_up=True, handle_signals=False)
    spark.catalog.clearCache()
    expect_what_the_publications_publish()


FAMILIES = """
CREATE TABLE parent (id int PRIMARY KEY, v text);
CREATE TABLE child (extra int) INHERITS (parent);
ALTER TABLE child ADD PRIMARY KEY (id);
CREATE TABLE events (id int, k int, v text, PRIMARY KEY (id, k)) PARTITION BY RANGE (k);
CREATE TABLE events_low PARTITION OF events FOR VALUES FROM (0) TO (10);
CREATE TABLE events_high PARTITION OF events FOR VALUES FROM (10) TO (20) PARTITION BY HASH (id);
CREATE TABLE events_high_0 PARTITION OF events_high FOR VALUES WITH (MODULUS 2, REMAINDER 0);
CREATE TABLE events_high_1 PARTITION OF events_high FOR VALUES WITH (MODULUS 2, REMAINDER 1);
INSERT INTO parent SELECT i, 'parent ' || i FROM generate_series(1, 300) i;
INSERT INTO child SELECT i, 'child ' || i, i FROM generate_series(1001, 1300) i;
INSERT INTO events SELECT i, i % 20, 'event ' || i FROM generate_series(1, 900) i;
ANALYZE parent, child, events_low, events_high_0, events_high_1;
CREATE PUBLICATION families FOR TABLE parent, events WITH (publish_via_partition_root);
"""
FAMILY_CHANGES = """
INSERT INTO parent VALUES (400, 'parent new');
INSERT INTO child VALUES (1400, 'child new', 1);
UPDATE parent SET v = v || ' changed' WHERE id % 10 = 0;   -- the children's rows too
DELETE FROM parent WHERE id % 7 = 0;
UPDATE events SET k = 19 - k WHERE id % 5 = 0;             -- rows move between partitions
DELETE FROM events WHERE id % 11 = 0;
INSERT INTO events SELECT i, i % 20, 'late ' || i FROM generate_series(901, 950) i;
"""


def test_inheritance_children_and_partition_trees_are_each_mirrored_once(pg, spark):
    """A publication of an inheritance parent publishes its children as tables of their own: the parent's
    mirror holds the parent's own rows alone. A partitioned table published through its root is copied leaf
    by leaf (many ranges) into the root's one mirror, and rows moving between partitions stay one row."""
    from pgcdc.spark.snapshot import plan_table_ranges

    pg.execute(FAMILIES)
    with pg.connect() as conn:
        ranges, estimate = plan_table_ranges(conn, "public", "events", target_rows_per_task=100)
    assert {r.table for r in ranges} == {"events_low", "events_high_0", "events_high_1"}
    assert len(ranges) > 3 and estimate == 900
    config = pipeline_config(pg, spark, publication="families", slot="families", snapshot_rows_per_task=100)
    pipeline = Pipeline(config, spark=spark)

    def expect_each_row_once() -> None:
        spark.catalog.clearCache()
        assert mirror_rows(spark, pipeline, "parent") == sorted(pg.execute("SELECT id, v FROM ONLY parent"))
        assert mirror_rows(spark, pipeline, "child") == sorted(pg.execute("SELECT id, v, extra FROM child"))
        assert mirror_rows(spark, pipeline, "events") == sorted(pg.execute("SELECT id, k, v FROM events"))
        assert_mirrors_equal(config, spark, pg.dsn, {"public.parent", "public.child", "public.events"})

    pipeline.snapshot()
    expect_each_row_once()
    pg.execute(FAMILY_CHANGES)
    pipeline.run(until_caught_up=True, handle_signals=False)
    expect_each_row_once()


def test_a_row_moved_into_a_row_filter_gets_the_toast_values_it_did_not_change(pg, spark):
    """An UPDATE that moves a row into the filter comes as an INSERT, whose unchanged TOAST values the server
    cannot send (the old row is outside the mirror too): the table is copied again, never mirrored with NULLs."""
    pg.execute("""
        CREATE TABLE docs (id int PRIMARY KEY, v int, body text);
        ALTER TABLE docs ALTER body SET STORAGE EXTERNAL;
        INSERT INTO docs SELECT g, g, repeat(md5(g::text), 400) FROM generate_series(1, 20) g;
        CREATE PUBLICATION docs FOR TABLE docs WHERE (id > 10);
    """)
    config = pipeline_config(pg, spark, publication="docs", slot="docs")
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    pg.execute("""
        UPDATE docs SET id = id + 100 WHERE id <= 3;          -- into the filter, body unchanged
        UPDATE docs SET id = id + 100, v = -v WHERE id = 4;
        UPDATE docs SET v = 0 WHERE id = 15;                  -- inside it all along, body unchanged
    """)
    pipeline.run(until_caught_up=True, handle_signals=False)
    spark.catalog.clearCache()
    assert mirror_rows(spark, pipeline, "docs") == sorted(pg.execute("SELECT id, v, body FROM docs WHERE id > 10"))


def test_a_table_without_columns_is_passed_over_until_it_has_one(pg, spark, caplog):
    """``CREATE TABLE z ()`` is valid, and its rows carry nothing a mirror could hold: the publication's other
    tables are mirrored as ever, and z from the first change after it gains a column."""
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY);
        CREATE TABLE z ();
        ALTER TABLE z REPLICA IDENTITY FULL;
        INSERT INTO t VALUES (1);
        INSERT INTO z DEFAULT VALUES;
        CREATE PUBLICATION pub FOR TABLE t, z;
    """)
    config = pipeline_config(pg, spark, publication="pub")
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    pg.execute("INSERT INTO z DEFAULT VALUES; DELETE FROM z; INSERT INTO t VALUES (2)")
    pipeline.run(until_caught_up=True, handle_signals=False)
    assert "public.z has no published columns" in caplog.text
    assert_mirrors_equal(config, spark, pg.dsn, {"public.t"})
    pg.execute("ALTER TABLE z ADD COLUMN a int; INSERT INTO z VALUES (5), (5); INSERT INTO t VALUES (3)")
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert_mirrors_equal(config, spark, pg.dsn, {"public.t", "public.z"})


@pytest.mark.parametrize("change", [
    "ALTER PUBLICATION pub SET TABLE cl (id, a, secret), rf WHERE (id > 2), plain",  # wider: what it left out is needed
    "ALTER PUBLICATION pub SET TABLE cl (id), rf WHERE (id > 9), plain",  # narrower: what it leaves out must go
], ids=["wider", "narrower"])
def test_a_changed_column_list_or_row_filter_copies_the_table_again(pg, spark, caplog, change):
    """The mirror holds what the publication published: a new column list or row filter is a new copy."""
    pg.server.require(15, "column lists and row filters")
    pg.execute("""
        CREATE TABLE cl (id int PRIMARY KEY, a text, secret text);
        CREATE TABLE rf (id int PRIMARY KEY, v int);
        CREATE TABLE plain (id int PRIMARY KEY);
        INSERT INTO cl SELECT g, 'a' || g, 's' || g FROM generate_series(1, 4) g;
        INSERT INTO rf SELECT g, g FROM generate_series(1, 10) g;
        INSERT INTO plain VALUES (1);
        CREATE PUBLICATION pub FOR TABLE cl (id, a), rf WHERE (id > 8), plain;
    """)
    config = pipeline_config(pg, spark, publication="pub")
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    pg.execute("ALTER TABLE plain ADD COLUMN n int; INSERT INTO plain VALUES (2, 2)")  # not a definition change
    pipeline.run(until_caught_up=True, handle_signals=False)
    pg.execute(f"{change}; UPDATE cl SET a = 'changed' WHERE id = 1; UPDATE rf SET v = -v WHERE id = 10")
    with caplog.at_level(logging.WARNING, logger="pgcdc"):
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert_mirrors_equal(config, spark, pg.dsn, {"public.cl", "public.rf", "public.plain"})
    copied = [r.getMessage() for r in caplog.records if r.getMessage().startswith("copying ")]
    assert len(copied) == 1 and "public.cl, public.rf again" in copied[0], copied


def test_a_table_taken_out_of_the_publication_and_put_back_is_copied_again(pg, spark, caplog):
    """Its changes while out were never sent: the run says its mirror is no longer written, once; put back, it is
    copied again (as a table added later is). A table dropped, or renamed (copied under its new name), leaves
    its mirror as it was, said alike."""
    pg.server.require(15, "publication membership read with column lists")
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY, v text);
        CREATE TABLE u (id int PRIMARY KEY);
        INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 5) g;
        INSERT INTO u VALUES (1);
        CREATE PUBLICATION pub FOR TABLE t, u;
    """)
    config = pipeline_config(pg, spark, publication="pub")
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    pg.execute("ALTER PUBLICATION pub DROP TABLE t")
    pg.execute("UPDATE t SET v = 'while out' WHERE id = 1; DELETE FROM t WHERE id = 2; INSERT INTO t VALUES (6, 'x')")
    pg.execute("INSERT INTO u VALUES (2)")
    t_position = namespace_positions(pipeline.mirrors)[("public", "t")]

    def unpublished() -> list[str]:
        return [r.getMessage() for r in caplog.records if " is no longer in publication " in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="pgcdc"):
        pipeline.run(until_caught_up=True, handle_signals=False)
        pipeline.run(until_caught_up=True, handle_signals=False)  # said once by a pipeline
    t_mirror = pipeline.mirrors.identifier_for("public", "t")
    assert unpublished() == [
        f"public.t is no longer in publication pub (dropped, renamed, moved to another schema or taken out of it): "
        f"its mirror {t_mirror} keeps the rows it held at {t_position} and is no longer written. Drop the mirror if "
        "it is not wanted; if the table is published under that name again, it is copied again"], caplog.text
    pg.execute("ALTER PUBLICATION pub ADD TABLE t")
    pg.execute("UPDATE t SET v = 'back' WHERE id = 3; INSERT INTO u VALUES (3)")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pgcdc"):
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert_mirrors_equal(config, spark, pg.dsn, {"public.t", "public.u"})
    copied = [r.getMessage() for r in caplog.records if r.getMessage().startswith("copying ")]
    assert len(copied) == 1 and copied[0].startswith("copying public.t again"), copied
    assert unpublished() == []

    # renamed: copied under its new name; dropped: nothing to copy; each old mirror stays as it was, said so
    u_position = namespace_positions(pipeline.mirrors)[("public", "u")]
    t_rows = pg.execute("SELECT count(*) FROM t")[0][0]
    pg.execute("ALTER TABLE t RENAME TO t_renamed; INSERT INTO t_renamed VALUES (7, 'renamed'); DROP TABLE u")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pgcdc"):
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    assert_mirrors_equal(config, spark, pg.dsn, {"public.t_renamed"})
    told = unpublished()
    assert sorted(m.split(" is no longer")[0] for m in told) == ["public.t", "public.u"], told
    assert any(m.startswith("public.u ") and f"keeps the rows it held at {u_position} " in m for m in told), told
    assert spark.table(t_mirror).count() == t_rows
    # pgcdc status names both mirrors, whose tables the database no longer has (t_renamed's has its table)
    status = run_pgcdc("status", "--dsn", config.dsn, *catalog_arguments(config), "--namespace",
                       config.destination.namespace, "--json", timeout=600)
    assert status.returncode == 0, status.stderr[-3000:]
    gone = {w["mirror"]: w["warning"] for w in json.loads(status.stdout)["warnings"] if "mirror" in w}
    u_mirror = pipeline.mirrors.identifier_for("public", "u")
    assert set(gone) == {t_mirror, u_mirror}, gone
    assert gone[u_mirror] == (f"the source table public.u of mirror {u_mirror} no longer exists in database "
                              f"{pg.name} (dropped, renamed or moved to another schema): the mirror keeps the "
                              f"rows it held at {u_position} and is no longer written"), gone


def test_partitions_attached_detached_or_dropped_copy_the_table_and_new_empty_ones_do_not(pg, spark, caplog):
    """A partitioned table published through its root gains or loses rows with no change decoded when a
    partition holding rows is attached, or one is detached or dropped: its mirror is copied again. A partition
    created empty (a new month's) brings no rows, and nothing is copied."""
    pg.execute("""
        CREATE TABLE readings (id int, at date, v int, PRIMARY KEY (id, at)) PARTITION BY RANGE (at);
        CREATE TABLE readings_2024 PARTITION OF readings FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
        CREATE TABLE readings_2025 PARTITION OF readings FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
        INSERT INTO readings SELECT g, date '2024-01-01' + g * 3, g FROM generate_series(1, 200) g;
        CREATE PUBLICATION pub FOR TABLE readings WITH (publish_via_partition_root = true);
    """)
    config = pipeline_config(pg, spark, publication="pub")
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()

    def run_and_compare() -> set[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pgcdc"):
            Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
        assert_mirrors_equal(config, spark, pg.dsn, {"public.readings"})
        return {r.getMessage().split(" again:")[0] for r in caplog.records if r.getMessage().startswith("copying ")}

    pg.execute("CREATE TABLE readings_2026 PARTITION OF readings FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');"
               "INSERT INTO readings VALUES (1000, '2026-02-02', 1)")
    assert run_and_compare() == set()
    pg.execute("DROP TABLE readings_2024; UPDATE readings SET v = -v WHERE id = 150")
    assert run_and_compare() == {"copying public.readings"}
    pg.execute("CREATE TABLE readings_2027 (id int, at date, v int, PRIMARY KEY (id, at));"
               "INSERT INTO readings_2027 VALUES (2000, '2027-03-03', 7), (2001, '2027-04-04', 8)")
    pg.execute("ALTER TABLE readings ATTACH PARTITION readings_2027 FOR VALUES FROM ('2027-01-01') TO ('2028-01-01');"
               "UPDATE readings SET v = 0 WHERE id = 1000")
    assert run_and_compare() == {"copying public.readings"}
    pg.execute("ALTER TABLE readings DETACH PARTITION readings_2025; INSERT INTO readings VALUES (3000, '2026-05-05', 1)")
    assert run_and_compare() == {"copying public.readings"}
