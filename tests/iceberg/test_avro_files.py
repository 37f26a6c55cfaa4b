"""Avro container files read by pgcdc (pgcdc.iceberg.avro_files), written by another writer: PyIceberg's, which
writes Iceberg's manifests in Python (Java-written manifests: tests/iceberg/test_table_files.py). Every record
comes back as written, whatever the codec (each one Iceberg writes: snappy and zstd too, which once went through
the JVM) and blocks; a snapshot's manifests in any codec list its files; damaged files are refused as unreadable,
never misread. No JVM, no server: these run in make test-fast."""

from __future__ import annotations

import contextlib
import decimal
import json
import random
import struct
from pathlib import Path

import pytest
from pyiceberg.avro.encoder import BinaryEncoder
from pyiceberg.avro.file import AvroOutputFile
from pyiceberg.io.pyarrow import PyArrowFileIO
from pyiceberg.manifest import (
    DataFile,
    DataFileContent,
    FileFormat,
    ManifestEntry,
    ManifestEntryStatus,
    write_manifest,
    write_manifest_list,
)
from pyiceberg.partitioning import PartitionField, PartitionSpec
from pyiceberg.schema import Schema
from pyiceberg.transforms import BucketTransform, DayTransform
from pyiceberg.typedef import Record
from pyiceberg.types import (
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FixedType,
    FloatType,
    IntegerType,
    ListType,
    LongType,
    MapType,
    NestedField,
    StringType,
    StructType,
)

from pgcdc.errors import MetadataUnreadable
from pgcdc.iceberg.avro_files import read_container
from pgcdc.iceberg.catalog_reader import Storage
from pgcdc.iceberg.table_files import TableFile, snapshot_files
from pgcdc.iceberg.table_metadata import Snapshot

SCHEMA = Schema(
    NestedField(1, "id", LongType(), required=True),
    NestedField(2, "name", StringType(), required=False),
    NestedField(3, "tags", ListType(4, StringType(), element_required=True), required=False),
    NestedField(5, "counts", MapType(6, IntegerType(), 7, LongType(), value_required=True), required=False),
    NestedField(8, "blobs", MapType(9, StringType(), 10, BinaryType()), required=False),
    NestedField(11, "nested", StructType(NestedField(12, "f", FloatType(), required=False),
                                         NestedField(13, "d", DoubleType(), required=True),
                                         NestedField(14, "b", BooleanType(), required=True)), required=False),
    NestedField(15, "fixed", FixedType(3), required=False),
    NestedField(16, "amount", DecimalType(9, 2), required=False),
)


def random_record(rng: random.Random, key: int) -> tuple[Record, dict]:
    """A record of SCHEMA for PyIceberg's writer, and what reading it back must give (maps as Iceberg writes them
    to Avro: arrays of key-value records; decimals as their unscaled big-endian bytes)."""
    def maybe(value):
        return None if rng.random() < 0.2 else value

    name = maybe("".join(rng.choice("aé z\u00ff\U0001f600") for _ in range(rng.randrange(0, 12))))
    tags = maybe([f"t{rng.randrange(-5, 5)}" for _ in range(rng.randrange(0, 4))])
    counts = maybe({rng.randrange(-2**31, 2**31): rng.randrange(-2**63, 2**63) for _ in range(rng.randrange(0, 3))})
    blobs = maybe({f"k{i}": rng.randbytes(rng.randrange(0, 6)) for i in range(rng.randrange(0, 3))})
    nested = maybe((maybe(struct.unpack("<f", struct.pack("<f", rng.uniform(-1e6, 1e6)))[0]),
                    rng.uniform(-1e300, 1e300), rng.random() < 0.5))
    fixed = maybe(rng.randbytes(3))
    cents = rng.randrange(-10**8, 10**8)
    amount = maybe(decimal.Decimal(cents).scaleb(-2))
    record = Record(key, name, tags, counts, blobs, None if nested is None else Record(*nested), fixed, amount)
    expected = {"id": key, "name": name, "tags": tags,
                "counts": None if counts is None else [{"key": k, "value": v} for k, v in counts.items()],
                "blobs": None if blobs is None else [{"key": k, "value": v} for k, v in blobs.items()],
                "nested": None if nested is None else dict(zip(("f", "d", "b"), nested, strict=True)),
                "fixed": fixed,
                "amount": None if amount is None else cents.to_bytes(4, "big", signed=True)}
    return record, expected


def written(path: Path, codec: str, blocks: list[list[Record]]) -> bytes:
    with AvroOutputFile(PyArrowFileIO().new_output(str(path)), SCHEMA, "manifest_entry",
                        metadata={"avro.codec": codec, "format-version": "2"}) as output:
        for block in blocks:
            output.write_block(block)
    return path.read_bytes()


