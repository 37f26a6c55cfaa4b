"""date, time, timetz, timestamp, timestamptz and interval.

Dates and timestamps keep PostgreSQL's whole range exactly (proleptic Gregorian, BC as negative years),
computed in integers: Python's ``datetime`` ends in 9999, PostgreSQL's dates in 5874897 AD. ±infinity
follows the infinity policy; a timestamp int64 microseconds since 1970 cannot hold is refused.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from datetime import datetime, timedelta
from decimal import Decimal

import numpy as np
import pyarrow as pa

from pgcdc.errors import UnconvertibleValue
from pgcdc.types.decoding import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    ColumnKind,
    ColumnKinds,
    ConversionOptions,
    Values,
    as_strings,
    cast_text,
    columnar,
    fixed_from_c,
    fixed_width,
)

PG_EPOCH_DAYS = 10_957  # 2000-01-01 - 1970-01-01
PG_EPOCH_MICROS = PG_EPOCH_DAYS * 86_400_000_000
# ±infinity under the 'clamp' policy: the extremes of date32 and of int64 microseconds. No PostgreSQL date
# reaches them (its dates end in 5874897 AD); the last int64 microsecond (294247-01-10 04:00:54.775807) is a
# PostgreSQL timestamp, which is refused with the later ones so that infinity alone holds it.
DATE_INFINITY_DAYS, DATE_MINUS_INFINITY_DAYS = INT32_MAX, INT32_MIN
TIMESTAMP_INFINITY_MICROS, TIMESTAMP_MINUS_INFINITY_MICROS = INT64_MAX, INT64_MIN
LAST_TIMESTAMP_TEXT = "294247-01-10 04:00:54.775806"
INTERVAL_TYPE = pa.struct([("months", pa.int32()), ("days", pa.int32()), ("microseconds", pa.int64())])


_SPECIAL_DATE = re.compile(r"^(-?infinity)$|^(\d+)-(\d\d)-(\d\d)( BC)?$")


class _Infinity:
    def __init__(self, policy: str) -> None:
        self.policy = policy

    def days(self, positive: bool) -> int:
        if self.policy == "error":
            raise UnconvertibleValue(f"{'' if positive else '-'}infinity has no date value (infinity policy is 'error')")
        return DATE_INFINITY_DAYS if positive else DATE_MINUS_INFINITY_DAYS

    def micros(self, positive: bool) -> int:
        if self.policy == "error":
            raise UnconvertibleValue(f"{'' if positive else '-'}infinity has no timestamp value (infinity policy is 'error')")
        return TIMESTAMP_INFINITY_MICROS if positive else TIMESTAMP_MINUS_INFINITY_MICROS


_MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _proleptic_days(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date, year 0 = 1 BC, in integers: PostgreSQL's dates run
    from 4713 BC to 5874897 AD, Python's ``date`` from 1 to 9999 (the C module's days_from_civil, the same
    algorithm)."""
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    if not (1 <= month <= 12 and 1 <= day <= _MONTH_DAYS[month - 1] + (month == 2 and leap)):
        raise UnconvertibleValue(f"no day {day} in month {month} of year {year}")
    year -= month <= 2
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468


