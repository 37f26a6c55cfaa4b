"""Every value a type holds, on every path: the server is the oracle.

For each supported type, hypothesis generates values across the type's whole domain (its edges first:
min, max, ±infinity, BC, empty, NULL), the server stores them, and pgcdc reads them back through the
text stream, the binary stream and the snapshot's ``COPY (FORMAT binary)``, each with the C column paths
and with the pure-Python ones. Every mirror value is handed back to the server (as the integer, string or
parts the Arrow column holds) and must print as ``v::text`` prints the stored value.

One database for the module, one slot; each example gets its own schema and publication.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from psycopg import sql
from type_support import copied, slot_inserts, streamed_column

from pgcdc.errors import ConversionError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput import Relation, tuple_store
from pgcdc.replication.published import published_tables
from pgcdc.types import SESSION_SETTINGS, ConversionOptions, TableConverter, TypeRegistry, decoding

SLOT = "domain"
STREAM_LSN = Lsn("16/B374D848")  # what the pipeline passes with a stream's rows, for its errors
PATHS = ("text", "binary", "copy")
_schemas = itertools.count(1)


@pytest.fixture(scope="module")
def db(pg_server) -> Iterator[psycopg.Connection]:
    """One database and one slot for the module; the connection carries pgcdc's session settings."""
    from conftest import drop_database

    name = f"pgcdc_domain_{next(_schemas)}_{id(pg_server)}"
    with psycopg.connect(pg_server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        with psycopg.connect(pg_server.dsn_for(name), autocommit=True) as conn:
            for key, value in SESSION_SETTINGS.items():
                conn.execute("SELECT set_config(%s, %s, false)", (key, value))
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
            yield conn
    finally:
        drop_database(pg_server, name)


@dataclass
class Stored:
    """One example's table: what the server holds and what each path receives."""

    schema: str
    server_text: list[str | None]  # v::text per row, in id order
    server_elements: list[list[str | None] | None]  # arrays: each element's text, flattened row-major
    stream: dict[str, tuple[Relation, list]]  # "text"/"binary" -> (Relation, tuple data of the inserts)
    published: Relation  # the table as the snapshot knows it
    registry: TypeRegistry

    def paths(self, options: ConversionOptions | None) -> list[str]:
        """The paths pgcdc reads this table by: not the binary stream when a type has no binary decoder."""
        text_only = TableConverter(self.published, self.registry, options).requires_text_mode
        return [path for path in PATHS if not (text_only and path == "binary")]

    def convert(self, conn: psycopg.Connection, path: str, accelerated: bool,
                options: ConversionOptions | None = None) -> pa.Array:
        """Column v as ``path`` converts it, with the C modules or without (the stream's rows as the pipeline
        converts them: gathered from the bytes sent, checked against their direct conversion)."""
        with pytest.MonkeyPatch.context() as patch:
            if not accelerated:
                patch.setattr(decoding, "accelerator", None)
                patch.setattr(tuple_store, "accelerator", None)
            if path == "copy":
                converter = TableConverter(self.published, self.registry, options)
                return copied(conn, self.schema, "t", converter).column("v").combine_chunks()
            relation, tuples = self.stream[path]
            return streamed_column(relation, tuples, self.registry, options, STREAM_LSN)


def store(conn: psycopg.Connection, type_sql: str, literals: list[str | None]) -> Stored:
    """Table ``t (id, v type_sql)`` in a fresh schema holding ``literals`` (the type's input text)."""
    schema = f"s{next(_schemas)}"
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    table = sql.Identifier(schema, "t")
    conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, v {})").format(table, sql.SQL(type_sql)))
    conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(sql.Identifier(f"p_{schema}"), table))
    with conn.cursor() as cursor:
        cursor.executemany(sql.SQL("INSERT INTO {} VALUES (%s, %s::{})").format(table, sql.SQL(type_sql)),
                           list(enumerate(literals)))
    elements = sql.SQL("ARRAY(SELECT e::text FROM unnest(v) e)" if type_sql.endswith("]") else "NULL::text[]")
    rows = conn.execute(sql.SQL("SELECT v::text, CASE WHEN v IS NULL THEN NULL ELSE {} END FROM {} ORDER BY id")
                        .format(elements, table)).fetchall()
    registry = TypeRegistry()
    registry.load_from_server(conn)
    if conn.info.server_version >= 160000:
        # A decoding call starts at the slot's restart point, which moves only past a running-transactions
        # record (the server logs one every 15 s): without one here, each call decodes again every example's
        # DDL since the last (measured: the module's server CPU 53 s, 31-37 s with it). A superuser's function
        # unless granted: a PGCDC_TEST_DSN role without it only reads more.
        with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT pg_log_standby_snapshot()")
    # peek the text stream, then consume the binary one
    stream = {"text": slot_inserts(conn, SLOT, f"p_{schema}", registry, binary=False, consume=False),
              "binary": slot_inserts(conn, SLOT, f"p_{schema}", registry, binary=True)}
    assert all(len(tuples) == len(literals) for _, tuples in stream.values())
    published = published_tables(conn, f"p_{schema}")[0].relation
    return Stored(schema, [r[0] for r in rows], [r[1] for r in rows], stream, published, registry)


