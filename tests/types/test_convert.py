"""Typed values against a real server: what the slot sends (text and binary) and what the snapshot's
``COPY (FORMAT binary)`` reads, converted, equals what PostgreSQL says."""

from __future__ import annotations

import datetime as dt
import decimal
import math
import struct
from decimal import Decimal

import psycopg
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from type_support import copied, slot_inserts, streamed_rows

from pgcdc.errors import ConversionError
from pgcdc.pgoutput import Relation
from pgcdc.replication.published import published_tables
from pgcdc.types import SESSION_SETTINGS, ConversionOptions, TableConverter, TypeRegistry

# text and binary: pgoutput tuple data from a slot; copy: the snapshot's COPY binary output, split into columns
FORMATS = pytest.mark.parametrize("binary", [False, True, "copy"], ids=["text", "binary", "copy"])


def _session(conn: psycopg.Connection) -> None:
    for key, value in SESSION_SETTINGS.items():
        conn.execute("SELECT set_config(%s, %s, false)", (key, value))


def captured(pg, ddl: str, inserts: list[tuple], *, binary: bool | str, options: ConversionOptions | None = None,
             read_back: bool = True):
    """Create table t, insert the rows, read them back from a slot (``binary`` False or True) or with the
    snapshot's COPY (``binary="copy"``); returns (converted batch, server rows, converter)."""
    slot_binary = binary is True
    with pg.connect() as conn:
        _session(conn)
        conn.execute(f"CREATE TABLE t (id int PRIMARY KEY, {ddl})")
        conn.execute("CREATE PUBLICATION pub FOR TABLE t")
        if binary != "copy":
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (pg.name,))
        placeholders = ", ".join(["%s"] * (len(inserts[0]) + 1))
        for index, row in enumerate(inserts):
            conn.execute(f"INSERT INTO t VALUES ({placeholders})", (index, *row))
        registry = TypeRegistry()
        registry.load_from_server(conn)
        if binary == "copy":  # the relation as the snapshot knows it: from the catalog, no slot
            converter = TableConverter(published_tables(conn, "pub")[0].relation, registry, options)
            batch = copied(conn, "public", "t", converter)
        else:
            relation, tuples = slot_inserts(conn, pg.name, "pub", registry, binary=slot_binary)
            converter = TableConverter(relation, registry, options)
            batch = streamed_rows(relation, tuples, registry, options)  # as the pipeline converts them
    with pg.connect() as conn:  # psycopg's own loaders, default session: the server's view of the values
        server = conn.execute("SELECT * FROM t ORDER BY id").fetchall() if read_back else []
    return batch, server, converter


@FORMATS
@settings(max_examples=12)
@given(ints=st.lists(st.tuples(st.integers(-2**15, 2**15 - 1), st.integers(-2**31, 2**31 - 1),
                               st.integers(-2**63, 2**63 - 1)), min_size=1, max_size=20))
def test_integers(pg_factory, binary, ints):
    pg = pg_factory()
    batch, server, _ = captured(pg, "a int2, b int4, c int8", ints, binary=binary)
    assert batch.select(["a", "b", "c"]).to_pylist() == [{"a": r[1], "b": r[2], "c": r[3]} for r in server]


@FORMATS
@settings(max_examples=12)
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=1, max_size=20))
def test_float8_keeps_nan_and_infinity(pg_factory, binary, values):
    pg = pg_factory()
    batch, server, _ = captured(pg, "f float8", [(v,) for v in values], binary=binary)
    got = batch.column("f").to_pylist()
    for mine, (_, theirs) in zip(got, server, strict=True):
        assert repr(mine) == repr(theirs)


@FORMATS
@settings(max_examples=12)
@given(values=st.lists(st.decimals(min_value=Decimal("-99999999.99"), max_value=Decimal("99999999.99"), places=2,
                                   allow_nan=False), min_size=1, max_size=20))
