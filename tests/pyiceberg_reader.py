"""A second reader of the mirrors that is not pgcdc's code: PyIceberg, reading a table's own metadata as a user
would — the newest metadata file of a Hadoop-catalog table (its ``version-hint.text``), or a JDBC catalog through
PyIceberg's ``SqlCatalog`` — and compared with what Iceberg's Java reader (Spark) reads of the same snapshot."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

import pyarrow as pa

_VERSION_FILE = re.compile(r"v(\d+)\.metadata\.json")


def newest_metadata(table_location: str) -> str:
    """The newest metadata file of a Hadoop-catalog table, found as Iceberg's own Hadoop catalog finds it: the
    version ``version-hint.text`` names — or the highest version listed when the hint cannot be read, as while a
    commit replaces it (Iceberg deletes the old hint, then renames the new one in) — then each next version while
    its file exists."""
    directory = Path(unquote(urlparse(table_location).path)) / "metadata"
    try:
        version = int((directory / "version-hint.text").read_text().strip())
    except (FileNotFoundError, ValueError):
        version = max((int(match.group(1)) for name in os.listdir(directory)
                       if (match := _VERSION_FILE.fullmatch(name))), default=0)
    while (directory / f"v{version + 1}.metadata.json").exists():
        version += 1
    return str(directory / f"v{version}.metadata.json")


def hadoop_table(spark, identifier: str):
    """The PyIceberg table of a mirror in a local Hadoop-catalog warehouse (``identifier`` as Spark names it)."""
    from pyiceberg.table import StaticTable

    location = next(row.data_type for row in spark.sql(f"DESCRIBE TABLE EXTENDED {identifier}").collect()
                    if row.col_name == "Location")
    return StaticTable.from_metadata(newest_metadata(location))


def sql_catalog_table(uri: str, warehouse: str, identifier: tuple[str, ...], properties: dict[str, str],
                      name: str = "pgcdc"):
    """The PyIceberg table of a mirror recorded in Iceberg's JDBC catalog ``name`` (a PostgreSQL database at
    ``uri``, ``postgresql+psycopg2://...``), read through PyIceberg's ``SqlCatalog``."""
    from pyiceberg.catalog.sql import SqlCatalog

    catalog = SqlCatalog(name, uri=uri, warehouse=warehouse, **properties)
    return catalog.load_table(identifier)


def jdbc_catalog_table(setup, s3, identifier: str):
    """The PyIceberg table of a mirror (``identifier`` as Spark names it, catalog first) in Iceberg's JDBC catalog
    on a local S3 server (:func:`pgcdc.local_object_store.jdbc_catalog`'s ``setup``), read through PyIceberg's
    ``SqlCatalog`` from the catalog's own database and the bucket."""
    from urllib.parse import urlparse

    jdbc = urlparse(setup.catalog_uri.removeprefix("jdbc:"))
    user = setup.spark_conf[f"spark.sql.catalog.{setup.catalog}.jdbc.user"]
    parts = [part.strip("`") for part in identifier.split("`.`")]
    return sql_catalog_table(f"postgresql+psycopg2://{user}@{jdbc.hostname}:{jdbc.port}{jdbc.path}", setup.warehouse,
                             tuple(parts[1:]), {"s3.endpoint": s3.endpoint, "s3.access-key-id": s3.access_key,
                                                "s3.secret-access-key": s3.secret_key, "s3.region": "us-east-1"},
                             name=setup.catalog)


def sorted_rows(table: pa.Table) -> list[str]:
    """Rows as their repr, sorted: a total order in which equal values compare equal (NaN, None and nested values
    included)."""
    columns = [table.column(i).to_pylist() for i in range(table.num_columns)]
    return sorted(repr(row) for row in zip(*columns, strict=True)) if columns else []


def assert_reads_alike(spark, identifier: str, pyiceberg_table, snapshot_id: int | None = None) -> int:
    """PyIceberg reads exactly the rows Spark reads of the mirror's snapshot (default: the current one); returns
    how many."""
    from pgcdc.spark.arrow import plain_type

    if snapshot_id is None:
        snapshot = pyiceberg_table.current_snapshot()
        snapshot_id = snapshot.snapshot_id if snapshot is not None else None
    read = pyiceberg_table.scan(snapshot_id=snapshot_id).to_arrow() if snapshot_id is not None else None
    frame = spark.read.option("snapshot-id", snapshot_id).table(identifier) if snapshot_id is not None \
        else spark.table(identifier)
    batches = frame._collect_as_arrow()
    expected = pa.Table.from_batches(batches) if batches else None
    # a snapshot older than a column: PyIceberg reads it in its own schema, Spark in the table's (the column NULL)
    names = [f.name for f in frame.schema.fields if read is None or f.name in read.column_names]
    if expected is not None:
        for name in (f.name for f in frame.schema.fields if f.name not in names):
            assert expected.column(name).null_count == expected.num_rows, (identifier, snapshot_id, name)
        expected = expected.select(names)
    plain = [] if read is None else sorted_rows(read.select(names).cast(
        pa.schema([pa.field(f.name, plain_type(f.type)) for f in read.select(names).schema])))
    wanted = [] if expected is None else sorted_rows(expected.cast(
        pa.schema([pa.field(f.name, plain_type(f.type)) for f in expected.schema])))
    if plain != wanted:
        differing = [(a, b) for a, b in zip(plain, wanted, strict=False) if a != b][:2]
        raise AssertionError(f"{identifier} at snapshot {snapshot_id}: PyIceberg read {len(plain)} rows, Spark "
                             f"{len(wanted)}; first differing (PyIceberg, Spark): {differing}")
    return len(plain)