@pytest.mark.parametrize("codec", ["deflate", "null", "snappy", "zstandard", "bzip2"])
def test_every_record_of_every_block_reads_back_as_written(tmp_path, codec):
    rng = random.Random(f"avro-{codec}")
    made = [random_record(rng, key) for key in range(700)]
    cuts = sorted(rng.sample(range(1, 700), 6))
    blocks = [[record for record, _ in made[start:end]] for start, end in zip([0, *cuts], [*cuts, 700], strict=True)]
    metadata, records = read_container(written(tmp_path / "f.avro", codec, blocks), "f.avro")
    assert records == [expected for _, expected in made]
    assert metadata["avro.codec"] == codec and metadata["format-version"] == "2"
    assert [field["name"] for field in metadata["avro.schema"]["fields"]] == [f.name for f in SCHEMA.fields]


def test_avro_maps_enums_and_named_types_read_by_the_spec(tmp_path):
    """What PyIceberg's writer does not write (it writes maps as arrays), encoded here value by value with its
    encoder: an Avro map, an enum, a fixed and a record referred to by name after their definition."""
    schema = {"type": "record", "name": "outer", "namespace": "n", "fields": [
        {"name": "m", "type": {"type": "map", "values": "long"}},
        {"name": "e", "type": {"type": "enum", "name": "colour", "symbols": ["red", "green", "blue"]}},
        {"name": "inner", "type": {"type": "record", "name": "pair", "fields": [{"name": "a", "type": "int"}]}},
        {"name": "again", "type": ["null", "n.pair"]},
        {"name": "colours", "type": {"type": "array", "items": "colour"}}]}
    body = BinaryEncoder(output := _Buffer())
    body.write_int(2)  # a map block of two entries
    for key, value in (("x", -1), ("y", 2**40)):
        body.write_utf8(key)
        body.write_int(value)
    body.write_int(0)
    body.write_int(1)  # green
    body.write_int(7)  # inner.a
    body.write_int(1)  # the union's second branch: a pair
    body.write_int(-3)
    body.write_int(-2)  # an array block with its size in bytes: two items
    body.write_int(2)
    body.write_int(0)
    body.write_int(2)
    body.write_int(0)
    data = _container(json.dumps(schema), bytes(output.data))
    assert read_container(data, "f.avro")[1] == [{"m": {"x": -1, "y": 2**40}, "e": "green", "inner": {"a": 7},
                                                "again": {"a": -3}, "colours": ["red", "blue"]}]


@pytest.mark.parametrize("codec", ["deflate", "snappy", "zstandard", "null"])
def test_damaged_files_are_unreadable_never_misread(tmp_path, codec):
    rng = random.Random(f"avro-damage-{codec}")
    made = [random_record(rng, key) for key in range(40)]
    data = written(tmp_path / "f.avro", codec, [[r for r, _ in made[:20]], [r for r, _ in made[20:]]])
    expected = [e for _, e in made]
    for end in range(len(data)):  # cut anywhere: unreadable, or whole blocks of what was written
        try:
            records = read_container(data[:end], "f.avro")[1]
        except MetadataUnreadable:
            continue
        assert records in (expected[:0], expected[:20]), end
    for position in rng.sample(range(len(data)), 300):  # a byte changed anywhere: unreadable, or read by the schema
        damaged = bytearray(data)
        damaged[position] ^= 1 << rng.randrange(8)
        with contextlib.suppress(MetadataUnreadable):
            read_container(bytes(damaged), "f.avro")
    with pytest.raises(MetadataUnreadable, match="not an Avro container"):
        read_container(b"PAR1" + data[4:], "f.avro")
    with pytest.raises(MetadataUnreadable, match="codec 'brotli'"):
        read_container(_container('"long"', b"\x02", codec=b"brotli"), "g.avro")
    with pytest.raises(MetadataUnreadable, match=r"schema cannot be read.*elsewhere"):
        read_container(_container(json.dumps({"type": "record", "name": "r", "fields": [
            {"name": "a", "type": "elsewhere"}]}), b""), "f.avro")