def drop(conn: psycopg.Connection, stored: Stored) -> None:
    conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(f"p_{stored.schema}")))
    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(stored.schema)))


# -- the oracle: a mirror value handed back to the server, printed as the server prints the type ---------


INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN = 2**31 - 1, -(2**31), 2**63 - 1, -(2**63)


def _scalar_sql(arrow_type: pa.DataType, pg_type: str) -> Callable[[pa.Scalar], tuple[str, tuple]]:
    """An SQL expression (and its parameters) of type ``pg_type`` rebuilt from one mirror value."""
    if pa.types.is_date32(arrow_type):
        def date(value: pa.Scalar) -> tuple[str, tuple]:
            days = value.cast(pa.int32()).as_py()
            if days in (INT32_MAX, INT32_MIN):  # the documented representation of ±infinity
                return "%s::date", ("infinity" if days > 0 else "-infinity",)
            return "'1970-01-01'::date + %s::int", (days,)
        return date
    if pa.types.is_timestamp(arrow_type):
        origin = "'1970-01-01 00:00+00'::timestamptz" if arrow_type.tz else "'1970-01-01 00:00'::timestamp"

        def timestamp(value: pa.Scalar) -> tuple[str, tuple]:
            micros = value.cast(pa.int64()).as_py()
            if micros in (INT64_MAX, INT64_MIN):
                return f"%s::{pg_type}", ("infinity" if micros > 0 else "-infinity",)
            days, rest = divmod(micros, 86_400_000_000)
            return f"{origin} + make_interval(days => %s) + (%s || ' microseconds')::interval", (days, str(rest))
        return timestamp
    if pa.types.is_struct(arrow_type):  # interval
        def interval(value: pa.Scalar) -> tuple[str, tuple]:
            parts = value.as_py()
            if (parts["months"], parts["days"], parts["microseconds"]) in ((INT32_MAX, INT32_MAX, INT64_MAX),
                                                                           (INT32_MIN, INT32_MIN, INT64_MIN)):
                return "%s::interval", ("infinity" if parts["months"] > 0 else "-infinity",)
            return "%s::interval", (f"{parts['months']} months {parts['days']} days "
                                    f"{parts['microseconds']} microseconds",)
        return interval
    if pa.types.is_floating(arrow_type):
        def floating(value: pa.Scalar) -> tuple[str, tuple]:
            # the exact value as text (repr round-trips); float4 values widen to float8 exactly
            return f"%s::float8::{pg_type}", (_float_text(value.as_py()),)
        return floating
    if pa.types.is_binary(arrow_type):
        return lambda value: (f"%s::bytea::{pg_type}", (value.as_py(),))
    if pa.types.is_int64(arrow_type) and pg_type == "time":  # microseconds since midnight; 24:00:00 included
        def clock(value: pa.Scalar) -> tuple[str, tuple]:
            seconds, micros = divmod(value.as_py(), 1_000_000)
            return "%s::time", (f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}.{micros:06d}",)
        return clock
    if pa.types.is_decimal(arrow_type) and pg_type == "numeric":  # --numeric decimal38: the scale is the mirror's
        return lambda value: ("trim_scale(%s::numeric)", (str(value.as_py()),))
    # ints, bool, decimals, strings: their Python value, in the type's input form
    return lambda value: (f"%s::text::{pg_type}", (str(value.as_py()).lower() if isinstance(value.as_py(), bool)
                                                   else str(value.as_py()),))


