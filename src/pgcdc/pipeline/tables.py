"""The source tables a pipeline mirrors: per table, its converter, its key and its mirror.

A table's schema version is a Relation message (or its catalog twin for the snapshot). Each distinct
version gets one converter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pgcdc.pgoutput.messages import Relation
from pgcdc.pipeline.config import PipelineConfig
from pgcdc.replication import source_connection
from pgcdc.replication.published import primary_key
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
                                          namespace=self.config.namespace)
        return self._mirrors

    def converter_for(self, relation: Relation) -> TableConverter:
        """The converter of a relation version (one per distinct schema, reused)."""
        signature = schema_signature(relation)
        converter = self._converters.get(signature)
        if converter is None:
            converter = TableConverter(relation, self.registry, ConversionOptions(numeric=self.config.numeric))
            self._converters[signature] = converter
        return converter

    def key_for(self, relation: Relation) -> tuple[str, ...]:
        """The mirror's key: the primary key when there is one (also under REPLICA IDENTITY FULL, where
        pgoutput flags every column), else the replica identity index, else none."""
        key = self._keys.get((relation.relation_id,))
        if key is None:
            with source_connection(self.config.dsn, 120.0) as conn:
                primary = primary_key(conn, relation.relation_id)
            if primary and set(primary) <= {c.name for c in relation.columns}:
                key = primary
            elif relation.replica_identity in ("d", "i"):
                key = tuple(c.name for c in relation.key_columns)
            else:
                key = ()
            self._keys[(relation.relation_id,)] = key
        return key

    def mirror_for(self, relation: Relation) -> MirrorTable:
        """The mirror of a relation version, created or evolved to it."""
        from pgcdc.spark.mirror import TableSpec

        if relation.replica_identity == "n":
            log.warning("%s has REPLICA IDENTITY NOTHING: its mirror is insert-only (updates and deletes cannot "
                        "be matched); fix with ALTER TABLE %s REPLICA IDENTITY FULL or add a primary key",
                        relation.qualified_name, relation.qualified_name)
        spec = TableSpec(source_schema=relation.namespace, source_table=relation.name,
                         spark_schema=self.converter_for(relation).spark_schema, key_columns=self.key_for(relation),
                         replica_identity=relation.replica_identity)
        return self.mirrors.ensure(spec)

    def has_position(self, relation: Relation) -> bool:
        """Whether the relation's mirror holds a position (was copied or applied to)."""
        name = (relation.namespace, relation.name)
        if name not in self._positioned:
            if self.mirror_for(relation).position is None:
                return False
            self._positioned.add(name)
        return True
