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
