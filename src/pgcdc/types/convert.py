"""Column values (PostgreSQL text or binary format) to Arrow, column by column.

A column's value bytes are gathered into one Arrow array and parsed with vectorised
Arrow casts or NumPy views of fixed-width binary values, or by the optional C module
(``_columns``) where Arrow has no kernel (integer arrays, numeric, uuid and jsonb in binary);
Python runs per value only where neither exists (bytea hex, intervals, other arrays) or for
the rare value a fast path defers (BC dates, infinity, NaN, unusual array forms).

Policies (also in docs/types.md):

- numeric(p, s) with p <= 38 → decimal(p, s); NaN in such a column is a ConversionError.
  Unconstrained numeric (and p > 38) → string holding PostgreSQL's text (NaN, Infinity
  included); with ``numeric='decimal38'`` → decimal(38, ``numeric_scale``), ConversionError on
  NaN, infinity or overflow. Never a float, never rounded.
- dates and timestamps: PostgreSQL's whole range, exactly (proleptic Gregorian, BC as negative years;
  never through Python's ``datetime``, which ends in 9999). date/timestamp ±infinity → the extremes of
  date32 / int64 microseconds, which no real value maps to, or a ConversionError with
  ``infinity='error'``. A timestamp past 294247-01-10 04:00:54.775806 (int64 microseconds since 1970
  end there) is a ConversionError on every path, never a wrapped value.
- time → int64 microseconds since midnight (Spark has no time type); timetz → its text
  ``HH:MM:SS[.ffffff]+HH[:MM]``; interval → struct(months, days, microseconds), exact; its ±infinity
  (PostgreSQL 17+) is every field at its extreme, as PostgreSQL itself keeps it.
- arrays → list of the element type; multi-dimensional arrays are flattened in row-major order;
  lower bounds other than 1 are not kept.
- enums, domains of text types, uuid, json, jsonb, money, inet, cidr, macaddr, bit, varbit,
  tsvector, ranges, composites, hstore and unknown types → string of PostgreSQL's text output. In
  binary mode those without a binary decoder here make ``requires_text_mode`` true: pgcdc then asks
  the server for text.
"""

from __future__ import annotations

import functools
import gc
import itertools
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.errors import ConversionError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Relation, TupleData
from pgcdc.types.registry import PgType, TypeRegistry

Values = Sequence[bytes | memoryview | None]
PG_EPOCH_DAYS = 10_957  # 2000-01-01 - 1970-01-01
PG_EPOCH_MICROS = PG_EPOCH_DAYS * 86_400_000_000
INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
# ±infinity under the 'clamp' policy: the extremes of date32 and of int64 microseconds. No PostgreSQL date
# reaches them (its dates end in 5874897 AD); the last int64 microsecond (294247-01-10 04:00:54.775807) is a
# PostgreSQL timestamp, which is refused with the later ones so that infinity alone holds it.
DATE_INFINITY_DAYS, DATE_MINUS_INFINITY_DAYS = INT32_MAX, INT32_MIN
TIMESTAMP_INFINITY_MICROS, TIMESTAMP_MINUS_INFINITY_MICROS = INT64_MAX, INT64_MIN
LAST_TIMESTAMP_TEXT = "294247-01-10 04:00:54.775806"
INTERVAL_TYPE = pa.struct([("months", pa.int32()), ("days", pa.int32()), ("microseconds", pa.int64())])

try:  # optional C paths for what Arrow has no kernel for; each returns None when a value needs the exact path
    from pgcdc.types import _columns as _accelerator  # type: ignore[attr-defined]
except ImportError:
    _accelerator = None
else:
    _accelerator.configure_rows(TupleData, TupleData.__dict__["kinds"], TupleData.__dict__["values"])


def _accelerated(name: str, values: Values | pa.Array, *args: object) -> tuple | None:
    """The C function ``name`` over a list of values or an Arrow binary/string array (read in place), or None
    (not built, another input, a value off the fast path)."""
    if _accelerator is None:
        return None
    if not isinstance(values, list):
        values = _packed(values)
        if values is None:
            return None
    return getattr(_accelerator, name)(values, *args)


def _packed(values: object) -> tuple | None:
    """An Arrow binary or string array as the C module reads it: (count, first, validity, offsets, offset
    width, data)."""
    if not isinstance(values, pa.Array):
        return None
    if pa.types.is_large_binary(values.type) or pa.types.is_large_string(values.type):
        width = 8
    elif pa.types.is_binary(values.type) or pa.types.is_string(values.type):
        width = 4
    else:
        return None
    validity, offsets, data = values.buffers()
    return len(values), values.offset, validity, offsets, width, b"" if data is None else data


def _as_list(values: Values | pa.Array) -> Values:
    """Values one by one, for the paths that take them so (an Arrow array becomes a list of bytes)."""
    return values.to_pylist() if isinstance(values, pa.Array) else values


def _columnar(decoder: Callable[[Values], pa.Array]) -> Callable[[Values], pa.Array]:
    """Marks a binary decoder that also takes an Arrow binary array (the snapshot's COPY columns) as is."""
    decoder.columnar = True  # type: ignore[attr-defined]
    return decoder


def _validity(flags: bytes) -> pa.Buffer:
    """One byte per value (1 = present) as Arrow's validity bitmap."""
    return pa.py_buffer(np.packbits(np.frombuffer(flags, dtype=np.uint8), bitorder="little"))


