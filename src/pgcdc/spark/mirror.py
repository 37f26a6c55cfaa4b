"""Iceberg mirror tables: names, creation, schema evolution and the positions they hold.

A source table ``schema.table`` is mirrored as ``<catalog>.<namespace>.<schema>.<table>``: the
source schema becomes a nested Iceberg namespace, so names stay readable and distinct, case
included. Characters that would break a file-system path in path-based catalogs are
percent-encoded (``/`` → ``%2F``, ``\\`` → ``%5C``, ``%`` → ``%25``); everything else, dots,
spaces, quotes and unicode included, is kept and back-quoted in SQL.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pgcdc.errors import ConfigError, IdentityChangedError, PositionCorruptError
from pgcdc.lsn import Lsn

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession
    from pyspark.sql.types import DataType, StructType

log = logging.getLogger("pgcdc.spark.mirror")

POSITION_PROPERTY = "pgcdc.lsn"
SOURCE_PROPERTY = "pgcdc.source"
KEY_PROPERTY = "pgcdc.key"
# the replication slot the mirror streams from: what `pgcdc decode --consume` must not move past unasked
SLOT_PROPERTY = "pgcdc.slot"
# columns being added whose existing rows still wait for the value PostgreSQL gives them (JSON: column -> text)
FILL_PROPERTY = "pgcdc.fill"
CHANGELOG_SUFFIX = "__changes"
REJECTS_SUFFIX = "__rejects"  # changes whose values could not be converted (--on-conversion-error quarantine)
ORDINAL_PROPERTY = "pgcdc.ordinal"  # with pgcdc.lsn, the last change a __rejects table holds
# a table property: the position again, where snapshot expiry cannot remove it (JSON: lsn, and pending while a
# commit of a table without a key is in flight); see MirrorCatalog.recording
RECORD_PROPERTY = "pgcdc.position"
# The source a mirror's rows hold (JSON of SourceShape): the table's OID, its columns' PostgreSQL types, and
# what the catalog said of its storage and publication; a change that gave existing rows values the stream
# never sends is told by them (pgcdc.pipeline.tables.SourceTables.needs_copy).
SHAPE_PROPERTY = "pgcdc.source-shape"
_PATH_UNSAFE = {"%": "%25", "/": "%2F", "\\": "%5C"}


def quote(identifier: str) -> str:
    """A Spark SQL identifier part, back-quoted with back-quotes doubled."""
    return "`" + identifier.replace("`", "``") + "`"


def encode_name(name: str) -> str:
    return "".join(_PATH_UNSAFE.get(ch, ch) for ch in name)


@dataclass(frozen=True)
class TableSpec:
    """What a mirror must look like: the source's name, the Spark schema of its columns, its key."""

    source_schema: str
    source_table: str
    spark_schema: StructType
    key_columns: tuple[str, ...] = ()
    replica_identity: str = "d"
    shape: SourceShape | None = None

    @property
    def source(self) -> str:
        return f"{self.source_schema}.{self.source_table}"

    @property
    def append_only(self) -> bool:
        """Rows the server never identifies (REPLICA IDENTITY NOTHING, or DEFAULT without a primary key): PostgreSQL
        refuses UPDATE and DELETE on such a table while they are published, so its mirror only takes inserts.
        Without a key under FULL, rows are identified by every column instead."""
        return not self.key_columns and self.replica_identity != "f"


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


@dataclass
class MirrorTable:
    """An Iceberg table mirroring one source table; ``position`` is its ``pgcdc.lsn`` (None before any)."""

    identifier: str
    changelog_identifier: str
    spec: TableSpec
    schema: StructType
    position: Lsn | None = None
    changelog_position: Lsn | None = None
    pending_fill: dict[str, str | None] = field(default_factory=dict)  # see FILL_PROPERTY
    rejects_identifier: str = ""  # <table>__rejects: changes set aside (--on-conversion-error quarantine)
    rejects_position: tuple[int, int] | None = None  # (commit LSN, ordinal) of the last change set aside
    shape: SourceShape | None = None  # see SHAPE_PROPERTY
    changelog_image: StructType | None = None  # the row image the change log was last written with


def stored_type(data_type: DataType) -> DataType:
    """The type Iceberg stores for a Spark type: it has no 8- or 16-bit integers (they become int)."""
    from pyspark.sql.types import (
        ArrayType,
        ByteType,
        IntegerType,
        MapType,
        ShortType,
        StructField,
        StructType,
    )

    if isinstance(data_type, ByteType | ShortType):
        return IntegerType()
    if isinstance(data_type, ArrayType):
        return ArrayType(stored_type(data_type.elementType), data_type.containsNull)
    if isinstance(data_type, MapType):
        return MapType(stored_type(data_type.keyType), stored_type(data_type.valueType), data_type.valueContainsNull)
    if isinstance(data_type, StructType):
        return StructType([StructField(f.name, stored_type(f.dataType), f.nullable) for f in data_type.fields])
    return data_type


