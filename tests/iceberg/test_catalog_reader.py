"""The catalogs' metadata read without a JVM (pgcdc.iceberg.catalog_reader, table_metadata): Iceberg's rules for
finding a table's current metadata, the position and tag rules read over it, and every setting it does not
reproduce refused (the start then reads through Spark). Files on disk; the readers against real catalogs, beside
Spark's own reads, are in tests/integration/test_start_without_jvm.py and tests/objectstore/."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from pgcdc.errors import PositionCorruptError
from pgcdc.iceberg.catalog_reader import HadoopCatalogReader, JdbcCatalogReader, Storage, catalog_reader
from pgcdc.iceberg.table_metadata import MetadataUnreadable, TableMetadata
from pgcdc.lsn import Lsn
from pgcdc.mirrors.consistent import settled_lsn, tag_state
from pgcdc.mirrors.positions import table_position


def metadata(snapshots: list[tuple[int, int | None, str, dict]], *, current: int | None = None,
             properties: dict | None = None, tag: int | None = None, version: int = 2) -> dict:
    """A table metadata document: ``snapshots`` as (id, parent, operation, summary), oldest first."""
    document: dict = {
        "format-version": version, "table-uuid": "00000000-0000-0000-0000-000000000000", "location": "file:/t",
        "last-updated-ms": 0, "last-column-id": 1, "schemas": [], "current-schema-id": 0,
        "properties": properties or {},
        "current-snapshot-id": current if current is not None else (snapshots[-1][0] if snapshots else -1),
        "snapshots": [{"snapshot-id": sid, **({"parent-snapshot-id": parent} if parent is not None else {}),
                       "timestamp-ms": 0, "summary": {"operation": operation, **summary}, "manifest-list": "x"}
                      for sid, parent, operation, summary in snapshots],
    }
    if version >= 2:
        document["refs"] = {"main": {"snapshot-id": document["current-snapshot-id"], "type": "branch"}}
        if tag is not None:
            document["refs"]["pgcdc_consistent"] = {"snapshot-id": tag, "type": "tag"}
    return document


def table(*args, **kwargs) -> TableMetadata:
    return TableMetadata(metadata(*args, **kwargs), "file:/t/metadata/v1.metadata.json")


def test_metadata_reads_as_iceberg_parses_it():
    read = table([(1, None, "append", {"pgcdc.lsn": "0/10"}), (2, 1, "replace", {})],
                 properties={"pgcdc.key": "id"}, tag=1)
    assert read.currentSnapshot().snapshotId() == 2 and read.currentSnapshot().parentId() == 1
    assert read.currentSnapshot().operation() == "replace"
    assert "operation" not in read.snapshot(1).summary() and read.snapshot(1).summary()["pgcdc.lsn"] == "0/10"
    assert read.snapshot(99) is None and read.refs()["pgcdc_consistent"].snapshotId() == 1
    assert read.properties()["pgcdc.key"] == "id"
    assert table([], version=2).currentSnapshot() is None  # -1: no snapshot yet
    old = table([(5, None, "append", {})], version=1)  # format 1 before refs: main is the current snapshot
    assert old.refs()["main"].snapshotId() == 5
    compressed = gzip.compress(json.dumps(metadata([(1, None, "append", {})])).encode())
    assert TableMetadata.parse(compressed, "s3a://b/t/metadata/v3.gz.metadata.json").currentSnapshot() is not None
    with pytest.raises(MetadataUnreadable, match="format version 4"):
        TableMetadata(metadata([], version=4), "x")
    with pytest.raises(MetadataUnreadable):
        TableMetadata.parse(b"{not json", "x")
    with pytest.raises(MetadataUnreadable):
        TableMetadata({"format-version": 2, "snapshots": [{"summary": {}}]}, "x")


def test_positions_read_from_metadata_follow_the_same_rules():
    # the highest pgcdc.lsn of the current lineage; a snapshot off the lineage does not count
    lineage = table([(1, None, "append", {"pgcdc.lsn": "0/30"}), (2, 1, "overwrite", {"pgcdc.lsn": "0/20"}),
                     (9, None, "append", {"pgcdc.lsn": "0/99"}), (3, 2, "replace", {})], current=3,
                    properties={"pgcdc.key": "id"})
    assert table_position("m", lineage) == Lsn.parse("0/30")
    # every summary expired: the property; a pending mark on a keyless table is refused, never guessed
    expired = table([(7, 6, "replace", {})], properties={"pgcdc.key": "id", "pgcdc.position": '{"lsn": "0/40"}'})
    assert table_position("m", expired) == Lsn.parse("0/40")
    pending = table([(7, 6, "replace", {})], properties={"pgcdc.key": "", "pgcdc.position":
                                                           '{"lsn": "0/40", "pending": "0/50"}'})
    with pytest.raises(PositionCorruptError, match="no key"):
        table_position("m", pending)
    with pytest.raises(PositionCorruptError, match="not an LSN"):
        table_position("m", table([(1, None, "append", {"pgcdc.lsn": "not-an-lsn"})]))
    assert table_position("m", table([])) is None


def test_tags_at_rest_need_no_move_and_any_other_state_does():
    start = Lsn.parse("0/90")

    def tagged(at: str, tag: int = 2, current: int = 2) -> TableMetadata:
        return table([(1, None, "append", {"pgcdc.lsn": "0/10"}), (2, 1, "append", {"pgcdc.lsn": "0/20"})],
                     current=current, tag=tag, properties={"pgcdc.consistent": json.dumps({"lsn": at, "snapshot": tag})})

    assert tag_state(tagged("0/20")).lsn == Lsn.parse("0/20")
    assert settled_lsn({"a": tagged("0/20"), "b": tagged("0/20")}, start) == Lsn.parse("0/20")  # at rest
    assert settled_lsn({"a": tagged("0/90", tag=1), "b": tagged("0/90")}, start) == start  # already at start
    assert settled_lsn({"a": tagged("0/20"), "b": tagged("0/10", tag=1)}, start) is None  # apart: they move
    assert settled_lsn({"a": tagged("0/20", tag=1), "b": tagged("0/20")}, start) is None  # a commit since
    untagged = table([(1, None, "append", {"pgcdc.lsn": "0/10"})])
    assert settled_lsn({"a": tagged("0/20"), "b": untagged}, start) is None  # a mirror without a tag
    assert settled_lsn({"a": tagged("0/20"), "b": None}, start) is None  # a mirror gone meanwhile
    assert settled_lsn({}, start) is None


def write_version(directory: Path, version: int, snapshot: int, *, suffix: str = ".metadata.json") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = json.dumps(metadata([(snapshot, None, "append", {})])).encode()
    (directory / f"v{version}{suffix}").write_bytes(gzip.compress(data) if "gz" in suffix else data)


def test_the_hadoop_catalog_finds_the_current_metadata_as_iceberg_does(tmp_path: Path):
    reader = HadoopCatalogReader(tmp_path.as_uri(), Storage({}))
    metadata_dir = tmp_path / "mirror" / "public" / "t" / "metadata"
    assert reader.load(("mirror", "public"), "t") is None  # no metadata: no table
    write_version(metadata_dir, 1, 10)
    write_version(metadata_dir, 2, 20)
    (metadata_dir / "version-hint.text").write_text("1")
    # a stale hint: the versions after it are followed to the last one that exists
    assert reader.load(("mirror", "public"), "t").currentSnapshot().snapshotId() == 20
    write_version(metadata_dir, 3, 30, suffix=".gz.metadata.json")
    assert reader.load(("mirror", "public"), "t").currentSnapshot().snapshotId() == 30
    (metadata_dir / "version-hint.text").write_text("garbage")  # unreadable hint: the highest version listed
    assert reader.load(("mirror", "public"), "t").currentSnapshot().snapshotId() == 30
    (metadata_dir / "version-hint.text").write_text("7")  # a hint naming a file that is missing: not guessed
    with pytest.raises(MetadataUnreadable, match="version 7 is missing"):
        reader.load(("mirror", "public"), "t")
    (metadata_dir / "version-hint.text").write_text("3")

    (tmp_path / "mirror" / "other" / "not_a_table").mkdir(parents=True)  # a namespace holding no table yet
    write_version(tmp_path / "mirror" / "public" / "t__changes" / "metadata", 1, 1)
    assert sorted(reader.namespaces(("mirror",)) or []) == [("mirror", "other"), ("mirror", "public")]
    assert sorted(reader.tables(("mirror", "public"))) == ["t", "t__changes"]
    assert reader.tables(("mirror", "other")) == []
    assert reader.namespaces(("mirror", "public", "t")) is None  # a table is no namespace
    assert reader.namespaces(("nothing",)) is None


def test_settings_it_does_not_reproduce_are_left_to_spark(tmp_path: Path):
    catalog = "spark.sql.catalog.pgcdc"
    hadoop = {catalog: "org.apache.iceberg.spark.SparkCatalog", f"{catalog}.type": "hadoop",
              f"{catalog}.warehouse": tmp_path.as_uri()}
    assert isinstance(catalog_reader("pgcdc", hadoop), HadoopCatalogReader)
    for refused in ({f"{catalog}.type": "hive"}, {f"{catalog}.catalog-impl": "org.example.Glue"},
                    {f"{catalog}.io-impl": "org.apache.iceberg.aws.s3.S3FileIO"},
                    {catalog: "org.apache.spark.sql.delta.catalog.DeltaCatalog"},
                    {f"{catalog}.encryption.kms-impl": "org.example.Kms"},
                    {"spark.hadoop.fs.s3a.access.key": "${env.KEY}"}):
        with pytest.raises(MetadataUnreadable):
            catalog_reader("pgcdc", {**hadoop, **refused})
    on_hdfs = catalog_reader("pgcdc", {**hadoop, f"{catalog}.warehouse": "hdfs://namenode/warehouse"})
    with pytest.raises(MetadataUnreadable, match="hdfs"):
        on_hdfs.load(("mirror", "public"), "t")
    provider = catalog_reader("pgcdc", {**hadoop, f"{catalog}.warehouse": "s3a://bucket/warehouse",
                                        "spark.hadoop.fs.s3a.aws.credentials.provider": "org.example.AssumedRole"})
    with pytest.raises(MetadataUnreadable, match="provider"):
        provider.load(("mirror", "public"), "t")


def test_a_jdbc_catalog_is_reached_as_postgresql_s_driver_would():
    conninfo = JdbcCatalogReader._conninfo("jdbc:postgresql://db.example:6543/ice%20berg?ssl=true&ApplicationName=x",
                                           {"jdbc.user": "iceberg", "jdbc.password": "secret",
                                            "jdbc.schema-version": "V1"})
    assert conninfo == {"host": "db.example", "port": "6543", "dbname": "ice berg", "connect_timeout": "30",
                        "user": "iceberg", "password": "secret", "sslmode": "verify-full", "application_name": "x"}
    assert JdbcCatalogReader._conninfo("jdbc:postgresql://h/db", {})["port"] == "5432"
    for refused in ("jdbc:sqlite:/tmp/catalog.db", "jdbc:postgresql://a:1,b:2/db", "jdbc:postgresql://h/db?currentSchema=x"):
        with pytest.raises(MetadataUnreadable):
            JdbcCatalogReader._conninfo(refused, {})
    with pytest.raises(MetadataUnreadable, match="options"):  # a driver property libpq has no word for
        JdbcCatalogReader._conninfo("jdbc:postgresql://h/db", {"jdbc.options": "-c search_path=x"})