@dataclass(frozen=True)
class ConversionOptions:
    """``numeric``: 'string' (default) or 'decimal38' for unconstrained numeric; ``infinity``: 'clamp' or 'error'."""

    numeric: str = "string"
    numeric_scale: int = 18
    infinity: str = "clamp"

    def __post_init__(self) -> None:
        if self.numeric not in ("string", "decimal38"):
            raise ValueError(f"numeric policy {self.numeric!r} must be 'string' or 'decimal38'")
        if self.infinity not in ("clamp", "error"):
            raise ValueError(f"infinity policy {self.infinity!r} must be 'clamp' or 'error'")
        if not 0 <= self.numeric_scale <= 38:
            raise ValueError("numeric_scale must be between 0 and 38")


class _ValueError(Exception):
    """A value a decoder cannot convert; becomes a ConversionError with the column's context."""


@dataclass(frozen=True)
class ColumnKind:
    """How one column converts: its Arrow type and its decoders for text and binary values."""

    type_name: str
    arrow_type: pa.DataType
    text: Callable[[Values], pa.Array]
    binary: Callable[[Values], pa.Array] | None  # None: no binary decoder, ask the server for text


# -- vectorised helpers -------------------------------------------------------------------------


def _as_strings(values: Values | pa.Array) -> pa.Array:
    if isinstance(values, pa.Array):  # already columnar (the snapshot's CSV reader)
        return values if pa.types.is_string(values.type) else values.cast(pa.string())
    return pa.array(values, pa.binary()).cast(pa.string())


