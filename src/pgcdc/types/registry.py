"""Which PostgreSQL type an OID is: built-ins from psycopg's table, the rest from Type messages or pg_type."""

from __future__ import annotations

from dataclasses import dataclass

from psycopg.postgres import types as builtin_types

from pgcdc.pgoutput.messages import Type

# PostgreSQL's FirstNormalObjectId: OIDs below it belong to the catalog initdb creates (built-in types and
# their arrays); every type created afterwards (extensions, enums, domains, composites) has one at or above it.
FIRST_NORMAL_OBJECT_ID = 16384

# Session settings the text decoders assume; replication and snapshot connections set them.
SESSION_SETTINGS: dict[str, str] = {
    "DateStyle": "ISO, MDY",
    "IntervalStyle": "iso_8601",
    "TimeZone": "UTC",
    "extra_float_digits": "3",
    "bytea_output": "hex",
}


@dataclass(frozen=True)
class PgType:
    """What pgcdc needs to know of a type: its name, and for arrays, domains and enums what they are of."""

    oid: int
    name: str
    namespace: str = "pg_catalog"
    element_oid: int = 0  # arrays: the element type
    base_oid: int = 0  # domains: the base type
    is_enum: bool = False


class TypeRegistry:
    """Type OIDs to :class:`PgType`: PostgreSQL's built-ins, plus user types learnt from the stream's Type
    messages or read from the server's catalog (domains, enums, arrays of them)."""

    def __init__(self) -> None:
        self._types: dict[int, PgType] = {}
        for info in builtin_types:
            self._types[info.oid] = PgType(info.oid, info.name)
            if info.array_oid:
                self._types[info.array_oid] = PgType(info.array_oid, f"_{info.name}", element_oid=info.oid)

    def get(self, oid: int) -> PgType | None:
        return self._types.get(oid)

    def add(self, pg_type: PgType) -> None:
        self._types[pg_type.oid] = pg_type

    def knows(self, message: Type) -> bool:
        """Whether the registry holds the type a Type message names, as the message names it (a domain, which
        the server sends with its base type's name, counts as known once read from the catalog)."""
        known = self._types.get(message.type_oid)
        return known is not None and (bool(known.base_oid) or (
            known.name == message.name and known.namespace == (message.namespace or "pg_catalog")))

    def observe(self, message: Type) -> None:
        """Learn a non-built-in type from the stream alone, when the catalog could not tell more (a Type message
        has no element type, enum mark or base type): its text form is what its columns then hold."""
        if not self.knows(message):
            self._types[message.type_oid] = PgType(message.type_oid, message.name, message.namespace or "pg_catalog")

    def load_from_server(self, conn) -> None:
        """Read every non-built-in type of the database (psycopg 3 connection): domains resolve to their base
        type, enums are marked, arrays know their element type."""
        rows = conn.execute(
            "SELECT t.oid::bigint, t.typname, n.nspname, t.typelem::bigint, t.typbasetype::bigint, "
            "t.typtype = 'e' FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
            "WHERE t.oid >= %s", (FIRST_NORMAL_OBJECT_ID,)).fetchall()
        for oid, name, namespace, element, base, is_enum in rows:
            element_oid = element if name.startswith("_") else 0
            self._types[oid] = PgType(oid, name, namespace, element_oid=element_oid, base_oid=base,
                                      is_enum=bool(is_enum))

    def resolve(self, oid: int) -> PgType | None:
        """The type after following domains to their base type."""
        seen = set()
        pg_type = self._types.get(oid)
        while pg_type is not None and pg_type.base_oid and pg_type.oid not in seen:
            seen.add(pg_type.oid)
            pg_type = self._types.get(pg_type.base_oid)
        return pg_type
