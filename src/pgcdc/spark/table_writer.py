"""Rows written as an Iceberg table's own data files by Arrow, in the table's layout, ready for a commit.

What every writer of pgcdc's that bypasses Spark shares (the row-delta writer, :mod:`pgcdc.apply.row_delta`; the
compaction of a small mirror, :mod:`pgcdc.mirrors.small_compaction`): the Parquet layout read from the table's
schema (field ids, Iceberg's stored types, codec), the paths the table's location provider gives, the table's
FileIO for stores Arrow does not write directly, and a ``DataFile`` per file with its metrics from the footer —
one file per partition of a partitioned table (:mod:`pgcdc.iceberg.partition_values`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from pgcdc.iceberg.locations import local_path
from pgcdc.iceberg.parquet import layout_schema, parquet_footer, write_parquet
from pgcdc.iceberg.partition_specs import PartitionField, UnsupportedPartitioning, spec_fields
from pgcdc.iceberg.partition_values import partition_rows
from pgcdc.spark.iceberg_java import (
    PartitionsUnavailable,
    commit_outcome_unknown,
    data_file,
    default_data_directory,
    iceberg_classes,
    parquet_compression,
    parquet_layout,
    partition_data,
    partition_spec_json,
    schema_json,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("pgcdc.spark.table_writer")


@dataclass(frozen=True)
class Written:
    """A data file written: its location, its Iceberg ``DataFile``, and which rows of those handed over it holds,
    in its order (row i of the file is row ``rows[i]`` of them)."""

    path: str
    data_file: Any
    rows: np.ndarray


@dataclass(frozen=True)
class Layout:
    """What a writer of a table's files reads from its metadata: the Parquet layout (field ids, Iceberg's stored
    types), codec, partition spec, format version, metrics configs and location provider. Kept between writes while
    the table's ``shape`` stays the same (``pgcdc.iceberg.Commits.shape``: its format version, schema, spec, sort
    order, location and properties other than pgcdc's; None without pgcdc's jar, whose layout is read afresh every
    write)."""

    shape: str | None
    schema: pa.Schema
    layout_problem: str | None
    compression: tuple[str, int | None]
    spec: Any
    partitioned: bool
    partition_fields: list[PartitionField]
    partition_problem: str | None
    format_version: int
    metrics: Any  # the table's MetricsConfig, for data files
    position_metrics: Any  # for position-delete files
    locations: Any  # the table's LocationProvider
    # where Iceberg's default location provider puts the table's new files of no partition, each named here without
    # a round trip into the JVM (None: another provider, which is asked for each file's location)
    data_directory: str | None = None

    @classmethod
    def of(cls, table: Any, known: Layout | None = None, shape: str | None = None) -> Layout:
        """``table``'s layout: ``known`` when the table's shape is still the one it was read at, else read now.
        ``shape``: the table's, when the caller read it already (:func:`~pgcdc.spark.iceberg_java.refreshed_state`)."""
        classes = iceberg_classes()
        if shape is None and classes.commits is not None:
            shape = str(classes.commits.shape(table))
        if known is not None and shape is not None and known.shape == shape:
            return known
        layout_problem: str | None = None
        table_schema = schema_json(table)  # the layout's and the partition spec's source columns
        try:
            columns = parquet_layout(table, table_schema)
        except NotImplementedError as exc:
            layout_problem, columns = str(exc), []
        spec = table.spec()
        partitioned = bool(spec.isPartitioned())
        partition_fields: list[PartitionField] = []
        partition_problem: str | None = None
        if partitioned:
            try:
                partition_fields = spec_fields(partition_spec_json(spec), table_schema)
            except UnsupportedPartitioning as exc:
                partition_problem = f"its partition spec holds {exc}"
            if classes.partitions is None:
                partition_problem = str(PartitionsUnavailable())
        locations = table.locationProvider()
        return cls(shape, layout_schema(columns), layout_problem, parquet_compression(table), spec, partitioned,
                   partition_fields, partition_problem, int(table.operations().current().formatVersion()),
                   classes.metrics_for_table(table), classes.metrics_for_position_deletes(table), locations,
                   default_data_directory(locations))