def _fixed(values: Values | pa.Array, width: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-width big-endian binary values as a native NumPy array and a null mask (no Python per value:
    Arrow gathers the bytes into one buffer, NumPy swaps them)."""
    if isinstance(values, pa.Array):
        return _fixed_columnar(values, width, dtype)
    try:
        gathered = pa.array(values, pa.binary(width))
    except pa.ArrowInvalid:
        raise _ValueError(f"binary values of {width} bytes expected") from None
    mask = gathered.is_null().to_numpy(zero_copy_only=False)
    big_endian = np.dtype(dtype).newbyteorder(">")
    raw = np.frombuffer(gathered.buffers()[1], dtype=big_endian, count=len(gathered) * width // big_endian.itemsize)
    return raw.astype(dtype), mask


def _fixed_columnar(values: pa.Array, width: int, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``_fixed`` over an Arrow binary array: its present values lie back to back in its data buffer."""
    packed = _packed(values)
    if packed is None:
        raise _ValueError(f"binary values of {width} bytes expected, not {values.type}")
    count, first, _, offset_buffer, offset_width, data = packed
    offsets = np.frombuffer(offset_buffer, dtype=f"i{offset_width}", count=first + count + 1)[first:]
    mask = values.is_null().to_numpy(zero_copy_only=False)
    lengths = np.diff(offsets)
    if (lengths[~mask] != width).any() or lengths[mask].any():
        raise _ValueError(f"binary values of {width} bytes expected")
    native = np.dtype(dtype)
    per_value = width // native.itemsize
    raw = np.frombuffer(data, dtype=np.uint8, count=int(offsets[-1]))[offsets[0]:]
    present = raw.view(native.newbyteorder(">")).astype(native)
    if not mask.any():
        return present, mask
    out = np.zeros((count, per_value), dtype=native)
    out[~mask] = present.reshape(-1, per_value)
    return out.ravel(), mask


def _fixed_from_c(values: Values | pa.Array, kind: str, target: pa.DataType) -> pa.Array | None:
    """Integers and timestamps parsed from text in C, or None (not built, a value off its path)."""
    fast = _accelerated("fixed_text", values, kind)
    if fast is None:
        return None
    data, valid = fast
    return pa.Array.from_buffers(target, len(values), [_validity(valid), pa.py_buffer(data)])


def _cast_text(target: pa.DataType, fallback: Callable[[str], object] | None = None, c_kind: str | None = None
               ) -> Callable[[Values], pa.Array]:
    def decode(values: Values) -> pa.Array:
        if c_kind is not None:
            fast = _fixed_from_c(values, c_kind, target)
            if fast is not None:
                return fast
        strings = _as_strings(values)
        try:
            return strings.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            if fallback is None:
                raise _ValueError(str(exc)) from None
        return pa.array([None if s is None else fallback(s) for s in strings.to_pylist()], target)

    return decode


def _fixed_binary(width: int, dtype: str, target: pa.DataType) -> Callable[[Values], pa.Array]:
    @_columnar
    def decode(values: Values) -> pa.Array:
        data, mask = _fixed(values, width, dtype)
        return pa.array(data, target, mask=mask)

    return decode


def _bool_text(values: Values) -> pa.Array:
    strings = _as_strings(values)
    bad = pc.and_(pc.not_equal(strings, "t"), pc.not_equal(strings, "f"))
    if pc.any(bad).as_py():
        raise _ValueError(f"not a boolean: {strings.filter(bad)[0]}")
    return pc.equal(strings, "t")


@_columnar
def _bool_binary(values: Values) -> pa.Array:
    data, mask = _fixed(values, 1, "u1")
    return pa.array(data != 0, pa.bool_(), mask=mask)


@_columnar
def _string_binary(values: Values) -> pa.Array:
    return _as_strings(values)


@_columnar
def _jsonb_binary(values: Values) -> pa.Array:
    fast = _accelerated("jsonb_binary", values)
    if fast is not None:
        offsets, text, valid = fast
        return pa.Array.from_buffers(pa.string(), len(values), [_validity(valid), pa.py_buffer(offsets),
                                                                pa.py_buffer(text)])

    def body(v: bytes | memoryview) -> bytes:
        raw = bytes(v)
        if not raw or raw[0] != 1:
            raise _ValueError(f"unknown jsonb binary version {raw[:1]!r}")
        return raw[1:]

    return _as_strings([None if v is None else body(v) for v in _as_list(values)])


def _bytea_text(values: Values) -> pa.Array:
    def unhex(text: str) -> bytes:
        if not text.startswith("\\x"):
            raise _ValueError("bytea text is not in hex format (set bytea_output = hex)")
        return bytes.fromhex(text[2:])

    return pa.array([None if s is None else unhex(s) for s in _as_strings(values).to_pylist()], pa.binary())


@_columnar
def _bytes_binary(values: Values) -> pa.Array:
    if isinstance(values, pa.Array):
        return values.cast(pa.binary())
    return pa.array([None if v is None else bytes(v) for v in values], pa.binary())


# -- dates and times ----------------------------------------------------------------------------

_SPECIAL_DATE = re.compile(r"^(-?infinity)$|^(\d+)-(\d\d)-(\d\d)( BC)?$")


class _Infinity:
    def __init__(self, policy: str) -> None:
        self.policy = policy

    def days(self, positive: bool) -> int:
        if self.policy == "error":
            raise _ValueError(f"{'' if positive else '-'}infinity has no date value (infinity policy is 'error')")
        return DATE_INFINITY_DAYS if positive else DATE_MINUS_INFINITY_DAYS

    def micros(self, positive: bool) -> int:
        if self.policy == "error":
            raise _ValueError(f"{'' if positive else '-'}infinity has no timestamp value (infinity policy is 'error')")
        return TIMESTAMP_INFINITY_MICROS if positive else TIMESTAMP_MINUS_INFINITY_MICROS


_MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _proleptic_days(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date, year 0 = 1 BC, in integers: PostgreSQL's dates run
    from 4713 BC to 5874897 AD, Python's ``date`` from 1 to 9999 (the C module's days_from_civil, the same
    algorithm)."""
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    if not (1 <= month <= 12 and 1 <= day <= _MONTH_DAYS[month - 1] + (month == 2 and leap)):
        raise _ValueError(f"no day {day} in month {month} of year {year}")
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468


def _past_int64_micros(text: str) -> _ValueError:
    return _ValueError(f"{text} is past {LAST_TIMESTAMP_TEXT}, the last moment int64 microseconds since 1970 "
                       "(Arrow's, Spark's and Iceberg's timestamps) hold: it cannot be mirrored")


def _date_days(text: str, infinity: _Infinity) -> int:
    match = _SPECIAL_DATE.match(text)
    if match is None:
        raise _ValueError(f"not a date: {text!r}")
    if match.group(1):
        return infinity.days(not text.startswith("-"))
    year, month, day = int(match.group(2)), int(match.group(3)), int(match.group(4))
    if match.group(5):
        year = 1 - year
    return _proleptic_days(year, month, day)


_TIMESTAMP = re.compile(r"^(\d+)-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?([+-]\d\d(?::?\d\d)?(?::?\d\d)?)?( BC)?$")


def _timestamp_micros(text: str, infinity: _Infinity) -> int:
    if text in ("infinity", "-infinity"):
        return infinity.micros(text == "infinity")
    match = _TIMESTAMP.match(text)
    if match is None:
        raise _ValueError(f"not a timestamp: {text!r}")
    year, month, day, hour, minute, second = (int(match.group(i)) for i in range(1, 7))
    fraction = int((match.group(7) or "0").ljust(6, "0"))
    if match.group(9):
        year = 1 - year
    micros = _proleptic_days(year, month, day) * 86_400_000_000
    micros += ((hour * 60 + minute) * 60 + second) * 1_000_000 + fraction
    if match.group(8):
        sign = -1 if match.group(8)[0] == "-" else 1
        parts = [int(p) for p in re.findall(r"\d\d", match.group(8))]
        offset = parts[0] * 3600 + (parts[1] * 60 if len(parts) > 1 else 0) + (parts[2] if len(parts) > 2 else 0)
        micros -= sign * offset * 1_000_000
    if micros >= TIMESTAMP_INFINITY_MICROS:
        raise _past_int64_micros(text)
    return micros


def _date_text(infinity: _Infinity) -> Callable[[Values], pa.Array]:
    fast = _cast_text(pa.date32(), None)

    def decode(values: Values) -> pa.Array:
        try:
            return fast(values)
        except _ValueError:
            strings = _as_strings(values).to_pylist()
            return pa.array([None if s is None else _date_days(s, infinity) for s in strings], pa.int32()).cast(
                pa.date32())

    return decode


def _date_binary(infinity: _Infinity) -> Callable[[Values], pa.Array]:
    @_columnar
    def decode(values: Values) -> pa.Array:
        data, mask = _fixed(values, 4, "i4")
        days = data.astype("i8") + PG_EPOCH_DAYS
        special = (data == INT32_MAX) | (data == INT32_MIN)
        if special.any():
            for index in np.flatnonzero(special & ~mask):
                days[index] = infinity.days(data[index] == INT32_MAX)
        return pa.array(days.astype("i4"), pa.int32(), mask=mask).cast(pa.date32())

    return decode


def _timestamp_text(target: pa.DataType, infinity: _Infinity) -> Callable[[Values], pa.Array]:
    def decode(values: Values) -> pa.Array:
        parsed = _fixed_from_c(values, "T", target)
        if parsed is not None:
            return parsed
        strings = _as_strings(values)
        try:
            return strings.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            micros = [None if s is None else _timestamp_micros(s, infinity) for s in strings.to_pylist()]
            return pa.array(micros, pa.int64()).cast(target)

    return decode


def _timestamp_binary(target: pa.DataType, infinity: _Infinity) -> Callable[[Values], pa.Array]:
    @_columnar
    def decode(values: Values) -> pa.Array:
        data, mask = _fixed(values, 8, "i8")
        special = (data == INT64_MAX) | (data == INT64_MIN)
        past = (data >= TIMESTAMP_INFINITY_MICROS - PG_EPOCH_MICROS) & ~special & ~mask
        if past.any():  # the epoch shift would wrap them
            moment = int(data[np.flatnonzero(past)[0]])
            raise _past_int64_micros(f"the timestamp {moment} microseconds after 2000-01-01")
        micros = data + PG_EPOCH_MICROS if not special.any() else data.copy()
        if special.any():
            micros[~special] += PG_EPOCH_MICROS
            for index in np.flatnonzero(special & ~mask):
                micros[index] = infinity.micros(data[index] == INT64_MAX)
        return pa.array(micros, pa.int64(), mask=mask).cast(target)

    return decode


def _time_micros(text: str) -> int:
    match = re.match(r"^(\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?", text)
    if match is None:
        raise _ValueError(f"not a time: {text!r}")
    hour, minute, second = int(match.group(1)), int(match.group(2)), int(match.group(3))
    return ((hour * 60 + minute) * 60 + second) * 1_000_000 + int((match.group(4) or "0").ljust(6, "0"))


def _time_text(values: Values) -> pa.Array:
    return pa.array([None if s is None else _time_micros(s) for s in _as_strings(values).to_pylist()], pa.int64())


@_columnar
def _time_binary(values: Values) -> pa.Array:
    data, mask = _fixed(values, 8, "i8")
    return pa.array(data, pa.int64(), mask=mask)


def _timetz_binary(values: Values) -> pa.Array:
    def text(v: bytes | memoryview) -> str:
        micros, zone = struct.unpack(">qi", bytes(v))
        offset = -zone  # PostgreSQL stores seconds west of UTC
        sign = "+" if offset >= 0 else "-"
        hours, rest = divmod(abs(offset), 3600)
        minutes, seconds = divmod(rest, 60)
        clock = (datetime.min + timedelta(microseconds=micros)).strftime("%H:%M:%S.%f").rstrip("0").rstrip(".")
        if micros == 86_400_000_000:
            clock = "24:00:00"
        zone_text = f"{sign}{hours:02d}" + (f":{minutes:02d}" if minutes or seconds else "") + (
            f":{seconds:02d}" if seconds else "")
        return clock + zone_text

    return pa.array([None if v is None else text(v) for v in values], pa.string())


_ISO_INTERVAL = re.compile(
    r"^P(?:(-?\d+)Y)?(?:(-?\d+)M)?(?:(-?\d+)D)?(?:T(?:(-?\d+)H)?(?:(-?\d+)M)?(?:(-?\d+(?:\.\d+)?)S)?)?$")


# PostgreSQL 17+ keeps interval ±infinity as every field at its extreme; its binary form says so too
_INTERVAL_INFINITY = {"infinity": {"months": INT32_MAX, "days": INT32_MAX, "microseconds": INT64_MAX},
                      "-infinity": {"months": INT32_MIN, "days": INT32_MIN, "microseconds": INT64_MIN}}


def _interval_parts(text: str) -> dict[str, int]:
    """An ISO 8601 interval as PostgreSQL prints it with IntervalStyle iso_8601 (e.g. P1Y2M3DT4H5M6.7S)."""
    if text in _INTERVAL_INFINITY:
        return _INTERVAL_INFINITY[text]
    match = _ISO_INTERVAL.match(text)
    if match is None or text == "P":
        if text == "PT0S":
            return {"months": 0, "days": 0, "microseconds": 0}
        raise _ValueError(f"not an ISO 8601 interval (set IntervalStyle = iso_8601): {text!r}")
    years, months, days, hours, minutes = (int(g) if g else 0 for g in match.groups()[:5])
    seconds = Decimal(match.group(6) or 0)
    micros = (hours * 3600 + minutes * 60) * 1_000_000 + int(seconds * 1_000_000)
    return {"months": years * 12 + months, "days": days, "microseconds": micros}


def _interval_text(values: Values) -> pa.Array:
    return pa.array([None if s is None else _interval_parts(s) for s in _as_strings(values).to_pylist()],
                    INTERVAL_TYPE)


def _interval_binary(values: Values) -> pa.Array:
    mask = np.fromiter((v is None for v in values), dtype=bool, count=len(values))
    buffer = b"".join(bytes(16) if v is None else bytes(v) for v in values)
    if len(buffer) != 16 * len(values):
        raise _ValueError("interval binary values are 16 bytes")
    parts = np.frombuffer(buffer, dtype=np.dtype([("us", ">i8"), ("days", ">i4"), ("months", ">i4")]))
    return pa.StructArray.from_arrays(
        [pa.array(parts["months"].astype("i4")), pa.array(parts["days"].astype("i4")),
         pa.array(parts["us"].astype("i8"))],
        fields=list(INTERVAL_TYPE), mask=pa.array(mask))


def _uuid_text(values: Values) -> pa.Array:
    return _as_strings(values)


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype="S1")
_UUID_DASHES = (8, 12, 16, 20)


@_columnar
def _uuid_binary(values: Values) -> pa.Array:
    """16-byte uuids to their canonical text (in C, or with NumPy over all values at once)."""
    fast = _accelerated("uuid_binary", values)
    if fast is not None:
        text, valid = fast
        offsets = np.arange(0, 36 * (len(values) + 1), 36, dtype=np.int32)
        return pa.Array.from_buffers(pa.string(), len(values), [_validity(valid), pa.py_buffer(offsets),
                                                                pa.py_buffer(text)])
    data, mask = _fixed(values, 16, "u1") if len(values) else (np.empty(0, "u1"), np.empty(0, bool))
    octets = data.reshape(-1, 16)
    digits = np.empty((len(octets), 32), dtype="S1")
    digits[:, 0::2] = _HEX_DIGITS[octets >> 4]
    digits[:, 1::2] = _HEX_DIGITS[octets & 0x0F]
    parts = np.split(digits, _UUID_DASHES, axis=1)
    dash = np.full((len(octets), 1), b"-", dtype="S1")
    text = np.concatenate([parts[0], dash, parts[1], dash, parts[2], dash, parts[3], dash, parts[4]], axis=1)
    strings = text.view("S36").ravel()
    return pa.array(strings, pa.binary(36), mask=mask).cast(pa.string())


# -- numeric ------------------------------------------------------------------------------------


def _numeric_typmod(typmod: int) -> tuple[int, int] | None:
    if typmod < 4:
        return None
    return ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0xFFFF


def _numeric_binary_text(v: bytes | memoryview) -> str:
    """A numeric's binary form (base-10000 digits) as the exact decimal text PostgreSQL would print."""
    raw = bytes(v)
    if len(raw) < 8:
        raise _ValueError("numeric binary value shorter than its header")
    # ndigits unsigned: numeric_send writes it as int16, yet a numeric holds up to 36,864 base-10000 digits
    ndigits, weight, sign, dscale = struct.unpack_from(">HhHH", raw)
    if sign == 0xC000:
        return "NaN"
    if sign == 0xD000:
        return "Infinity"
    if sign == 0xF000:
        return "-Infinity"
    if len(raw) != 8 + 2 * ndigits:
        raise _ValueError("numeric binary value length does not match its digit count")
    digits = struct.unpack_from(f">{ndigits}H", raw, 8)
    text_digits = "".join(f"{d:04d}" for d in digits) or "0"
    point = (weight + 1) * 4
    if point <= 0:
        integer, fraction = "0", "0" * -point + text_digits
    elif point >= len(text_digits):
        integer, fraction = text_digits + "0" * (point - len(text_digits)), ""
    else:
        integer, fraction = text_digits[:point], text_digits[point:]
    integer = integer.lstrip("0") or "0"
    fraction = (fraction + "0" * dscale)[:dscale]
    text = integer + ("." + fraction if dscale else "")
    return ("-" if sign == 0x4000 else "") + text


def _numeric_decoders(typmod: int, options: ConversionOptions) -> tuple[pa.DataType, Callable, Callable]:
    constrained = _numeric_typmod(typmod)
    if constrained is not None and constrained[0] <= 38:
        target: pa.DataType = pa.decimal128(*constrained)
    elif options.numeric == "decimal38":
        target = pa.decimal128(38, options.numeric_scale)
    else:
        return pa.string(), _as_strings, lambda values: pa.array(
            [None if v is None else _numeric_binary_text(v) for v in values], pa.string())
    scale = target.scale

    def from_strings(strings: list[str | None]) -> pa.Array:
        decimals: list[Decimal | None] = []
        for s in strings:
            if s is None:
                decimals.append(None)
                continue
            try:
                value = Decimal(s)
                if not value.is_finite():
                    raise InvalidOperation
                exact = value.quantize(Decimal(1).scaleb(-scale))
            except InvalidOperation:
                raise _ValueError(f"{s} does not fit {target} exactly (see the numeric policy)") from None
            if exact != value:
                raise _ValueError(f"{s} has more than {scale} decimal places: it would be rounded")
            decimals.append(exact)
        try:
            return pa.array(decimals, target)
        except (pa.ArrowInvalid, OverflowError) as exc:
            raise _ValueError(f"value out of range for {target}: {exc}") from None

    def text(values: Values) -> pa.Array:
        strings = _as_strings(values)
        try:
            return strings.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return from_strings(strings.to_pylist())

    @_columnar
    def binary(values: Values) -> pa.Array:
        fast = _accelerated("numeric_binary", values, scale)
        if fast is not None:
            data, valid = fast
            return pa.Array.from_buffers(target, len(values), [_validity(valid), pa.py_buffer(data)])
        values = _as_list(values)
        load = _psycopg_loader(1700, binary=True)
        decimals = [None if v is None else load(v) for v in values]
        try:
            return pa.array(decimals, target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            # NaN/infinity or too many digits: the exact checks (and their message) of the text path
            return from_strings([None if v is None else _numeric_binary_text(v) for v in values])

    return target, text, binary


@functools.cache
def _psycopg_loader(oid: int, *, binary: bool) -> Callable[[Any], Any]:
    """psycopg's own (C) loader of a built-in type, for values no Arrow kernel parses. Looked up at run time
    (and cached per process), never captured: converters travel to Spark executors by pickling."""
    from psycopg.adapt import Transformer
    from psycopg.pq import Format

    return Transformer().get_loader(oid, Format.BINARY if binary else Format.TEXT).load


# -- arrays -------------------------------------------------------------------------------------


def _parse_text_array(text: str) -> list[str | None]:
    """The elements of an array's text form, flattened row-major; dimension decorations are skipped."""
    if text.startswith("["):
        text = text[text.index("=") + 1:]
    elements: list[str | None] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "{},":
            i += 1
        elif ch == '"':
            i += 1
            chars = []
            while i < n and text[i] != '"':
                if text[i] == "\\":
                    i += 1
                chars.append(text[i])
                i += 1
            if i >= n:
                raise _ValueError(f"unterminated quoted array element in {text!r}")
            i += 1
            elements.append("".join(chars))
        elif ch.isspace():
            i += 1
        else:
            start = i
            while i < n and text[i] not in ",}":
                i += 1
            token = text[start:i].strip()
            elements.append(None if token == "NULL" else token)
    return elements


def _parse_binary_array(raw: bytes) -> list[bytes | None]:
    if len(raw) < 12:
        raise _ValueError("array binary value shorter than its header")
    ndim, _flags, _element_oid = struct.unpack_from(">iiI", raw)
    if ndim == 0:
        return []
    offset = 12 + 8 * ndim
    if ndim < 0 or len(raw) < offset:
        raise _ValueError("array binary header is truncated")
    count = 1
    for d in range(ndim):
        count *= struct.unpack_from(">i", raw, 12 + 8 * d)[0]
    elements: list[bytes | None] = []
    for _ in range(count):
        if offset + 4 > len(raw):
            raise _ValueError("array binary element is truncated")
        (size,) = struct.unpack_from(">i", raw, offset)
        offset += 4
        if size < 0:
            elements.append(None)
            continue
        if offset + size > len(raw):
            raise _ValueError("array binary element is truncated")
        elements.append(raw[offset:offset + size])
        offset += size
    return elements


def _array_decoders(element: ColumnKind) -> tuple[Callable, Callable | None]:
    def build(per_row: list[list | None], decode_elements: Callable[[Values], pa.Array]) -> pa.Array:
        offsets = [0]
        flat: list = []
        mask = []
        for row in per_row:
            mask.append(row is None)
            if row is not None:
                flat.extend(row)
            offsets.append(len(flat))
        values = decode_elements(flat) if flat else pa.array([], element.arrow_type)
        return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), values, mask=pa.array(mask))

    def text(values: Values) -> pa.Array:
        rows = [None if s is None else [None if e is None else e.encode() for e in _parse_text_array(s)]
                for s in _as_strings(values).to_pylist()]
        return build(rows, element.text)

    if element.binary is None:
        return text, None
    element_binary = element.binary

    def binary(values: Values) -> pa.Array:
        rows = [None if v is None else _parse_binary_array(bytes(v)) for v in values]
        return build(rows, element_binary)

    return text, binary


