"""A value pgcdc cannot mirror (a timestamp past what int64 microseconds since 1970 hold, see docs/types.md):
by default pgcdc stops and says which row and how to get past it; with --on-conversion-error quarantine the
change goes whole and raw to <table>__rejects, the mirror row stays as it was, and everything else flows."""

from __future__ import annotations

import dataclasses

import psycopg
import pytest

from pgcdc.errors import ConversionError
from pgcdc.mirrors.metadata import MirrorMetadata
from pgcdc.mirrors.status import describe_mirrors, describe_mirrors_from_metadata, namespace_positions
from pgcdc.pipeline import Pipeline
from pgcdc.verify import compare_publication
from pipeline_support import pipeline_config, run_cli

pytestmark = pytest.mark.slow

FAR = "294270-01-01 00:00:00"  # PostgreSQL stores it; int64 microseconds since 1970 end in 294247

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, at timestamp, note text);
INSERT INTO items SELECT g, '2024-01-01'::timestamp + g * interval '1 day', 'n' || g FROM generate_series(1, 20) g;
CREATE TABLE other (id int PRIMARY KEY, v int);
INSERT INTO other SELECT g, g FROM generate_series(1, 5) g;
CREATE PUBLICATION shop FOR TABLE items, other;
"""

CHANGES = f"""
INSERT INTO items VALUES (100, '2030-01-01', 'fine before');
BEGIN;
INSERT INTO items VALUES (101, '{FAR}', 'too far');
UPDATE items SET note = 'changed' WHERE id = 1;
UPDATE other SET v = -1 WHERE id = 1;
COMMIT;
UPDATE items SET note = 'still too far' WHERE id = 101;
INSERT INTO items VALUES (102, '2031-01-01', 'fine after');
DELETE FROM items WHERE id = 2;
INSERT INTO other VALUES (6, 6);
"""


def catch_up(config, spark) -> Pipeline:
    pipeline = Pipeline(config, spark=spark)
    pipeline.run(until_caught_up=True, handle_signals=False)
    return pipeline


def rejects_of(spark, pipeline: Pipeline) -> list:
    identifier = pipeline.mirrors.rejects_identifier_for("public", "items")
    spark.catalog.clearCache()
    return spark.sql(f"SELECT op, commit_lsn, ordinal, error, value_format, new_values, old_values "
                     f"FROM {identifier} ORDER BY commit_lsn_value, ordinal").collect()


def assert_equal_but_the_rejected_row(pipeline: Pipeline, pg) -> None:
    pipeline.spark.catalog.clearCache()
    for result in compare_publication(pipeline, pg.dsn, "shop"):
        assert result.equal, result.describe()
        # row 101 cannot be mirrored: its every change was set aside, and the mirror never held it
        assert len(result.unmirrorable) == (1 if result.table == "public.items" else 0), result.describe()


@pytest.mark.parametrize("binary", [False, True], ids=["text", "binary"])
def test_stop_names_the_row_and_the_way_out_quarantine_sets_the_change_aside(pg, spark, binary):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop", binary=binary)
    catch_up(config, spark)
    pg.execute(CHANGES)
    with pytest.raises(ConversionError) as stopped:
        catch_up(config, spark)
    message = str(stopped.value)
    assert "public.items.at" in message and "(id=101)" in message and "committed at LSN" in message
    assert "--on-conversion-error quarantine" in message and "items__rejects" in message

    quarantine = pipeline_config(pg, spark, publication="shop", binary=binary, namespace=config.destination.namespace,
                                 on_conversion_error="quarantine")
    pipeline = catch_up(quarantine, spark)
    assert pipeline.progress.rows_rejected == 2
    assert_equal_but_the_rejected_row(pipeline, pg)
    rejects = rejects_of(spark, pipeline)
    assert [r.op for r in rejects] == ["I", "U"]
    inserted = dict(rejects[0].new_values)
    assert "public.items.at" in rejects[0].error and "cannot be mirrored" in rejects[0].error
    assert rejects[0].value_format == ("binary" if binary else "text")
    if binary:  # the bytes of each value's binary form, as hex
        assert inserted == {"id": (101).to_bytes(4, "big").hex(), "at": inserted["at"], "note": b"too far".hex()}
    else:
        assert inserted == {"id": "101", "at": FAR, "note": "too far"}
        assert dict(rejects[1].new_values)["note"] == "still too far"
    described = {row["source"]: row for row in describe_mirrors(pipeline.mirrors)}
    assert described["public.items"]["rejected"] == 2 and described["public.other"]["rejected"] == 0
    # replayed from an earlier position, nothing is set aside twice
    again = catch_up(quarantine, spark)
    assert len(rejects_of(spark, again)) == 2


def test_killed_after_setting_changes_aside_loses_and_doubles_nothing(pg, spark):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="shop", on_conversion_error="quarantine")
    catch_up(config, spark)
    pg.execute(CHANGES)
    process = run_cli(config, "--until-caught-up", "--on-conversion-error", "quarantine",
                      env={"PGCDC_INJECT": "apply.rejects:1"})
    output, _ = process.communicate(timeout=300)
    assert process.returncode == -9, output[-3000:]  # killed right after the __rejects commit, before the MERGE
    with psycopg.connect(config.dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s",
                            (config.slot,)).fetchone()[0] == 1
    pipeline = catch_up(config, spark)
    assert [r.op for r in rejects_of(spark, pipeline)] == ["I", "U"]
    assert_equal_but_the_rejected_row(pipeline, pg)


@pytest.mark.parametrize("writer", ["arrow", "spark"])
def test_the_initial_copy_of_a_value_it_cannot_hold_names_the_row_and_the_way_out(pg, spark, writer):
    """In the copy, such a value stops the copy of its table with one error naming the row (its value as
    PostgreSQL writes it, its key) and the fixes (not Spark's job failure); nothing of that table is committed,
    the other tables are copied and the error says which were and which were not, and once the value is
    corrected the next run copies it."""
    pg.execute(SCHEMA)
    pg.execute(f"UPDATE items SET at = '{FAR}' WHERE id = 13")
    config = pipeline_config(pg, spark, snapshot_writer=writer, snapshot_rows_per_task=5)
    with pytest.raises(ConversionError) as raised:
        Pipeline(config, spark=spark).snapshot()
    message = str(raised.value)
    assert message.startswith(f"public.items.at (timestamp, binary): {FAR} is past 294247-01-10"), message
    assert "in the row with id = 13" in message
    assert "nothing of it is committed" in message and "correct the value in the source" in message
    assert "--on-conversion-error quarantine" in message
    assert "copied: public.other; not copied: public.items" in message
    pipeline = Pipeline(config, spark=spark)
    assert namespace_positions(pipeline.mirrors).get(("public", "items")) is None
    assert namespace_positions(pipeline.mirrors).get(("public", "other")) is not None
    pg.execute("UPDATE items SET at = '2024-06-01' WHERE id = 13")
    pipeline.snapshot()
    pipeline.spark.catalog.clearCache()
    assert all(result.equal for result in compare_publication(pipeline, pg.dsn, "shop"))


COPY_REJECTS = f"UPDATE items SET at = '{FAR}' WHERE id IN (3, 13)"


def test_a_copy_under_quarantine_sets_rows_aside_once_through_a_kill_and_the_stream_judges_them_alike(pg, spark):
    """With quarantine the copy sets the rows it cannot hold aside in <table>__rejects (op 'S', at the copy's
    position) and copies everything else. Killed between that commit and the copy's, the run copies again and
    sets nothing aside twice; later changes to those rows are judged as the stream judges any."""
    pg.execute(SCHEMA)
    pg.execute(COPY_REJECTS)
    config = pipeline_config(pg, spark, publication="shop", snapshot_rows_per_task=5)
    # the default policy: one readable sentence, none of the executor's stack trace on the way
    stopped = run_cli(config, "--until-caught-up", env={"PGCDC_LOG_LEVEL": "INFO"})
    output, _ = stopped.communicate(timeout=300)
    assert stopped.returncode == 1, output[-3000:]
    assert f"{FAR} is past" in output and "not copied: public.items" in output, output[-3000:]
    assert "pgcdc.spark.jvm" not in output and "\tat org.apache" not in output, output[-3000:]

    killed = run_cli(config, "--until-caught-up", "--on-conversion-error", "quarantine",
                     env={"PGCDC_INJECT": "snapshot.rejects:1"})
    output, _ = killed.communicate(timeout=300)
    assert killed.returncode == -9, output[-3000:]  # the rows set aside committed, the copy of items not yet

    quarantine = dataclasses.replace(config, on_conversion_error="quarantine")
    pipeline = catch_up(quarantine, spark)
    assert pipeline.progress.rows_rejected == 2
    rejects = rejects_of(spark, pipeline)
    assert [r.op for r in rejects] == ["S", "S"] and len({r.commit_lsn for r in rejects}) == 1
    assert {int(dict(r.new_values)["id"], 16) for r in rejects} == {3, 13}
    assert all(r.value_format == "binary" and f"{FAR} is past" in r.error for r in rejects)
    assert_equal_but_rows(pipeline, pg, unmirrorable=2)
    described = {row["source"]: row for row in describe_mirrors(pipeline.mirrors)}
    assert described["public.items"]["rejected"] == 2
    # copied only, no delete file: pgcdc status reads the same counts from the metadata, without a JVM
    assert describe_mirrors_from_metadata(MirrorMetadata.of(config.destination)) == list(described.values())

    # the stream: a row set aside given a value the mirror can hold arrives; one given a bad value is set aside
    pg.execute("UPDATE items SET at = '2030-01-01' WHERE id = 3; UPDATE items SET at = "
               f"'{FAR}', note = 'far now' WHERE id = 4; UPDATE items SET note = 'still' WHERE id = 13")
    pipeline = catch_up(quarantine, spark)
    assert [r.op for r in rejects_of(spark, pipeline)] == ["S", "S", "U", "U"]
    assert_equal_but_rows(pipeline, pg, unmirrorable=2)


def assert_equal_but_rows(pipeline: Pipeline, pg, *, unmirrorable: int) -> None:
    pipeline.spark.catalog.clearCache()
    for result in compare_publication(pipeline, pg.dsn, "shop"):
        assert result.equal, result.describe()
        assert len(result.unmirrorable) == (unmirrorable if result.table == "public.items" else 0), result.describe()


@pytest.mark.parametrize("writer", ["spark"])
def test_a_copy_through_spark_s_writer_sets_rows_aside_too(pg, spark, writer):
    pg.execute(SCHEMA)
    pg.execute(COPY_REJECTS)
    config = pipeline_config(pg, spark, publication="shop", snapshot_rows_per_task=5, snapshot_writer=writer,
                             on_conversion_error="quarantine")
    pipeline = catch_up(config, spark)
    assert [r.op for r in rejects_of(spark, pipeline)] == ["S", "S"]
    assert_equal_but_rows(pipeline, pg, unmirrorable=2)