def test_numeric_with_typmod_is_exact_decimal(pg_factory, binary, values):
    pg = pg_factory()
    batch, server, converter = captured(pg, "n numeric(10, 2)", [(v,) for v in values], binary=binary)
    assert converter.arrow_schema.field("n").type == pa.decimal128(10, 2)
    assert batch.column("n").to_pylist() == [r[1] for r in server]


@FORMATS
def test_unconstrained_numeric_policies(pg, binary):
    values = [("NaN",), ("Infinity",), ("-0.000001",), ("123456789012345678901234567890.123456789",), (None,)]
    batch, _, _ = captured(pg, "n numeric", values, binary=binary)
    assert batch.column("n").to_pylist() == ["NaN", "Infinity", "-0.000001",
                                              "123456789012345678901234567890.123456789", None]
    with pytest.raises(ConversionError, match=r"t\.n"):
        converter = TableConverter(batch_relation(pg), TypeRegistry(), ConversionOptions(numeric="decimal38"))
        converter.convert_columns([[b"1"], [b"NaN"]], binary=False)


def batch_relation(pg) -> Relation:
    with pg.connect() as conn:
        return published_tables(conn, "pub")[0].relation


@FORMATS
def test_times_dates_intervals_and_edges(pg, binary):
    rows = [("2024-02-29", "23:59:59.999999", "12:00+05:30", "2024-01-01 12:34:56.789", "2024-06-30 23:00:00+02",
             "1 year 2 mons 3 days 04:05:06.7"),
            ("4713-01-01 BC", "00:00", "00:00+00", "-infinity", "infinity", "-178000000 years")]
    batch, _, _ = captured(pg, "d date, t time, ttz timetz, ts timestamp, tstz timestamptz, iv interval",
                           [tuple(r) for r in rows], binary=binary, read_back=False)
    bc_days = pg.execute("SELECT '4713-01-01 BC'::date - '1970-01-01'::date")[0][0]  # the server's arithmetic
    assert batch.column("d").cast(pa.int32()).to_pylist() == [(dt.date(2024, 2, 29) - dt.date(1970, 1, 1)).days,
                                                              bc_days]
    assert batch.column("t").to_pylist() == [86_399_999_999, 0]
    assert batch.column("ttz").to_pylist() == ["12:00:00+05:30", "00:00:00+00"]
    assert batch.column("ts")[0].as_py() == dt.datetime(2024, 1, 1, 12, 34, 56, 789000)
    assert batch.column("tstz")[0].as_py() == dt.datetime(2024, 6, 30, 21, tzinfo=dt.UTC)
    # ±infinity: int64's extremes, which no other timestamp maps to
    assert batch.column("ts").cast(pa.int64())[1].as_py() == -2**63
    assert batch.column("tstz").cast(pa.int64())[1].as_py() == 2**63 - 1
    assert batch.column("iv").to_pylist() == [{"months": 14, "days": 3, "microseconds": 14_706_700_000},
                                              {"months": -2_136_000_000, "days": 0, "microseconds": 0}]


@FORMATS
def test_text_like_bytes_uuid_json_arrays_enums_domains(pg, binary):
    with pg.connect() as conn:
        conn.execute("CREATE TYPE mood AS ENUM ('sad', 'happy')")
        conn.execute("CREATE DOMAIN small AS int CHECK (VALUE < 10)")
    rows = [("héllo", "ab", b"\x00\xff", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", '{"a": [1]}', '{"b": null}',
             [1, None, 3], [["x", None], ["q\"", "y z"]], "happy", 5),
            (None, None, None, None, None, None, None, None, None, None)]
    batch, server, _ = captured(pg, "s text, c char(3), b bytea, u uuid, j json, jb jsonb, a int[], g text[][], "
                                    "m mood, d small", rows, binary=binary)
    assert batch.column("s").to_pylist() == ["héllo", None]
    assert batch.column("c").to_pylist() == ["ab ", None]
    assert batch.column("b").to_pylist() == [b"\x00\xff", None]
    assert batch.column("u").to_pylist() == [str(server[0][4]), None]
    assert batch.column("j").to_pylist() == ['{"a": [1]}', None]
    assert batch.column("jb").to_pylist() == ['{"b": null}', None]
    assert batch.column("a").to_pylist() == [[1, None, 3], None]
    assert batch.column("g").to_pylist() == [["x", None, 'q"', "y z"], None]  # flattened row-major
    assert batch.column("m").to_pylist() == ["happy", None]
    assert batch.column("d").to_pylist() == [5, None]


