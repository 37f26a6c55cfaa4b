"""Partition transforms computed on Arrow columns equal Iceberg's own (PyIceberg's implementation of the spec is
the oracle here, Java's in the pipeline tests, where Spark and PyIceberg prune files by the values written), and
what users write for --partition-by is read or refused clearly."""

from __future__ import annotations

import datetime
import struct
from decimal import Decimal

import mmh3
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyiceberg import transforms as pt
from pyiceberg import types as it

from pgcdc.iceberg.partition_specs import (
    PartitionField,
    PartitionSyntaxError,
    PartitionTransform,
    UnsupportedPartitioning,
    parse_transform,
    parse_transforms,
    spec_fields,
)
from pgcdc.iceberg.partition_values import murmur3_of_longs, partition_rows, single_value_bytes, transformed

EPOCH = datetime.datetime(1970, 1, 1)
LONGS = st.integers(-(2**63), 2**63 - 1)
INTS = st.integers(-(2**31), 2**31 - 1)
DAYS = st.integers(-719_162, 2_932_896)  # 0001-01-01 .. 9999-12-31
MICROS = st.integers(-62_135_596_800_000_000, 253_402_300_799_999_999)

# (Iceberg type name, Arrow type, values, PyIceberg type, the Python value PyIceberg's transform takes)
KINDS = {
    "int": (pa.int32(), INTS, it.IntegerType(), lambda v: v),
    "long": (pa.int64(), LONGS, it.LongType(), lambda v: v),
    "date": (pa.date32(), DAYS, it.DateType(), lambda v: v),
    "timestamp": (pa.timestamp("us"), MICROS, it.TimestampType(), lambda v: v),
    "timestamptz": (pa.timestamp("us", "UTC"), MICROS, it.TimestamptzType(), lambda v: v),
    "time": (pa.time64("us"), st.integers(0, 86_399_999_999), it.TimeType(), lambda v: v),
    "string": (pa.string(), st.text(max_size=12), it.StringType(), lambda v: v),
    "binary": (pa.binary(), st.binary(max_size=12), it.BinaryType(), lambda v: v),
    "decimal(12, 3)": (pa.decimal128(12, 3), st.decimals(min_value=Decimal("-999999999.999"),
                                                          max_value=Decimal("999999999.999"), places=3,
                                                          allow_nan=False, allow_infinity=False),
                       it.DecimalType(12, 3), lambda v: v),
}
CASES = [(kind, transform) for kind in KINDS for transform in ("identity", "bucket[16]", "bucket[1000]")] + \
    [(kind, transform) for kind in ("int", "long", "string", "binary", "decimal(12, 3)")
     for transform in ("truncate[1]", "truncate[4]", "truncate[10]")] + \
    [(kind, transform) for kind in ("date", "timestamp", "timestamptz") for transform in ("year", "month", "day")] + \
    [(kind, "hour") for kind in ("timestamp", "timestamptz")]


def oracle(transform: str, iceberg_type: it.IcebergType):
    if transform == "identity":
        return pt.IdentityTransform().transform(iceberg_type)
    if transform.startswith("bucket["):
        return pt.BucketTransform(int(transform[7:-1])).transform(iceberg_type)
    if transform.startswith("truncate["):
        return pt.TruncateTransform(int(transform[9:-1])).transform(iceberg_type)
    return {"year": pt.YearTransform, "month": pt.MonthTransform, "day": pt.DayTransform,
            "hour": pt.HourTransform}[transform]().transform(iceberg_type)


def arrow_values(kind: str, values: list) -> pa.Array:
    arrow_type = KINDS[kind][0]
    if kind == "date":
        return pa.array(values, pa.int32()).cast(arrow_type)
    if kind in ("timestamp", "timestamptz", "time"):
        return pa.array(values, pa.int64()).cast(arrow_type)
    return pa.array(values, arrow_type)


@pytest.mark.parametrize(("kind", "transform"), CASES, ids=[f"{t} of {k}" for k, t in CASES])
def test_each_transform_gives_icebergs_value_for_every_value_of_its_type(kind, transform):
    _, values, iceberg_type, to_python = KINDS[kind]
    expected_of = oracle(transform, iceberg_type)
    field = PartitionField("p", transform, "c", kind, "")

    @settings(max_examples=120, deadline=None)
    @given(st.lists(st.none() | values, max_size=30))
    def check(drawn):
        got = transformed(field, arrow_values(kind, drawn)).to_pylist()
        expected = [None if v is None else expected_of(to_python(v)) for v in drawn]
        if transform == "day" or (transform == "identity" and kind == "date"):
            expected = [None if v is None else (v - datetime.date(1970, 1, 1)).days
                        if isinstance(v, datetime.date) else v for v in expected]
        if transform == "identity" and kind in ("timestamp", "timestamptz", "time"):
            expected = drawn  # physical microseconds
        if transform.startswith("truncate[") and kind in ("int", "long"):
            # Java (which writes Spark's files) computes in the type's width: near its minimum the result wraps
            bits = 32 if kind == "int" else 64
            expected = [None if v is None else (v + 2 ** (bits - 1)) % 2**bits - 2 ** (bits - 1) for v in expected]
        assert got == expected

    check()