def _can_identify(data_type: Any) -> bool:
    """Whether Iceberg takes a column of ``data_type`` as an identifier field: primitive, not floating-point."""
    from pyspark.sql.types import ArrayType, DoubleType, FloatType, MapType, StructType

    return not isinstance(data_type, ArrayType | DoubleType | FloatType | MapType | StructType)


def _widens(old: DataType, new: DataType) -> bool:
    from pyspark.sql.types import DecimalType, DoubleType, FloatType, IntegerType, LongType, ShortType

    if old == new:
        return True
    if isinstance(old, ShortType | IntegerType) and isinstance(new, IntegerType | LongType):
        return True
    if isinstance(old, FloatType) and isinstance(new, DoubleType):
        return True
    return (isinstance(old, DecimalType) and isinstance(new, DecimalType) and old.scale == new.scale
            and new.precision >= old.precision)


def _narrowed(current: StructType, spec: TableSpec) -> list[str]:
    """The mirror's columns whose type Iceberg cannot change in place to ``spec``'s."""
    return cannot_widen(current, spec.spark_schema)


def cannot_widen(current: StructType, target: StructType) -> list[str]:
    """The fields of ``current`` whose type Iceberg cannot change in place to ``target``'s."""
    wanted = {f.name: f for f in target.fields}
    return [f.name for f in current.fields if f.name in wanted
            and not _widens(stored_type(f.dataType), stored_type(wanted[f.name].dataType))]


