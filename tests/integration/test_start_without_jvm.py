"""A start with nothing to do starts no JVM; whatever needs Spark starts it. ``pgcdc run --until-caught-up`` as a
user runs it, Java's starts noted (tests/start_support.py): with the mirrors at the slot's position it reads their
metadata itself (pgcdc.mirrors.metadata) and exits without one; a table added to the publication, changes
to apply (a table rewritten among them, copied again) start Spark and end with every mirror equal to its source;
a damaged position is refused from the metadata as it is through Spark; `pgcdc status` counts the rows of mirrors
with position deletes without one. The metadata read here and through Spark agree, mirror by mirror (hostile names: tests/reliability/test_hostile_names.py; S3 behind JDBC and REST catalogs:
tests/objectstore/)."""

from __future__ import annotations

import json

import pytest

from cli_support import run_pgcdc
from pgcdc.errors import PositionCorruptError
from pgcdc.mirrors.catalog import MirrorCatalog
from pgcdc.mirrors.metadata import MirrorMetadata
from pgcdc.pipeline import Pipeline
from pipeline_support import assert_mirrors_equal, catalog_arguments, pipeline_config
from start_support import JavaStarts, assert_read_alike, run_until_caught_up

pytestmark = pytest.mark.slow


def test_only_a_run_with_something_to_do_starts_a_jvm(pg, spark, tmp_path):
    from pgcdc.spark.iceberg_java import load_table, with_commit_properties

    pg.execute("CREATE TABLE a (id int PRIMARY KEY, v text)")
    pg.execute("CREATE TABLE b (id int PRIMARY KEY, v text)")
    # more rows than a small file holds (pgcdc.apply.fold): updates and deletes of them are position deletes
    pg.execute("INSERT INTO a SELECT i, 'a' || i FROM generate_series(1, 20000) i")
    pg.execute("INSERT INTO b SELECT i, 'b' || i FROM generate_series(1, 50) i")
    pg.execute("CREATE PUBLICATION shop FOR TABLE a")
    config = pipeline_config(pg, spark, slot="lazy")
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)  # the mirrors, copied here
    java = JavaStarts(tmp_path)

    # nothing to do: the positions, slots and tags come from the metadata, and no JVM starts
    result, started = run_until_caught_up(config, java)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "applied 0 changes" in result.stdout and started == [], (started, result.stderr[-2000:])
    assert assert_read_alike(config, spark)  # copied, no delete file yet: status's counts read here too

    # a damaged position is refused as through Spark, before anything would start one
    mirror = MirrorCatalog(spark, config.destination).identifier_for("public", "a")
    sound = load_table(spark, mirror).currentSnapshot().snapshotId()
    with_commit_properties(spark, {"pgcdc.lsn": "not-an-lsn"}, lambda: spark.sql(f"INSERT INTO {mirror} VALUES (-1, 'x')"))
    result, started = run_until_caught_up(config, java)
    assert result.returncode == 1 and "not an LSN" in result.stdout + result.stderr, result.stderr[-3000:]
    assert started == []
    with pytest.raises(PositionCorruptError, match="not an LSN"):
        MirrorMetadata.of(config.destination).positions.read(mirror)
    table = load_table(spark, mirror)
    table.manageSnapshots().rollbackTo(sound).commit()

    # a table added to the publication is copied: Spark starts for it
    pg.execute("ALTER PUBLICATION shop ADD TABLE b")
    result, started = run_until_caught_up(config, java)
    assert result.returncode == 0, result.stderr[-3000:]
    assert started, "the copy of b started no JVM"
    assert_mirrors_equal(config, spark, pg.dsn, {"public.a", "public.b"})

    # changes to apply, a rewritten table among them (copied again): Spark starts for them
    pg.execute("INSERT INTO a VALUES (100000, 'new')")
    pg.execute("ALTER TABLE b ALTER COLUMN v TYPE varchar(10) USING upper(v)")
    pg.execute("UPDATE b SET v = 'changed' WHERE id = 1")
    result, started = run_until_caught_up(config, java)
    assert result.returncode == 0, result.stderr[-3000:]
    assert started and "copying public.b again" in result.stderr, result.stderr[-3000:]
    assert_mirrors_equal(config, spark, pg.dsn, {"public.a", "public.b"})

    # b, copied again at a later point than the batch, holds no moment of it: the tags stayed, and the next start
    # moves them (Spark writes them) as it applies updates and deletes of a's copied rows (by position: its copy is
    # too large a file to fold, pgcdc.apply.fold); once they are at rest, a start needs no JVM again
    pg.execute("UPDATE a SET v = v || '!' WHERE id % 3 = 0")
    pg.execute("DELETE FROM a WHERE id % 10 = 0")
    result, started = run_until_caught_up(config, java)
    assert result.returncode == 0 and started and "moving the consistent tags" in result.stderr, result.stderr[-3000:]
    result, started = run_until_caught_up(config, java)
    assert result.returncode == 0, result.stderr[-3000:]
    assert started == [], (started, result.stderr[-3000:])
    assert_mirrors_equal(config, spark, pg.dsn, {"public.a", "public.b"})

    # a's position deletes are counted from its manifests and delete files, as Spark counts them: `pgcdc status`
    # reads every mirror's row count without a JVM
    mirror_a = load_table(spark, MirrorCatalog(spark, config.destination).identifier_for("public", "a"))
    assert int(mirror_a.currentSnapshot().summary()["total-position-deletes"]) > 0
    assert assert_read_alike(config, spark)
    mark = java.mark()
    status = run_pgcdc("status", "--dsn", config.dsn, *catalog_arguments(config), "--namespace",
                       config.destination.namespace, "--json", env=java.env)
    assert status.returncode == 0 and java.since(mark) == [], (java.since(mark), status.stderr[-3000:])
    assert {m["source"]: m["rows"] for m in json.loads(status.stdout)["mirrors"]} == {
        "public.a": pg.execute("SELECT count(*) FROM a")[0][0], "public.b": 50}
