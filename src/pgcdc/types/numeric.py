"""Integers, oid and xid, floats and numeric.

numeric(p, s) with p <= 38 becomes decimal(p, s), exactly; unconstrained numeric (or p > 38) PostgreSQL's
exact text, or decimal(38, scale) under ``numeric='decimal38'``. Never a float, never rounded: a value the
target cannot hold exactly (NaN in a decimal, lost digits) is refused.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from decimal import Context, Decimal, InvalidOperation, localcontext

import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.errors import UnconvertibleValue
from pgcdc.types.decoding import (
    ColumnKind,
    ColumnKinds,
    ConversionOptions,
    Values,
    accelerated,
    as_list,
    as_strings,
    cast_text,
    columnar,
    fixed_binary,
    psycopg_loader,
    validity_bitmap,
)

# name: (binary width, NumPy dtype of the binary value, Arrow type, C text parser kind or None)
_FIXED_WIDTH = {"int2": (2, "i2", pa.int16(), "h"), "int4": (4, "i4", pa.int32(), "i"),
                "int8": (8, "i8", pa.int64(), "q"), "oid": (4, "u4", pa.int64(), "q"), "xid": (4, "u4", pa.int64(), "q"),
                "float4": (4, "f4", pa.float32(), None), "float8": (8, "f8", pa.float64(), None)}


def _numeric_typmod(typmod: int) -> tuple[int, int] | None:
    """(precision, scale) of the decimal that holds every value of a numeric column of ``typmod`` exactly; None
    when unconstrained. PostgreSQL 15+ allows a scale below 0 (``numeric(5, -2)``: integers rounded to hundreds,
    up to 7 digits: decimal(7, 0)) and above the precision (``numeric(3, 5)``: up to 0.00999: decimal(5, 5));
    the scale is stored as 11 bits, two's complement."""
    if typmod < 4:
        return None
    precision, stored_scale = ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0x7FF
    scale = (stored_scale ^ 0x400) - 0x400
    if scale < 0:
        return precision - scale, 0
    return max(precision, scale), scale


def _numeric_binary_text(v: bytes | memoryview) -> str:
    """A numeric's binary form (base-10000 digits) as the exact decimal text PostgreSQL would print."""
    raw = bytes(v)
    if len(raw) < 8:
        raise UnconvertibleValue("numeric binary value shorter than its header")
    # ndigits unsigned: numeric_send writes it as int16, yet a numeric holds up to 36,864 base-10000 digits
    ndigits, weight, sign, dscale = struct.unpack_from(">HhHH", raw)
    if sign == 0xC000:
        return "NaN"
    if sign == 0xD000:
        return "Infinity"
    if sign == 0xF000:
        return "-Infinity"
    if len(raw) != 8 + 2 * ndigits:
        raise UnconvertibleValue("numeric binary value length does not match its digit count")
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


def _integer_digits_fit(strings: pa.Array, target: pa.Decimal128Type) -> bool:
    """Whether every decimal text (PostgreSQL's numeric output: no exponent) has at most the integer digits
    ``target`` holds; texts with an exponent are left to the exact path."""
    if len(strings) == 0 or strings.null_count == len(strings):
        return True
    if pc.any(pc.match_substring(strings, "e")).as_py() or pc.any(pc.match_substring(strings, "E")).as_py():
        return False
    if pc.max(pc.binary_length(strings)).as_py() <= target.precision - target.scale:
        return True  # no text holds more integer digits than characters: the usual case, without splitting
    integer_part = pc.list_element(pc.split_pattern(strings, ".", max_splits=1), 0)
    widest = pc.max(pc.utf8_length(pc.utf8_ltrim(integer_part, characters="+-0"))).as_py()
    return widest is None or widest <= target.precision - target.scale


def _numeric_decoders(typmod: int, options: ConversionOptions) -> tuple[pa.DataType, Callable, Callable]:
    constrained = _numeric_typmod(typmod)
    if constrained is not None and constrained[0] <= 38:
        target: pa.DataType = pa.decimal128(*constrained)
    elif options.numeric == "decimal38":
        target = pa.decimal128(38, options.numeric_scale)
    else:
        return pa.string(), as_strings, lambda values: pa.array(
            [None if v is None else _numeric_binary_text(v) for v in values], pa.string())
    scale = target.scale

    def from_strings(strings: list[str | None]) -> pa.Array:
        decimals: list[Decimal | None] = []
        for s in strings:
            if s is None:
                decimals.append(None)
                continue
            try:
                # the target's own precision: the default context (28 digits) refused values decimal(38, s) holds
                with localcontext(Context(prec=target.precision)):
                    value = Decimal(s)
                    if not value.is_finite():
                        raise InvalidOperation
                    exact = value.quantize(Decimal(1).scaleb(-scale))
            except InvalidOperation:
                raise UnconvertibleValue(f"{s} does not fit {target} exactly (see the numeric policy)") from None
            if exact != value:
                raise UnconvertibleValue(f"{s} has more than {scale} decimal places: it would be rounded")
            decimals.append(exact)
        try:
            return pa.array(decimals, target)
        except (pa.ArrowInvalid, OverflowError) as exc:
            raise UnconvertibleValue(f"value out of range for {target}: {exc}") from None

    @columnar
    def text(values: Values) -> pa.Array:
        strings = as_strings(values)
        if not _integer_digits_fit(strings, target):
            # Arrow's string-to-decimal cast wraps some values with too many integer digits instead of failing
            return from_strings(strings.to_pylist())
        try:
            return strings.cast(target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return from_strings(strings.to_pylist())

    @columnar
    def binary(values: Values) -> pa.Array:
        fast = accelerated("numeric_binary", values, scale)
        if fast is not None:
            data, valid = fast
            return pa.Array.from_buffers(target, len(values), [validity_bitmap(valid), pa.py_buffer(data)])
        values = as_list(values)
        load = psycopg_loader(1700, binary=True)
        decimals = [None if v is None else load(v) for v in values]
        try:
            return pa.array(decimals, target)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            # NaN/infinity or too many digits: the exact checks (and their message) of the text path
            return from_strings([None if v is None else _numeric_binary_text(v) for v in values])

    return target, text, binary


def register(kinds: ColumnKinds) -> None:
    for name, (width, dtype, target, c_kind) in _FIXED_WIDTH.items():
        kinds.register(name, ColumnKind(name, target, cast_text(target, c_kind=c_kind),
                                        fixed_binary(width, dtype, target)))

    def numeric_kind(typmod: int, options: ConversionOptions) -> ColumnKind:
        return ColumnKind("numeric", *_numeric_decoders(typmod, options))

    kinds.register("numeric", numeric_kind)