@pytest.mark.parametrize("binary", [False, "copy"], ids=["text", "copy"])
def test_types_without_binary_decoder_ask_for_text(pg, binary):
    """Their text output, exactly as the server prints it (in the copy too: inet ``::1`` is not ``::1/128``)."""
    with pg.connect() as conn:
        conn.execute("CREATE TYPE pair AS (a int, b text)")
    batch, _, converter = captured(pg, "ip inet, net cidr, r int4range, price money, p pair, bits varbit",
                                   [("10.0.0.1", "::/0", "[1,5)", "1.50", "(1,x)", "101"),
                                    ("::1", "10.1.0.0/16", "empty", "-0.01", "(,)", ""),
                                    (None, None, None, None, None, None)], binary=binary)
    assert batch.to_pylist() == [
        {"id": 0, "ip": "10.0.0.1", "net": "::/0", "r": "[1,5)", "price": "$1.50", "p": "(1,x)", "bits": "101"},
        {"id": 1, "ip": "::1", "net": "10.1.0.0/16", "r": "empty", "price": "-$0.01", "p": "(,)", "bits": ""},
        {"id": 2, "ip": None, "net": None, "r": None, "price": None, "p": None, "bits": None}]
    assert converter.requires_text_mode


def test_malformed_value_names_table_column_type_and_lsn(pg):
    _, _, converter = captured(pg, "i int4", [(1,)], binary=False)
    from pgcdc.lsn import Lsn
    from pgcdc.pgoutput import TupleData

    with pytest.raises(ConversionError) as info:
        converter.convert([TupleData("tt", (b"1", b"not a number"))], lsn=Lsn("0/ABC"))
    message = str(info.value)
    assert "public.t.i" in message and "int4" in message and "0/ABC" in message


# -- the C paths against the exact Python paths, value for value ------------------------------------


@pytest.fixture(params=["C", "python"])
def accelerator(request, monkeypatch):
    """Run a test with the C column paths (where built) and with the pure-Python ones."""
    from pgcdc.pgoutput import tuple_store
    from pgcdc.types import decoding

    if request.param == "python":
        monkeypatch.setattr(decoding, "accelerator", None)
        monkeypatch.setattr(tuple_store, "accelerator", None)
    elif decoding.accelerator is None:
        pytest.skip("the C column paths are not built here")
    return request.param


@FORMATS
@settings(max_examples=10)
@given(arrays=st.lists(st.one_of(
    st.none(),
    st.lists(st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)), max_size=6),
    st.lists(st.lists(st.one_of(st.none(), st.integers(-2**31, 2**31 - 1)), min_size=2, max_size=2),
             min_size=1, max_size=3)), min_size=1, max_size=15),
       bigs=st.lists(st.integers(-2**63, 2**63 - 1), max_size=4),
       smalls=st.lists(st.one_of(st.none(), st.integers(-2**15, 2**15 - 1)), max_size=4))
def test_integer_arrays_any_shape(pg_factory, accelerator, binary, arrays, bigs, smalls):
    pg = pg_factory()
    rows = [(a, bigs, smalls) for a in arrays]
    batch, server, _ = captured(pg, "a int4[], b int8[], s int2[]", rows, binary=binary)

    def flat(value):
        if value is None:
            return None
        return [x for v in value for x in (flat(v) if isinstance(v, list) else [v])]

    assert batch.column("a").to_pylist() == [flat(r[1]) for r in server]
    assert batch.column("b").to_pylist() == [flat(r[2]) for r in server]
    assert batch.column("s").to_pylist() == [flat(r[3]) for r in server]