def _printed(conn: psycopg.Connection, pg_type: str, array: pa.Array, cache: dict) -> list:
    """Each mirror value of ``array`` as the server prints it back (arrays: each element's text)."""
    if pa.types.is_list(array.type):
        element_type = pg_type.removesuffix("[]").removesuffix("[]")
        flat = _printed(conn, element_type, array.flatten(), cache)
        offsets = array.offsets.to_pylist()
        return [None if not array[i].is_valid else flat[offsets[i] - array.offset:offsets[i + 1] - array.offset]
                for i in range(len(array))]
    rebuild = _scalar_sql(array.type, pg_type)
    out = []
    for value in array:
        if not value.is_valid:
            out.append(None)
            continue
        expression, params = rebuild(value)
        key = (pg_type, expression, params)
        if key not in cache:
            cache[key] = conn.execute(f"SELECT ({expression})::text", params).fetchone()[0]
        out.append(cache[key])
    return out


def assert_every_path_prints_as_the_server(conn: psycopg.Connection, type_sql: str, literals: list[str | None],
                                           options: ConversionOptions | None = None) -> None:
    """Each path, with and without the C module, gives mirror values that the server prints as it prints
    the stored ones (arrays: element by element, flattened row-major)."""
    stored = store(conn, type_sql, literals)
    try:
        is_array = type_sql.endswith("]")
        expected = stored.server_elements if is_array else stored.server_text
        cache: dict = {}
        for path in stored.paths(options):
            for accelerated in (True, False):
                array = stored.convert(conn, path, accelerated, options)
                assert _printed(conn, type_sql, array, cache) == expected, (path, accelerated, literals)
    finally:
        drop(conn, stored)


def assert_refused_on_every_path(conn: psycopg.Connection, type_sql: str, literals: list[str | None],
                                 message: str, options: ConversionOptions | None = None) -> None:
    """Each path, with and without the C module, refuses the values with a ConversionError naming the
    table, the column, the type, and on the stream the LSN."""
    stored = store(conn, type_sql, literals)
    try:
        base_type = type_sql.split("(")[0].removesuffix("[]")
        for path in stored.paths(options):
            for accelerated in (True, False):
                where = "" if path == "copy" else f" at LSN {STREAM_LSN}"
                with pytest.raises(ConversionError, match=rf"^{stored.schema}\.t\.v \({base_type}.*\){where}: .*{message}"):
                    stored.convert(conn, path, accelerated, options)
    finally:
        drop(conn, stored)


# -- the domains: each type's edges, and a strategy over its whole range --------------------------------


@dataclass(frozen=True)
class Domain:
    edges: list[str]  # min, max, ±infinity, BC, empty: checked on every run
    general: st.SearchStrategy[str]  # anywhere in the type's range
    delimiter: str = ","  # between elements of its arrays (pg_type.typdelim)

    def values(self) -> st.SearchStrategy[str | None]:
        return st.one_of(st.none(), st.sampled_from(self.edges), self.general)


def _date_text(year: int, month: int, day: int) -> str:
    return f"{abs(year):04d}-{month:02d}-{day:02d}" + (" BC" if year < 0 else "")


def _moment_text(year: int, month: int, day: int, seconds: int, micros: int) -> str:
    clock = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}.{micros:06d}"
    return f"{abs(year):04d}-{month:02d}-{day:02d} {clock}" + (" BC" if year < 0 else "")


def _float_text(number: float) -> str:
    return "NaN" if math.isnan(number) else repr(number).replace("inf", "Infinity")


def _years(last: int) -> st.SearchStrategy[int]:
    """AD years up to ``last``, BC years back to 4713, and the common era more often."""
    return st.one_of(st.integers(1, last), st.integers(-4713, -1), st.integers(1900, 2100))


ZONES = st.sampled_from(["+00", "+05:30", "-08", "+14", "-03:30:15", "-15:59"])
# int64 microseconds since 1970 end at 294247-01-10 04:00:54.775807 (that one is infinity's); PostgreSQL's
# timestamps run to 294276-12-31 23:59:59.999999: the moments between are refused (see the test below)
LAST_MOMENT = "294247-01-10 04:00:54.775806"
TIMESTAMP_EDGES = ["infinity", "-infinity", "4714-11-24 00:00:00 BC", "0001-12-31 23:59:59.999999 BC",
                   "0001-01-01 00:00:00", "1970-01-01 00:00:00", "1969-12-31 23:59:59.999999",
                   "9999-12-31 23:59:59.999999", "10000-01-01 00:00:00", LAST_MOMENT, "2000-02-29 12:00:00",
                   "2016-12-31 23:59:60"]  # a leap second: PostgreSQL stores the next minute