def _civil_from_days(days: int) -> tuple[int, int, int]:
    """(year, month, day) of a day count since 1970-01-01, year 0 = 1 BC: the inverse of
    :func:`_proleptic_days`, in integers for any year."""
    days += 719_468
    era = days // 146_097
    day_of_era = days - era * 146_097
    year_of_era = (day_of_era - day_of_era // 1460 + day_of_era // 36_524 - day_of_era // 146_096) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    shifted_month = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * shifted_month + 2) // 5 + 1
    month = shifted_month + 3 if shifted_month < 10 else shifted_month - 9
    return year_of_era + era * 400 + (month <= 2), month, day


def timestamp_text(micros_since_2000: int, *, with_zone: bool) -> str:
    """A timestamp (PostgreSQL's binary form: microseconds since 2000-01-01) as PostgreSQL writes it in UTC,
    e.g. ``294276-12-31 23:59:59`` (``+00`` for a timestamptz, `` BC`` before year 1): how an error shows a
    value that cannot be mirrored, whatever its year."""
    days, micros = divmod(micros_since_2000 + PG_EPOCH_MICROS, 86_400_000_000)
    year, month, day = _civil_from_days(days)
    seconds, fraction = divmod(micros, 1_000_000)
    minutes, second = divmod(seconds, 60)
    hour, minute = divmod(minutes, 60)
    text = f"{year if year > 0 else 1 - year:04d}-{month:02d}-{day:02d} {hour:02d}:{minute:02d}:{second:02d}"
    if fraction:
        text += f".{fraction:06d}".rstrip("0")
    return text + ("+00" if with_zone else "") + (" BC" if year <= 0 else "")


def _past_int64_micros(text: str) -> UnconvertibleValue:
    return UnconvertibleValue(f"{text} is past {LAST_TIMESTAMP_TEXT}, the last moment int64 microseconds since 1970 "
                       "(Arrow's, Spark's and Iceberg's timestamps) hold: it cannot be mirrored")


def _date_days(text: str, infinity: _Infinity) -> int:
    match = _SPECIAL_DATE.match(text)
    if match is None:
        raise UnconvertibleValue(f"not a date: {text!r}")
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
        raise UnconvertibleValue(f"not a timestamp: {text!r}")
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
    fast = cast_text(pa.date32(), None)

    @columnar
    def decode(values: Values) -> pa.Array:
        try:
            return fast(values)
        except UnconvertibleValue:
            strings = as_strings(values).to_pylist()
            return pa.array([None if s is None else _date_days(s, infinity) for s in strings], pa.int32()).cast(
                pa.date32())

    return decode


def _date_binary(infinity: _Infinity) -> Callable[[Values], pa.Array]:
    @columnar
    def decode(values: Values) -> pa.Array:
        data, mask = fixed_width(values, 4, "i4")
        days = data.astype("i8") + PG_EPOCH_DAYS
        special = (data == INT32_MAX) | (data == INT32_MIN)
        if special.any():
            for index in np.flatnonzero(special & ~mask):
                days[index] = infinity.days(data[index] == INT32_MAX)
        return pa.array(days.astype("i4"), pa.int32(), mask=mask).cast(pa.date32())

    return decode


def _timestamp_text(target: pa.DataType, infinity: _Infinity) -> Callable[[Values], pa.Array]:
    @columnar
    def decode(values: Values) -> pa.Array:
        parsed = fixed_from_c(values, "T", target)
        if parsed is not None:
            return parsed
        strings = as_strings(values)
        try:
            return strings.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            micros = [None if s is None else _timestamp_micros(s, infinity) for s in strings.to_pylist()]
            return pa.array(micros, pa.int64()).cast(target)

    return decode


def _timestamp_binary(target: pa.DataType, infinity: _Infinity) -> Callable[[Values], pa.Array]:
    with_zone = getattr(target, "tz", None) is not None

    @columnar
    def decode(values: Values) -> pa.Array:
        data, mask = fixed_width(values, 8, "i8")
        special = (data == INT64_MAX) | (data == INT64_MIN)
        past = (data >= TIMESTAMP_INFINITY_MICROS - PG_EPOCH_MICROS) & ~special & ~mask
        if past.any():  # the epoch shift would wrap them
            moment = int(data[np.flatnonzero(past)[0]])
            raise _past_int64_micros(timestamp_text(moment, with_zone=with_zone))
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
        raise UnconvertibleValue(f"not a time: {text!r}")
    hour, minute, second = int(match.group(1)), int(match.group(2)), int(match.group(3))
    return ((hour * 60 + minute) * 60 + second) * 1_000_000 + int((match.group(4) or "0").ljust(6, "0"))


@columnar
def _time_text(values: Values) -> pa.Array:
    return pa.array([None if s is None else _time_micros(s) for s in as_strings(values).to_pylist()], pa.int64())


@columnar
def _time_binary(values: Values) -> pa.Array:
    data, mask = fixed_width(values, 8, "i8")
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
        raise UnconvertibleValue(f"not an ISO 8601 interval (set IntervalStyle = iso_8601): {text!r}")
    years, months, days, hours, minutes = (int(g) if g else 0 for g in match.groups()[:5])
    seconds = Decimal(match.group(6) or 0)
    micros = (hours * 3600 + minutes * 60) * 1_000_000 + int(seconds * 1_000_000)
    return {"months": years * 12 + months, "days": days, "microseconds": micros}


@columnar
def _interval_text(values: Values) -> pa.Array:
    return pa.array([None if s is None else _interval_parts(s) for s in as_strings(values).to_pylist()],
                    INTERVAL_TYPE)


def _interval_binary(values: Values) -> pa.Array:
    mask = np.fromiter((v is None for v in values), dtype=bool, count=len(values))
    buffer = b"".join(bytes(16) if v is None else bytes(v) for v in values)
    if len(buffer) != 16 * len(values):
        raise UnconvertibleValue("interval binary values are 16 bytes")
    parts = np.frombuffer(buffer, dtype=np.dtype([("us", ">i8"), ("days", ">i4"), ("months", ">i4")]))
    return pa.StructArray.from_arrays(
        [pa.array(parts["months"].astype("i4")), pa.array(parts["days"].astype("i4")),
         pa.array(parts["us"].astype("i8"))],
        fields=list(INTERVAL_TYPE), mask=pa.array(mask))



def register(kinds: ColumnKinds) -> None:
    def date_kind(typmod: int, options: ConversionOptions) -> ColumnKind:
        infinity = _Infinity(options.infinity)
        return ColumnKind("date", pa.date32(), _date_text(infinity), _date_binary(infinity))

    def timestamp_kinds(name: str, target: pa.DataType) -> Callable[[int, ConversionOptions], ColumnKind]:
        def kind(typmod: int, options: ConversionOptions) -> ColumnKind:
            infinity = _Infinity(options.infinity)
            return ColumnKind(name, target, _timestamp_text(target, infinity), _timestamp_binary(target, infinity))
        return kind

    kinds.register("date", date_kind)
    kinds.register("timestamp", timestamp_kinds("timestamp", pa.timestamp("us")))
    kinds.register("timestamptz", timestamp_kinds("timestamptz", pa.timestamp("us", tz="UTC")))
    kinds.register("time", ColumnKind("time", pa.int64(), _time_text, _time_binary))
    kinds.register("timetz", ColumnKind("timetz", pa.string(), as_strings, _timetz_binary))
    kinds.register("interval", ColumnKind("interval", INTERVAL_TYPE, _interval_text, _interval_binary))
