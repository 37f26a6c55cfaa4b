"""Partitioned mirrors (--partition-by): the copy and every batch put each row in a data file of its partition,
labelled with the values Iceberg itself computes for it (PyIceberg's transforms are the oracle, Spark's and
PyIceberg's filtered reads skip files by them), deleting by position from any partition, under a spec its users
evolve later; a spec pgcdc cannot use, or a table the publication does not hold, is refused clearly."""

from __future__ import annotations

import datetime
from decimal import Decimal

import pytest
from pyiceberg import transforms as pt
from pyiceberg import types as it
from pyiceberg.expressions import GreaterThanOrEqual, LessThan

from pgcdc.errors import ConfigError
from pgcdc.pipeline import Pipeline
from pgcdc.verify import compare_publication
from pipeline_support import pipeline_config
from pyiceberg_reader import assert_reads_alike, hadoop_table

pytestmark = pytest.mark.slow

SCHEMA = """
CREATE TABLE events (id bigint PRIMARY KEY, at timestamptz, tenant text, amount numeric(10, 2), day date,
                     note text);
INSERT INTO events
SELECT g, timestamptz '1969-12-30 22:00+00' + g * interval '7 hours', 'tenant-' || (g % 7), (g % 4) * 1.25,
       date '1969-12-25' + (g % 40), 'n' || g
FROM generate_series(1, 400) g;
UPDATE events SET at = NULL, tenant = NULL WHERE id % 50 = 0;   -- NULL partition values
CREATE TABLE plain (id int PRIMARY KEY, v int);
INSERT INTO plain SELECT g, g FROM generate_series(1, 20) g;
CREATE PUBLICATION shop FOR TABLE events, plain;
"""
PARTITIONS = "months(at), bucket(5, tenant), truncate(100, id), amount, months(day)"
EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)


def catch_up(config, spark) -> Pipeline:
    pipeline = Pipeline(config, spark=spark)
    pipeline.run(until_caught_up=True, handle_signals=False)
    return pipeline


def expected_partition(spec_fields: list[tuple[str, str]], row) -> tuple:
    """The partition Iceberg gives ``row`` under (transform, column) fields, by PyIceberg's transforms."""
    values = []
    for transform, column in spec_fields:
        value = getattr(row, column)
        if value is None:
            values.append(None)
            continue
        if column == "at":
            value, kind = int((value.replace(tzinfo=datetime.UTC) - EPOCH).total_seconds() * 1e6), \
                it.TimestamptzType()
        elif column == "day":
            value, kind = (value - datetime.date(1970, 1, 1)).days, it.DateType()
        elif column == "id":
            kind = it.LongType()
        elif column == "amount":
            kind = it.DecimalType(10, 2)
        else:
            kind = it.StringType()
        if transform == "identity":
            values.append(value)
            continue
        if transform.startswith("bucket"):
            function = pt.BucketTransform(int(transform[7:-1]))
        elif transform.startswith("truncate"):
            function = pt.TruncateTransform(int(transform[9:-1]))
        else:
            function = {"day": pt.DayTransform, "month": pt.MonthTransform}[transform]()
        result = function.transform(kind)(value)
        values.append((result - datetime.date(1970, 1, 1)).days if isinstance(result, datetime.date) else result)
    return tuple(values)


def assert_every_row_in_its_partitions_file(spark, identifier: str) -> int:
    """Each live row sits in a data file whose recorded partition is the one its values give, under that file's
    spec; returns how many data files were checked."""
    specs, names = {}, {}
    table = hadoop_table(spark, identifier)
    for spec in table.specs().values():
        specs[spec.spec_id] = [(str(f.transform), table.schema().find_field(f.source_id).name) for f in spec.fields]
        names[spec.spec_id] = [f.name for f in spec.fields]
    files = {r.file_path: (r.spec_id, r.partition) for r in spark.sql(
        f"SELECT file_path, spec_id, partition FROM {identifier}.files WHERE content = 0").collect()}
    rows = spark.sql(f"SELECT *, _file FROM {identifier}").collect()
    assert rows
    for row in rows:
        spec_id, partition = files[row._file]
        fields = specs[spec_id]
        # the files table's partition holds the fields of every spec the table had, by name
        recorded = tuple(partition[name] for name in names[spec_id])
        recorded = tuple((v - datetime.date(1970, 1, 1)).days if isinstance(v, datetime.date) else
                         float(v) if isinstance(v, Decimal) else v for v in recorded)
        expected = tuple(float(v) if isinstance(v, Decimal) else v for v in expected_partition(fields, row))
        assert recorded == expected, (row, fields, recorded, expected)
    return len(files)


