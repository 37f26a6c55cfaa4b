"""Iceberg mirror tables: their names, their creation and schema evolution, and the listing of a namespace.

What a mirror records beside its rows lives with its own module: the position (:mod:`pgcdc.positions`, read and
written by :mod:`.positions`), and the key, slot, source shape and fill promises
(:mod:`.properties`); a mirror opened here is read once, its state kept in :class:`MirrorTable`.

A source table ``schema.table`` is mirrored as ``<catalog>.<namespace>.<schema>.<table>``: the
source schema becomes a nested Iceberg namespace, so names stay readable and distinct, case
included. Characters that would break a file-system path in path-based catalogs are
percent-encoded (``/`` → ``%2F``, ``\\`` → ``%5C``, ``%`` → ``%25``); everything else, dots,
spaces, quotes and unicode included, is kept and back-quoted in SQL.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pgcdc.errors import ConfigError, IdentityChangedError
from pgcdc.iceberg.partition_specs import PartitionTransform
from pgcdc.lsn import Lsn
from pgcdc.mirrors.positions import MirrorPositions
from pgcdc.mirrors.properties import (
    FILL_PROPERTY,
    KEY_PROPERTY,
    SHAPE_PROPERTY,
    SLOT_PROPERTY,
    SOURCE_PROPERTY,
    MirrorProperties,
    SourceShape,
    describe_key,
    key_tokens,
    recorded_key,
)
from pgcdc.spark.destination import Destination

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import DataType, StructType

    from pgcdc.index.mirror_index import MirrorIndex

log = logging.getLogger("pgcdc.mirrors.catalog")

CHANGELOG_SUFFIX = "__changes"
REJECTS_SUFFIX = "__rejects"  # changes whose values could not be converted (--on-conversion-error quarantine)
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
    index: MirrorIndex | None = None  # where each row is (deleting by position), built when first needed
    iceberg_table: Any = None  # its org.apache.iceberg.Table, kept between batches by the row-delta writer
    writer_layout: Any = None  # what the row-delta writer read of its layout (pgcdc.spark.table_writer.Layout)
    deletes: str | None = None  # "equality" when this mirror cannot delete by position (why was logged)
    # the small files of its last commit (pgcdc.apply.fold.SmallFiles), which the apply makes at its first batch:
    # folding is the apply's to know, a room above this one
    small_files: Any = None


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


def cannot_widen(current: StructType, target: StructType) -> list[str]:
    """The fields of ``current`` whose type Iceberg cannot change in place to ``target``'s."""
    wanted = {f.name: f for f in target.fields}
    return [f.name for f in current.fields if f.name in wanted
            and not _widens(stored_type(f.dataType), stored_type(wanted[f.name].dataType))]


class MirrorNames:
    """The names of a namespace's mirrors: ``<catalog>.<namespace>.<source schema>.<source table>``."""

    def __init__(self, catalog: str, namespace: str) -> None:
        self.catalog = catalog
        self.namespace = namespace

    def identifier_for(self, source_schema: str, source_table: str) -> str:
        return f"{self.namespace_for(source_schema)}.{quote(encode_name(source_table))}"

    def namespace_for(self, source_schema: str) -> str:
        """The Iceberg namespace holding the mirrors of one source schema."""
        return ".".join([quote(self.catalog), quote(self.namespace), quote(encode_name(source_schema))])

    def changelog_identifier_for(self, source_schema: str, source_table: str) -> str:
        return self.identifier_for(source_schema, source_table + CHANGELOG_SUFFIX)

    def rejects_identifier_for(self, source_schema: str, source_table: str) -> str:
        return self.identifier_for(source_schema, source_table + REJECTS_SUFFIX)

    @staticmethod
    def mirrored(table_name: str) -> str | None:
        """The source table an Iceberg table of a source schema's namespace mirrors, by its name (None: a change
        log or a ``__rejects`` table)."""
        return None if table_name.endswith((CHANGELOG_SUFFIX, REJECTS_SUFFIX)) else decode_name(table_name)


