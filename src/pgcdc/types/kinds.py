"""Which column kind a PostgreSQL type converts as: each type family registers its kinds by type name (as
psycopg registers a loader per type and format); arrays, domains and enums are resolved here."""

from __future__ import annotations

from pgcdc.types import numeric, temporal, text
from pgcdc.types.arrays import array_kind
from pgcdc.types.decoding import ColumnKind, ColumnKinds, ConversionOptions
from pgcdc.types.registry import FIRST_NORMAL_OBJECT_ID, PgType, TypeRegistry
from pgcdc.types.text import enum_kind, text_form

DEFAULT_KINDS = ColumnKinds()
for _family in (numeric, temporal, text):
    _family.register(DEFAULT_KINDS)


def column_kind(registry: TypeRegistry, type_oid: int, typmod: int, options: ConversionOptions,
                kinds: ColumnKinds = DEFAULT_KINDS) -> ColumnKind:
    """How a column of type ``type_oid`` (with ``typmod``) converts. Types pgcdc has no kind for are read as
    their text output."""
    pg_type = registry.resolve(type_oid)
    if pg_type is None:
        return text_form(f"oid {type_oid}")
    if pg_type.element_oid:
        element_type = registry.resolve(pg_type.element_oid)
        element = (_scalar_kind(element_type, typmod, options, kinds) if element_type is not None
                   else text_form(f"oid {pg_type.element_oid}"))
        return array_kind(element, pg_type.oid, built_in=pg_type.oid < FIRST_NORMAL_OBJECT_ID)
    if pg_type.namespace == "pg_catalog" or pg_type.is_enum:
        return _scalar_kind(pg_type, typmod, options, kinds)
    return text_form(pg_type.name)


def _scalar_kind(pg_type: PgType, typmod: int, options: ConversionOptions, kinds: ColumnKinds) -> ColumnKind:
    if pg_type.is_enum:
        return enum_kind(pg_type.name)
    return kinds.get(pg_type.name, typmod, options) or text_form(pg_type.name)


# Built-in type OIDs (fixed in PostgreSQL's catalog) of the type changes PostgreSQL makes without a rewrite.
_TEXT, _VARCHAR, _VARBIT, _NUMERIC, _INTERVAL = 25, 1043, 1562, 1700, 1186
_TIMES = frozenset({1083, 1114, 1184, 1266})  # time, timestamp, timestamptz, timetz: typmod = fractional digits


def type_change_keeps_values(old: tuple[int, int], new: tuple[int, int]) -> bool:
    """Whether ``ALTER COLUMN ... TYPE`` from ``old`` to ``new`` (type OID, typmod) is one PostgreSQL makes
    without rewriting the table, leaving every value as it was: ``text`` or a longer ``varchar``/``varbit``, a
    ``numeric`` of more digits at the same scale, more fractional digits of a time or timestamp, or the type's
    limit removed. Any other change rewrites every row through the cast or a ``USING`` expression, which may
    give them values that logical decoding never sends (a wider integer too: its ``USING`` may be anything)."""
    (old_type, old_mod), (new_type, new_mod) = old, new
    if old == new:
        return True
    if old_type in (_TEXT, _VARCHAR) and new_type in (_TEXT, _VARCHAR):
        return new_type == _TEXT or new_mod < 0 or (old_type == _VARCHAR and 0 <= old_mod <= new_mod)
    if old_type != new_type:
        return False
    if new_mod < 0:  # the limit removed: every value fits as it is
        return old_type in (_VARBIT, _NUMERIC, _INTERVAL) or old_type in _TIMES
    if old_mod < 0:
        return False
    if old_type == _VARBIT or old_type in _TIMES:
        return new_mod >= old_mod
    if old_type == _NUMERIC:  # typmod - 4 = precision << 16 | scale (11 bits, signed): same scale, more digits
        return (old_mod - 4) & 0x7FF == (new_mod - 4) & 0x7FF and (new_mod - 4) >> 16 >= (old_mod - 4) >> 16
    return False