class MirrorCatalog:
    """The mirrors of one pgcdc pipeline: ``<catalog>.<namespace>.<source schema>.<source table>``."""

    def __init__(self, spark: SparkSession, *, catalog: str = "pgcdc", namespace: str = "mirror",
                 slot: str | None = None) -> None:
        """``slot``: the replication slot the mirrors stream from, recorded in each mirror it creates or opens
        (None: a reader such as ``pgcdc status``, which records nothing)."""
        if not namespace or "`" in namespace:
            raise ConfigError(f"mirror namespace {namespace!r} must be a non-empty name without back-quotes")
        self.spark = spark
        self.catalog = catalog
        self.namespace = namespace
        self.slot = slot
        self._tables: dict[tuple[str, str], MirrorTable] = {}

    def identifier_for(self, source_schema: str, source_table: str) -> str:
        return f"{self.namespace_for(source_schema)}.{quote(encode_name(source_table))}"

    def namespace_for(self, source_schema: str) -> str:
        """The Iceberg namespace holding the mirrors of one source schema."""
        return ".".join([quote(self.catalog), quote(self.namespace), quote(encode_name(source_schema))])

    def changelog_identifier_for(self, source_schema: str, source_table: str) -> str:
        return self.identifier_for(source_schema, source_table + CHANGELOG_SUFFIX)

    def rejects_identifier_for(self, source_schema: str, source_table: str) -> str:
        return self.identifier_for(source_schema, source_table + REJECTS_SUFFIX)

    def _exists(self, identifier: str) -> bool:
        return bool(self.spark.catalog.tableExists(identifier))

    def _readable(self, identifier: str) -> bool:
        """True for a usable table; a broken leftover of an interrupted creation is dropped."""
        if not self._exists(identifier):
            return False
        from pyspark.errors import AnalysisException

        try:
            self.spark.table(identifier).schema  # noqa: B018 - loads the table's metadata
            self.spark.sql(f"SELECT count(*) FROM {identifier}.snapshots").collect()
        except AnalysisException as exc:
            log.warning("dropping mirror %s left unusable by an interrupted run (%s)", identifier,
                        str(exc).splitlines()[0])
            self.spark.sql(f"DROP TABLE IF EXISTS {identifier}")
            return False
        return True

    def ensure(self, spec: TableSpec, *, replacing_rows: bool = False) -> MirrorTable:
        """The mirror of ``spec``'s source, created or evolved to ``spec.spark_schema``.

        A mirror keyed on other columns than ``spec.key_columns``, or holding a column whose type Iceberg cannot
        change in place to the new one, is refused with the way out (a new copy), or, with ``replacing_rows``
        (the caller is about to replace every row), dropped and made again."""
        key = (spec.source_schema, spec.source_table)
        known = self._tables.get(key)
        if known is not None and known.spec == spec:
            return known
        identifier = self.identifier_for(spec.source_schema, spec.source_table)
        changelog = self.changelog_identifier_for(spec.source_schema, spec.source_table)
        readable = known is not None or self._readable(identifier)
        recorded = (known.spec.key_columns if known is not None
                    else self._recorded_key(identifier) if readable else None)
        if recorded is not None and _key_tokens(recorded) != _key_tokens(spec.key_columns):
            if not replacing_rows:  # the pipeline copies such a table first (SourceTables.needs_copy)
                raise IdentityChangedError(
                    f"{spec.source}: its mirror {identifier} is keyed on {describe_key(recorded)}, but the "
                    f"table's replica identity now identifies rows by {describe_key(spec.key_columns)}; applying "
                    "its changes by the old key would leave wrong rows in the mirror. Copy that table again with "
                    "the new key: DROP TABLE it in Spark and run pgcdc, which copies it while the others stream")
            self._drop_for_copy(identifier, spec, f"was keyed on {describe_key(recorded)}; making it again keyed "
                                                  f"on {describe_key(spec.key_columns)}")
            known, readable = None, False
        current = None if not readable else known.schema if known is not None else self.spark.table(identifier).schema
        if current is not None and replacing_rows and _narrowed(current, spec):
            self._drop_for_copy(identifier, spec, f"holds {', '.join(_narrowed(current, spec))} of types Iceberg "
                                                  "cannot change in place to the source's new ones")
            known, readable, current = None, False, None
        if current is None:
            self._create(identifier, spec)
            mirror = MirrorTable(identifier, changelog, spec, self.spark.table(identifier).schema)
            mirror.shape = spec.shape
        else:
            mirror = MirrorTable(identifier, changelog, spec, self._evolve(identifier, spec, current))
            mirror.position = known.position if known is not None else self.read_position(identifier)
            mirror.changelog_position = (known.changelog_position if known is not None
                                         else self.read_position(changelog) if self._exists(changelog) else None)
            properties = self._properties(identifier) if known is None else {}
            pending = properties.get(FILL_PROPERTY)
            mirror.pending_fill = json.loads(pending) if pending else {}
            mirror.shape = known.shape if known is not None else SourceShape.decode(properties.get(SHAPE_PROPERTY))
            updates = {}
            if known is None and self.slot is not None and properties.get(SLOT_PROPERTY) != self.slot:
                updates[SLOT_PROPERTY] = self.slot
            shape = spec.shape.following(mirror.shape) if spec.shape is not None else None
            # rows about to be replaced keep their shape until the copy replacing them commits (record_shape)
            if shape is not None and shape != mirror.shape and not replacing_rows:
                updates[SHAPE_PROPERTY] = shape.encode()
                mirror.shape = shape
            self._set_properties(identifier, updates)
        mirror.rejects_identifier = self.rejects_identifier_for(spec.source_schema, spec.source_table)
        if known is not None:
            mirror.rejects_position = known.rejects_position
        elif readable:
            mirror.rejects_position = self.read_rejects_position(mirror.rejects_identifier)
        self._tables[key] = mirror
        return mirror

    def cannot_take(self, source_schema: str, source_table: str, spark_schema: StructType) -> bool:
        """Whether the mirror has a column whose type Iceberg cannot change in place to ``spark_schema``'s."""
        known = self._tables.get((source_schema, source_table))
        identifier = self.identifier_for(source_schema, source_table)
        current = known.schema if known is not None else self.spark.table(identifier).schema
        return bool(cannot_widen(current, spark_schema))

    def record_shape(self, source_schema: str, source_table: str, shape: SourceShape) -> None:
        """Record ``shape`` as the mirror's source shape (the mirror exists): after a copy replaced its rows."""
        self._set_properties(self.identifier_for(source_schema, source_table), {SHAPE_PROPERTY: shape.encode()})
        known = self._tables.get((source_schema, source_table))
        if known is not None:
            known.shape = shape

    def _drop_for_copy(self, identifier: str, spec: TableSpec, why: str) -> None:
        log.warning("%s: mirror %s %s, for a new copy", spec.source, identifier, why)
        self.spark.sql(f"DROP TABLE {identifier}")
        self._tables.pop((spec.source_schema, spec.source_table), None)

    def source_shape(self, source_schema: str, source_table: str) -> SourceShape | None:
        """The source shape the mirror's rows hold (before :meth:`ensure` evolves it); None when there is no
        mirror or it records none."""
        known = self._tables.get((source_schema, source_table))
        if known is not None:
            return known.shape
        identifier = self.identifier_for(source_schema, source_table)
        if not self._readable(identifier):
            return None
        return SourceShape.decode(self._property(identifier, SHAPE_PROPERTY))

    def keyed_otherwise(self, source_schema: str, source_table: str, key: tuple[str, ...]) -> tuple[str, ...] | None:
        """The key the mirror of a source table is keyed on, when it is not ``key`` (None: it is, or there is no
        mirror, or it records none)."""
        known = self._tables.get((source_schema, source_table))
        if known is not None:
            recorded: tuple[str, ...] | None = known.spec.key_columns
        else:
            identifier = self.identifier_for(source_schema, source_table)
            recorded = self._recorded_key(identifier) if self._readable(identifier) else None
        if recorded is None or _key_tokens(recorded) == _key_tokens(key):
            return None
        return recorded

    def _recorded_key(self, identifier: str) -> tuple[str, ...] | None:
        """The key a mirror was created with (its ``pgcdc.key`` property); None when it records none."""
        value = self._property(identifier, KEY_PROPERTY)
        if value is None:
            return None
        return (value,) if value else ()  # compared by _key_tokens: a column name may hold a comma

    def _property(self, identifier: str, name: str) -> str | None:
        return self._properties(identifier).get(name)

    def _properties(self, identifier: str) -> dict[str, str]:
        # from Iceberg's table, not SHOW TBLPROPERTIES: Spark redacts any value that mentions a secret, a
        # password or a token (spark.redaction.regex) — a column's name or a default's text, say
        from pgcdc.spark.iceberg import load_table

        return {str(k): str(v) for k, v in load_table(self.spark, identifier).properties().items()}

    def _set_properties(self, identifier: str, values: Mapping[str, str]) -> None:
        """One metadata commit setting ``values`` among the table's properties (none when empty)."""
        if values:
            self.spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ("
                           + ", ".join(f"{sql_string(k)} = {sql_string(v)}" for k, v in values.items()) + ")")

    def held_position(self, source_schema: str, source_table: str, *, changelog: bool) -> Lsn | None:
        """The position below which the mirror (and its change log, when kept) holds every transaction, read
        without evolving the mirror; None when it holds none."""
        known = self._tables.get((source_schema, source_table))
        identifier = self.identifier_for(source_schema, source_table)
        if known is not None:
            positions = [known.position, known.changelog_position if changelog else known.position]
        elif self._exists(identifier):
            changelog_identifier = self.changelog_identifier_for(source_schema, source_table)
            position = self.read_position(identifier)
            positions = [position, (self.read_position(changelog_identifier) if self._exists(changelog_identifier)
                                    else None) if changelog else position]
        else:
            return None
        return None if None in positions else min(p for p in positions if p is not None)

    def columns_of(self, source_schema: str, source_table: str) -> set[str] | None:
        """The columns the mirror of a source table has now (before :meth:`ensure` evolves it); None when there
        is no mirror yet."""
        known = self._tables.get((source_schema, source_table))
        if known is not None:
            return set(known.schema.names)
        identifier = self.identifier_for(source_schema, source_table)
        return set(self.spark.table(identifier).schema.names) if self._readable(identifier) else None

    def expect_fill(self, spec: TableSpec, values: Mapping[str, str | None]) -> None:
        """Record, before the columns are added, that the existing rows of these new columns must get
        ``values`` (the source's text): a crash between adding them and :meth:`fill` leaves the promise."""
        identifier = self.identifier_for(spec.source_schema, spec.source_table)
        pending = json.loads(self._property(identifier, FILL_PROPERTY) or "{}")
        pending.update(values)
        self._set_properties(identifier, {FILL_PROPERTY: json.dumps(pending)})
        self._tables.pop((spec.source_schema, spec.source_table), None)  # ensure reads the promise back

    def fill(self, mirror: MirrorTable, values: pa.Table) -> None:
        """Set every row's columns of ``values`` (one row) to its values, then forget the promise. Runs before
        any change carrying these columns is applied, so every row it touches predates them (and a replay after
        a crash in between does the same again)."""
        from pyspark.sql.types import StructType

        from pgcdc.spark.arrow import arrow_to_dataframe
        from pgcdc.spark.iceberg import with_commit_properties

        schema = StructType([mirror.schema[name] for name in values.column_names])
        arrow_to_dataframe(self.spark, values, schema).createOrReplaceTempView("_pgcdc_fill")
        assignments = ", ".join(f"t.{quote(n)} = s.{quote(n)}" for n in values.column_names)
        statement = f"MERGE INTO {mirror.identifier} t USING _pgcdc_fill s ON true WHEN MATCHED THEN UPDATE SET {assignments}"
        properties = {POSITION_PROPERTY: str(mirror.position)} if mirror.position is not None else {}
        with_commit_properties(self.spark, properties, lambda: self.spark.sql(statement))
        log.info("%s: existing rows given the value PostgreSQL gives them in %s", mirror.spec.source,
                 ", ".join(values.column_names))
        self.forget_fill(mirror)

    def forget_fill(self, mirror: MirrorTable) -> None:
        """Drop the promise of :meth:`expect_fill` (kept, or made moot by a copy that replaced every row)."""
        self.spark.sql(f"ALTER TABLE {mirror.identifier} UNSET TBLPROPERTIES IF EXISTS ({sql_string(FILL_PROPERTY)})")
        mirror.pending_fill = {}

    def _create(self, identifier: str, spec: TableSpec) -> None:
        missing = [k for k in spec.key_columns if k not in spec.spark_schema.names]
        if missing:
            raise ConfigError(f"{spec.source}: key columns {missing} are not among its columns")
        # Iceberg identifier fields must be required columns.
        columns = ", ".join(
            f"{quote(f.name)} {ddl_type(f.dataType)}{' NOT NULL' if f.name in spec.key_columns else ''}"
            for f in spec.spark_schema.fields)
        properties = {
            "format-version": "2",
            # merge-on-read: a batch's MERGE writes delete files instead of rewriting data files
            "write.delete.mode": "merge-on-read",
            "write.update.mode": "merge-on-read",
            "write.merge.mode": "merge-on-read",
            SOURCE_PROPERTY: spec.source,
            KEY_PROPERTY: ",".join(spec.key_columns),
            **({SLOT_PROPERTY: self.slot} if self.slot is not None else {}),
            **({SHAPE_PROPERTY: spec.shape.encode()} if spec.shape is not None else {}),
        }
        self.spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {self.namespace_for(spec.source_schema)}")
        self.spark.sql(f"CREATE TABLE {identifier} ({columns}) USING iceberg TBLPROPERTIES ("
                       + ", ".join(f"{sql_string(k)} = {sql_string(v)}" for k, v in properties.items()) + ")")
        refused = [k for k in spec.key_columns if not _can_identify(spec.spark_schema[k].dataType)]
        if spec.key_columns and not refused:
            self.spark.sql(f"ALTER TABLE {identifier} SET IDENTIFIER FIELDS "
                           + ", ".join(quote(k) for k in spec.key_columns))
        elif refused:  # the key stays pgcdc's (pgcdc.key); Iceberg's identifier fields are only a declaration
            log.info("%s: no Iceberg identifier fields for %s: its key holds %s, which Iceberg does not take as "
                     "identifier fields (floating-point or nested types)", identifier, spec.source, ", ".join(refused))
        log.info("created mirror %s for %s (key: %s)", identifier, spec.source, ", ".join(spec.key_columns) or "none")

    def _evolve(self, identifier: str, spec: TableSpec, current: StructType) -> StructType:
        wanted = {f.name: f for f in spec.spark_schema.fields}
        existing = {f.name: f for f in current.fields}
        for name in _narrowed(current, spec)[:1]:
            raise ConfigError(
                f"{spec.source}.{name} changed from {existing[name].dataType.simpleString()} to "
                f"{wanted[name].dataType.simpleString()}, which Iceberg cannot express in place; resnapshot the "
                f"table: DROP TABLE {identifier} in Spark (and its {CHANGELOG_SUFFIX} table if kept), then "
                "run pgcdc again, which copies it at a fresh consistent point")
        statements = []
        for name, field_ in existing.items():
            target = wanted.get(name)
            if target is None:
                if name in spec.key_columns:
                    continue
                statements.append(f"ALTER TABLE {identifier} DROP COLUMN {quote(name)}")
            elif stored_type(target.dataType) != stored_type(field_.dataType):
                statements.append(f"ALTER TABLE {identifier} ALTER COLUMN {quote(name)} TYPE "
                                  f"{ddl_type(stored_type(target.dataType))}")
        for name, target in wanted.items():
            if name not in existing:
                statements.append(f"ALTER TABLE {identifier} ADD COLUMN {quote(name)} {ddl_type(target.dataType)}")
        for statement in statements:
            log.info("schema change: %s", statement)
            self.spark.sql(statement)
        return self.spark.table(identifier).schema if statements else current

    def read_position(self, identifier: str) -> Lsn | None:
        """Where a mirror (or change log) stands: the highest ``pgcdc.lsn`` in the snapshots of its current
        lineage, or, when none of them carries one (expired after commits pgcdc did not make), the position
        recorded in its ``pgcdc.position`` table property (see :meth:`recording`). None: it holds none.
        Read through Iceberg's Java API from the table's metadata: no query to plan, which a start-up with many
        mirrors would pay per mirror."""
        from py4j.protocol import Py4JJavaError
        from pyspark.errors import AnalysisException

        from pgcdc.spark.iceberg import load_table

        try:
            table = load_table(self.spark, identifier)
            snapshot = table.currentSnapshot()
            carried: list[str] = []
            while snapshot is not None:
                value = snapshot.summary().get(POSITION_PROPERTY)
                if value is not None:
                    carried.append(str(value))
                parent = snapshot.parentId()
                snapshot = table.snapshot(parent) if parent is not None else None  # None: expired
        except (AnalysisException, Py4JJavaError) as exc:
            # a table whose creation was interrupted (the process killed mid-way) holds no position: it is
            # copied again, which replaces whatever it holds
            log.warning("mirror %s cannot be read (%s); it will be copied again", identifier,
                        str(exc).strip().splitlines()[0])
            return None
        # the highest, not the newest: a maintenance commit made by `pgcdc maintain` beside a running pipeline
        # may land on top of a newer data commit while carrying the position it read before it
        if carried:
            return max(self._parse_position(identifier, POSITION_PROPERTY, value) for value in carried)
        return self._recorded_position(identifier)

    def _parse_position(self, identifier: str, name: str, value: str) -> Lsn:
        try:
            return Lsn.parse(value)
        except ValueError:
            raise PositionCorruptError(
                f"mirror {identifier} stores {name}={value!r}, which is not an LSN: its position "
                "cannot be trusted, so pgcdc will not guess what it holds. Copy the table again (DROP TABLE "
                f"{identifier} in Spark, then run pgcdc, which recopies it at a fresh consistent point), or roll "
                "it back to an earlier snapshot with the Iceberg procedure system.rollback_to_snapshot") from None

    def _recorded_position(self, identifier: str) -> Lsn | None:
        """The position in the ``pgcdc.position`` property, for a table whose snapshots no longer carry one.

        The row-delta writer sets it in its commit's own transaction (exact); after other commits it is written
        after the commit (a lower bound of what the table holds), and, for tables where a lower bound would
        double rows, a ``pending`` mark before it: a mark left behind means pgcdc stopped between the two, and
        that commit may or may not have landed."""
        value = self._property(identifier, RECORD_PROPERTY)
        if value is None:
            return None
        try:
            position, pending = parse_position_record(value)
        except (ValueError, KeyError, TypeError):
            raise PositionCorruptError(
                f"{identifier} stores {RECORD_PROPERTY}={value!r}, which is not a position record, and no snapshot "
                "of it carries pgcdc.lsn any more: pgcdc cannot know which changes it holds. Copy it again (DROP "
                f"TABLE {identifier} in Spark, then run pgcdc)") from None
        if pending is None:
            return position
        if self._property(identifier, KEY_PROPERTY):
            # replaying the changes after a lower bound rewrites keyed rows with the values they already hold
            log.warning("%s: its snapshots carrying pgcdc.lsn were expired while a commit was in flight; resuming "
                        "from %s, the last position known to be whole (its changes are upserts: applied again, "
                        "they leave the rows as they are)", identifier, position)
            return position
        raise PositionCorruptError(
            f"{identifier} was being written up to {pending} (from {position}) when pgcdc stopped, and every "
            "snapshot that would tell whether that commit landed was expired since (by snapshot expiry that "
            "pgcdc did not run). Its rows have no key, so replaying the changes could add them twice and skipping "
            "them could lose them. Copy it again: DROP TABLE "
            f"{identifier} in Spark (and its {CHANGELOG_SUFFIX}/{REJECTS_SUFFIX} tables), then run pgcdc")

    def recording(self, identifier: str, *, before: Lsn | None, upto: Lsn, held: Callable[[], Lsn | None],
                  whole: bool, deferred: bool = False) -> _PositionRecording:
        """``with mirrors.recording(...):`` around a commit that moves a table from ``before`` to ``upto`` and
        carries ``upto`` in its snapshot summary: afterwards the ``pgcdc.position`` property records ``held()``
        (what the table holds then) too, where snapshot expiry cannot remove it (nothing to write when the
        commit set it itself). With ``whole`` (tables without a key, change logs: a replay from a lower bound
        would double rows) the commit is first marked pending, so that a record left behind by a crash between
        the commit and the record is known for what it is — on entering, or with ``deferred`` when the caller
        calls ``mark_pending()``: a commit that writes the property in its own metadata commit needs no mark."""
        return _PositionRecording(self, identifier, before, upto, held, whole, deferred)

    def record_position(self, identifier: str, position: Lsn | None, *, pending: Lsn | None = None,
                        advance_only: bool = False) -> None:
        """Write the ``pgcdc.position`` property (one metadata commit; nothing when it already says this). With
        ``advance_only`` (a maintenance beside the stream, whose position may be behind an apply's, or whose
        apply may be pending), only over a settled position behind this one."""
        if position is None:
            return
        from pgcdc.spark.iceberg import load_table

        value = position_record(position, pending=pending)
        table = load_table(self.spark, identifier)
        table.refresh()
        current = table.properties().get(RECORD_PROPERTY)
        if current == value or (advance_only and not _settled_behind(current, position)):
            return
        table.updateProperties().set(RECORD_PROPERTY, value).commit()

    def read_rejects_position(self, identifier: str) -> tuple[int, int] | None:
        """(commit LSN, ordinal) of the last change a ``__rejects`` table holds: the highest its lineage carries,
        else (those snapshots expired) the highest among its rows, which are exactly the changes appended."""
        if not self._exists(identifier):
            return None
        rows = self.spark.sql(
            f"SELECT s.summary['{POSITION_PROPERTY}'] AS lsn, s.summary['{ORDINAL_PROPERTY}'] AS ordinal "
            f"FROM {identifier}.snapshots s JOIN {identifier}.history h ON s.snapshot_id = h.snapshot_id "
            f"WHERE h.is_current_ancestor AND s.summary['{ORDINAL_PROPERTY}'] IS NOT NULL").collect()
        if not rows:
            rows = self.spark.sql(f"SELECT commit_lsn AS lsn, ordinal FROM {identifier} "
                                  "ORDER BY commit_lsn_value DESC, ordinal DESC LIMIT 1").collect()
        if not rows:
            return None
        try:
            return max((int(Lsn.parse(row.lsn)), int(row.ordinal)) for row in rows)
        except (ValueError, TypeError):
            raise PositionCorruptError(
                f"{identifier} stores {POSITION_PROPERTY}/{ORDINAL_PROPERTY} values that are not a position "
                f"({', '.join(f'{row.lsn!r}/{row.ordinal!r}' for row in rows[:3])}), so pgcdc cannot know which "
                "changes it holds. Roll it back to an earlier snapshot with the Iceberg procedure "
                "system.rollback_to_snapshot, or drop it") from None

    def carried_positions(self, identifier: str, *, rejects: bool = False) -> dict[str, str]:
        """The snapshot properties that a commit changing no row of ``identifier`` (compaction, a manifest
        rewrite) carries to keep the table's position ({} for a table holding none). The ``pgcdc.position``
        property is brought up to date first: expiry after commits that carry nothing (anyone's compaction)
        leaves the position there."""
        if rejects:  # its rows tell its position exactly, whatever expiry removes
            held = self.read_rejects_position(identifier)
            return {} if held is None else {POSITION_PROPERTY: str(Lsn(held[0])), ORDINAL_PROPERTY: str(held[1])}
        position = self.read_position(identifier)
        if position is None:
            return {}
        self.record_position(identifier, position, advance_only=True)
        return {POSITION_PROPERTY: str(position)}

    def all_tables(self) -> list[tuple[str, bool]]:
        """(identifier, is a __rejects table) of every table in the namespace: mirrors, change logs, rejects."""
        found = []
        for source_schema, source_table, identifier in self._source_tables():
            found.append((identifier, False))
            for other, rejects in ((self.changelog_identifier_for(source_schema, source_table), False),
                                   (self.rejects_identifier_for(source_schema, source_table), True)):
                if self._exists(other):
                    found.append((other, rejects))
        return found

    def known(self) -> list[MirrorTable]:
        """The mirrors this catalog has opened (or created) so far, in the order it did."""
        return list(self._tables.values())

    def _source_tables(self) -> list[tuple[str, str, str]]:
        """(source schema, source table, identifier) of every mirror in the namespace, from the catalog's
        own listing (exact names, no parsing of SQL output)."""
        session: Any = self.spark._jsparkSession
        # the catalog plug-ins are read from the thread's active session: set it for threads Spark did not start
        self.spark.sparkContext._jvm.org.apache.spark.sql.SparkSession.setActiveSession(session)  # type: ignore[union-attr]
        catalog = session.sessionState().catalogManager().catalog(self.catalog)
        gateway: Any = self.spark.sparkContext._gateway
        root = gateway.new_array(gateway.jvm.java.lang.String, 1)
        root[0] = self.namespace
        if not catalog.namespaceExists(root):
            return []
        found = []
        for namespace in catalog.listNamespaces(root):
            parts = list(namespace)
            source_schema = _decode(parts[-1])
            for identifier in catalog.listTables(namespace):
                name = identifier.name()
                if name.endswith((CHANGELOG_SUFFIX, REJECTS_SUFFIX)):
                    continue
                source_table = _decode(name)
                found.append((source_schema, source_table, self.identifier_for(source_schema, source_table)))
        return sorted(found)

    def positions(self) -> dict[tuple[str, str], Lsn]:
        """{(source schema, source table): pgcdc.lsn} of every mirror holding a position."""
        result = {}
        for source_schema, source_table, identifier in self._source_tables():
            position = self.read_position(identifier)
            if position is not None:
                result[(source_schema, source_table)] = position
        return result

    def describe(self) -> list[dict[str, Any]]:
        """For ``pgcdc status``: each mirror with its source, position, rows and snapshot count."""
        rows = []
        for source_schema, source_table, identifier in self._source_tables():
            count = self.spark.sql(f"SELECT count(*) AS n FROM {identifier}").collect()[0].n
            snapshots = self.spark.sql(f"SELECT count(*) AS n FROM {identifier}.snapshots").collect()[0].n
            position = self.read_position(identifier)
            rejects = self.rejects_identifier_for(source_schema, source_table)
            rejected = (self.spark.sql(f"SELECT count(*) AS n FROM {rejects}").collect()[0].n
                        if self._exists(rejects) else 0)
            rows.append({"mirror": identifier, "source": f"{source_schema}.{source_table}",
                         "slot": self._property(identifier, SLOT_PROPERTY),
                         "lsn": str(position) if position is not None else None, "rows": count,
                         "snapshots": snapshots, "rejected": rejected})
        return rows

    def streaming_from(self, slot: str) -> list[tuple[str, Lsn | None]]:
        """(identifier, position) of every mirror that records ``slot`` as the slot it streams from."""
        return [(identifier, self.read_position(identifier)) for _, _, identifier in self._source_tables()
                if self._property(identifier, SLOT_PROPERTY) == slot]



