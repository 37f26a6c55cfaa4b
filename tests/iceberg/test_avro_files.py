"""Avro container files read by pgcdc (pgcdc.iceberg.avro_files), written by another writer: PyIceberg's, which
writes Iceberg's manifests in Python (Java-written manifests: tests/iceberg/test_table_files.py). Every record
comes back as written, whatever the codec and blocks; damaged files are refused as unreadable, never misread.
No JVM, no server: these run in make test-fast."""

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
from pyiceberg.schema import Schema
from pyiceberg.typedef import Record
from pyiceberg.types import (
    BinaryType,
    BooleanType,
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


@pytest.mark.parametrize("codec", ["deflate", "null"])
def test_every_record_of_every_block_reads_back_as_written(tmp_path, codec):
    rng = random.Random(f"avro-{codec}")
    made = [random_record(rng, key) for key in range(700)]
    cuts = sorted(rng.sample(range(1, 700), 6))
    blocks = [[record for record, _ in made[start:end]] for start, end in zip([0, *cuts], [*cuts, 700], strict=True)]
    metadata, records = read_container(written(tmp_path / "f.avro", codec, blocks), "f.avro")
    assert records == [expected for _, expected in made]
    assert metadata["avro.codec"] == codec.encode() and metadata["format-version"] == b"2"
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


def test_damaged_files_are_unreadable_never_misread(tmp_path):
    rng = random.Random("avro-damage")
    made = [random_record(rng, key) for key in range(40)]
    data = written(tmp_path / "f.avro", "deflate", [[r for r, _ in made[:20]], [r for r, _ in made[20:]]])
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
    with pytest.raises(MetadataUnreadable, match="codec 'bzip2'"):
        read_container(written(tmp_path / "g.avro", "bzip2", [[made[0][0]]]), "g.avro")
    with pytest.raises(MetadataUnreadable, match="not defined"):
        read_container(_container(json.dumps({"type": "record", "name": "r", "fields": [
            {"name": "a", "type": "elsewhere"}]}), b""), "f.avro")


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk


def _container(schema: str, block: bytes, records: int = 1) -> bytes:
    """An Avro container of one uncompressed block holding ``records`` records, its header written with
    PyIceberg's encoder as the spec lays it out."""
    header = BinaryEncoder(output := _Buffer())
    output.write(b"Obj\x01")
    header.write_int(2)
    for key, value in (("avro.schema", schema.encode()), ("avro.codec", b"null")):
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
