"""What pgcdc keeps in a mirror's table properties, beside its position (:mod:`pgcdc.positions`): its source,
its key, the slot it streams from, the source shape its rows hold, and the values promised to columns being
added. Read from Iceberg's table itself, not ``SHOW TBLPROPERTIES``: Spark redacts any value that mentions a
secret, a password or a token (``spark.redaction.regex``), a column's name or a default's text, say."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("pgcdc.mirrors.catalog")

SOURCE_PROPERTY = "pgcdc.source"
KEY_PROPERTY = "pgcdc.key"  # the columns the mirror is keyed on, comma-joined ("" for none)
# the replication slot the mirror streams from: what `pgcdc decode --consume` must not move past unasked
SLOT_PROPERTY = "pgcdc.slot"
# columns being added whose existing rows still wait for the value PostgreSQL gives them (JSON: column -> text)
FILL_PROPERTY = "pgcdc.fill"
# The source a mirror's rows hold (JSON of SourceShape): the table's OID, its columns' PostgreSQL types, and
# what the catalog said of its storage and publication; a change that gave existing rows values the stream
# never sends is told by them (pgcdc.pipeline.copy_reasons).
SHAPE_PROPERTY = "pgcdc.source-shape"


@dataclass(frozen=True)
class SourceShape:
    """The source table a mirror's rows come from: its relation OID and each column's PostgreSQL type (as the
    stream's Relation messages tell them), and what the catalog told of its storage when it was last copied
    (file numbers, which a rewrite changes; how the publication publishes it) and since (column numbers: a
    column dropped and added again under its name gets a new one); None where not known."""

    relation_id: int
    columns: tuple[tuple[str, int, int], ...]  # name, type OID, typmod
    filenodes: tuple[int, ...] | None = None
    attnums: tuple[tuple[str, int], ...] | None = None
    # the publication's column list, row filter and membership rows (pgcdc.replication.published.TableStorage)
    definition: tuple[tuple[str, ...] | None, str | None, str] | None = None
    printed_types: tuple[str, ...] | None = None  # (pgcdc.replication.published.TableStorage)
    partitions: tuple[int, ...] | None = None  # the leaves' OIDs, of a partitioned table

    def encode(self) -> str:
        definition = None if self.definition is None else {
            "columns": None if self.definition[0] is None else list(self.definition[0]), "filter": self.definition[1],
            "member": self.definition[2]}
        return json.dumps({"relation": self.relation_id, "columns": [list(c) for c in self.columns],
                           "filenodes": None if self.filenodes is None else list(self.filenodes),
                           "attnums": None if self.attnums is None else dict(self.attnums),
                           "definition": definition,
                           "printed_types": None if self.printed_types is None else list(self.printed_types),
                           "partitions": None if self.partitions is None else list(self.partitions)})

    @classmethod
    def decode(cls, value: str | None) -> SourceShape | None:
        try:
            data = json.loads(value) if value else None
            if data is None:
                return None
            filenodes, attnums, definition = data.get("filenodes"), data.get("attnums"), data.get("definition")
            printed, partitions = data.get("printed_types"), data.get("partitions")
            return cls(int(data["relation"]),
                       tuple((str(name), int(oid), int(typmod)) for name, oid, typmod in data["columns"]),
                       None if filenodes is None else tuple(int(f) for f in filenodes),
                       None if attnums is None else tuple((str(k), int(v)) for k, v in attnums.items()),
                       None if definition is None else (
                           None if definition["columns"] is None else tuple(str(c) for c in definition["columns"]),
                           None if definition["filter"] is None else str(definition["filter"]),
                           str(definition["member"])),
                       None if printed is None else tuple(str(f) for f in printed),
                       None if partitions is None else tuple(int(p) for p in partitions))
        except (ValueError, KeyError, TypeError, AttributeError):
            log.warning("ignoring %s=%r, which is not a source shape", SHAPE_PROPERTY, value)
            return None

    def following(self, recorded: SourceShape | None) -> SourceShape:
        """This shape, with what ``recorded`` knows of the storage where this one does not (a Relation message
        tells nothing of it)."""
        if recorded is None or recorded.relation_id != self.relation_id:
            return self
        return replace(self, filenodes=recorded.filenodes if self.filenodes is None else self.filenodes,
                       attnums=recorded.attnums if self.attnums is None else self.attnums,
                       definition=recorded.definition if self.definition is None else self.definition,
                       printed_types=recorded.printed_types if self.printed_types is None else self.printed_types,
                       partitions=recorded.partitions if self.partitions is None else self.partitions)


def key_tokens(key: tuple[str, ...]) -> list[str]:
    """A key as ``pgcdc.key`` records it (comma-joined), as a set of columns in any order."""
    return sorted(",".join(key).split(","))


def recorded_key(properties: Mapping[str, str]) -> tuple[str, ...] | None:
    """The key a mirror was created with (compare with :func:`key_tokens`: a column name may hold a comma); None
    when it records none."""
    value = properties.get(KEY_PROPERTY)
    if value is None:
        return None
    return (value,) if value else ()


def describe_key(key: tuple[str, ...]) -> str:
    """A mirror's key as messages name it: ``(a, b)``, or no key."""
    return f"({', '.join(key)})" if key else "no key (whole rows)"


def sql_string(value: str) -> str:
    """A Spark SQL string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


class MirrorProperties:
    """Reads and writes the table properties of mirrors (each write one metadata commit)."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark

    def read(self, identifier: str, *, table: Any = None) -> dict[str, str]:
        """The table's properties; ``table``: its Iceberg table, when loaded already."""
        from pgcdc.spark.iceberg_java import light_view, load_table

        table = table if table is not None else load_table(self.spark, identifier)
        return {str(k): str(v) for k, v in light_view(table).properties().items()}

    def set(self, identifier: str, values: Mapping[str, str]) -> None:
        """One metadata commit setting ``values`` among the table's properties (none when empty)."""
        if values:
            self.spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ("
                           + ", ".join(f"{sql_string(k)} = {sql_string(v)}" for k, v in values.items()) + ")")

    def unset(self, identifier: str, name: str) -> None:
        self.spark.sql(f"ALTER TABLE {identifier} UNSET TBLPROPERTIES IF EXISTS ({sql_string(name)})")