# -- the type table -----------------------------------------------------------------------------


def _scalar_kind(pg_type: PgType, typmod: int, options: ConversionOptions) -> ColumnKind:
    name = pg_type.name
    infinity = _Infinity(options.infinity)
    if pg_type.is_enum:
        return ColumnKind(name, pa.string(), _as_strings, _string_binary)
    if name == "bool":
        return ColumnKind(name, pa.bool_(), _bool_text, _bool_binary)
    fixed = {"int2": (2, "i2", pa.int16(), "h"), "int4": (4, "i4", pa.int32(), "i"),
             "int8": (8, "i8", pa.int64(), "q"), "oid": (4, "u4", pa.int64(), "q"), "xid": (4, "u4", pa.int64(), "q"),
             "float4": (4, "f4", pa.float32(), None), "float8": (8, "f8", pa.float64(), None)}
    if name in fixed:
        width, dtype, target, c_kind = fixed[name]
        return ColumnKind(name, target, _cast_text(target, c_kind=c_kind), _fixed_binary(width, dtype, target))
    if name == "numeric":
        target, text, binary = _numeric_decoders(typmod, options)
        return ColumnKind(name, target, text, binary)
    if name in ("text", "varchar", "bpchar", "name", "char", "json", "xml", "citext"):
        return ColumnKind(name, pa.string(), _as_strings, _string_binary)
    if name == "jsonb":
        return ColumnKind(name, pa.string(), _as_strings, _jsonb_binary)
    if name == "uuid":
        return ColumnKind(name, pa.string(), _uuid_text, _uuid_binary)
    if name == "bytea":
        return ColumnKind(name, pa.binary(), _bytea_text, _bytes_binary)
    if name == "date":
        return ColumnKind(name, pa.date32(), _date_text(infinity), _date_binary(infinity))
    if name == "timestamp":
        target = pa.timestamp("us")
        return ColumnKind(name, target, _timestamp_text(target, infinity), _timestamp_binary(target, infinity))
    if name == "timestamptz":
        target = pa.timestamp("us", tz="UTC")
        return ColumnKind(name, target, _timestamp_text(target, infinity), _timestamp_binary(target, infinity))
    if name == "time":
        return ColumnKind(name, pa.int64(), _time_text, _time_binary)
    if name == "timetz":
        return ColumnKind(name, pa.string(), _as_strings, _timetz_binary)
    if name == "interval":
        return ColumnKind(name, INTERVAL_TYPE, _interval_text, _interval_binary)
    # money, inet, cidr, macaddr, bit, varbit, tsvector, ranges, composites, hstore, unknown: text form
    return ColumnKind(name, pa.string(), _as_strings, None)