class MirrorCatalog(MirrorNames):
    """The mirrors of one pgcdc pipeline, through Spark: ``<catalog>.<namespace>.<source schema>.<source table>``."""

    def __init__(self, spark: SparkSession, destination: Destination, *, slot: str | None = None,
                 partition_by: Mapping[tuple[str, str], Sequence[PartitionTransform]] | None = None) -> None:
        """The mirrors of ``destination``'s namespace. ``slot``: the replication slot the mirrors stream from,
        recorded in each mirror it creates or opens (None: a reader such as ``pgcdc status``, which records
        nothing). ``partition_by``: the partition spec of the mirrors it creates, by source (schema, table)."""
        super().__init__(destination.catalog, destination.namespace)
        self.spark = spark
        self.slot = slot
        self.partition_by = dict(partition_by or {})
        self._tables: dict[tuple[str, str], MirrorTable] = {}
        self._readable: set[str] = set()  # tables found usable; only this catalog drops them (_drop)
        # mirrors loaded once, before they are opened, for every question a start asks of them (whether they exist,
        # their position, key, shape and schema); opening one takes its table from here (ensure)
        self._looks: dict[str, Any] = {}
        # mirrors whose change log and __rejects table the namespace's listing found missing, until the mirror's
        # opening (the first thing any write of either needs) reads its state: no load then asks again
        self._missing_beside: dict[str, tuple[bool, bool]] = {}
        self._namespaces: set[str] = set()  # source schemas whose namespace this process made or found
        self.properties = MirrorProperties(spark)
        self.positions = MirrorPositions(spark)

    def _exists(self, identifier: str) -> bool:
        return self.positions.exists(identifier)

    def table(self, identifier: str) -> Any:
        """Iceberg's ``Table`` of ``identifier``, loaded through the JVM."""
        from pgcdc.spark.iceberg_java import load_table

        return load_table(self.spark, identifier)

    def readable(self, identifier: str) -> bool:
        """True for a usable table."""
        return identifier in self._readable or self.look(identifier) is not None

    def look(self, identifier: str) -> Any:
        """Iceberg's ``Table`` of ``identifier`` as this process first loaded it, before the mirror is opened (None:
        no such table): one load answers whether it exists and what it holds. Looked again once the catalog
        dropped or made it, or after :meth:`look_afresh`."""
        if identifier in self._looks:
            return self._looks[identifier]
        from pyspark.errors import AnalysisException

        self._session_active()
        try:
            table = self.table(identifier)
        except AnalysisException as exc:
            if exc.getErrorClass() != "TABLE_OR_VIEW_NOT_FOUND":
                raise
            table = None
        else:
            self.positions.seen(identifier)
            self._readable.add(identifier)
        self._looks[identifier] = table
        return table

    def look_at(self, tables: list[tuple[str, str]],
                each: Callable[[Callable[[str], Any], list[str]], object] | None = None) -> None:
        """:meth:`look` at the mirror of each source (schema, table) not looked at yet: the namespaces listed once
        (a mirror not there is not loaded, which would cost an exception through Spark), those there loaded by
        ``each(call, items)`` side by side (None: one after another) — a first batch over hundreds of mirrors
        waited for their loads one after another (on an object store, a few round trips each)."""
        unseen = {identifier: (schema, table) for schema, table in tables
                  if (identifier := self.identifier_for(schema, table)) not in self._looks
                  and identifier not in self._readable}
        named = self._table_names({schema for schema, _ in unseen.values()}) if len(unseen) > 1 else {}
        loading = []
        for identifier, (schema, table) in unseen.items():
            if schema not in named:
                loading.append(identifier)
                continue
            self._missing_beside[identifier] = (encode_name(table + CHANGELOG_SUFFIX) not in named[schema],
                                                encode_name(table + REJECTS_SUFFIX) not in named[schema])
            if encode_name(table) not in named[schema]:
                self._looks[identifier] = None
            else:
                loading.append(identifier)
        if each is not None and len(loading) > 1:
            each(self.look, loading)
            return
        for identifier in loading:
            self.look(identifier)

    def _table_names(self, source_schemas: set[str]) -> dict[str, set[str]]:
        """The names of the tables in the namespace of each of ``source_schemas``, by the catalog's listing (one
        call a schema; a namespace not made yet holds none)."""
        catalog, gateway, classes = self._java_catalog()
        names: dict[str, set[str]] = {}
        for source_schema in source_schemas:
            namespace = gateway.new_array(classes.String, 2)
            namespace[0], namespace[1] = self.namespace, encode_name(source_schema)
            names[source_schema] = ({str(identifier.name()) for identifier in catalog.listTables(namespace)}
                                    if catalog.namespaceExists(namespace) else set())
        return names

    def _java_catalog(self) -> tuple[Any, Any, Any]:
        """Spark's catalog plug-in of this catalog (a ``TableCatalog``), py4j's gateway and pgcdc's Java classes."""
        classes = self._session_active()
        session: Any = self.spark._jsparkSession
        return session.sessionState().catalogManager().catalog(self.catalog), self.spark.sparkContext._gateway, classes

    def _session_active(self) -> Any:
        """Make the session the calling thread's active one, and return pgcdc's Java classes: the catalog plug-ins
        are read from the thread's active session, which a thread Spark did not start has none of (the stream's,
        a pool's; the session itself may have started on another) until its catalog's first load."""
        from pgcdc.spark.iceberg_java import iceberg_classes

        classes = iceberg_classes()
        classes.set_active_session(self.spark._jsparkSession)
        return classes

    def _opened_look(self, identifier: str) -> Any:
        """The table of a mirror being opened, from its look, which the mirror keeps from now on (its
        ``iceberg_table``): refreshed when looked at before now, since what this process committed to the mirror
        meanwhile (a shape recorded, a copy's evolution) is not in the Table the look loaded."""
        looked = identifier in self._looks
        table = self.look(identifier)
        self._looks.pop(identifier, None)
        if looked and table is not None:
            table.refresh()
        return table

    def look_afresh(self) -> None:
        """Forget the tables looked at: a new start reads them again."""
        self._looks.clear()
        self._missing_beside.clear()

    def _unlook(self, identifier: str) -> None:
        """Forget what a look at the mirror ``identifier`` found (its table, what its listing said beside it)."""
        self._looks.pop(identifier, None)
        self._missing_beside.pop(identifier, None)

    def _drop(self, identifier: str, *, if_exists: bool = False) -> None:
        self._readable.discard(identifier)
        self._unlook(identifier)
        self.positions.forget(identifier)
        self.spark.sql(f"DROP TABLE {'IF EXISTS ' if if_exists else ''}{identifier}")

    def known_table(self, source_schema: str, source_table: str) -> MirrorTable | None:
        """The mirror as this catalog last opened it (None: not opened yet)."""
        return self._tables.get((source_schema, source_table))

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
        # a mirror opened first in this process is loaded once for its properties, its position and the writer
        # (which refreshes it before each batch): a start over many mirrors paid a load for each
        table = None if known is not None else self._opened_look(identifier)
        properties = {} if table is None else self.properties.read(identifier, table=table)
        exists = known is not None or bool(properties)
        recorded = known.spec.key_columns if known is not None else recorded_key(properties)
        if exists and recorded is not None and key_tokens(recorded) != key_tokens(spec.key_columns):
            if not replacing_rows:  # the pipeline copies such a table first (pgcdc.pipeline.copy_reasons)
                raise IdentityChangedError(
                    f"{spec.source}: its mirror {identifier} is keyed on {describe_key(recorded)}, but the "
                    f"table's replica identity now identifies rows by {describe_key(spec.key_columns)}; applying "
                    "its changes by the old key would leave wrong rows in the mirror. Copy that table again with "
                    "the new key: DROP TABLE it in Spark and run pgcdc, which copies it while the others stream")
            self._drop_for_copy(identifier, spec, f"was keyed on {describe_key(recorded)}; making it again keyed "
                                                  f"on {describe_key(spec.key_columns)}")
            known, exists = None, False
        from pgcdc.spark.iceberg_java import spark_schema_of

        if not exists:
            current = None
        elif known is not None:
            current = known.schema
        else:
            current = spark_schema_of(table)
        if current is not None and replacing_rows and cannot_widen(current, spec.spark_schema):
            self._drop_for_copy(identifier, spec, f"holds {', '.join(cannot_widen(current, spec.spark_schema))} of "
                                                  "types Iceberg cannot change in place to the source's new ones")
            known, current = None, None
        if current is None:
            table = self._create(identifier, spec)
            mirror = self._table(spec, spark_schema_of(table))
            mirror.shape = spec.shape
            mirror.iceberg_table = table  # for its copy and its first batch, as an opened mirror keeps its own
        else:
            mirror = self._table(spec, self._evolve(identifier, spec, current))
            self._open(mirror, known, properties, replacing_rows=replacing_rows, table=table)
            if known is None and table is not None:
                self._tell_other_partitioning(spec, table)
        self._tables[key] = mirror
        return mirror

    def _table(self, spec: TableSpec, schema: StructType) -> MirrorTable:
        return MirrorTable(self.identifier_for(spec.source_schema, spec.source_table),
                           self.changelog_identifier_for(spec.source_schema, spec.source_table), spec, schema,
                           rejects_identifier=self.rejects_identifier_for(spec.source_schema, spec.source_table))

    def _open(self, mirror: MirrorTable, known: MirrorTable | None, properties: Mapping[str, str], *,
              replacing_rows: bool, table: Any = None) -> None:
        """An existing mirror's state: as this catalog knew it, else read from its metadata (once per mirror:
        ``table``, loaded by the caller, is kept for the writer); its slot and source shape recorded when they
        changed."""
        if known is not None:
            mirror.position, mirror.changelog_position = known.position, known.changelog_position
            mirror.rejects_position, mirror.shape = known.rejects_position, known.shape
        else:
            mirror.position = self.positions.read(mirror.identifier, table=table)
            mirror.iceberg_table = table
            no_changelog, no_rejects = self._missing_beside.pop(mirror.identifier, (False, False))
            mirror.changelog_position = None if no_changelog else \
                self.positions.read_if_exists(mirror.changelog_identifier)
            mirror.rejects_position = None if no_rejects else self.positions.read_rejects(mirror.rejects_identifier)
            pending = properties.get(FILL_PROPERTY)
            mirror.pending_fill = json.loads(pending) if pending else {}
            mirror.shape = SourceShape.decode(properties.get(SHAPE_PROPERTY))
        updates = {}
        if known is None and self.slot is not None and properties.get(SLOT_PROPERTY) != self.slot:
            updates[SLOT_PROPERTY] = self.slot
        shape = mirror.spec.shape.following(mirror.shape) if mirror.spec.shape is not None else None
        # rows about to be replaced keep their shape until the copy replacing them commits (record_shape)
        if shape is not None and shape != mirror.shape and not replacing_rows:
            updates[SHAPE_PROPERTY] = shape.encode()
            mirror.shape = shape
        self.properties.set(mirror.identifier, updates)

    def record_shape(self, source_schema: str, source_table: str, shape: SourceShape) -> None:
        """Record ``shape`` as the source shape the rows of the mirror (which exists) hold: after a copy replaced
        them, or when the catalog told more of it."""
        identifier = self.identifier_for(source_schema, source_table)
        self.properties.set(identifier, {SHAPE_PROPERTY: shape.encode()})
        self._looks.pop(identifier, None)  # its look holds the shape before
        known = self._tables.get((source_schema, source_table))
        if known is not None:
            known.shape = shape

    def cannot_take(self, source_schema: str, source_table: str, spark_schema: StructType) -> bool:
        """Whether the mirror has a column whose type Iceberg cannot change in place to ``spark_schema``'s."""
        known = self._tables.get((source_schema, source_table))
        identifier = self.identifier_for(source_schema, source_table)
        current = known.schema if known is not None else self.spark.table(identifier).schema
        return bool(cannot_widen(current, spark_schema))

    def _drop_for_copy(self, identifier: str, spec: TableSpec, why: str) -> None:
        log.warning("%s: mirror %s %s, for a new copy", spec.source, identifier, why)
        self._drop(identifier)
        self._tables.pop((spec.source_schema, spec.source_table), None)

    def columns_of(self, source_schema: str, source_table: str) -> set[str] | None:
        """The columns the mirror of a source table has now (before :meth:`ensure` evolves it); None when there
        is no mirror yet."""
        known = self._tables.get((source_schema, source_table))
        if known is not None:
            return set(known.schema.names)
        from pgcdc.spark.iceberg_java import spark_schema_of

        table = self.look(self.identifier_for(source_schema, source_table))
        return None if table is None else set(spark_schema_of(table).names)

    def _tell_other_partitioning(self, spec: TableSpec, table: Any) -> None:
        """A mirror made before, whose partition spec is not the one --partition-by gives it now: said once (a spec
        is given at creation; pgcdc writes whatever spec the mirror has, evolved by its users or not)."""
        wanted = self.partition_by.get((spec.source_schema, spec.source_table))
        if wanted is None:
            return
        from pgcdc.iceberg.partition_specs import spec_fields
        from pgcdc.spark.iceberg_java import partition_spec_json, schema_json

        has = [f.as_given() for f in spec_fields(partition_spec_json(table.spec()), schema_json(table))]
        if has != list(wanted):
            log.warning("%s: its mirror is partitioned by [%s], not by the [%s] --partition-by gives: a partition "
                        "spec is given when a mirror is made. To change it, evolve the mirror's spec (ALTER TABLE "
                        "... ADD/DROP PARTITION FIELD; pgcdc writes the new spec from its next batch), or copy the "
                        "table again", spec.source, ", ".join(str(t) for t in has) or "nothing",
                        ", ".join(str(t) for t in wanted))

    def _create(self, identifier: str, spec: TableSpec) -> Any:
        """The mirror of ``spec`` made, with its key's columns required and declared Iceberg's identifier fields,
        and the partition spec --partition-by gives it; returns its Iceberg ``Table``."""
        self._unlook(identifier)
        missing = [k for k in spec.key_columns if k not in spec.spark_schema.names]
        if missing:
            raise ConfigError(f"{spec.source}: key columns {missing} are not among its columns")
        partitioning = self.partition_by.get((spec.source_schema, spec.source_table), ())
        unknown = [str(t) for t in partitioning if t.column not in spec.spark_schema.names]
        if unknown:
            raise ConfigError(f"--partition-by {spec.source}: {', '.join(unknown)} names no column of the table "
                              f"(its columns: {', '.join(spec.spark_schema.names)})")
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
        self.ensure_namespace(spec.source_schema)
        refused = [k for k in spec.key_columns if not _can_identify(spec.spark_schema[k].dataType)]
        from py4j.protocol import Py4JJavaError

        from pgcdc.spark.iceberg_java import create_table

        try:
            table = create_table(
                self.spark, self.catalog, [self.namespace, encode_name(spec.source_schema)],
                encode_name(spec.source_table), _declared(spec.spark_schema, spec.key_columns),
                [] if refused else list(spec.key_columns),
                [(t.transform, t.column, t.width) for t in partitioning], properties)
        except Py4JJavaError as exc:
            if not partitioning or "ValidationException" not in str(exc.java_exception.getClass().getName()):
                raise
            # a transform of a type it does not take: hours of a date, say
            raise ConfigError(f"--partition-by {spec.source}={', '.join(str(t) for t in partitioning)}: "
                              f"Iceberg refuses it: {str(exc.java_exception.getMessage()).strip()[:300]}") from None
        if refused:  # the key stays pgcdc's (pgcdc.key); Iceberg's identifier fields are only a declaration
            log.info("%s: no Iceberg identifier fields for %s: its key holds %s, which Iceberg does not take as "
                     "identifier fields (floating-point or nested types)", identifier, spec.source, ", ".join(refused))
        log.info("created mirror %s for %s (key: %s%s)", identifier, spec.source, ", ".join(spec.key_columns) or "none",
                 f"; partitioned by {', '.join(str(t) for t in partitioning)}" if partitioning else "")
        self._readable.add(identifier)
        self.positions.seen(identifier)
        return table

    def ensure_namespace(self, source_schema: str) -> None:
        """The namespace of ``source_schema``'s mirrors, made if missing: once per process and schema. Called
        before mirrors are created side by side (the initial copy), since two ``CREATE NAMESPACE IF NOT EXISTS`` of
        one namespace at once may both find it missing, and the second fail."""
        if source_schema not in self._namespaces:
            self.spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {self.namespace_for(source_schema)}")
            self._namespaces.add(source_schema)

    def _evolve(self, identifier: str, spec: TableSpec, current: StructType) -> StructType:
        wanted = {f.name: f for f in spec.spark_schema.fields}
        existing = {f.name: f for f in current.fields}
        for name in cannot_widen(current, spec.spark_schema)[:1]:
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

    def all_tables(self) -> list[tuple[str, bool]]:
        """(identifier, is a __rejects table) of every table in the namespace: mirrors, change logs, rejects."""
        found = []
        for source_schema, source_table, identifier in self.source_tables():
            found.append((identifier, False))
            for other, rejects in ((self.changelog_identifier_for(source_schema, source_table), False),
                                   (self.rejects_identifier_for(source_schema, source_table), True)):
                if self._exists(other):
                    found.append((other, rejects))
        return found

    def forget(self, source_schema: str, source_table: str) -> None:
        """Open the mirror of this source table afresh the next time (its metadata changed behind this catalog)."""
        self._unlook(self.identifier_for(source_schema, source_table))
        self._tables.pop((source_schema, source_table), None)

    def known(self) -> list[MirrorTable]:
        """The mirrors this catalog has opened (or created) so far, in the order it did."""
        return list(self._tables.values())

    def source_tables(self) -> list[tuple[str, str, str]]:
        """(source schema, source table, identifier) of every mirror in the namespace, from the catalog's
        own listing (exact names, no parsing of SQL output)."""
        catalog, gateway, classes = self._java_catalog()
        root = gateway.new_array(classes.String, 1)
        root[0] = self.namespace
        if not catalog.namespaceExists(root):
            return []
        found = []
        for namespace in catalog.listNamespaces(root):
            parts = list(namespace)
            source_schema = decode_name(parts[-1])
            for identifier in catalog.listTables(namespace):
                source_table = self.mirrored(identifier.name())
                if source_table is not None:
                    found.append((source_schema, source_table, self.identifier_for(source_schema, source_table)))
        return sorted(found)


def decode_name(name: str) -> str:
    """A source schema's or table's name from its Iceberg name (:func:`encode_name`)."""
    for raw, encoded in _PATH_UNSAFE.items():
        if raw != "%":
            name = name.replace(encoded, raw)
    return name.replace("%25", "%")


def _declared(schema: StructType, key_columns: tuple[str, ...]) -> StructType:
    """A mirror's columns as its table declares them: every column and nested field nullable, but the key's
    columns (Iceberg's identifier fields must be required)."""
    from pyspark.sql.types import StructField, StructType

    return StructType([StructField(f.name, _nullable_inside(f.dataType), f.name not in key_columns)
                       for f in schema.fields])


def _nullable_inside(data_type: DataType) -> DataType:
    from pyspark.sql.types import ArrayType, MapType, StructField, StructType

    if isinstance(data_type, StructType):
        return StructType([StructField(f.name, _nullable_inside(f.dataType), True) for f in data_type.fields])
    if isinstance(data_type, ArrayType):
        return ArrayType(_nullable_inside(data_type.elementType), True)
    if isinstance(data_type, MapType):
        return MapType(_nullable_inside(data_type.keyType), _nullable_inside(data_type.valueType), True)
    return data_type


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