MOMENTS = st.builds(_moment_text, _years(294_246), st.integers(1, 12), st.integers(1, 28), st.integers(0, 86_399),
                    st.integers(0, 999_999))


def _with_zone(moment: str, zone: str) -> str:
    return moment.replace(" BC", zone + " BC") if moment.endswith(" BC") else moment + zone


def _int_domain(low: int, high: int) -> Domain:
    return Domain([str(low), str(high), "0", "-1", "1"], st.integers(low, high).map(str))


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
# jsonb refuses \u0000 (text cannot hold it)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False,
                                                                                      allow_infinity=False)
                    | _TEXT, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                    max_leaves=6)

DOMAINS: dict[str, Domain] = {
    "bool": Domain(["t", "f"], st.sampled_from(["true", "false"])),
    "int2": _int_domain(-2**15, 2**15 - 1),
    "int4": _int_domain(INT32_MIN, INT32_MAX),
    "int8": _int_domain(INT64_MIN, INT64_MAX),
    "oid": Domain(["0", "4294967295"], st.integers(0, 2**32 - 1).map(str)),
    "float4": Domain(["NaN", "Infinity", "-Infinity", "-0", "0", "1e-45", "-1e-45", "1.1754944e-38", "3.4028235e38"],
                     st.floats(width=32).map(_float_text)),
    "float8": Domain(["NaN", "Infinity", "-Infinity", "-0", "0", "5e-324", "-5e-324", "2.2250738585072014e-308",
                      "1.7976931348623157e308", "-1.7976931348623157e308"], st.floats(width=64).map(_float_text)),
    "numeric": Domain(["NaN", "Infinity", "-Infinity", "0", "-0.0", "0.000000000000000000000000000000000000001",
                       "9" * 131072 + "." + "9" * 16383, "-" + "9" * 131072, "0." + "0" * 16382 + "1"],
                      st.decimals(allow_nan=False, allow_infinity=False).map(str)),
    "numeric(38, 10)": Domain(["9999999999999999999999999999.9999999999",
                               "-9999999999999999999999999999.9999999999", "0.0000000001", "0"],
                              st.decimals(min_value=-10**28 + 1, max_value=10**28 - 1, places=10,
                                          allow_nan=False).map(str)),
    # PostgreSQL 15+: a scale below 0 (integers rounded to hundreds: decimal(7, 0)) or above the precision
    # (below 0.01: decimal(5, 5))
    "numeric(5, -2)": Domain(["0", "9999900", "-9999900", "1234549", "-50"],
                             st.integers(-9_999_949, 9_999_949).map(str)),
    "numeric(3, 5)": Domain(["0", "0.00999", "-0.00999", "0.000004", "-0.000005"],
                            st.decimals(min_value="-0.00999", max_value="0.00999", places=5).map(str)),
    "text": Domain(["", " ", "NULL", '"', "\\", "{}", "\U0001D11E", "\U0010FFFF", "\uFFFD", "\x01\x7f"],
                   _TEXT),
    "varchar(5)": Domain(["", "abcde", "\U0010FFFF" * 5], _TEXT.map(lambda t: t[:5])),
    "char(3)": Domain(["", "a", "a  ", " a", "é\U0001D11E"], _TEXT.map(lambda t: t[:3])),
    "name": Domain(["", "x" * 63], _TEXT.map(lambda t: t.encode()[:63].decode(errors="ignore"))),
    '"char"': Domain(["", "a", "\x01", "\\200", "\\377", "é"], st.characters(min_codepoint=1, max_codepoint=255)),
    "json": Domain(["{}", "[]", "null", ' { "a" : 1 , "a" : 2 } ', '"\\u00e9"'], JSON.map(json.dumps)),
    "jsonb": Domain(["{}", "[]", "null", '{"a": 1, "a": 2}', '[1e300, -0, 0.1]', '"\\u00e9"'], JSON.map(json.dumps)),
    "xid": Domain(["0", "4294967295"], st.integers(0, 2**32 - 1).map(str)),
    # types read as their text output (no binary decoder: pgcdc streams their tables in text); box's arrays
    # are delimited by ';'
    "box": Domain(["(1,1),(0,0)", "(2.5,-1e300),(-0,NaN)"], st.builds(lambda a, b, c, d: f"({a},{b}),({c},{d})",
                                                                       *[st.integers(-9, 9)] * 4), ";"),
    "inet": Domain(["::1", "10.0.0.1/8", "::ffff:1.2.3.4"], st.ip_addresses().map(str)),
    "bytea": Domain(["\\x", "\\x" + bytes(range(256)).hex()], st.binary(max_size=40).map(lambda b: "\\x" + b.hex())),
    "uuid": Domain(["00000000-0000-0000-0000-000000000000", "ffffffff-ffff-ffff-ffff-ffffffffffff"],
                   st.uuids().map(str)),
    "date": Domain(["infinity", "-infinity", "4714-11-24 BC", "4713-01-01 BC", "0001-12-31 BC", "0001-01-01",
                    "1970-01-01", "9999-12-31", "10000-01-01", "5874897-12-31", "2000-02-29"],
                   st.builds(_date_text, _years(5_874_896), st.integers(1, 12), st.integers(1, 28))),
    "timestamp": Domain(TIMESTAMP_EDGES, MOMENTS),
    "timestamptz": Domain([e if "infinity" in e else _with_zone(e, "+00") for e in TIMESTAMP_EDGES]
                          + ["294247-01-10 09:30:54.775806+05:30"],
                          st.builds(_with_zone, MOMENTS, ZONES)),
    "time": Domain(["00:00:00", "23:59:59.999999", "24:00:00", "23:59:60"], st.times().map(lambda t: t.isoformat())),
    "timetz": Domain(["00:00:00+15:59", "24:00:00-15:59", "12:00:00+05:30", "00:00:00-00:00:01"],
                     st.builds(lambda t, z: t.isoformat() + z, st.times(), ZONES)),
    "interval": Domain(["infinity", "-infinity", "0", "1 microsecond", "-1 microsecond", "1 year -1 day 1 hour",
                        "2147483647 months 2147483647 days 9223372036854775806 microseconds",
                        "-2147483648 months -2147483648 days -9223372036854775807 microseconds"],
                       st.builds(lambda m, d, us: f"{m} months {d} days {us} microseconds",
                                 st.integers(INT32_MIN, INT32_MAX - 1), st.integers(INT32_MIN, INT32_MAX - 1),
                                 st.integers(INT64_MIN + 1, INT64_MAX - 1))),
}
# numeric's widest values would make array literals of megabytes: arrays of it keep to its specials
ARRAY_DOMAINS = {**DOMAINS, "numeric": Domain(["NaN", "Infinity", "-Infinity", "0"], DOMAINS["numeric"].general)}