# Arrays whose elements psycopg's C loaders produce as values Arrow takes as they are.
_NATIVE_ARRAY_ELEMENTS = frozenset({"int2", "int4", "int8", "float4", "float8", "text", "varchar", "bpchar",
                                    "name", "bool"})


def _flatten(value: list) -> list:
    if any(isinstance(e, list) for e in value):
        return [x for e in value for x in (_flatten(e) if isinstance(e, list) else [e])]
    return value


def _native_array(array_oid: int, arrow_type: pa.DataType, binary: bool, fallback: Callable) -> Callable:
    def decode(values: Values) -> pa.Array:
        load = _psycopg_loader(array_oid, binary=binary)
        try:
            lists = [None if v is None else _flatten(load(v)) for v in values]
            return pa.array(lists, arrow_type)
        except (ValueError, TypeError, pa.ArrowInvalid, OverflowError):
            return fallback(values)  # a value psycopg will not load as is: the exact parser says why

    return decode


_INT_WIDTHS = {"int2": 2, "int4": 4, "int8": 8}


def _int_array(element: ColumnKind, binary: bool, fallback: Callable) -> Callable:
    """Integer arrays parsed in C into list buffers; anything off that path goes to ``fallback``."""
    width = _INT_WIDTHS[element.type_name]
    name = "int_array_binary" if binary else "int_array_text"

    @_columnar
    def decode(values: Values) -> pa.Array:
        fast = _accelerated(name, values, width)
        if fast is None:
            return fallback(_as_list(values) if binary else values)
        offsets, list_valid, items, item_valid = fast
        elements = pa.Array.from_buffers(element.arrow_type, len(item_valid),
                                         [_validity(item_valid), pa.py_buffer(items)])
        return pa.Array.from_buffers(pa.list_(element.arrow_type), len(values),
                                     [_validity(list_valid), pa.py_buffer(offsets)], children=[elements])

    return decode