def _key_tokens(key: tuple[str, ...]) -> list[str]:
    # as ``pgcdc.key`` records a key (comma-joined), in any order: the key is a set of columns
    return sorted(",".join(key).split(","))


def describe_key(key: tuple[str, ...]) -> str:
    """A mirror's key as messages name it: ``(a, b)``, or no key."""
    return f"({', '.join(key)})" if key else "no key (whole rows)"


def _decode(name: str) -> str:
    for raw, encoded in _PATH_UNSAFE.items():
        if raw != "%":
            name = name.replace(encoded, raw)
    return name.replace("%25", "%")


def sql_string(value: str) -> str:
    """A Spark SQL string literal."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def ddl_type(data_type: DataType) -> str:
    """A Spark SQL type for DDL, with nested field names quoted (``simpleString`` does not quote them)."""
    from pyspark.sql.types import ArrayType, MapType, StructType

    if isinstance(data_type, StructType):
        return "STRUCT<" + ", ".join(f"{quote(f.name)}: {ddl_type(f.dataType)}" for f in data_type.fields) + ">"
    if isinstance(data_type, ArrayType):
        return f"ARRAY<{ddl_type(data_type.elementType)}>"
    if isinstance(data_type, MapType):
        return f"MAP<{ddl_type(data_type.keyType)}, {ddl_type(data_type.valueType)}>"
    return data_type.simpleString()


def _settled_behind(record: str | None, position: Lsn) -> bool:
    """Whether a ``pgcdc.position`` value is missing or records a settled position (no commit pending) behind
    ``position``."""
    if record is None:
        return True
    try:
        recorded, pending = parse_position_record(record)
    except (ValueError, KeyError, TypeError):
        return False
    return pending is None and recorded < position


def parse_position_record(value: str) -> tuple[Lsn, str | None]:
    """(position, pending mark or None) of a ``pgcdc.position`` value; ValueError, KeyError or TypeError when it
    is not one."""
    record = json.loads(value)
    return Lsn.parse(record["lsn"]), record.get("pending")


def position_record(position: Lsn, *, pending: Lsn | None = None) -> str:
    """The ``pgcdc.position`` property's value for a table holding ``position`` (and maybe, ``pending``, being
    written up to there)."""
    record: dict[str, str] = {"lsn": str(position)}
    if pending is not None:
        record["pending"] = str(pending)
    return json.dumps(record, sort_keys=True)


class _PositionRecording:
    """The context manager of :meth:`MirrorCatalog.recording`."""

    def __init__(self, mirrors: MirrorCatalog, identifier: str, before: Lsn | None, upto: Lsn,
                 held: Callable[[], Lsn | None], whole: bool, deferred: bool) -> None:
        self._mirrors, self._identifier = mirrors, identifier
        self._before, self._upto, self._held, self._whole = before, upto, held, whole
        self._deferred = deferred

    def __enter__(self) -> _PositionRecording:
        if not self._deferred:
            self.mark_pending()
        return self

    def mark_pending(self) -> None:
        """Mark the commit pending (for a table with ``whole``): called before a commit that does not write the
        ``pgcdc.position`` property itself."""
        if self._whole and self._before is not None and self._before < self._upto \
                and self._mirrors._exists(self._identifier):
            self._mirrors.record_position(self._identifier, self._before, pending=self._upto)

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            return  # a pending mark stays: whether the commit landed is read from the table on the next try
        held = self._held()
        if held is not None and self._mirrors._exists(self._identifier):
            self._mirrors.record_position(self._identifier, held)