def _json_text(size: int) -> st.SearchStrategy:
    # jsonb refuses \u0000 (it cannot be stored in text)
    return st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=size)


@FORMATS
@settings(max_examples=10)
@given(uuids=st.lists(st.one_of(st.none(), st.uuids()), min_size=1, max_size=10),
       documents=st.lists(st.one_of(st.none(), st.recursive(
           st.none() | st.booleans() | st.integers(-10**6, 10**6) | _json_text(8),
           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_json_text(5), inner, max_size=3),
           max_leaves=6)), min_size=10, max_size=10))
def test_uuid_and_jsonb(pg_factory, accelerator, binary, uuids, documents):
    import json

    pg = pg_factory()
    rows = [(u, None if d is None else psycopg.types.json.Jsonb(d)) for u, d in zip(uuids, documents, strict=False)]
    batch, server, _ = captured(pg, "u uuid, doc jsonb", rows, binary=binary)
    assert batch.column("u").to_pylist() == [None if r[1] is None else str(r[1]) for r in server]
    assert [None if d is None else json.loads(d) for d in batch.column("doc").to_pylist()] == [r[2] for r in server]


@FORMATS
def test_numeric_edges_at_38_digits(pg, accelerator, binary):
    values = ["9999999999999999999999999999.9999999999", "-9999999999999999999999999999.9999999999", "0",
              "0.0000000001", "-0.0000000001", "100000000000000000000", "1.5000000000", None]
    batch, server, converter = captured(pg, "n numeric(38, 10)", [(v,) for v in values], binary=binary)
    assert converter.arrow_schema.field("n").type == pa.decimal128(38, 10)
    assert batch.column("n").to_pylist() == [r[1] for r in server]


@FORMATS
def test_nan_in_a_constrained_numeric_is_an_error_on_both_paths(pg, accelerator, binary):
    with pytest.raises(ConversionError, match=r"t\.n"):
        captured(pg, "n numeric(10, 2)", [("1.50",), ("NaN",)], binary=binary)


@FORMATS
def test_array_forms_off_the_fast_path_still_convert(pg, accelerator, binary):
    """Explicit lower bounds, empty arrays and multi-dimensional values: flattened, bounds not kept."""
    rows = [("[0:2]={1,2,3}",), ("{}",), ("{{1,2},{3,NULL}}",), ("[2:2][1:2]={{7,8}}",), (None,)]
    batch, _, _ = captured(pg, "a int4[]", rows, binary=binary, read_back=False)
    assert batch.column("a").to_pylist() == [[1, 2, 3], [], [1, 2, 3, None], [7, 8], None]


def test_a_row_of_the_wrong_width_is_named(pg, accelerator):
    _, _, converter = captured(pg, "i int4", [(1,)], binary=False)
    from pgcdc.pgoutput import TupleData

    with pytest.raises(ConversionError, match="a row has 1 columns, the relation 2"):
        converter.convert([TupleData("tt", (b"1", b"2")), TupleData("t", (b"1",))])


@settings(max_examples=300)
@given(values=st.lists(st.one_of(st.none(), st.decimals(allow_nan=True, allow_infinity=True, places=None)),
                       max_size=8), scale=st.integers(0, 12))
def test_c_numeric_path_equals_the_exact_path_or_defers_to_it(values, scale):
    """Binary numerics (psycopg's encoder writes PostgreSQL's format) through the C path either give exactly
    what the exact path gives, or defer to it (NaN, infinity, too many digits or decimal places)."""
    from pgcdc.types import decoding

    if decoding.accelerator is None:
        pytest.skip("the C column paths are not built here")
    from psycopg.adapt import PyFormat, Transformer

    dump = Transformer().get_dumper(Decimal(0), PyFormat.BINARY).dump
    encoded = [None if v is None else bytes(dump(v)) for v in values]
    fast = decoding.accelerator.numeric_binary(encoded, scale)
    if fast is None:
        return
    data, valid = fast
    quantum = Decimal(1).scaleb(-scale)
    with decimal.localcontext() as context:
        context.prec = 100  # exact comparisons of up to 38 digits
        for index, value in enumerate(values):
            if value is None:
                assert valid[index] == 0
                continue
            unscaled = int.from_bytes(data[16 * index:16 * index + 16], "little", signed=True)
            assert valid[index] == 1 and Decimal(unscaled).scaleb(-scale) == value.quantize(quantum) == value


