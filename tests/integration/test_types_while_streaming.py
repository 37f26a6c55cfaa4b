"""Types that appear while pgcdc streams: a column of a type created after pgcdc read the catalog, a column of a
type that binary values cannot carry, a domain over an array met in an older version of its table. The stream
goes on, and each column is what a copy would make of it."""

from __future__ import annotations

import pytest

from pgcdc.pipeline import Pipeline
from pgcdc.verify import compare_publication
from pipeline_support import pipeline_config, run_in_background, wait_for

pytestmark = pytest.mark.slow


def _assert_equal(pipeline: Pipeline, dsn: str) -> None:
    pipeline.spark.catalog.clearCache()
    results = compare_publication(pipeline, dsn, pipeline.config.publication)
    assert results and all(r.equal for r in results), [r.describe() for r in results]


def _stream_until(pipeline: Pipeline, pg, changes: str, rows: int) -> None:
    """Run the pipeline in the background, make ``changes`` once it streams, stop it once the mirror of ``t``
    holds ``rows`` rows."""
    runner, failures = run_in_background(pipeline)
    identifier = pipeline.mirrors.identifier_for("public", "t")
    try:
        wait_for(lambda: bool(failures) or pipeline.progress.phase == "streaming", 120, "the stream to start")
        pg.execute(changes)

        def mirrored() -> bool:
            pipeline.spark.catalog.clearCache()
            return bool(failures) or pipeline.spark.table(identifier).count() == rows

        wait_for(mirrored, 180, f"{rows} rows in the mirror")
    finally:
        pipeline.stop()
        runner.join(timeout=120)
    assert not failures, failures


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_columns_of_types_created_while_streaming_are_what_a_copy_makes_them(pg, spark, binary):
    pg.execute("""
        CREATE TABLE t (id int PRIMARY KEY, v text);
        INSERT INTO t VALUES (1, 'before');
        CREATE PUBLICATION pub FOR TABLE t;
    """)
    config = pipeline_config(pg, spark, publication="pub", binary=binary)
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    _stream_until(pipeline, pg, """
        CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
        CREATE DOMAIN positive AS int CHECK (VALUE > 0);
        ALTER TABLE t ADD COLUMN moods mood[], ADD COLUMN mood mood, ADD COLUMN n positive,
                      ADD COLUMN span int4range;
        INSERT INTO t VALUES (2, 'after', '{happy,NULL,sad}', 'ok', 7, '[1,5)');
        UPDATE t SET moods = '{}', span = 'empty' WHERE id = 1;
    """, rows=2)
    _assert_equal(pipeline, pg.dsn)
    fields = {f.name: f.dataType.simpleString() for f in spark.table(pipeline.mirrors.identifier_for(
        "public", "t")).schema.fields}
    assert fields == {"id": "int", "v": "string", "moods": "array<string>", "mood": "string", "n": "int",
                      "span": "string"}
    # a copy makes the same columns
    copied = pipeline_config(pg, spark, publication="pub", slot="copied", namespace=config.destination.namespace + "_copy")
    again = Pipeline(copied, spark=spark)
    again.snapshot()
    assert {f.name: f.dataType.simpleString() for f in spark.table(again.mirrors.identifier_for(
        "public", "t")).schema.fields} == fields


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_a_domain_over_an_array_in_an_older_version_of_its_table(pg, spark, binary):
    pg.execute("""
        CREATE DOMAIN int_list AS int[];
        CREATE TABLE t (id int PRIMARY KEY, v int_list);
        CREATE PUBLICATION pub FOR TABLE t;
    """)
    config = pipeline_config(pg, spark, publication="pub", binary=binary)
    pipeline = Pipeline(config, spark=spark)
    pipeline.snapshot()
    # both before the run: the stream holds a version of t older than the catalog's
    pg.execute("INSERT INTO t VALUES (1, '{1,2}')")
    pg.execute("ALTER TABLE t ADD COLUMN w int_list")
    pg.execute("INSERT INTO t VALUES (2, '{3}', '{4,NULL}')")
    pipeline = Pipeline(config, spark=spark)  # a new run, which reads the catalog as it is now
    pipeline.run(until_caught_up=True, handle_signals=False)
    _assert_equal(pipeline, pg.dsn)
    rows = sorted((r.id, r.v, r.w) for r in spark.table(pipeline.mirrors.identifier_for("public", "t")).collect())
    assert rows == [(1, [1, 2], None), (2, [3], [4, None])]
