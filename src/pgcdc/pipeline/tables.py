"""The source tables a pipeline mirrors: per table, its converter, its key and its mirror.

A table's schema version is a Relation message (or its catalog twin for the snapshot). Each distinct
version gets one converter; its key is what the server sends as the row's identity
(:func:`pgcdc.replication.published.identity_key`), so a new replica identity is a new version, and its
mirror is refused when it was keyed otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import psycopg
import pyarrow as pa

from pgcdc.errors import IdentityChangedError
from pgcdc.faults import injection_point
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import REPLICA_IDENTITY_FULL, REPLICA_IDENTITY_NOTHING, Relation, TupleData, Type
from pgcdc.pipeline.config import PipelineConfig
from pgcdc.pipeline.copy_reasons import (
    CopyReason,
    MirrorFacts,
    SourceFacts,
    Why,
    copy_reason,
    new_filled_partitions,
    refreshed_shape,
)
from pgcdc.pipeline.workers import DaemonThreads
from pgcdc.replication import KeptConnection, source_connection
from pgcdc.replication.published import (
    AddedColumn,
    TableStorage,
    added_columns,
    holds_rows_from_before_it_joined,
    identity_key,
    primary_key,
    published_tables,
    table_storage,
)
from pgcdc.types import ConversionOptions, TableConverter, TypeRegistry

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.mirrors.catalog import MirrorCatalog, MirrorTable, TableSpec
    from pgcdc.mirrors.metadata import MirrorMetadata
    from pgcdc.mirrors.status import MirrorReads

log = logging.getLogger("pgcdc.pipeline")

T = TypeVar("T")


def schema_signature(relation: Relation) -> tuple:
    """What makes two Relation messages the same schema version (key flags included, the xid that Relation
    messages inside a stream carry left out)."""
    return (relation.relation_id, relation.namespace, relation.name, relation.replica_identity, relation.columns)


class SourceTables:
    """Converters, keys and mirrors of the published tables, each made once and reused."""

    def __init__(self, config: PipelineConfig, spark: Callable[[], SparkSession], *,
                 session_ready: Callable[[], bool] | None = None) -> None:
        """``spark``: the session, started when called. ``session_ready``: whether it is up; until it is, the start's
        reads of the namespace's mirrors (:meth:`read_mirrors`) come from their metadata without a JVM (None: always
        through Spark)."""
        self.config = config
        self.registry = TypeRegistry()
        self._spark = spark
        self._session_ready = session_ready
        self._converters: dict[tuple, TableConverter] = {}
        self._keys: dict[tuple, tuple[str, ...]] = {}
        self._mirrors: MirrorCatalog | None = None
        self._metadata: MirrorMetadata | None = None
        self._positioned: set[tuple[str, str]] = set()
        self._append_only_told: set[int] = set()  # tables whose append-only mirror was warned about
        self._catalog = KeptConnection(config.dsn)  # the catalog read before every batch (storage_of)
        self._look_workers: DaemonThreads | None = None  # the threads mirrors are looked at on (look_ahead)

    @property
    def mirrors(self) -> MirrorCatalog:
        if self._mirrors is None:
            from pgcdc.mirrors.catalog import MirrorCatalog

            self._mirrors = MirrorCatalog(self._spark(), self.config.destination, slot=self.config.slot,
                                          partition_by=self.config.partition_specs)
        return self._mirrors

    def opened_mirrors(self) -> list[MirrorTable]:
        """The mirrors opened (or created) so far, without starting Spark when none was."""
        return [] if self._mirrors is None else self._mirrors.known()

    def read_mirrors(self, reading: Callable[[MirrorReads], T]) -> T:
        """``reading`` of the namespace's mirrors (:func:`pgcdc.mirrors.status.namespace_positions`, ...): from
        their metadata, read by this process, while Spark's session is not up and the catalog allows it
        (:mod:`pgcdc.mirrors.metadata`); else, or when that meets anything it does not read by itself,
        through Spark. The metadata is read once per start (:meth:`read_afresh`)."""
        from pgcdc.errors import MetadataUnreadable

        metadata = self._start_metadata()
        if metadata is not None:
            try:
                return reading(metadata)
            except MetadataUnreadable as exc:
                log.info("reading the mirrors through Spark: %s", exc)
                self._session_ready = None
                self._metadata = None
        return reading(self.mirrors)

    def read_afresh(self) -> None:
        """The next :meth:`read_mirrors` reads the mirrors' metadata again (a new start: the stream reconnects), and
        the mirrors not opened yet are looked at again."""
        self._metadata = None
        if self._mirrors is not None:
            self._mirrors.look_afresh()

    def look_ahead(self, relations: list[Relation]) -> None:
        """Load the mirrors of ``relations`` not opened yet, side by side (as many at once as a batch applies), for
        what the hand-off of a batch and its apply ask of them."""
        mirrors = self.mirrors
        if self._look_workers is None and self.config.mirror_workers > 1:
            self._look_workers = DaemonThreads("pgcdc-look", self.config.mirror_workers)
        mirrors.look_at([(r.namespace, r.name) for r in relations if mirrors.known_table(r.namespace, r.name) is None],
                        None if self._look_workers is None else self._look_workers.run_all)

    def _start_metadata(self) -> MirrorMetadata | None:
        if self._session_ready is None or self._mirrors is not None or self._session_ready():
            return None
        if self._metadata is None:
            from pgcdc.errors import MetadataUnreadable
            from pgcdc.mirrors.metadata import MirrorMetadata

            try:
                self._metadata = MirrorMetadata.of(self.config.destination)
            except MetadataUnreadable as exc:
                log.info("reading the mirrors through Spark: %s", exc)
                self._session_ready = None
        return self._metadata

    def observe_type(self, message: Type) -> None:
        """A Type message of the stream: a type the registry does not know as named (created or renamed since
        the catalog was read) is read from the catalog again, which tells what the message does not (an
        array's element type, an enum, a domain's base type)."""
        if self.registry.knows(message):
            return
        with source_connection(self.config.dsn, 120.0) as conn:
            self.registry.load_from_server(conn)
        self.registry.observe(message)  # a type dropped since: only the message's word on it

    def converter_for(self, relation: Relation) -> TableConverter:
        """The converter of a relation version (one per distinct schema, reused)."""
        signature = schema_signature(relation)
        converter = self._converters.get(signature)
        if converter is None:
            converter = TableConverter(relation, self.registry, ConversionOptions(numeric=self.config.numeric))
            self._converters[signature] = converter
        return converter

    def binary_possible(self, conn: psycopg.Connection, publication: str, *, wanted: bool) -> bool:
        """Whether the stream carries binary values: when ``wanted`` and every published table's types have a
        binary decoder (else the whole stream is text, with a warning naming the tables that need it)."""
        text_only = [t.relation.qualified_name for t in published_tables(conn, publication)
                     if self.converter_for(t.relation).requires_text_mode]
        if wanted and text_only:
            log.warning("binary values requested, but %s have types without a binary decoder: streaming text",
                        ", ".join(text_only))
        return wanted and not text_only

    def key_for(self, relation: Relation) -> tuple[str, ...]:
        """The mirror's key for a relation version; only REPLICA IDENTITY FULL asks the catalog (for the
        primary key, which the Relation message does not tell apart from the other columns)."""
        signature = schema_signature(relation)
        key = self._keys.get(signature)
        if key is None:
            primary: tuple[str, ...] = ()
            if relation.replica_identity == REPLICA_IDENTITY_FULL:
                with source_connection(self.config.dsn, 120.0) as conn:
                    primary = primary_key(conn, relation.relation_id)
            key = self._keys[signature] = identity_key(relation, primary)
        return key

    def spec_for(self, relation: Relation, storage: TableStorage | None = None) -> TableSpec:
        """What the mirror of a relation version must look like (with ``storage``: the source shape a copy of the
        table records)."""
        from pgcdc.mirrors.catalog import TableSpec
        from pgcdc.mirrors.properties import SourceShape
        from pgcdc.spark.schema import spark_schema

        return TableSpec(source_schema=relation.namespace, source_table=relation.name,
                         spark_schema=spark_schema(self.converter_for(relation).arrow_schema),
                         key_columns=self.key_for(relation), replica_identity=relation.replica_identity,
                         shape=SourceShape(
                             relation.relation_id, tuple((c.name, c.type_oid, c.type_modifier) for c in relation.columns),
                             storage.filenodes if storage is not None else None,
                             storage.attnums if storage is not None else None,
                             storage.definition if storage is not None else None,
                             storage.printed_types if storage is not None else None,
                             tuple(leaf for leaf, _ in storage.partitions) if storage is not None else None))

    def mirror_for(self, relation: Relation, *, replacing_rows: bool = False,
                   storage: TableStorage | None = None) -> MirrorTable:
        """The mirror of a relation version, created or evolved to it. A mirror keyed otherwise, or with a column
        of a type it cannot take in place, is refused (the way out is a new copy), or, with ``replacing_rows``
        (a copy is about to replace its rows with the table's, whose ``storage`` it records), made again."""
        from pgcdc.mirrors.column_fills import expect_fill, fill, forget_fill

        spec = self.spec_for(relation, storage)
        if spec.append_only and relation.relation_id not in self._append_only_told:
            self._append_only_told.add(relation.relation_id)
            log.warning("%s has no replica identity (%s): its mirror is append-only, as PostgreSQL refuses UPDATE "
                        "and DELETE on it; if that is not meant, ALTER TABLE %s ADD PRIMARY KEY (...) or REPLICA "
                        "IDENTITY FULL, and pgcdc keys its mirror again", relation.qualified_name,
                        "NOTHING" if relation.replica_identity == REPLICA_IDENTITY_NOTHING
                        else "DEFAULT without a primary key", relation.qualified_name)
        if replacing_rows:  # a copy is about to replace every row: nothing of the old ones to fill
            mirror = self.mirrors.ensure(spec, replacing_rows=True)
            if mirror.pending_fill:
                forget_fill(self.mirrors, mirror)
            return mirror
        added = self._added_columns(relation)
        values = {a.name: a.missing_text for a in added if a.missing_text is not None}
        if values:  # promised before the columns exist, kept until their existing rows hold the values
            expect_fill(self.mirrors, spec, values)
        mirror = self.mirrors.ensure(spec)
        if mirror.pending_fill:
            injection_point("apply.fill")
            fill(self.mirrors, mirror, self._values_table(relation, mirror.pending_fill))
        return mirror

    def storage_of(self, relations: list[Relation]) -> dict[int, TableStorage]:
        """The catalog's word on the storage of these relations' tables (those that still exist). Read before
        every batch, on a connection kept for it (:meth:`close` ends it): bounded as the stream's silence is, so a
        silent partition is noticed here as soon."""
        relation_ids = sorted({r.relation_id for r in relations})
        return self._catalog.run(lambda conn: table_storage(conn, relation_ids, self.config.publication),
                                 self.config.receive_timeout_seconds)

    def close(self) -> None:
        """End the connection kept for the catalog reads and the threads mirrors are looked at on (a later read
        or look starts them again)."""
        self._catalog.close()
        if self._look_workers is not None:
            self._look_workers.shutdown()
            self._look_workers = None

    def copy_reason(self, relation: Relation, storage: TableStorage | None, *,
                    facts: MirrorFacts | None = None) -> CopyReason | None:
        """Why this relation version's mirror must be copied again before its changes reach it (None: it need
        not; see :func:`.copy_reasons.copy_reason`), from facts read now: ``storage`` is the table's now, ``facts``
        the mirror's (read here when not given). A changed replica identity under ``--on-identity-change stop``
        raises :class:`IdentityChangedError` instead."""
        mirror = facts if facts is not None else self.mirror_facts(relation)
        shape = mirror.shape if mirror is not None else None
        attached: frozenset[int] = frozenset()
        filled = new_filled_partitions(shape, storage)
        if filled:
            with source_connection(self.config.dsn, 600.0) as conn:
                attached = frozenset(oid for oid in filled if holds_rows_from_before_it_joined(conn, oid))
        added = self._added_columns(relation, mirror.columns) if mirror is not None else []
        source = SourceFacts(self.key_for(relation), storage,
                             rewritten_defaults=any(a.missing_text is None and a.has_default for a in added),
                             attached_with_rows=attached)
        reason = copy_reason(relation, source, mirror)
        if reason is not None and reason.why is Why.IDENTITY and self.config.on_identity_change == "stop":
            raise IdentityChangedError(
                f"{reason.text.split(': the mirror is made again')[0]}; applying its changes by the old key would "
                "leave wrong rows in the mirror, and --on-identity-change stop stops here. Run with "
                "--on-identity-change copy (the default) to copy that table again keyed on its new identity while "
                "the others stream, or restore its replica identity")
        return reason

    def record_refreshed_shape(self, relation: Relation, storage: TableStorage | None, *,
                               facts: MirrorFacts | None = None) -> None:
        """What the catalog added since the mirror's last copy (columns, enum values, empty partitions), recorded
        in its source shape: a later change is then judged against it. ``facts``: the mirror's, when read
        already."""
        facts = facts if facts is not None else self.mirror_facts(relation)
        refreshed = refreshed_shape(facts.shape if facts is not None else None, storage)
        if refreshed is not None:
            self.mirrors.record_shape(relation.namespace, relation.name, refreshed)

    def mirror_facts(self, relation: Relation) -> MirrorFacts | None:
        """What the relation's mirror holds now, read without evolving it (None: it has no mirror)."""
        from pgcdc.mirrors.catalog import cannot_widen
        from pgcdc.mirrors.properties import SHAPE_PROPERTY, SourceShape, recorded_key
        from pgcdc.spark.schema import spark_schema

        mirrors = self.mirrors
        known = mirrors.known_table(relation.namespace, relation.name)
        if known is not None:
            key: tuple[str, ...] | None = known.spec.key_columns
            shape, schema = known.shape, known.schema
        else:
            table = mirrors.look(mirrors.identifier_for(relation.namespace, relation.name))
            if table is None:
                return None
            from pgcdc.spark.iceberg_java import spark_schema_of

            identifier = mirrors.identifier_for(relation.namespace, relation.name)
            properties = mirrors.properties.read(identifier, table=table)
            key, shape = recorded_key(properties), SourceShape.decode(properties.get(SHAPE_PROPERTY))
            schema = spark_schema_of(table)
        wanted = spark_schema(self.converter_for(relation).arrow_schema)
        return MirrorFacts(key, shape, frozenset(schema.names), narrowed=bool(cannot_widen(schema, wanted)))

    def _added_columns(self, relation: Relation, existing: frozenset[str] | set[str] | None = None
                       ) -> list[AddedColumn]:
        """The relation's columns its mirror does not have yet (``existing``: the mirror's columns, when known),
        with what the catalog says of each."""
        if existing is None:
            existing = self.mirrors.columns_of(relation.namespace, relation.name)
        new = [c.name for c in relation.columns if existing is not None and c.name not in existing]
        if not new:
            return []
        with source_connection(self.config.dsn, 120.0) as conn:
            return list(added_columns(conn, relation.relation_id, new).values())

    def _values_table(self, relation: Relation, texts: dict[str, str | None]) -> pa.Table:
        """One row of the given columns' values, converted from the source's text as the stream's are."""
        names = [c.name for c in relation.columns]
        kinds = "".join("t" if name in texts and texts[name] is not None else "n" for name in names)
        values = tuple(texts[name].encode() if kind == "t" else None  # type: ignore[union-attr]
                       for name, kind in zip(names, kinds, strict=True))
        batch = self.converter_for(relation).convert([TupleData(kinds, values)]).batch
        wanted = [name for name in texts if name in names]
        return pa.Table.from_arrays([batch.column(batch.schema.get_field_index(n)) for n in wanted], names=wanted)

    def has_position(self, relation: Relation) -> bool:
        """Whether the relation's mirror holds a position (was copied or applied to); asked without evolving
        the mirror to this version, which may be older than the mirror's."""
        name = (relation.namespace, relation.name)
        if name not in self._positioned:
            if self.held_position(relation.namespace, relation.name, changelog=False) is None:
                return False
            self._positioned.add(name)
        return True

    def held_position(self, source_schema: str, source_table: str, *, changelog: bool) -> Lsn | None:
        """The position below which the mirror (and its change log, when kept) holds every transaction, read
        without evolving the mirror; None when it holds none."""
        mirrors = self.mirrors
        known = mirrors.known_table(source_schema, source_table)
        if known is not None:
            positions = [known.position, known.changelog_position if changelog else known.position]
        else:
            identifier = mirrors.identifier_for(source_schema, source_table)
            table = mirrors.look(identifier)
            if table is None:
                return None
            position = mirrors.positions.read(identifier, table=table)
            changelog_identifier = mirrors.changelog_identifier_for(source_schema, source_table)
            positions = [position, mirrors.positions.read_if_exists(changelog_identifier) if changelog else position]
        return None if None in positions else min(p for p in positions if p is not None)
