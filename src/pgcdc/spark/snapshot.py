"""The initial copy: a table read by parallel Spark tasks inside one exported snapshot, written in one commit.

Each task reads a range of the table's pages (``ctid`` ranges, PostgreSQL 14+ scans them
directly) inside the snapshot the slot exported (``SET TRANSACTION SNAPSHOT``), with
``COPY ... TO STDOUT (FORMAT binary)`` drained by libpq into one buffer, split into columns in C and
converted with the same typed-values converter as the stream (columns of types without a binary
decoder are copied as their text form).

Where the mirror's data location is a directory of this machine (a local or mounted warehouse) or on S3
(``s3a://``, reached with the table's own Hadoop settings), each task writes its rows as a Parquet data
file in the table's layout (Iceberg field ids, Iceberg's types and codec) and the driver commits all files
at once with their column metrics: the rows never pass one by one through the JVM. Elsewhere (HDFS,
partitioned mirrors) the tasks' Arrow batches go through Spark's Iceberg writer. Either way all rows land in one atomic overwrite carrying the slot's
consistent point as ``pgcdc.lsn``: an interrupted copy commits nothing, and a new copy replaces
whatever an earlier one left."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import pyarrow as pa
from psycopg import sql

from pgcdc import errors
from pgcdc.errors import ConfigError, ConversionError, PgcdcError, SourceChangedError
from pgcdc.iceberg.locations import local_path, object_path
from pgcdc.iceberg.parquet import layout_schema, parquet_footer, write_parquet
from pgcdc.lsn import Lsn
from pgcdc.positions import carried_summary, commit_properties
from pgcdc.spark.iceberg_java import (
    data_directory,
    load_table,
    local_data_directory,
    parquet_compression,
    parquet_layout,
    replace_with_files,
    s3_options,
)
from pgcdc.types.copy_binary import split_copy_binary

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger("pgcdc.spark.snapshot")

_BATCH_ROWS = 65_536


@dataclass(frozen=True)
class CopyProgress:
    table: str
    rows: int
    total_estimate: int
    seconds: float

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class CopyResult:
    rows: int
    seconds: float
    tasks: int
    recorded: bool = False  # the copy's commit set the table's pgcdc.position property itself


@dataclass(frozen=True)
class PageRange:
    """Pages [first, last) of the table ``schema.table`` alone (never its inheritance children, which a
    publication publishes as tables of their own); ``last`` None means to the end (pages added since planning).
    A partitioned table is copied as the ranges of its leaf partitions."""

    schema: str
    table: str
    first: int
    last: int | None

    def describe(self) -> str:
        return f"{self.schema}.{self.table} pages {self.first}..{'' if self.last is None else self.last}"


# the relations holding a table's rows: its leaf partitions (pg_partition_tree, PostgreSQL 12+; before 13 no
# publication holds a partitioned table), else (a plain table) itself
_SIZES_SQL = """
WITH leaves AS ({leaves})
SELECT n.nspname, c.relname, pg_relation_size(c.oid) / current_setting('block_size')::bigint,
       GREATEST(c.reltuples, 0)::bigint, c.relpages,
       pg_relation_size(c.oid) + CASE WHEN c.reltoastrelid = 0 THEN 0 ELSE pg_relation_size(c.reltoastrelid) END
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid IN (SELECT relid FROM leaves)
   OR (c.oid = %(table)s::regclass AND NOT EXISTS (SELECT FROM leaves))
