"""The initial copy: a table read by parallel Spark tasks inside one exported snapshot, written in one commit.

Each task reads a range of the table's pages (``ctid`` ranges, PostgreSQL 14+ scans them
directly) inside the snapshot the slot exported (``SET TRANSACTION SNAPSHOT``), with
``COPY ... TO STDOUT (FORMAT csv)`` parsed by Arrow's C++ CSV reader and converted with the
same typed-values converter as the stream. All tasks' rows land in one atomic Iceberg
overwrite carrying the slot's consistent point as ``pgcdc.lsn``: an interrupted copy commits
nothing, and a new copy replaces whatever an earlier one left.
"""

from __future__ import annotations

import io
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
import pyarrow.csv as pa_csv
from psycopg import sql

from pgcdc.lsn import Lsn
from pgcdc.spark.mirror import POSITION_PROPERTY

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger("pgcdc.spark.snapshot")

_BATCH_ROWS = 65_536
_CSV_BLOCK = 4 << 20  # bytes of CSV per parsed batch: about 25,000 rows of a typical table


@dataclass(frozen=True)
class CopyProgress:
    table: str
    rows: int
    total_estimate: int
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def seconds_left(self) -> float | None:
        if not self.rows or self.total_estimate <= self.rows:
            return None
        return (self.total_estimate - self.rows) / self.rows_per_s


@dataclass(frozen=True)
class CopyResult:
    rows: int
    seconds: float
    tasks: int


@dataclass(frozen=True)
class PageRange:
    """Pages [first, last) of a table; ``last`` None means to the end (pages added since planning)."""

    first: int
    last: int | None


def plan_table_ranges(conn: psycopg.Connection, schema: str, table: str, *, target_rows_per_task: int = 250_000,
                      max_tasks: int = 256) -> tuple[list[PageRange], int]:
    """Split a table into page ranges of about ``target_rows_per_task`` rows; returns (ranges, row estimate).
    Every page is covered exactly once; the last range is open-ended."""
    row = conn.execute(
        "SELECT pg_relation_size(c.oid) / current_setting('block_size')::bigint, GREATEST(c.reltuples, 0)::bigint, "
        "c.relpages FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relname = %s", (schema, table)).fetchone()
    if row is None:
        raise LookupError(f"table {schema}.{table} does not exist")
    pages, reltuples, relpages = int(row[0]), int(row[1]), int(row[2])
    if reltuples == 0 and pages > 0:  # never analyzed: estimate from a typical page
        reltuples = pages * 60
    estimate = int(reltuples * pages / relpages) if relpages > 0 else reltuples
    tasks = max(1, min(max_tasks, math.ceil(estimate / target_rows_per_task), pages or 1))
    step = math.ceil(pages / tasks) if pages else 0
    ranges = [PageRange(i * step, (i + 1) * step) for i in range(tasks - 1)]
    ranges.append(PageRange((tasks - 1) * step, None))
    return ranges, estimate


def copy_csv_query(schema: str, table: str, columns: list[str], page_range: PageRange | None = None
                   ) -> sql.Composed:
    """COPY of the columns (of a page range) as CSV with every non-null value quoted (see read_csv_columns)."""
    conditions: list[sql.Composable] = [sql.SQL("true")]
    if page_range is not None:
        conditions = [sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({page_range.first},0)"))]
        if page_range.last is not None:
            conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({page_range.last},0)")))
    select = sql.SQL("SELECT {} FROM {}.{} WHERE {}").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.Identifier(schema), sql.Identifier(table),
        sql.SQL(" AND ").join(conditions))
    return sql.SQL("COPY ({}) TO STDOUT (FORMAT csv, NULL '', FORCE_QUOTE *)").format(select)


def _csv_options(width: int) -> tuple[pa_csv.ReadOptions, pa_csv.ParseOptions, pa_csv.ConvertOptions]:
    """COPY CSV with every non-null value quoted: an unquoted empty field is NULL, ``""`` the empty string."""
    names = [f"c{i}" for i in range(width)]
    return (pa_csv.ReadOptions(column_names=names, block_size=_CSV_BLOCK),
            pa_csv.ParseOptions(newlines_in_values=True),
            pa_csv.ConvertOptions(column_types={n: pa.string() for n in names}, null_values=[""],
                                  strings_can_be_null=True, quoted_strings_can_be_null=False))


def read_csv_columns(data: bytes, width: int) -> list[pa.Array]:
    """The columns of a whole COPY CSV output (see :func:`copy_csv_query`) as string arrays."""
    read, parse, convert = _csv_options(width)
    table = pa_csv.read_csv(io.BytesIO(data), read_options=read, parse_options=parse, convert_options=convert)
    return [table.column(i).combine_chunks() for i in range(width)]