def test_a_blocks_count_checksum_and_sync_marker_are_checked(tmp_path):
    """What fastavro alone would pass over: a block holding more than its count of records (a damaged count
    would drop records unseen), an absurd or negative count, a snappy block whose checksum does not match; and a
    block without the file's sync marker."""
    longs = b"\x02\x04\x06"  # 1, 2, 3
    assert read_container(_container('"long"', longs, records=3), "f.avro")[1] == [1, 2, 3]
    with pytest.raises(MetadataUnreadable, match="holds more than its 2 records"):
        read_container(_container('"long"', longs, records=2), "f.avro")
    for count in (-3, 4, 2**62):
        with pytest.raises(MetadataUnreadable):
            read_container(_container('"long"', longs, records=count), "f.avro")
    damaged = bytearray(_container('"long"', longs, records=3))
    damaged[-1] ^= 0xFF
    with pytest.raises(MetadataUnreadable, match="sync marker"):
        read_container(bytes(damaged), "f.avro")
    snappy = written(tmp_path / "s.avro", "snappy", [[random_record(random.Random(1), 1)[0]]])
    read_container(snappy, "s.avro")
    damaged = bytearray(snappy)
    damaged[-17] ^= 1  # the block's CRC-32, just before its sync marker
    with pytest.raises(MetadataUnreadable, match="checksum"):
        read_container(bytes(damaged), "s.avro")


TABLE = Schema(NestedField(1, "id", LongType(), required=True), NestedField(2, "day", DateType(), required=True),
               NestedField(3, "v", StringType(), required=False))
SPEC = PartitionSpec(PartitionField(2, 1000, DayTransform(), "day_day"),
                     PartitionField(1, 1001, BucketTransform(8), "id_bucket"), spec_id=3)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "zstd", "null"])  # write.avro.compression-codec's values
def test_a_snapshots_manifests_in_every_codec_iceberg_writes_list_its_files(tmp_path, codec):
    """A snapshot's manifest list and manifests as PyIceberg writes them (one entry per block), partitioned by a
    day (a date) and a bucket: its live files, each partition value as written (the date its int of days)."""
    io = PyArrowFileIO()

    def data_file(number: int) -> DataFile:
        return DataFile.from_args(
            content=DataFileContent.DATA, file_path=f"{tmp_path}/data/{number}.parquet",
            file_format=FileFormat.PARQUET, partition=Record(19_000 + number % 3, number % 8),
            record_count=100 + number, file_size_in_bytes=4096 + number, column_sizes={1: 80, 2: 20, 3: 300},
            value_counts={1: 100, 2: 100, 3: 100}, null_value_counts={1: 0, 2: 0, 3: number},
            nan_value_counts={}, lower_bounds={1: (number * 100).to_bytes(8, "little"), 3: b"a"},
            upper_bounds={1: (number * 100 + 99).to_bytes(8, "little"), 3: b"z" * 16}, split_offsets=[4],
            sort_order_id=0)

    manifests = []
    for first in (0, 40):
        with write_manifest(2, SPEC, TABLE, io.new_output(f"{tmp_path}/m{first}.avro"), 7, codec) as writer:
            for number in range(first, first + 40):
                entry = ManifestEntry.from_args(snapshot_id=7 if number % 4 else 5, sequence_number=number % 4 or 2,
                                                file_sequence_number=number % 4 or 2, data_file=data_file(number))
                if number % 4 == 0:
                    writer.existing(entry)
                elif number % 4 == 3:
                    writer.delete(entry)
                else:
                    writer.add(ManifestEntry.from_args(status=ManifestEntryStatus.ADDED, snapshot_id=7,
                                                       data_file=data_file(number)))
        manifests.append(writer.to_manifest_file())
    with write_manifest_list(2, io.new_output(f"{tmp_path}/snap-7.avro"), 7, 5, 9, codec) as writer:
        writer.add_manifests(manifests)
    avro_codec = {"gzip": "deflate", "zstd": "zstandard"}.get(codec, codec)
    for name in ("snap-7.avro", "m0.avro", "m40.avro"):
        assert read_container((tmp_path / name).read_bytes(), name)[0]["avro.codec"] == avro_codec

    snapshot = Snapshot(7, 5, "append", {}, manifest_list=f"{tmp_path}/snap-7.avro")
    assert snapshot_files(snapshot, Storage({})) == [
        TableFile(content=0, path=f"{tmp_path}/data/{number}.parquet", file_format="PARQUET",
                  record_count=100 + number, data_sequence_number=2 if number % 4 == 0 else 9,
                  partition=(3, (19_000 + number % 3, number % 8)), content_offset=None)
        for number in range(80) if number % 4 != 3]


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk


def _container(schema: str, block: bytes, records: int = 1, codec: bytes = b"null") -> bytes:
    """An Avro container of one block (uncompressed, whatever its header's ``codec``) holding ``records``
    records, its header written with PyIceberg's encoder as the spec lays it out."""
    header = BinaryEncoder(output := _Buffer())
    output.write(b"Obj\x01")
    header.write_int(2)
    for key, value in (("avro.schema", schema.encode()), ("avro.codec", codec)):
        header.write_utf8(key)
        header.write_bytes(value)
    header.write_int(0)
    sync = bytes(range(16))
    output.write(sync)
    header.write_int(records if block else 0)
    header.write_int(len(block))
    output.write(block)
    output.write(sync)
    return bytes(output.data)