def column_kind(registry: TypeRegistry, type_oid: int, typmod: int, options: ConversionOptions) -> ColumnKind:
    pg_type = registry.resolve(type_oid)
    if pg_type is None:
        return ColumnKind(f"oid {type_oid}", pa.string(), _as_strings, None)
    if pg_type.element_oid:
        element_type = registry.resolve(pg_type.element_oid)
        element = (_scalar_kind(element_type, typmod, options) if element_type is not None
                   else ColumnKind(f"oid {pg_type.element_oid}", pa.string(), _as_strings, None))
        text, binary = _array_decoders(element)
        arrow_type = pa.list_(element.arrow_type)
        if element.type_name in _NATIVE_ARRAY_ELEMENTS and pg_type.oid < 16384:
            text = _native_array(pg_type.oid, arrow_type, False, text)
            if binary is not None:
                binary = _native_array(pg_type.oid, arrow_type, True, binary)
        if element.type_name in _INT_WIDTHS and pg_type.oid < 16384:
            text = _int_array(element, False, text)
            if binary is not None:
                binary = _int_array(element, True, binary)
        return ColumnKind(f"{element.type_name}[]", arrow_type, text, binary)
    if pg_type.namespace == "pg_catalog" or pg_type.is_enum:
        return _scalar_kind(pg_type, typmod, options)
    return ColumnKind(pg_type.name, pa.string(), _as_strings, None)