class _CopyStream(io.RawIOBase):
    """COPY TO STDOUT's chunks as a file, so Arrow parses while PostgreSQL still sends."""

    def __init__(self, chunks: Iterator[Any]) -> None:
        self._chunks = chunks
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        # COPY sends one message per row: fill the whole buffer, not one row per call
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view):
            if not self._pending:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._pending = memoryview(chunk).cast("B")
            size = min(len(view) - filled, len(self._pending))
            view[filled:filled + size] = self._pending[:size]
            self._pending = self._pending[size:]
            filled += size
        return filled


def _read_range(dsn: str, snapshot_name: str, settings: Mapping[str, str], schema: str, table: str,
                columns: list[str], page_range: PageRange, converter: Any, target_schema: pa.Schema
                ) -> Iterator[pa.RecordBatch]:
    """One task: its page range, inside the exported snapshot, as Arrow batches in the target's layout. Batches
    go out while the range is still being read: Spark writes one while the next is parsed."""
    with psycopg.connect(dsn, autocommit=False, application_name="pgcdc snapshot") as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
        for key, value in settings.items():
            conn.execute("SELECT set_config(%s, %s, true)", (key, value))
        conn.execute("SET LOCAL client_encoding = 'UTF8'")
        with conn.cursor().copy(copy_csv_query(schema, table, columns, page_range)) as copy:
            read, parse, convert = _csv_options(len(columns))
            stream = io.BufferedReader(_CopyStream(iter(copy)), buffer_size=1 << 20)
            try:
                reader = pa_csv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert)
            except pa.ArrowInvalid as exc:
                if "Empty CSV file" not in str(exc):
                    raise
                return  # an empty page range
            for batch in reader:
                if batch.num_rows:
                    rows = converter.convert_columns(batch.columns, binary=False).batch
                    yield from pa.Table.from_batches([rows]).cast(target_schema).to_batches(max_chunksize=_BATCH_ROWS)
        conn.rollback()


def copy_table(
    spark: SparkSession, *, dsn: str, source_schema: str, source_table: str, columns: list[str], converter: Any,
    spark_schema: StructType, target_identifier: str, snapshot_name: str, consistent_lsn: Lsn,
    session_settings: Mapping[str, str], progress: Callable[[CopyProgress], None] | None = None,
    target_rows_per_task: int = 250_000,
) -> CopyResult:
    """Copy ``source_schema.source_table`` into ``target_identifier`` as of ``snapshot_name``; see the module."""
    from pyspark.sql.functions import lit
    from pyspark.sql.types import IntegerType, LongType, StructField, StructType

    from pgcdc.spark.arrow import spark_arrow_schema

    started = time.monotonic()
    label = f"{source_schema}.{source_table}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        ranges, estimate = plan_table_ranges(conn, source_schema, source_table,
                                             target_rows_per_task=target_rows_per_task)
    target_schema = spark_arrow_schema(spark_schema)
    context = spark.sparkContext
    copied = context.accumulator(0)
    settings = dict(session_settings)

    def copy_partition(batches: Iterable[pa.RecordBatch]) -> Iterable[pa.RecordBatch]:
        for batch in batches:
            for task in batch.to_pylist():
                page_range = PageRange(task["first"], None if task["last"] < 0 else task["last"])
                for rows in _read_range(dsn, snapshot_name, settings, source_schema, source_table, columns,
                                        page_range, converter, target_schema):
                    copied.add(rows.num_rows)
                    yield rows

    plan = StructType([StructField("task", IntegerType()), StructField("first", LongType()),
                       StructField("last", LongType())])
    tasks = spark.createDataFrame([(i, r.first, -1 if r.last is None else r.last) for i, r in enumerate(ranges)],
                                  plan).repartition(len(ranges), "task")
    frame = tasks.mapInArrow(copy_partition, spark_schema)

    done = threading.Event()

    def report() -> None:
        while not done.wait(0.5):
            progress(CopyProgress(label, copied.value, estimate, time.monotonic() - started))  # type: ignore[misc]

    reporter = threading.Thread(target=report, daemon=True) if progress else None
    if reporter:
        reporter.start()
    try:
        (frame.writeTo(target_identifier)
         .option(f"snapshot-property.{POSITION_PROPERTY}", str(consistent_lsn))
         .option("check-nullability", "false")
         .overwrite(lit(True)))
    finally:
        done.set()
        if reporter:
            reporter.join()
    # the commit's own record count: metadata, no scan of what was just written
    summary = spark.sql(f"SELECT summary['total-records'] AS n FROM {target_identifier}.snapshots "
                        "ORDER BY committed_at DESC LIMIT 1").collect()
    rows = int(summary[0].n) if summary and summary[0].n is not None else 0
    seconds = time.monotonic() - started
    if progress:
        progress(CopyProgress(label, rows, rows, seconds))
    log.info("snapshot of %s: %d rows in %d tasks, %.1fs", label, rows, len(ranges), seconds)
    return CopyResult(rows=rows, seconds=seconds, tasks=len(ranges))
