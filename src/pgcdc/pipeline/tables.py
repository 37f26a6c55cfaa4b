"""The source tables a pipeline mirrors: per table, its converter, its key and its mirror.

A table's schema version is a Relation message (or its catalog twin for the snapshot). Each distinct
version gets one converter; its key is what the server sends as the row's identity
(:func:`pgcdc.replication.published.identity_key`), so a new replica identity is a new version, and its
mirror is refused when it was keyed otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import psycopg
import pyarrow as pa

from pgcdc.faults import injection_point
from pgcdc.pgoutput.messages import REPLICA_IDENTITY_FULL, REPLICA_IDENTITY_NOTHING, Relation, TupleData, Type
from pgcdc.pipeline.config import PipelineConfig
from pgcdc.replication import source_connection
from pgcdc.replication.published import (
    AddedColumn,
    added_columns,
    identity_key,
    primary_key,
    published_tables,
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

    def mirror_for(self, relation: Relation, *, replace_other_key: bool = False) -> MirrorTable:
        """The mirror of a relation version, created or evolved to it. A mirror keyed otherwise is refused
        (the way out is a new copy), or, with ``replace_other_key`` (a copy is about to replace its rows),
        made again with the new key."""
        from pgcdc.spark.mirror import TableSpec
        from pgcdc.spark.schema import spark_schema

        if relation.replica_identity == REPLICA_IDENTITY_NOTHING:
            log.warning("%s has REPLICA IDENTITY NOTHING: its mirror is insert-only (updates and deletes cannot "
                        "be matched); fix with ALTER TABLE %s REPLICA IDENTITY FULL or add a primary key",
                        relation.qualified_name, relation.qualified_name)
        spec = TableSpec(source_schema=relation.namespace, source_table=relation.name,
                         spark_schema=spark_schema(self.converter_for(relation).arrow_schema),
                         key_columns=self.key_for(relation), replica_identity=relation.replica_identity)
        if replace_other_key:  # a copy is about to replace every row: nothing of the old ones to fill
            mirror = self.mirrors.ensure(spec, replace_other_key=True)
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

    def needs_copy(self, relation: Relation) -> bool:
        """Whether this relation version's new columns hold, in the existing rows, values that logical decoding
        never sent, so that the mirror must be copied again: columns added with a default that PostgreSQL wrote
        by rewriting the table (a volatile one), or into a table rewritten since; and a version that both lacks
        columns of the mirror and brings new ones, which is what a RENAME COLUMN looks like (the Relation
        message carries names only). A plain ADD COLUMN (NULL) or a non-volatile default (the catalog's missing
        value, filled by :meth:`mirror_for`) needs no copy."""
        existing = self.mirrors.columns_of(relation.namespace, relation.name)
        names = {c.name for c in relation.columns}
        if existing is not None and names - existing and existing - names:
            return True
        return any(a.missing_text is None and a.has_default for a in self._added_columns(relation))

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