def assert_mirror_right(pipeline: Pipeline, pg, spark, identifier: str) -> None:
    spark.catalog.clearCache()
    for result in compare_publication(pipeline, pg.dsn, "shop"):
        assert result.equal, result.describe()
    assert_every_row_in_its_partitions_file(spark, identifier)
    pyiceberg = hadoop_table(spark, identifier)
    assert_reads_alike(spark, identifier, pyiceberg)
    # filtered reads skip files by their partition: a row in the wrong file would be missing here
    low, high = "1970-01-05T00:00:00+00:00", "1970-02-01T00:00:00+00:00"
    pruned = pyiceberg.scan(row_filter=GreaterThanOrEqual("at", low).__and__(LessThan("at", high))).to_arrow()
    wanted = pg.execute(f"SELECT count(*) FROM events WHERE at >= '{low}' AND at < '{high}'")[0][0]
    assert pruned.num_rows == wanted
    assert spark.sql(f"SELECT count(*) AS n FROM {identifier} WHERE at >= '{low}' AND at < '{high}'"
                     ).collect()[0].n == wanted
    equality = spark.sql(f"SELECT count(*) AS n FROM {identifier}.delete_files WHERE content = 2").collect()[0].n
    assert equality == 0


def test_partitioned_mirrors_take_every_change_in_the_right_partition_files(pg, spark, caplog):
    caplog.set_level("INFO", logger="pgcdc")
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, partition_by={"public.events": PARTITIONS})
    pipeline = catch_up(config, spark)
    identifier = pipeline.mirrors.identifier_for("public", "events")
    spec = [(str(f.transform), f.name) for f in hadoop_table(spark, identifier).spec().fields]
    assert [t for t, _ in spec] == ["month", "bucket[5]", "truncate[100]", "identity", "month"]
    plain = pipeline.mirrors.identifier_for("public", "plain")
    assert not hadoop_table(spark, plain).spec().fields
    assert_mirror_right(pipeline, pg, spark, identifier)

    # changes within partitions, across them (an update moving a row's day, tenant, id), to and from NULL
    for step in range(3):
        pg.execute(f"""
            INSERT INTO events SELECT g, timestamptz '1970-01-10 00:00+00' + g * interval '5 hours', 't' || g,
                                      g, date '1970-03-01', 'new' FROM generate_series({1000 + step * 50},
                                                                                        {1049 + step * 50}) g;
            UPDATE events SET at = at + interval '3 days', note = 'moved' WHERE id % 9 = {step};
            UPDATE events SET tenant = 'tenant-x', amount = amount + 1 WHERE id % 11 = {step};
            UPDATE events SET at = NULL WHERE id % 13 = {step};
            UPDATE events SET tenant = 'back' WHERE tenant IS NULL AND id % 2 = {step % 2};
            UPDATE events SET id = id + 5000 WHERE id % 17 = {step} AND id < 5000;
            DELETE FROM events WHERE id % 19 = {step};
            UPDATE plain SET v = v + 1;
        """)
        pipeline = catch_up(config, spark)
        assert_mirror_right(pipeline, pg, spark, identifier)
    assert "the MERGE writer applies" not in caplog.text  # the row-delta writer wrote every batch
    deletes = spark.sql(f"SELECT count(*) AS n FROM {identifier}.delete_files WHERE content = 1").collect()[0].n
    assert deletes > 1  # position deletes, one file per partition of the rows they remove

    # its users evolve the spec: new files take the new spec, deletes of old files keep theirs (and a partition
    # spec that differs from --partition-by is said, not changed)
    caplog.clear()
    spark.sql(f"ALTER TABLE {identifier} DROP PARTITION FIELD bucket(5, tenant)")
    spark.sql(f"ALTER TABLE {identifier} ADD PARTITION FIELD bucket(3, note)")
    pg.execute("""
        INSERT INTO events SELECT g, timestamptz '1970-01-20 00:00+00', 'late', 1, date '1970-01-01', 'late' || g
        FROM generate_series(9000, 9030) g;
        UPDATE events SET note = 'evolved' WHERE id % 5 = 0;
        DELETE FROM events WHERE id % 23 = 0;
    """)
    pipeline = catch_up(config, spark)
    assert_mirror_right(pipeline, pg, spark, identifier)
    spec_ids = {r.spec_id for r in spark.sql(f"SELECT spec_id FROM {identifier}.files").collect()}
    assert len(spec_ids) == 2
    assert ("partitioned by [month(at), truncate(100, id), amount, month(day), bucket(3, note)], not by the "
            "[month(at), bucket(5, tenant), truncate(100, id), amount, month(day)] --partition-by gives") in caplog.text


@pytest.mark.parametrize(("partition_by", "message"), [
    ({"public.events": "days(nothing)"}, "names no column of the table"),
    ({"public.events": "hours(day)"}, "Iceberg refuses it"),
    ({"public.evnts": "days(at)"}, "which publication shop does not publish"),
])
def test_a_partitioning_that_cannot_be_made_is_refused_before_any_mirror_is(pg, spark, partition_by, message):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, partition_by=partition_by)
    with pytest.raises(ConfigError, match=message):
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
