"""Files pgcdc writes itself, outside Spark's writer: where a table location points on this machine or in an
object store, and Parquet data files in an Iceberg table's layout. Used by the initial copy's tasks, the row-delta
writer and the removal of files an interrupted copy left."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote, urlparse

import pyarrow as pa

from pgcdc.spark.iceberg import FieldLayout, dictionary_columns


def local_path(location: str) -> str | None:
    """A ``file:`` location (``file:/x``, ``file:///x``, percent-encoded as Hadoop writes URIs) or a plain absolute
    path as a path of this machine; None for any other scheme (object stores, HDFS), which only the table's
    FileIO reaches."""
    if location.startswith("file:"):
        return unquote(urlparse(location).path)
    return location if location.startswith("/") else None


def object_path(location: str) -> str:
    """An object store location (``s3a://bucket/key``) as pyarrow's file systems name it (``bucket/key``)."""
    return location.split("://", 1)[1]


# Hadoop's credential providers whose credentials pyarrow finds the same way: the keys in the settings, or
# the AWS SDK's default chain (environment, profile, instance metadata)
_PLAIN_PROVIDERS = ("SimpleAWSCredentialsProvider", "TemporaryAWSCredentialsProvider",
                    "EnvironmentVariableCredentialsProvider", "IAMInstanceCredentialsProvider",
                    "InstanceProfileCredentialsProvider", "DefaultAWSCredentialsProviderChain")


def hadoop_s3_options(location: str, hadoop: Callable[[str], Any]) -> dict[str, Any] | None:
    """Keyword arguments of ``pyarrow.fs.S3FileSystem`` that reach ``location`` (``s3a://``, ``s3://``) as Hadoop's
    s3a client does with the settings ``hadoop`` gives (a key's value, or None: ``fs.s3a.*``, per-bucket
    ``fs.s3a.bucket.<bucket>.*`` first). None when ``location`` is not on S3, or its credentials come from a
    provider pyarrow cannot stand in for (e.g. an assumed role)."""
    parsed = urlparse(location)
    if parsed.scheme not in ("s3a", "s3", "s3n"):
        return None

    def setting(name: str) -> str | None:
        value = hadoop(f"fs.s3a.bucket.{parsed.netloc}.{name}") or hadoop(f"fs.s3a.{name}")
        return str(value).strip() or None if value else None

    providers = setting("aws.credentials.provider") or ""
    anonymous = "AnonymousAWSCredentialsProvider" in providers
    if providers and not anonymous and not all(
            p.strip().rsplit(".", 1)[-1] in _PLAIN_PROVIDERS for p in providers.split(",") if p.strip()):
        return None
    options: dict[str, Any] = {"anonymous": anonymous}
    if not anonymous and setting("access.key") and setting("secret.key"):
        options.update(access_key=setting("access.key"), secret_key=setting("secret.key"),
                       session_token=setting("session.token"))
    region = setting("endpoint.region") or setting("region")
    if region:
        options["region"] = region
    endpoint = setting("endpoint")
    ssl = (setting("connection.ssl.enabled") or "true").lower() != "false"
    if endpoint:
        if "://" in endpoint:
            scheme, endpoint = endpoint.split("://", 1)
            ssl = scheme == "https"
        options["endpoint_override"] = endpoint.rstrip("/")
        # pyarrow addresses buckets by path when it is given an endpoint, Hadoop only when told to
        options["force_virtual_addressing"] = (setting("path.style.access") or "false").lower() != "true"
    options["scheme"] = "https" if ssl else "http"
    return options


def layout_schema(layout: list[tuple[str, FieldLayout]]) -> pa.Schema:
    """The Arrow schema of an Iceberg table's Parquet layout (:func:`pgcdc.spark.iceberg.parquet_layout`): field
    ids on every column and nested field, Iceberg's types."""
    return pa.schema([pa.field(name, arrow_type, metadata={b"PARQUET:field_id": str(field_id).encode()})
                      for name, (field_id, arrow_type) in layout])


def in_layout(rows: pa.Table | list[pa.RecordBatch], schema: pa.Schema) -> pa.Table:
    """``rows`` by name in ``schema``'s order and types (Iceberg's: e.g. smallint stored as int, nested field
    ids attached); a column the rows lack is NULL."""
    table = rows if isinstance(rows, pa.Table) else (
        pa.Table.from_batches(rows) if rows else schema.empty_table())
    return pa.Table.from_arrays(
        [table.column(field.name).cast(field.type) if field.name in table.column_names
         else pa.nulls(table.num_rows, field.type) for field in schema], schema=schema)


ROW_GROUP_BYTES = 96 << 20  # Arrow bytes buffered per Parquet row group (Iceberg's default group: 128 MB)


def write_parquet(batches: Iterable[pa.RecordBatch], sink: Any, schema: pa.Schema,
                  compression: tuple[str, int | None]) -> int:
    """``batches`` as one Parquet file on ``sink`` (a path or an output stream) in ``schema`` (field ids, Iceberg's
    types), with the table's codec; returns the rows written. A dictionary only for the columns whose values
    repeat in the first batch (:func:`pgcdc.spark.iceberg.dictionary_columns`); row groups of about
    :data:`ROW_GROUP_BYTES`."""
    import pyarrow.parquet as pq

    codec, level = compression
    batches = iter(batches)
    first = next(batches, None)
    dictionary = dictionary_columns(first) if first is not None else []
    rows = 0
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    with pq.ParquetWriter(sink, schema, compression=codec, compression_level=level,
                          use_dictionary=dictionary or False, use_compliant_nested_type=True) as writer:
        for batch in itertools.chain([first] if first is not None else [], batches):
            pending.append(batch)
            pending_bytes += batch.nbytes
            rows += batch.num_rows
            if pending_bytes >= ROW_GROUP_BYTES:
                writer.write_table(in_layout(pending, schema), row_group_size=1 << 30)
                pending, pending_bytes = [], 0
        if pending or rows == 0:
            writer.write_table(in_layout(pending, schema), row_group_size=1 << 30)
    return rows


PARQUET_MAGIC = b"PAR1"
FOOTER_READ_BYTES = 64 << 10  # one read of a file's end holds the footer of any file pgcdc writes


def parquet_footer(file: Any, size: int) -> bytes:
    """The footer of the Parquet ``file`` (seekable: a local file, an object store's input file, a buffer) of
    ``size`` bytes: its metadata, Thrift-encoded, as stored before the footer's length and the closing magic.
    Iceberg's column metrics are read from it (:func:`pgcdc.spark.iceberg.data_file`), without opening the file
    again in the JVM."""
    if size < 12:
        raise ValueError(f"a Parquet file of {size} bytes has no footer")
    tail_size = min(size, FOOTER_READ_BYTES)
    file.seek(size - tail_size)
    tail = bytes(file.read(tail_size))
    length = int.from_bytes(tail[-8:-4], "little")
    if tail[-4:] != PARQUET_MAGIC or length + 12 > size:
        raise ValueError("not a Parquet file with a plain footer (an encrypted footer ends in PARE)")
    if length + 8 <= tail_size:
        return tail[tail_size - 8 - length:tail_size - 8]
    file.seek(size - 8 - length)
    return bytes(file.read(length))