@settings(max_examples=300)
@given(text=st.text(alphabet="{},-0123456789NUL [:]=\"\\ ", max_size=30))
def test_c_int_array_text_path_equals_the_exact_parser_or_defers(text):
    from pgcdc.types import arrays, decoding

    if decoding.accelerator is None:
        pytest.skip("the C column paths are not built here")
    fast = decoding.accelerator.int_array_text([text.encode()], 8)
    if fast is None:
        return
    offsets, list_valid, items, item_valid = fast
    assert list_valid == b"\x01"
    count = int.from_bytes(offsets[4:8], "little")
    parsed = [None if item_valid[i] == 0 else int.from_bytes(items[8 * i:8 * i + 8], "little", signed=True)
              for i in range(count)]
    expected = arrays._parse_text_array(text)
    assert parsed == [None if e is None else int(e) for e in expected]


@settings(max_examples=300)
@given(moments=st.lists(st.one_of(
    st.none(),
    st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59)).map(
        lambda d: d.isoformat(sep=" ")),
    st.tuples(st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30)),
              st.sampled_from(["+00", "+05:30", "-08", "+14", "-03:30:15"])).map(
        lambda p: p[0].isoformat(sep=" ") + p[1]),
    st.text(alphabet="0123456789-:. +BCinfty", max_size=30)), max_size=6),
    integers=st.lists(st.one_of(st.none(), st.integers(-2**70, 2**70).map(str), st.text(max_size=6)), max_size=6))
def test_c_text_integers_and_timestamps_equal_the_exact_path_or_defer(moments, integers):
    from pgcdc.types import decoding, temporal

    if decoding.accelerator is None:
        pytest.skip("the C column paths are not built here")
    encoded = [None if m is None else m.encode() for m in moments]
    fast = decoding.accelerator.fixed_text(encoded, "T")
    if fast is not None:
        data, valid = fast
        for index, moment in enumerate(moments):
            if moment is None:
                assert valid[index] == 0
                continue
            micros = int.from_bytes(data[8 * index:8 * index + 8], "little", signed=True)
            assert micros == temporal._timestamp_micros(moment, temporal._Infinity("clamp")), moment
    for kind, width, low, high in (("h", 2, -2**15, 2**15 - 1), ("i", 4, -2**31, 2**31 - 1),
                                   ("q", 8, -2**63, 2**63 - 1)):
        fast = decoding.accelerator.fixed_text([None if i is None else i.encode() for i in integers], kind)
        if fast is None:
            continue
        data, valid = fast
        for index, text in enumerate(integers):
            if text is None:
                assert valid[index] == 0
                continue
            value = int.from_bytes(data[width * index:width * (index + 1)], "little", signed=True)
            assert value == int(text) and low <= value <= high


# -- every other type family, generated ---------------------------------------------------------------

_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


@FORMATS
@settings(max_examples=8)
@given(rows=st.lists(st.tuples(st.one_of(st.none(), _TEXT), st.one_of(st.none(), _TEXT.map(lambda t: t[:20])),
                               st.one_of(st.none(), st.binary(max_size=40)), st.one_of(st.none(), st.booleans()),
                               st.one_of(st.none(), st.lists(st.one_of(st.none(), _TEXT), max_size=4)),
                               st.one_of(st.none(), st.floats(width=32))),
                     min_size=1, max_size=12))