# -- Spark types --------------------------------------------------------------------------------


def spark_type(arrow_type: pa.DataType):
    from pyspark.sql import types as T

    if pa.types.is_boolean(arrow_type):
        return T.BooleanType()
    if pa.types.is_int16(arrow_type):
        return T.ShortType()
    if pa.types.is_int32(arrow_type):
        return T.IntegerType()
    if pa.types.is_int64(arrow_type):
        return T.LongType()
    if pa.types.is_float32(arrow_type):
        return T.FloatType()
    if pa.types.is_float64(arrow_type):
        return T.DoubleType()
    if pa.types.is_decimal(arrow_type):
        return T.DecimalType(arrow_type.precision, arrow_type.scale)
    if pa.types.is_string(arrow_type):
        return T.StringType()
    if pa.types.is_binary(arrow_type):
        return T.BinaryType()
    if pa.types.is_date32(arrow_type):
        return T.DateType()
    if pa.types.is_timestamp(arrow_type):
        return T.TimestampType() if arrow_type.tz else T.TimestampNTZType()
    if pa.types.is_list(arrow_type):
        return T.ArrayType(spark_type(arrow_type.value_type))
    if pa.types.is_struct(arrow_type):
        return T.StructType([T.StructField(f.name, spark_type(f.type)) for f in arrow_type])
    raise ConversionError(f"no Spark type for Arrow type {arrow_type}")