class TableWriter:
    """One Iceberg table as a writer of its data files sees it now: its schema and field ids (a schema change
    between two writes is followed), its Parquet layout, codec and partition spec (:class:`Layout`)."""

    def __init__(self, spark: SparkSession, table: Any, known: Layout | None = None, shape: str | None = None
                 ) -> None:
        """``table``: the ``org.apache.iceberg.Table``, loaded or refreshed for this write; ``known``: its layout
        as the last write read it (kept while the table's shape is the same); ``shape``: the table's, when known."""
        self.spark = spark
        self.table = table
        self.layout = layout = Layout.of(table, known, shape)
        self.schema = layout.schema
        self.layout_problem = layout.layout_problem
        self.compression = layout.compression
        self.spec = layout.spec
        self.partitioned = layout.partitioned
        self.partition_fields = layout.partition_fields
        self.partition_problem = layout.partition_problem

    def arrow_problem(self) -> str | None:
        """Why Arrow cannot write this table's data files (None: it can)."""
        return self.partition_problem or self.layout_problem

    def data_files(self, rows: pa.Table, written: list[str]) -> list[Written]:
        """``rows`` as data files: one, or one per partition their values fall in. Each path is appended to
        ``written`` before its file is, so a failure can remove what exists (:meth:`remove`)."""
        metrics_config = self.layout.metrics
        if not self.partitioned:
            path, size, footer = self.write(rows, self.schema, written)
            return [Written(path, data_file(self.spark, self.table, path, size, footer, metrics_config=metrics_config,
                                            spec=self.spec), np.arange(rows.num_rows))]
        files = []
        for group in partition_rows(rows, self.partition_fields):
            partition = partition_data(self.spec, group.values)
            path, size, footer = self.write(rows.take(pa.array(group.rows)), self.schema, written,
                                            partition=partition)
            files.append(Written(path, data_file(self.spark, self.table, path, size, footer, spec=self.spec,
                                                 metrics_config=metrics_config, partition=partition), group.rows))
        return files

    def write(self, rows: pa.Table, schema: pa.Schema, written: list[str], *, partition: Any = None,
              spec: Any = None) -> tuple[str, int, bytes]:
        """``rows`` as one Parquet file in ``schema`` (field ids, Iceberg's types) at a new location of the
        table (under its partition's, when given); returns its path, size and footer."""
        name = f"{uuid.uuid4()}.parquet"
        provider = self.layout.locations
        if partition is not None:
            path = str(provider.newDataLocation(spec or self.spec, partition, name))
        elif self.layout.data_directory is not None:
            path = f"{self.layout.data_directory}/{name}"
        else:
            path = str(provider.newDataLocation(name))
        written.append(path)
        local = local_path(path)
        if local is not None:
            os.makedirs(os.path.dirname(local), exist_ok=True)
            write_parquet(rows.to_batches(), local, schema, self.compression)
            size = os.path.getsize(local)
            with open(local, "rb") as file:
                return path, size, parquet_footer(file, size)
        sink = pa.BufferOutputStream()
        write_parquet(rows.to_batches(), sink, schema, self.compression)
        content = sink.getvalue().to_pybytes()
        footer = parquet_footer(io.BytesIO(content), len(content))
        # a new name: s3a's create would first ask the store whether a file is there (a request of its own)
        stream = self.table.io().newOutputFile(path).createOrOverwrite()
        try:
            stream.write(bytearray(content))
        finally:
            stream.close()
        return path, len(content), footer

    @contextlib.contextmanager
    def committing(self, what: str) -> Iterator[list[str]]:
        """The paths of the files written for one commit (appended by :meth:`data_files` and :meth:`write`): removed
        when the commit fails for sure, kept when its outcome is unknown (they may be part of the table), the
        failure raised either way. ``what``: the commit, as the log names it."""
        written: list[str] = []
        try:
            yield written
        except Exception as exc:
            if commit_outcome_unknown(exc):
                log.error("%s outcome is unknown; its files are kept: %s", what, ", ".join(written))
            else:
                self.remove(written)
            raise

    def remove(self, paths: list[str]) -> None:
        """Delete the files of a commit that failed for sure (a failure to is logged: they are orphans then)."""
        for path in paths:
            try:
                self.table.io().deleteFile(path)
            except Exception as exc:
                log.warning("could not remove %s of a failed commit: %s", path, exc)