def _quoted(element: str | None) -> str:
    if element is None:
        return "NULL"
    return '"' + element.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _nested(items: list[str], shape: list[int], delimiter: str) -> str:
    if len(shape) == 1:
        return "{" + delimiter.join(items) + "}"
    step = len(items) // shape[0]
    return "{" + delimiter.join(_nested(items[i * step:(i + 1) * step], shape[1:], delimiter)
                                for i in range(shape[0])) + "}"


@st.composite
def array_literals(draw: st.DrawFn, domain: Domain) -> str | None:
    """An array's input text: NULL, empty, 1-D or n-D, NULL elements, lower bounds other than 1."""
    form = draw(st.sampled_from(["null", "empty", "array", "array", "array"]))
    if form != "array":
        return None if form == "null" else "{}"
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    body = _nested([_quoted(draw(domain.values())) for _ in range(math.prod(shape))], shape, domain.delimiter)
    if draw(st.booleans()):
        lows = [draw(st.integers(-5, 5)) for _ in shape]
        body = "".join(f"[{low}:{low + size - 1}]" for low, size in zip(lows, shape, strict=True)) + "=" + body
    return body


def _array_edges(domain: Domain) -> list[str | None]:
    first, last, cut = _quoted(domain.edges[0]), _quoted(domain.edges[-1]), domain.delimiter
    return [None, "{}", "{NULL}", _nested([_quoted(e) for e in domain.edges], [len(domain.edges)], cut),
            f"[0:1]={{{first}{cut}NULL}}", f"[-2:-1][3:4]={{{{{last}{cut}NULL}}{cut}{{NULL{cut}{first}}}}}"]


# -- the tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("type_sql", list(DOMAINS))
def test_every_edge_value_prints_as_the_server_prints_it(db, type_sql):
    assert_every_path_prints_as_the_server(db, type_sql, [None, *DOMAINS[type_sql].edges])