# -- the table converter ------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvertedRows:
    """A batch of rows; ``unchanged`` marks unchanged TOAST values (null in ``batch`` but NOT null)."""

    batch: pa.RecordBatch
    unchanged: dict[str, pa.BooleanArray]


class TableConverter:
    """Converts the tuple data of one relation version to Arrow (see the module's policies).

    >>> converter = TableConverter(relation, TypeRegistry())      # doctest: +SKIP
    >>> converter.convert([insert.new for insert in inserts]).batch  # doctest: +SKIP
    """

    def __init__(self, relation: Relation, registry: TypeRegistry, options: ConversionOptions | None = None) -> None:
        self.relation = relation
        self.options = options or ConversionOptions()
        self.kinds = [column_kind(registry, c.type_oid, c.type_modifier, self.options) for c in relation.columns]
        self.arrow_schema = pa.schema([pa.field(c.name, k.arrow_type) for c, k in zip(relation.columns, self.kinds,
                                                                                     strict=True)])

    @property
    def spark_schema(self):
        from pyspark.sql.types import StructField, StructType

        return StructType([StructField(f.name, spark_type(f.type)) for f in self.arrow_schema])

    @property
    def requires_text_mode(self) -> bool:
        """True when a column has no binary decoder: stream this table in text mode."""
        return any(kind.binary is None for kind in self.kinds)

    def convert(self, rows: Sequence[TupleData], *, lsn: Lsn | None = None) -> ConvertedRows:
        # the conversion allocates per-value objects but no reference cycles: collecting during it is pure cost
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._convert(rows, lsn)
        finally:
            if enabled:
                gc.enable()

    def _convert(self, rows: Sequence[TupleData], lsn: Lsn | None) -> ConvertedRows:
        width = len(self.kinds)
        if not rows:
            return self.convert_columns([[] for _ in range(width)], binary=False, lsn=lsn)
        columns, column_kinds = self._split(rows, width, lsn)
        arrays = []
        unchanged: dict[str, pa.BooleanArray] = {}
        for index in range(width):
            kinds = column_kinds[index]
            values = columns[index]
            binary = "b" in kinds
            if binary and "t" in kinds:
                raise ConversionError(f"{self._column(index)}: text and binary values mixed in one batch")
            if "u" in kinds:
                mask = np.frombuffer(kinds.encode("ascii"), dtype="u1") == ord("u")
                unchanged[self.relation.columns[index].name] = pa.array(mask, pa.bool_())
            arrays.append(self._decode(index, values, binary, lsn))
        return ConvertedRows(pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema), unchanged)

    def _split(self, rows: Sequence[TupleData], width: int, lsn: Lsn | None) -> tuple[list[list], list[str]]:
        """Rows to columns: per column, its values and its kinds ('t', 'b', 'n', 'u'), without a Python loop
        per value."""
        if _accelerator is not None:
            try:
                return _accelerator.split_columns(rows, width)
            except ValueError:
                pass  # a row of the wrong width: found and named below
        for row in rows:
            if len(row.kinds) != width:
                raise ConversionError(f"{self._table}: a row has {len(row.kinds)} columns, the relation {width} "
                                      f"(at LSN {lsn})")
        # slicing one flat sequence (C speed)
        all_kinds = "".join([row.kinds for row in rows])
        all_values = list(itertools.chain.from_iterable([row.values for row in rows]))
        return [all_values[i::width] for i in range(width)], [all_kinds[i::width] for i in range(width)]

    def convert_columns(self, columns: Sequence[Values | pa.Array], *, binary: bool | Sequence[bool],
                        lsn: Lsn | None = None) -> ConvertedRows:
        """The same conversion fed column-wise (COPY output, catalog reads): per column, a list of values or an
        Arrow binary/string array of them; ``binary`` says their format, for all columns or for each."""
        formats = [binary] * len(columns) if isinstance(binary, bool) else list(binary)
        arrays = [self._decode(i, values, formats[i], lsn) for i, values in enumerate(columns)]
        return ConvertedRows(pa.RecordBatch.from_arrays(arrays, schema=self.arrow_schema), {})

    def _decode(self, index: int, values: Values, binary: bool, lsn: Lsn | None) -> pa.Array:
        kind = self.kinds[index]
        decoder = kind.binary if binary else kind.text
        if decoder is None:
            raise ConversionError(f"{self._column(index)}: type {kind.type_name} has no binary decoder; stream this "
                                  "table in text mode (binary off)")
        if binary and isinstance(values, pa.Array) and not getattr(decoder, "columnar", False):
            values = values.to_pylist()
        try:
            array = decoder(values)
        except (_ValueError, ValueError, struct.error, UnicodeDecodeError, pa.ArrowInvalid, OverflowError) as exc:
            raise ConversionError(f"{self._column(index)} ({kind.type_name}, {'binary' if binary else 'text'}) at "
                                  f"LSN {lsn}: {exc}") from None
        return array if array.type == kind.arrow_type else array.cast(kind.arrow_type)

    @property
    def _table(self) -> str:
        return self.relation.qualified_name

    def _column(self, index: int) -> str:
        return f"{self._table}.{self.relation.columns[index].name}"