def test_text_bytes_bool_text_arrays_and_float4(pg_factory, binary, rows):
    pg = pg_factory()
    batch, server, _ = captured(pg, "s text, v varchar(20), b bytea, f bool, a text[], r real", rows, binary=binary)
    assert batch.column("s").to_pylist() == [r[1] for r in server]
    assert batch.column("v").to_pylist() == [r[2] for r in server]
    assert batch.column("b").to_pylist() == [r[3] for r in server]
    assert batch.column("f").to_pylist() == [r[4] for r in server]
    assert batch.column("a").to_pylist() == [r[5] for r in server]
    def as_float4(x):  # the same float4, whether widened from 32 bits (Arrow) or read from text (psycopg)
        if x is not None and math.isnan(x):
            return "NaN"  # the text form has one NaN; binary keeps a sign bit a generated -nan may carry
        return None if x is None else struct.pack("<f", x)

    assert [as_float4(x) for x in batch.column("r").to_pylist()] == [as_float4(r[6]) for r in server]


_MOMENTS = st.datetimes(min_value=dt.datetime(1, 1, 1), max_value=dt.datetime(9999, 12, 31, 23, 59, 59, 999999))


@FORMATS
@settings(max_examples=8)
@given(rows=st.lists(st.tuples(
    st.one_of(st.none(), st.dates()),
    st.one_of(st.none(), _MOMENTS),
    st.one_of(st.none(), _MOMENTS.map(lambda d: d.replace(tzinfo=dt.UTC)).filter(lambda d: d.year < 9999)),
    st.one_of(st.none(), st.times()),
    st.one_of(st.none(), st.timedeltas(min_value=dt.timedelta(days=-10**6), max_value=dt.timedelta(days=10**6)))),
    min_size=1, max_size=12))
def test_dates_timestamps_times_and_intervals(pg_factory, binary, rows):
    pg = pg_factory()
    batch, server, _ = captured(pg, "d date, ts timestamp, tstz timestamptz, t time, iv interval", rows,
                                binary=binary)
    assert batch.column("d").to_pylist() == [r[1] for r in server]
    assert batch.column("ts").to_pylist() == [r[2] for r in server]
    assert batch.column("tstz").to_pylist() == [None if r[3] is None else r[3].astimezone(dt.UTC) for r in server]
    assert batch.column("t").to_pylist() == [
        None if r[4] is None else ((r[4].hour * 60 + r[4].minute) * 60 + r[4].second) * 10**6 + r[4].microsecond
        for r in server]
    for mine, (*_, theirs) in zip(batch.column("iv").to_pylist(), server, strict=True):
        if theirs is None:
            assert mine is None
            continue
        assert mine["months"] == 0  # generated from day-time intervals
        assert dt.timedelta(days=mine["days"], microseconds=mine["microseconds"]) == theirs


@settings(max_examples=40, deadline=None)
@given(micros=st.lists(st.one_of(
    st.integers(-211_813_488_000_000_000, 9_223_371_331_199_999_999),  # 4713 BC to 294276 AD, PostgreSQL's range
    st.sampled_from([0, -1, 1, 500_000, 9_223_371_331_199_000_000, -63_082_281_600_000_000])), min_size=1,
    max_size=20))
def test_timestamps_are_shown_as_postgresql_writes_them(pg_factory, micros):
    """An error shows a value it cannot mirror as PostgreSQL prints it: the server is the oracle, from the
    binary form (microseconds since 2000) to the text of timestamp and timestamptz (UTC)."""
    from pgcdc.types.temporal import timestamp_text

    pg = pg_factory()
    with pg.connect() as conn:
        conn.execute("SET TimeZone = 'UTC'")
        conn.execute("SET DateStyle = 'ISO, YMD'")
        # whole days and the microseconds left: exact integer arithmetic over the server's whole range
        rows = conn.execute(
            "SELECT v::text, v::timestamptz::text FROM (SELECT timestamp '2000-01-01' + (m / 86400000000) * "
            "interval '1 day' + (m %% 86400000000) * interval '1 microsecond' AS v FROM unnest(%s::bigint[]) m) s",
            (micros,)).fetchall()
    for (plain, zoned), value in zip(rows, micros, strict=True):
        assert timestamp_text(value, with_zone=False) == plain
        assert timestamp_text(value, with_zone=True) == zoned