@pytest.mark.parametrize("type_sql", list(DOMAINS))
@settings(max_examples=30)
@given(data=st.data())
def test_every_value_prints_as_the_server_prints_it(db, type_sql, data):
    values = data.draw(st.lists(DOMAINS[type_sql].values(), min_size=1, max_size=8), label="values")
    assert_every_path_prints_as_the_server(db, type_sql, values)


@pytest.mark.parametrize("element", list(ARRAY_DOMAINS))
def test_every_array_edge_prints_as_the_server_prints_it(db, element):
    assert_every_path_prints_as_the_server(db, f"{element}[]", _array_edges(ARRAY_DOMAINS[element]))


@pytest.mark.parametrize("element", list(ARRAY_DOMAINS))
@settings(max_examples=12)
@given(data=st.data())
def test_every_array_prints_as_the_server_prints_it(db, element, data):
    values = data.draw(st.lists(array_literals(ARRAY_DOMAINS[element]), min_size=1, max_size=4),
                       label="arrays")
    assert_every_path_prints_as_the_server(db, f"{element}[]", values)


@pytest.mark.parametrize("type_sql", ["timestamp", "timestamptz", "timestamp[]"])
@pytest.mark.parametrize("moment", ["294276-12-31 23:59:59.999999", "294247-01-10 04:00:54.775807",
                                    "294250-06-01 00:00:00"])
def test_timestamps_past_int64_micros_are_refused_on_every_path(db, type_sql, moment):
    """int64 microseconds since 1970 (Arrow's, Spark's and Iceberg's timestamps) cannot hold them, and the
    last one they hold is infinity's: refused, never wrapped or clamped onto another value."""
    values = ["2024-01-01 00:00:00", moment]
    if type_sql == "timestamptz":
        values = [v + "+00" for v in values]
    elif type_sql == "timestamp[]":
        values = [f"{{{v}}}" for v in values]
    assert_refused_on_every_path(db, type_sql, values, "past 294247-01-10")


@pytest.mark.parametrize("numeric", ["string", "decimal38"])
def test_numeric_specials_under_both_policies(db, numeric):
    """The string policy keeps NaN and ±Infinity as PostgreSQL prints them; decimal38 refuses each on every
    path (a decimal cannot hold them)."""
    options = ConversionOptions(numeric=numeric)
    if numeric == "string":
        assert_every_path_prints_as_the_server(db, "numeric", ["NaN", "Infinity", "-Infinity", None, "1.5"], options)
        return
    assert_every_path_prints_as_the_server(db, "numeric", ["1.5", None, "-" + "9" * 20 + "." + "1" * 18], options)
    for special in ("NaN", "Infinity", "-Infinity"):
        assert_refused_on_every_path(db, "numeric", [special], "does not fit", options)


@pytest.mark.parametrize("too_wide", ["1" + "0" * 30, "-12345678901234567890123", "100000000000000000000.5",
                                      "9" * 21])
def test_decimal38_refuses_more_integer_digits_than_it_holds_on_every_path(db, too_wide):
    """decimal(38, 18) holds 20 integer digits: a wider value is refused on every path, never wrapped into
    another number (Arrow's string-to-decimal cast wraps some of them), and values at the edge still pass."""
    options = ConversionOptions(numeric="decimal38")
    assert_every_path_prints_as_the_server(db, "numeric", ["9" * 20 + "." + "9" * 18, "-" + "1" * 20, "0.5", None],
                                           options)
    assert_refused_on_every_path(db, "numeric", ["1.5", too_wide], "does not fit", options)


def test_nan_in_a_decimal_column_is_refused_on_every_path(db):
    """numeric(p, s) holds NaN in PostgreSQL; decimal(p, s) cannot: refused, never a made-up number."""
    assert_refused_on_every_path(db, "numeric(38, 10)", ["1.5", "NaN"], "does not fit")
    assert_refused_on_every_path(db, "numeric(38, 10)[]", ["{1.5,NaN}"], "does not fit")


@pytest.mark.parametrize("type_sql", ["date", "timestamp", "timestamptz"])
def test_infinity_policy_error_refuses_infinity_on_every_path(db, type_sql):
    for value in ("infinity", "-infinity"):
        assert_refused_on_every_path(db, type_sql, [value], "infinity policy is 'error'",
                                     ConversionOptions(infinity="error"))
