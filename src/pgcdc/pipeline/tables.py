"""The source tables a pipeline mirrors: per table, its converter, its key and its mirror.

A table's schema version is a Relation message (or its catalog twin for the snapshot). Each distinct
version gets one converter; its key is what the server sends as the row's identity
(:func:`pgcdc.replication.published.identity_key`), so a new replica identity is a new version, and its
mirror is refused when it was keyed otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import psycopg
import pyarrow as pa

from pgcdc.errors import IdentityChangedError
from pgcdc.faults import injection_point
from pgcdc.pgoutput.messages import REPLICA_IDENTITY_FULL, REPLICA_IDENTITY_NOTHING, Relation, TupleData, Type
from pgcdc.pipeline.config import PipelineConfig
from pgcdc.replication import source_connection
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

    from pgcdc.spark.mirror import MirrorCatalog, MirrorTable

log = logging.getLogger("pgcdc.pipeline")


def schema_signature(relation: Relation) -> tuple:
    """What makes two Relation messages the same schema version (key flags included, the xid that Relation
    messages inside a stream carry left out)."""
    return (relation.relation_id, relation.namespace, relation.name, relation.replica_identity, relation.columns)


class SourceTables:
    """Converters, keys and mirrors of the published tables, each made once and reused."""

    def __init__(self, config: PipelineConfig, spark: Callable[[], SparkSession]) -> None:
        self.config = config
        self.registry = TypeRegistry()
        self._spark = spark
        self._converters: dict[tuple, TableConverter] = {}
        self._keys: dict[tuple, tuple[str, ...]] = {}
        self._mirrors: MirrorCatalog | None = None
        self._positioned: set[tuple[str, str]] = set()
        self._append_only_told: set[int] = set()  # tables whose append-only mirror was warned about

    @property
    def mirrors(self) -> MirrorCatalog:
        if self._mirrors is None:
            from pgcdc.spark.mirror import MirrorCatalog

            self._mirrors = MirrorCatalog(self._spark(), catalog=self.config.catalog,
                                          namespace=self.config.namespace, slot=self.config.slot)
        return self._mirrors

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

    def mirror_for(self, relation: Relation, *, replacing_rows: bool = False,
                   storage: TableStorage | None = None) -> MirrorTable:
        """The mirror of a relation version, created or evolved to it. A mirror keyed otherwise, or with a column
        of a type it cannot take in place, is refused (the way out is a new copy), or, with ``replacing_rows``
        (a copy is about to replace its rows with the table's, whose ``storage`` it records), made again."""
        from pgcdc.spark.mirror import SourceShape, TableSpec
        from pgcdc.spark.schema import spark_schema

        spec = TableSpec(source_schema=relation.namespace, source_table=relation.name,
                         spark_schema=spark_schema(self.converter_for(relation).arrow_schema),
                         key_columns=self.key_for(relation), replica_identity=relation.replica_identity,
                         shape=SourceShape(
                             relation.relation_id, tuple((c.name, c.type_oid, c.type_modifier) for c in relation.columns),
                             storage.filenodes if storage is not None else None,
                             storage.attnums if storage is not None else None,
                             storage.definition if storage is not None else None,
                             storage.printed_types if storage is not None else None,
                             tuple(leaf for leaf, _ in storage.partitions) if storage is not None else None))
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
                self.mirrors.forget_fill(mirror)
            return mirror
        added = self._added_columns(relation)
        values = {a.name: a.missing_text for a in added if a.missing_text is not None}
        if values:  # promised before the columns exist, kept until their existing rows hold the values
            self.mirrors.expect_fill(spec, values)
        mirror = self.mirrors.ensure(spec)
        if mirror.pending_fill:
            injection_point("apply.fill")
            self.mirrors.fill(mirror, self._values_table(relation, mirror.pending_fill))
        return mirror

    def storage_of(self, relations: list[Relation]) -> dict[int, TableStorage]:
        """The catalog's word on the storage of these relations' tables (those that still exist). Read before
        every batch: bounded as the stream's silence is, so a silent partition is noticed here as soon."""
        with source_connection(self.config.dsn, self.config.receive_timeout_seconds) as conn:
            return table_storage(conn, sorted({r.relation_id for r in relations}), self.config.publication)

    def needs_copy(self, relation: Relation, storage: TableStorage | None) -> str | None:
        """Why this relation version's rows hold, in the mirror, values that logical decoding never sent, or are
        keyed otherwise, so that the mirror must be copied again (None when they do not); ``storage`` is the
        table's now:

        - its replica identity identifies rows by other columns than the mirror's key (under
          ``--on-identity-change stop``: :class:`pgcdc.errors.IdentityChangedError` instead);
        - it is another table than the mirror's source (dropped and created again under its name);
        - a column's type changed and the table was rewritten since the mirror's last copy (``ALTER COLUMN ...
          TYPE`` rewrites every row through the cast or its ``USING`` expression; a change PostgreSQL makes
          without a rewrite keeps every value), or, for a mirror that does not know, the change is not one
          that keeps every value (:func:`pgcdc.types.kinds.type_change_keeps_values`);
        - a column was dropped and added again under its name (it has a new column number);
        - an enum or composite its values print through changed that text (``ALTER TYPE ... RENAME VALUE``,
          ``ADD ATTRIBUTE``; ``ADD VALUE`` changes no existing value);
        - a partition was detached or dropped, or one holding rows written before it joined was attached (a
          new partition, and the rows written into it since, change nothing);
        - the publication's column list or row filter for the table changed (the mirror lacks the rows or
          values the old one left out, or holds rows the new one leaves out), or the table was taken out of
          the publication and put back (its changes in between were never sent);
        - its new columns were filled by rewriting the table (a volatile default), or added to a table rewritten
          since;
        - it both lacks columns of the mirror and brings new ones, which is what a RENAME COLUMN looks like (the
          Relation message carries names only).

        The catalog may be ahead of the stream: then the copy comes early, which is as right (rule 2 skips what
        it holds). A plain ADD COLUMN (NULL) or a non-volatile default (the catalog's missing value, filled by
        :meth:`mirror_for`) needs no copy."""
        from pgcdc.spark.mirror import describe_key
        from pgcdc.spark.schema import spark_schema
        from pgcdc.types.kinds import type_change_keeps_values

        keyed_on = self.mirrors.keyed_otherwise(relation.namespace, relation.name, self.key_for(relation))
        if keyed_on is not None:
            change = (f"{relation.qualified_name}: its replica identity now identifies rows by "
                      f"{describe_key(self.key_for(relation))}, but its mirror is keyed on {describe_key(keyed_on)}")
            if self.config.on_identity_change == "stop":
                raise IdentityChangedError(
                    f"{change}; applying its changes by the old key would leave wrong rows in the mirror, and "
                    "--on-identity-change stop stops here. Run with --on-identity-change copy (the default) to copy "
                    "that table again keyed on its new identity while the others stream, or restore its replica "
                    "identity")
            return "its replica identity changed: the mirror is made again, keyed on the new one"
        shape = self.mirrors.source_shape(relation.namespace, relation.name)
        if shape is not None:
            if shape.relation_id != relation.relation_id:
                return "the table was dropped and created again under its name"
            held = {name: (type_oid, typmod) for name, type_oid, typmod in shape.columns}
            changed = [c.name for c in relation.columns
                       if c.name in held and held[c.name] != (c.type_oid, c.type_modifier)]
            if changed and (shape.filenodes is not None and storage is not None
                            and storage.filenodes != shape.filenodes):
                return f"the type of {', '.join(changed)} changed and the table was rewritten, which may have " \
                       "changed their values"
            if changed and shape.filenodes is None and not all(
                    type_change_keeps_values(held[c.name], (c.type_oid, c.type_modifier))
                    for c in relation.columns if c.name in changed):
                return f"the type of {', '.join(changed)} changed, which may have changed their values"
            if storage is not None and shape.definition is not None and storage.definition is not None \
                    and storage.definition != shape.definition:
                return "the publication's column list or row filter for it changed, or it was taken out of the " \
                       "publication and put back: the mirror lacks rows or values the stream never sent"
            if shape.attnums is not None and storage is not None:
                before = dict(shape.attnums)
                renumbered = [name for name, number in storage.attnums if before.get(name, number) != number]
                if renumbered:
                    return f"{', '.join(renumbered)} were dropped and added again: their values are the new " \
                           "columns'"
            if storage is not None and shape.printed_types is not None:
                reprinted = _reprinted_types(shape.printed_types, storage.printed_types)
                if reprinted:
                    return f"{reprinted} changed how its values print (an enum value renamed, a composite's " \
                           "attributes changed): the mirror holds the old text"
            if storage is not None and shape.partitions is not None:
                leaves = dict(storage.partitions)
                if set(shape.partitions) - set(leaves):
                    return "partitions were detached or dropped: their rows left the table with no change decoded"
                filled = [leaf for leaf in set(leaves) - set(shape.partitions) if leaves[leaf]]
                if filled and self._attached_with_rows(filled):
                    return "a partition holding rows was attached: its rows joined the table with no change decoded"
            # columns, enum values, types or (empty) partitions added since, or what a mirror made before pgcdc
            # recorded it did not know: from now on
            partitions = tuple(leaf for leaf, _ in storage.partitions) if storage is not None else None
            if storage is not None and (shape.attnums is None or set(storage.attnums) - set(shape.attnums)
                                        or (shape.definition is None and storage.definition is not None)
                                        or shape.printed_types != storage.printed_types
                                        or shape.partitions != partitions):
                self.mirrors.record_shape(relation.namespace, relation.name, replace(
                    shape, attnums=storage.attnums, printed_types=storage.printed_types, partitions=partitions,
                    definition=shape.definition if shape.definition is not None else storage.definition))
        existing = self.mirrors.columns_of(relation.namespace, relation.name)
        names = {c.name for c in relation.columns}
        if existing is not None and names - existing and existing - names:
            return "columns were renamed: their values are the old columns', under new names"
        if any(a.missing_text is None and a.has_default for a in self._added_columns(relation)):
            return "new columns hold values PostgreSQL wrote by rewriting the table, which logical decoding does " \
                   "not send"
        if existing is not None and self.mirrors.cannot_take(
                relation.namespace, relation.name, spark_schema(self.converter_for(relation).arrow_schema)):
            return "a column's type changed to one its mirror cannot change to in place"
        return None

    def _attached_with_rows(self, partition_ids: list[int]) -> bool:
        with source_connection(self.config.dsn, 600.0) as conn:
            return any(holds_rows_from_before_it_joined(conn, oid) for oid in sorted(partition_ids))

    def _added_columns(self, relation: Relation) -> list[AddedColumn]:
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
            if self.mirrors.held_position(relation.namespace, relation.name, changelog=False) is None:
                return False
            self._positioned.add(name)
        return True


def _reprinted_types(before: tuple[str, ...], now: tuple[str, ...]) -> str | None:
    """The type (as "type <oid>") whose definition changed so that values the mirror holds print otherwise:
    an enum value of a type still used with another label, or an attribute of a composite used before that
    changed, appeared or went. A new enum value, or a type newly used or no longer used, changes no value."""
    def type_of(fact: str) -> str:
        return fact.split(" ", 2)[1]

    still_used, used_before = {type_of(f) for f in now}, {type_of(f) for f in before}
    changed = sorted({type_of(f) for f in set(before) - set(now) if type_of(f) in still_used}
                     | {type_of(f) for f in set(now) - set(before)
                        if f.startswith("composite ") and type_of(f) in used_before})
    return f"type {changed[0]}" if changed else None