def test_murmur3_of_longs_is_mmh3_of_their_little_endian_bytes():
    values = np.array([0, 1, -1, 34, 2**63 - 1, -(2**63), 1_700_000_000_000_000], np.int64)
    assert murmur3_of_longs(values).tolist() == [mmh3.hash(struct.pack("<q", int(v)), 0, signed=False)
                                                 for v in values]
    # the spec's own examples: 34 (int and long) hashes to 2017239379
    assert int(murmur3_of_longs(np.array([34]))[0]) == 2017239379


def test_rows_are_grouped_by_partition_in_batch_order_with_null_a_partition_of_its_own():
    rows = pa.table({"day": pa.array([0, 1, None, 0, 1, None, 40], pa.int32()).cast(pa.date32()),
                     "tenant": pa.array(["a", "b", "a", "a", "b", "a", "a"])})
    fields = [PartitionField("day_day", "day", "day", "date", "date"),
              PartitionField("tenant", "identity", "tenant", "string", "string")]
    groups = {g.values: g.rows.tolist() for g in partition_rows(rows, fields)}
    assert groups == {(struct.pack("<i", 0), b"a"): [0, 3], (struct.pack("<i", 1), b"b"): [1, 4],
                      (None, b"a"): [2, 5], (struct.pack("<i", 40), b"a"): [6]}
    assert partition_rows(rows.slice(0, 0), fields) == []


def test_single_values_are_icebergs_binary_form():
    assert single_value_bytes(5, "int") == b"\x05\x00\x00\x00"
    assert single_value_bytes(-1, "long") == b"\xff" * 8
    assert single_value_bytes(Decimal("-1.50"), "decimal(9, 2)") == (-150).to_bytes(2, "big", signed=True)
    assert single_value_bytes(Decimal("0.00"), "decimal(9, 2)") == b"\x00"
    assert single_value_bytes(Decimal("1.28"), "decimal(9, 2)") == b"\x00\x80"  # shortest, sign kept
    assert single_value_bytes(Decimal("-1.28"), "decimal(9, 2)") == b"\x80"
    assert single_value_bytes("é", "string") == "é".encode()
    assert single_value_bytes(True, "boolean") == b"\x01"
    assert single_value_bytes(None, "string") is None


@pytest.mark.parametrize(("text", "expected"), [
    ("created_at", PartitionTransform("identity", "created_at")),
    ("identity(tenant)", PartitionTransform("identity", "tenant")),
    ("days(created_at)", PartitionTransform("day", "created_at")),
    (" DATE ( created_at ) ", PartitionTransform("day", "created_at")),
    ("years(d)", PartitionTransform("year", "d")),
    ("month(d)", PartitionTransform("month", "d")),
    ("date_hour(ts)", PartitionTransform("hour", "ts")),
    ("bucket(16, id)", PartitionTransform("bucket", "id", 16)),
    ("truncate(4, name)", PartitionTransform("truncate", "name", 4)),
    ("truncate(name, 4)", PartitionTransform("truncate", "name", 4)),
    ('days("Created At")', PartitionTransform("day", "Created At")),
    ("bucket(8, `we,ird`)", PartitionTransform("bucket", "we,ird", 8)),
])
def test_transforms_read_as_users_write_them(text, expected):
    assert parse_transform(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("weeks(d)", "is not a partition transform"),
    ("bucket(id)", "takes a number and a column"),
    ("bucket(0, id)", "width of 1 to"),
    ("days(a, b)", "takes one column"),
    ("days()", "takes one column"),
    ("a b", "is not a partition transform"),
    ("", "no partition transform"),
    ("days(d), days(d)", "given twice"),
])
def test_what_cannot_be_read_is_refused_saying_what_is_wrong(text, message):
    with pytest.raises(PartitionSyntaxError, match=message):
        parse_transforms(text)


def test_several_transforms_and_their_ddl():
    transforms = parse_transforms('days(created_at), bucket(16, "tenant id"), truncate(4, name)')
    assert [t.ddl() for t in transforms] == ["days(`created_at`)", "bucket(16, `tenant id`)", "truncate(4, `name`)"]
    assert [str(t) for t in transforms] == ["day(created_at)", "bucket(16, tenant id)", "truncate(4, name)"]


def test_a_spec_is_read_from_icebergs_json_and_nested_sources_are_refused():
    schema = {"fields": [{"id": 1, "name": "id", "type": "long"}, {"id": 2, "name": "at", "type": "timestamptz"},
                         {"id": 3, "name": "s", "type": {"type": "struct", "fields": []}}]}
    spec = {"spec-id": 0, "fields": [{"name": "at_day", "transform": "day", "source-id": 2, "field-id": 1000},
                                     {"name": "id_bucket", "transform": "bucket[8]", "source-id": 1,
                                      "field-id": 1001}]}
    assert [(f.source, f.result_type) for f in spec_fields(spec, schema)] == [("at", "date"), ("id", "int")]
    with pytest.raises(UnsupportedPartitioning, match="nested"):
        spec_fields({"fields": [{"name": "x", "transform": "identity", "source-id": 9, "field-id": 1000}]}, schema)
