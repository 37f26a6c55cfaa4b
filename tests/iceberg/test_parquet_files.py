"""Parquet files pgcdc writes itself (iceberg/parquet.py): their footers, read where they were written, and the
column metrics Iceberg's commit records for them, which must be the ones Iceberg reads from the file itself: readers
(Spark's, PyIceberg's) skip files by them."""

from __future__ import annotations

import io
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pgcdc.iceberg.locations import local_path
from pgcdc.iceberg.parquet import FOOTER_READ_BYTES, parquet_footer


def written(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return sink.getvalue()


def as_metadata_file(footer: bytes) -> pq.FileMetaData:
    """``footer`` decoded by Arrow's own reader, framed as the metadata-only file Parquet's writers make."""
    return pq.read_metadata(io.BytesIO(b"PAR1" + footer + len(footer).to_bytes(4, "little") + b"PAR1"))


@pytest.mark.parametrize("columns", [3, 2000], ids=["in-the-first-read", "longer-than-the-first-read"])
def test_the_footer_is_the_files_metadata_however_long(columns):
    table = pa.table({f"c{i}": pa.array([i, None, i * 2], pa.int64()) for i in range(columns)})
    content = written(table)
    footer = parquet_footer(io.BytesIO(content), len(content))
    assert (len(footer) + 8 > FOOTER_READ_BYTES) == (columns == 2000)
    decoded = as_metadata_file(footer)
    assert decoded.num_rows == 3 and decoded.num_columns == columns
    assert decoded.row_group(0).column(columns - 1).statistics.null_count == 1


def test_what_is_not_a_parquet_file_with_a_plain_footer_says_so():
    content = written(pa.table({"id": [1, 2]}))
    for broken in (content[:-1], content[:-4] + b"PARE", b"PAR1" + b"\xff\xff\xff\x7f" + b"PAR1", b"PAR1"):
        with pytest.raises(ValueError, match="Parquet"):
            parquet_footer(io.BytesIO(broken), len(broken))


def test_column_metrics_from_the_footer_are_the_ones_iceberg_reads_from_the_file(spark, iceberg_namespace):
    """Every kind of column, with nulls, NaN, strings truncated in bounds, and per-column metric modes: the
    metrics built from a footer equal ``ParquetUtil.fileMetrics`` of the same file."""
    from pgcdc.spark.iceberg_java import footer_metrics, iceberg_classes, load_table

    identifier = f"pgcdc.{iceberg_namespace}.footers"
    spark.sql(f"""CREATE TABLE {identifier} (id bigint, small int, d double, f float, amount decimal(10, 2),
        big decimal(38, 10), name string, raw binary, flag boolean, day date, at timestamp, local_at timestamp_ntz,
        point struct<x: double, label: string>, tags array<string>, attrs map<string, bigint>) USING iceberg
        TBLPROPERTIES ('format-version' = '2', 'write.metadata.metrics.column.name' = 'truncate(4)',
        'write.metadata.metrics.column.raw' = 'none', 'write.metadata.metrics.column.big' = 'counts')""")
    spark.sql(f"""INSERT INTO {identifier} VALUES
        (1, 2, double('NaN'), float(1.5), 12.34, 12345678901234567890.0123456789,
         'a name longer than sixteen characters', X'00FF', true, DATE '2024-02-29',
         TIMESTAMP '2024-01-01 00:00:00', TIMESTAMP_NTZ '2024-01-01 00:00:00',
         named_struct('x', 1.5D, 'label', 'p'), array('a', null), map('k', 1L)),
        (null, null, null, null, null, null, null, null, null, null, null, null, null, null, null),
        (3, -5, double('-Infinity'), float('NaN'), -0.01, -1.5, '', X'', false, DATE '1970-01-01',
         TIMESTAMP '1969-12-31 23:59:59.999999', TIMESTAMP_NTZ '9999-12-31 23:59:59', named_struct('x', double('NaN'),
         'label', null), array(), map())""")
    table = load_table(spark, identifier)
    classes = iceberg_classes()
    config = classes.metrics_for_table(table)
    jvm = spark.sparkContext._jvm
    to_bytes = jvm.org.apache.iceberg.util.ByteBuffers.toByteArray

    def described(metrics) -> tuple:
        def counts(found):
            return None if found is None else {int(k): int(found.get(k)) for k in found.keySet()}

        def bounds(found):
            return None if found is None else {int(k): bytes(to_bytes(found.get(k))) for k in found.keySet()}

        return (metrics.recordCount(), counts(metrics.columnSizes()), counts(metrics.valueCounts()),
                counts(metrics.nullValueCounts()), counts(metrics.nanValueCounts()), bounds(metrics.lowerBounds()),
                bounds(metrics.upperBounds()))

    name_id, raw_id, big_id = (table.schema().findField(name).fieldId() for name in ("name", "raw", "big"))
    paths = [row.file_path for row in spark.sql(f"SELECT file_path FROM {identifier}.files").collect()]
    assert paths
    for path in paths:
        size = os.path.getsize(local_path(path))
        with open(local_path(path), "rb") as file:
            from_footer = described(footer_metrics(parquet_footer(file, size), config))
        from_file = described(jvm.org.apache.iceberg.parquet.ParquetUtil.fileMetrics(
            table.io().newInputFile(path), config))
        assert from_footer == from_file
        lower, upper = from_footer[5], from_footer[6]
        # the table's metric modes were applied, not left out: a truncated bound, none, counts only
        assert lower.get(name_id) in (None, b"", b"a na") and upper.get(name_id) in (None, b"", b"a nb")
        assert raw_id not in lower and raw_id not in from_footer[2]
        assert big_id not in lower and big_id in from_footer[2]


def test_a_copys_footers_are_read_in_order_and_only_a_few_ahead_of_the_commit(tmp_path, monkeypatch):
    """The copy's commit takes its files' footers one by one: the driver reads them a few at once, never all of a
    copy of tens of thousands of files before the first is taken."""
    from pgcdc.spark import snapshot

    files = []
    for index in range(100):
        path = tmp_path / f"{index}.parquet"
        pq.write_table(pa.table({"id": [index]}), path)
        files.append((f"file:{path}", path.stat().st_size))
    read = []
    footer = snapshot.parquet_footer
    monkeypatch.setattr(snapshot, "parquet_footer", lambda file, size: read.append(size) or footer(file, size))

    taken = snapshot._with_footers(files, None)
    first = next(taken)
    assert len(read) <= 2 * snapshot.FOOTERS_READ_AT_ONCE
    rest = list(taken)
    assert [(path, size) for path, size, _ in [first, *rest]] == files
    for (path, size, found), index in zip([first, *rest], range(100), strict=True):
        assert as_metadata_file(found).num_rows == 1
        with open(local_path(path), "rb") as file:
            assert found == parquet_footer(file, size), index