ORDER BY n.nspname, c.relname
"""


def plan_table_ranges(conn: psycopg.Connection, schema: str, table: str, *, target_rows_per_task: int = 250_000,
                      target_bytes_per_task: int = 64 << 20, max_tasks: int = 65_536) -> tuple[list[PageRange], int]:
    """Split a table (a partitioned one: each of its leaf partitions) into page ranges of about
    ``target_rows_per_task`` rows and at most about ``target_bytes_per_task`` bytes of table and TOAST (a task
    holds its range's COPY output in memory); returns (ranges, row estimate). Every page is covered exactly
    once; each relation's last range is open-ended. ``max_tasks`` keeps the byte bound up to 4 TB a relation
    (65,536 x 64 MB); past it, ranges grow."""
    qualified = sql.SQL("{}.{}").format(sql.Identifier(schema), sql.Identifier(table)).as_string(conn)
    try:
        query = _SIZES_SQL.format(leaves="SELECT relid FROM pg_partition_tree(%(table)s::regclass) WHERE isleaf"
                                  if conn.info.server_version >= 120000 else "SELECT NULL::regclass AS relid WHERE false")
        leaves = conn.execute(query, {"table": qualified}).fetchall()
    except psycopg.errors.UndefinedTable:
        leaves = []
    if not leaves:
        raise SourceChangedError(f"table {schema}.{table} was dropped while pgcdc was copying it; remove it from the "
                                 "publication, or create it again, and run pgcdc again")
    ranges: list[PageRange] = []
    total = 0
    for leaf_schema, leaf, pages, reltuples, relpages, size in leaves:
        pages, reltuples, relpages, size = int(pages), int(reltuples), int(relpages), int(size)
        if reltuples == 0 and pages > 0:  # never analyzed: estimate from a typical page
            reltuples = pages * 60
        estimate = int(reltuples * pages / relpages) if relpages > 0 else reltuples
        total += estimate
        wanted = max(math.ceil(estimate / target_rows_per_task), math.ceil(size / target_bytes_per_task))
        tasks = max(1, min(max_tasks, wanted, pages or 1))
        step = math.ceil(pages / tasks) if pages else 0
        ranges += [PageRange(leaf_schema, leaf, i * step, (i + 1) * step) for i in range(tasks - 1)]
        ranges.append(PageRange(leaf_schema, leaf, (tasks - 1) * step, None))
    return ranges, total


def text_output_functions(conn: psycopg.Connection, converter: Any) -> dict[str, tuple[str, str]]:
    """For each column whose type has no binary decoder: its type's output function (schema, name), which
    the COPY calls to read the column as the text the stream would carry (``::text`` is not that: e.g. inet
    ``::1`` casts to ``::1/128``)."""
    wanted = {column.name: column.type_oid for column, kind in zip(converter.relation.columns, converter.kinds,
                                                                   strict=True) if kind.binary is None}
    if not wanted:
        return {}
    rows = conn.execute(
        "SELECT t.oid, n.nspname, p.proname FROM pg_type t JOIN pg_proc p ON p.oid = t.typoutput "
        "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE t.oid = ANY(%s)", (list(set(wanted.values())),)
    ).fetchall()
    functions = {int(oid): (str(schema), str(name)) for oid, schema, name in rows}
    missing = sorted(name for name, oid in wanted.items() if oid not in functions)
    if missing:
        raise SourceChangedError(f"the types of columns {', '.join(missing)} were dropped while pgcdc was copying "
                                 "their table; run pgcdc again to copy it with its current columns")
    return {name: functions[oid] for name, oid in wanted.items()}


def copy_binary_query(schema: str, table: str, columns: list[str], page_range: PageRange | None = None,
                      text_outputs: Mapping[str, tuple[str, str]] | None = None,
                      row_filter: str | None = None) -> sql.Composed:
    """COPY of the columns in binary format: of ``page_range`` (its relation alone), else of the table's own
    rows (a partitioned table's: all its partitions'), of the rows ``row_filter`` keeps; the columns of
    ``text_outputs`` (see :func:`text_output_functions`) as their text form. ``row_filter`` is a publication's
    row filter as the server's catalog prints it (``pg_publication_tables.rowfilter``), never user input."""
    text_outputs = text_outputs or {}
    conditions: list[sql.Composable] = [sql.SQL("true")]
    if page_range is not None:
        schema, table = page_range.schema, page_range.table
        conditions = [sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({page_range.first},0)"))]
        if page_range.last is not None:
            conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({page_range.last},0)")))
    if row_filter is not None:
        conditions.append(sql.SQL("({})").format(sql.SQL(row_filter)))
    selected = [sql.SQL("pg_catalog.textin({}({}))").format(sql.Identifier(*text_outputs[c]), sql.Identifier(c))
                if c in text_outputs else sql.Identifier(c) for c in columns]
    # ONLY: inheritance children are published (and mirrored) as tables of their own; a partitioned table's
    # rows are all in its partitions, which ONLY would leave out
    select = sql.SQL("SELECT {} FROM {} {}.{} WHERE {}").format(
        sql.SQL(", ").join(selected), sql.SQL("ONLY" if page_range is not None else ""), sql.Identifier(schema),
        sql.Identifier(table), sql.SQL(" AND ").join(conditions))
    return sql.SQL("COPY ({}) TO STDOUT (FORMAT binary)").format(select)


def _read_range(dsn: str, snapshot_name: str, settings: Mapping[str, str], schema: str, table: str,
                columns: list[str], page_range: PageRange, converter: Any, target_schema: pa.Schema,
                text_outputs: Mapping[str, tuple[str, str]], row_filter: str | None,
                set_aside: list[SetAside] | None = None) -> Iterator[pa.RecordBatch]:
    """One task: its page range, inside the exported snapshot, as Arrow batches in the target's layout.

    psycopg2 drains the COPY into one buffer (page ranges are planned small enough to hold), which is split
    into per-column arrays in C and converted column by column: no Python object per value for the
    common types."""
    import psycopg2

    received = io.BytesIO()
    connection = psycopg2.connect(dsn, application_name="pgcdc snapshot", client_encoding="UTF8")
    try:
        with connection.cursor() as cursor:
            cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            cursor.execute("SET TRANSACTION SNAPSHOT %s", (snapshot_name,))
            for key, value in settings.items():
                cursor.execute("SELECT set_config(%s, %s, true)", (key, value))
            query = copy_binary_query(schema, table, columns, page_range, text_outputs, row_filter)
            cursor.copy_expert(query.as_string(None), received)
        connection.rollback()
    finally:
        connection.close()
    batches = convert_copy_binary(received.getbuffer(), columns, converter, text_outputs,
                                  source=page_range.describe(), set_aside=set_aside)
    del received  # split: the COPY output is no longer needed
    for rows in batches:
        if rows.schema != target_schema:
            rows = pa.Table.from_batches([rows]).cast(target_schema).combine_chunks().to_batches()[0]
        yield rows


@dataclass(frozen=True)
class SetAside:
    """A row of a copy that its mirror cannot hold (under ``--on-conversion-error quarantine``): why, and each
    column's value as COPY sent it, as hex of its bytes (NULL as None)."""

    error: str
    values: tuple[tuple[str, str | None], ...]


def convert_copy_binary(data: bytes | memoryview, columns: list[str], converter: Any,
                        text_outputs: Mapping[str, tuple[str, str]], *, source: str,
                        set_aside: list[SetAside] | None = None) -> Iterator[pa.RecordBatch]:
    """The whole output of :func:`copy_binary_query` (``columns``, the ``text_outputs`` ones as text), split now
    into per-column arrays, then converted lazily in batches of at most ``_BATCH_ROWS`` rows. A value that
    cannot be converted raises its ConversionError naming the row it is in (by its key) — or, given a
    ``set_aside`` list, the rows holding such values go there and the others are converted."""
    arrays = split_copy_binary(data, len(columns), source=source)
    binary = [column not in text_outputs for column in columns]
    total = len(arrays[0]) if arrays else 0
    for offset in range(0, total, _BATCH_ROWS):
        chunk = [a.slice(offset, _BATCH_ROWS) for a in arrays]
        try:
            yield converter.convert_columns(chunk, binary=binary).batch
        except ConversionError as exc:
            if set_aside is None:
                raise ConversionError(f"{exc}, in {_first_unconvertible_row(chunk, binary, converter)}") from None
            yield from _converted_setting_aside(chunk, binary, converter, columns, set_aside)


def _converted_setting_aside(chunk: list[pa.Array], binary: list[bool], converter: Any, columns: list[str],
                             set_aside: list[SetAside]) -> Iterator[pa.RecordBatch]:
    """``chunk`` converted but for its rows that cannot be, which go to ``set_aside``: a part that fails is halved
    until the failing rows stand alone, so the good rows cost one conversion more at most per halving."""
    try:
        yield converter.convert_columns(chunk, binary=binary).batch
        return
    except ConversionError as exc:
        length = len(chunk[0])
        if length == 1:
            set_aside.append(SetAside(str(exc), tuple(
                (name, None if not array[0].is_valid else array[0].as_py().hex())
                for name, array in zip(columns, chunk, strict=True))))
            return
    half = len(chunk[0]) // 2
    yield from _converted_setting_aside([a.slice(0, half) for a in chunk], binary, converter, columns, set_aside)
    yield from _converted_setting_aside([a.slice(half) for a in chunk], binary, converter, columns, set_aside)


def _first_unconvertible_row(chunk: list[pa.Array], binary: list[bool], converter: Any) -> str:
    """The first row of ``chunk`` holding a value that cannot be converted, as its key's values (every column's
    when the table has no key), found by halves."""
    start, length = 0, len(chunk[0])
    while length > 1:
        half = length // 2
        try:
            converter.convert_columns([a.slice(start, half) for a in chunk], binary=binary)
            start, length = start + half, length - half
        except ConversionError:
            length = half
    columns = converter.relation.columns
    shown = {c.name for c in converter.relation.key_columns} or {c.name for c in columns}
    # only the shown columns are converted: the failing value may be among the others
    row = [a.slice(start, 1) if c.name in shown else pa.nulls(1, a.type) for a, c in zip(chunk, columns, strict=True)]
    try:
        batch = converter.convert_columns(row, binary=binary).batch
        values = ", ".join(f"{c.name} = {batch.column(i)[0]}" for i, c in enumerate(columns) if c.name in shown)
    except ConversionError:
        return "a row whose key cannot be converted either"
    return f"the row with {values}"


def _write_range(batches: Iterable[pa.RecordBatch], path: str, layout: list[tuple[str, Any]],
                 compression: tuple[str, int | None], filesystem: Any = None) -> int:
    """``batches`` as one Parquet data file at ``path`` (of ``filesystem``, default this machine's) in the
    Iceberg table's layout; returns the rows written. A file is written whole or removed."""
    if filesystem is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        # the file exists from the task's start (empty until its rows are written at its end), before the
        # first batch, which picks the columns to dictionary-encode, has been read
        with (filesystem.open_output_stream(path) if filesystem is not None else pa.OSFile(path, "wb")) as sink:
            return write_parquet(batches, sink, layout_schema(layout), compression)
    except BaseException:
        with contextlib.suppress(OSError):
            _remove(path, filesystem)
        raise


def _copy_filesystem(s3: dict[str, Any] | None) -> Any:
    """pyarrow's S3 file system of the copy's ``s3`` options; None: the copy's files are on this machine."""
    if s3 is None:
        return None
    from pyarrow.fs import S3FileSystem

    return S3FileSystem(**s3)


def _local_file(location: str) -> str:
    path = local_path(location)
    assert path is not None, location  # the arrow writer writes only where this machine reaches
    return path


def _remove(path: str, filesystem: Any) -> None:
    if filesystem is None:
        os.unlink(path)
    else:
        filesystem.delete_file(path)


@dataclass(frozen=True)
class _CopySource:
    """What a copy task reads: the table's rows in one page range, inside the exported snapshot (sent to tasks)."""

    dsn: str
    snapshot_name: str
    settings: Mapping[str, str]
    schema: str
    table: str
    columns: list[str]
    converter: Any
    target_schema: pa.Schema
    text_outputs: Mapping[str, tuple[str, str]]
    row_filter: str | None

    def read(self, page_range: PageRange, set_aside: list[SetAside] | None) -> Iterator[pa.RecordBatch]:
        return _read_range(self.dsn, self.snapshot_name, self.settings, self.schema, self.table, self.columns,
                           page_range, self.converter, self.target_schema, self.text_outputs, self.row_filter,
                           set_aside)


def copy_table(
    spark: SparkSession, *, dsn: str, source_schema: str, source_table: str, columns: list[str], converter: Any,
    spark_schema: StructType, target_identifier: str, snapshot_name: str, consistent_lsn: Lsn,
    session_settings: Mapping[str, str], progress: Callable[[CopyProgress], None] | None = None,
    target_rows_per_task: int = 250_000, writer: str = "auto", row_filter: str | None = None,
    set_aside: Callable[[list[SetAside]], None] | None = None, table: Any = None,
) -> CopyResult:
    """Copy ``source_schema.source_table`` (the rows its publication's ``row_filter`` keeps) into
    ``target_identifier`` as of ``snapshot_name``; see the module.
    ``writer``: "arrow" writes Parquet data files in the tasks and commits them (tables in a local or mounted
    directory), "spark" goes through Spark's Iceberg writer (any catalog and storage), "auto" picks "arrow"
    where it can. ``set_aside`` (``--on-conversion-error quarantine``): the rows the mirror cannot hold are left
    out of the copy and handed to it, all of them, before the copy commits (an empty list: none); without it such
    a row stops the copy, which commits nothing. ``table``: the target's Iceberg table, when the caller holds it
    (refreshed here: one read of the catalog's pointer, where a load reads the metadata again)."""
    from pgcdc.spark.arrow import spark_arrow_schema

    started = time.monotonic()
    label = f"{source_schema}.{source_table}"
    with psycopg.connect(dsn, autocommit=True, client_encoding="UTF8") as conn:
        ranges, estimate = plan_table_ranges(conn, source_schema, source_table,
                                             target_rows_per_task=target_rows_per_task)
        text_outputs = text_output_functions(conn, converter)
    source = _CopySource(dsn, snapshot_name, dict(session_settings), source_schema, source_table, columns,
                         converter, spark_arrow_schema(spark_schema), text_outputs, row_filter)
    copied = spark.sparkContext.accumulator(0)
    if table is None:
        table = load_table(spark, target_identifier)
    else:
        table.refresh()
    layout, directory, s3 = _arrow_plan(table, writer, label, target_identifier)
    # a small table is read and written here, in the driver: a Spark job's own cost (tens to hundreds of ms) would
    # be most of its copy, and a database's tables are mostly small
    in_driver = len(ranges) == 1 and estimate <= IN_DRIVER_ROWS
    recorded = False  # Spark's writer cannot set the position property in its commit
    with _reporting(progress, label, copied, estimate, started):
        if layout is not None and directory is not None:
            recorded = True
            _copy_with_arrow(spark, table, source, ranges, copied, layout, (directory, s3), label,
                             consistent_lsn, set_aside, in_driver=in_driver)
        else:
            _copy_with_spark(spark, source, ranges, copied, spark_schema, target_identifier, label, consistent_lsn,
                             set_aside)
    # the commit's own record count: metadata, no scan of what was just written
    table.refresh()
    snapshot = table.currentSnapshot()
    rows = 0 if snapshot is None else int(snapshot.summary().getOrDefault("total-records", "0"))
    seconds = time.monotonic() - started
    if progress:
        progress(CopyProgress(label, rows, rows, seconds))
    log.info("snapshot of %s: %d rows in %d tasks, %.1fs", label, rows, len(ranges), seconds)
    return CopyResult(rows=rows, seconds=seconds, tasks=len(ranges), recorded=recorded)


IN_DRIVER_ROWS = 50_000  # a table of at most this many rows (one range) is copied in the driver


def _arrow_plan(table: Any, writer: str, label: str, identifier: str
                ) -> tuple[list[tuple[str, Any]] | None, str | None, dict[str, Any] | None]:
    """(the Parquet layout, the data directory, pyarrow's S3 options) when the tasks write the copy's files
    themselves; a None layout when Spark's writer does."""
    directory, s3 = _arrow_destination(table) if writer in ("auto", "arrow") else (None, None)
    layout = None
    if directory is not None:
        try:
            layout = parquet_layout(table)
        except NotImplementedError as exc:
            log.info("%s: Spark writes the copy (%s)", label, exc)
    if writer == "arrow" and layout is None:
        raise ConfigError(f"the arrow snapshot writer cannot write {identifier}: its data location is "
                          "neither a directory of this machine nor S3 reached through Hadoop's FileIO with keys, "
                          "the environment or instance credentials, it is partitioned, or it has a type without a "
                          "Parquet layout; use --snapshot-writer spark (or auto)")
    return layout, directory, s3


@contextlib.contextmanager
def _reporting(progress: Callable[[CopyProgress], None] | None, label: str, copied: Any, estimate: int,
               started: float) -> Iterator[None]:
    """While inside, ``progress`` hears the rows copied so far twice a second (from the tasks' accumulator)."""
    if progress is None:
        yield
        return
    done = threading.Event()

    def report() -> None:
        while not done.wait(0.5):
            progress(CopyProgress(label, copied.value, estimate, time.monotonic() - started))

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        yield
    finally:
        done.set()
        reporter.join()


def _copy_with_arrow(spark: SparkSession, table: Any, source: _CopySource, ranges: list[PageRange], copied: Any,
                     layout: list[tuple[str, Any]], destination: tuple[str, dict[str, Any] | None], label: str,
                     consistent_lsn: Lsn, set_aside: Callable[[list[SetAside]], None] | None, *,
                     in_driver: bool = False) -> None:
    """Each task writes its range as a Parquet data file with Arrow (no row-by-row trip through the JVM); the
    driver then commits all files at once, as Spark's writer would. ``in_driver``: the ranges are written here,
    without a Spark job."""
    directory, s3 = destination
    compression = parquet_compression(table)
    prefix = f"{directory}/{uuid.uuid4()}"
    quarantine = set_aside is not None

    def write_ranges(numbered: Iterable[tuple[int, PageRange]]) -> Iterator[tuple[Any, ...]]:
        from pyspark import TaskContext

        task_context = TaskContext.get()
        attempt = task_context.taskAttemptId() if task_context is not None else 0
        filesystem = _copy_filesystem(s3)
        for task, page_range in numbered:
            # a file per attempt: a retried or speculative attempt never writes over another's file; only the
            # files of the attempts Spark returns are committed
            path = f"{prefix}-{task:05d}-{attempt}.parquet"
            target = _local_file(path) if filesystem is None else object_path(path)
            rejected: list[SetAside] | None = [] if quarantine else None
            rows = _write_range(_counted(source.read(page_range, rejected), copied), target, layout, compression,
                                filesystem)
            if rejected:
                yield ("set-aside", task, rejected)
            if not rows:  # an empty page range: no data file
                _remove(target, filesystem)
                continue
            size = os.path.getsize(target) if filesystem is None else filesystem.get_file_info(target).size
            yield ("file", path, int(size))

    # plain Python tasks (an RDD, one range each): no SQL plan, shuffle or code generation to pay for; a copy that
    # fails leaves its files to the next copy of the table (spark/orphans.py): tasks being cancelled may still
    # write, and a commit that fails may still have landed (its state unknown)
    with _errors_raised_in_tasks(label, source.table):
        if in_driver:
            results = list(write_ranges(enumerate(ranges)))
        else:
            results = (spark.sparkContext.parallelize(list(enumerate(ranges)), len(ranges))
                       .mapPartitions(write_ranges).collect())
    written = [(path, size) for kind, path, size in results if kind == "file"]
    if set_aside is not None:  # before the commit: a crash in between leaves the mirror without this copy
        set_aside([row for _, _, rows in sorted(r for r in results if r[0] == "set-aside") for row in rows])
    summary, properties = commit_properties(consistent_lsn)  # the position, in the same metadata commit
    replace_with_files(spark, table, _with_footers(written, s3), summary, properties)
    _remove_uncommitted_attempts(prefix, {path for path, _ in written}, s3)


FOOTERS_READ_AT_ONCE = 16  # on S3 each footer is a round trip of its own


def _with_footers(files: list[tuple[str, int]], s3: dict[str, Any] | None) -> Iterator[tuple[str, int, bytes]]:
    """Each of the copy's ``files`` (path, size) with its footer, read on the driver where the tasks wrote it, in
    the files' order: a few at once, and only a few ahead of the commit that takes them, so that the driver never
    holds the footers of a copy of tens of thousands of files at once (~200 bytes a column of each row group)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    filesystem = _copy_filesystem(s3)

    def read(path: str, size: int) -> tuple[str, int, bytes]:
        if filesystem is None:
            with open(_local_file(path), "rb") as file:
                return path, size, parquet_footer(file, size)
        with filesystem.open_input_file(object_path(path)) as remote:
            return path, size, parquet_footer(remote, size)

    with ThreadPoolExecutor(FOOTERS_READ_AT_ONCE, thread_name_prefix="pgcdc-footers") as pool:
        ahead: list[Future[tuple[str, int, bytes]]] = []
        for path, size in files:
            ahead.append(pool.submit(read, path, size))
            if len(ahead) >= 2 * FOOTERS_READ_AT_ONCE:
                yield ahead.pop(0).result()
        for future in ahead:
            yield future.result()


_SET_ASIDE_COLUMN = "_pgcdc_set_aside"  # a copy's row the mirror cannot hold, as JSON (the spark writer's path)


def _copy_with_spark(spark: SparkSession, source: _CopySource, ranges: list[PageRange], copied: Any,
                     spark_schema: StructType, identifier: str, label: str, consistent_lsn: Lsn,
                     set_aside: Callable[[list[SetAside]], None] | None) -> None:
    """The tasks' Arrow batches through Spark's Iceberg writer, one overwrite. Under quarantine the rows set aside
    travel beside the others (one more column) in a persisted result, so that they are handed over before the
    commit."""
    import json

    from pyspark.sql.functions import col, lit
    from pyspark.sql.types import IntegerType, StringType, StructField, StructType

    from pgcdc.spark.arrow import spark_arrow_schema

    quarantine = set_aside is not None
    produced = StructType([*spark_schema.fields, StructField(_SET_ASIDE_COLUMN, StringType())]) if quarantine \
        else spark_schema
    produced_arrow = spark_arrow_schema(produced)

    def copy_partition(batches: Iterable[pa.RecordBatch]) -> Iterable[pa.RecordBatch]:
        for batch in batches:
            for task in batch.column("task").to_pylist():
                rejected: list[SetAside] | None = [] if quarantine else None
                for rows in _counted(source.read(ranges[task], rejected), copied):
                    yield rows.append_column(_SET_ASIDE_COLUMN, pa.nulls(rows.num_rows, pa.string())) \
                        if quarantine else rows
                if rejected:
                    marks = pa.array([json.dumps([row.error, row.values]) for row in rejected], pa.string())
                    empty = [pa.nulls(len(marks), field.type) for field in produced_arrow][:-1]
                    yield pa.RecordBatch.from_arrays([*empty, marks], schema=produced_arrow)

    plan = StructType([StructField("task", IntegerType())])
    tasks = spark.createDataFrame([(i,) for i in range(len(ranges))], plan).repartition(len(ranges), "task")
    produced_frame = tasks.mapInArrow(copy_partition, produced)
    frame = produced_frame
    with _errors_raised_in_tasks(label, source.table):
        try:
            if set_aside is not None:
                from pyspark import StorageLevel

                produced_frame.persist(StorageLevel.DISK_ONLY)
                marks = produced_frame.where(col(_SET_ASIDE_COLUMN).isNotNull()).select(_SET_ASIDE_COLUMN).collect()
                set_aside([SetAside(error, tuple((name, value) for name, value in values))
                           for error, values in (json.loads(mark[0]) for mark in marks)])
                frame = produced_frame.where(col(_SET_ASIDE_COLUMN).isNull()).drop(_SET_ASIDE_COLUMN)
            writer = frame.writeTo(identifier).option("check-nullability", "false")
            for key, value in carried_summary(consistent_lsn).items():
                writer = writer.option(f"snapshot-property.{key}", value)
            writer.overwrite(lit(True))
        finally:
            if set_aside is not None:
                produced_frame.unpersist()


def _counted(batches: Iterator[pa.RecordBatch], copied: Any) -> Iterator[pa.RecordBatch]:
    for rows in batches:
        copied.add(rows.num_rows)
        yield rows


_TASK_ERROR = re.compile(r"pgcdc\.errors\.(\w+): (.*)")


@contextlib.contextmanager
def _errors_raised_in_tasks(label: str, table: str) -> Iterator[None]:
    """The error one of pgcdc's own checks raised in a copy task (a value the mirror cannot hold, the table
    dropped meanwhile) as that error, with the way out, instead of Spark's job failure around it (or raised here,
    when the driver copies a small table itself)."""
    try:
        yield
    except PgcdcError as exc:
        if isinstance(exc, ConversionError):
            raise type(exc)(_copy_stopped(str(exc), label, table)) from None
        raise
    except Exception as exc:
        found = _TASK_ERROR.search(str(exc))
        kind = getattr(errors, found.group(1), None) if found else None
        if found is None or not (isinstance(kind, type) and issubclass(kind, PgcdcError)):
            raise
        message = found.group(2).strip()
        if issubclass(kind, ConversionError):
            message = _copy_stopped(message, label, table)
        raise kind(message) from None


def _copy_stopped(message: str, label: str, table: str) -> str:
    return (f"{message}. The copy of {label} stops rather than write a wrong value, and nothing of it "
            "is committed: run with --on-conversion-error quarantine to set such rows aside, whole and "
            f"raw, in {table}__rejects beside the mirror while the rest is copied, or "
            "correct the value in the source, or leave its column out of the publication (CREATE "
            "PUBLICATION ... FOR TABLE t (columns ...)), then run pgcdc again; docs/types.md says what "
            "each type can hold")


def _arrow_destination(table: Any) -> tuple[str | None, dict[str, Any] | None]:
    """Where the tasks write the copy's Parquet files themselves: (the data directory, None) on this machine,
    (the data directory, pyarrow's S3 options) on S3; (None, None) where only Spark's writer can."""
    local = local_data_directory(table)
    if local is not None:
        return local, None
    directory = data_directory(table)
    options = s3_options(table, directory) if directory is not None else None
    return (directory, options) if options is not None else (None, None)


def _remove_uncommitted_attempts(prefix: str, committed: set[str], s3: dict[str, Any] | None) -> None:
    """After the commit: remove this copy's data files that the commit does not hold, those of task attempts
    that failed (an executor lost in the middle of writing leaves its file behind: no ``finally`` runs in a
    killed process) or that Spark superseded. Only this copy's own files (its unique prefix) are touched:
    other writers of the warehouse, and other copies, are left alone. ``s3``: pyarrow's options for an object
    store prefix (None: a directory of this machine)."""
    removed = 0
    if s3 is None:
        import glob

        kept = {_local_file(path) for path in committed}
        for path in glob.glob(glob.escape(_local_file(prefix)) + "-*.parquet"):
            if path in kept:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
            with contextlib.suppress(FileNotFoundError):  # Hadoop's checksum beside it, if any
                os.unlink(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.crc"))
    else:
        from pyarrow.fs import FileSelector

        filesystem = _copy_filesystem(s3)
        kept = {object_path(path) for path in committed}
        object_prefix = object_path(prefix)
        listed = filesystem.get_file_info(FileSelector(object_prefix.rsplit("/", 1)[0], allow_not_found=True))
        for info in listed:
            if info.path.startswith(object_prefix + "-") and info.path.endswith(".parquet") and info.path not in kept:
                with contextlib.suppress(FileNotFoundError):
                    filesystem.delete_file(info.path)
                    removed += 1
    if removed:
        log.info("removed %d data files of failed or superseded copy attempts", removed)
