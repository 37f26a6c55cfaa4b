"""What ``pgcdc status`` and the pipeline's start-up checks read of a namespace's mirrors: each one's position,
slot, rows and snapshots, through Spark or from the metadata without a JVM. Reads only."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, Protocol

from pgcdc.errors import MetadataUnreadable
from pgcdc.iceberg.table_files import live_rows
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import MirrorCatalog
from pgcdc.mirrors.consistent import CONSISTENT_TAG, tag_state
from pgcdc.mirrors.metadata import MirrorMetadata
from pgcdc.mirrors.properties import SLOT_PROPERTY
from pgcdc.spark.iceberg_java import load_table


class _PositionReads(Protocol):
    def read(self, identifier: str) -> Lsn | None: ...


class _PropertyReads(Protocol):
    def read(self, identifier: str) -> Mapping[str, str]: ...


class MirrorReads(Protocol):
    """What the start path reads of a namespace's mirrors: :class:`pgcdc.mirrors.catalog.MirrorCatalog` through Spark,
    or :class:`pgcdc.mirrors.metadata.MirrorMetadata` without a JVM."""

    @property
    def positions(self) -> _PositionReads: ...

    @property
    def properties(self) -> _PropertyReads: ...

    def source_tables(self) -> list[tuple[str, str, str]]: ...

    def table(self, identifier: str) -> Any: ...


def namespace_positions(mirrors: MirrorReads) -> dict[tuple[str, str], Lsn]:
    """{(source schema, source table): position} of every mirror of the namespace holding one."""
    result = {}
    for source_schema, source_table, identifier in mirrors.source_tables():
        position = mirrors.positions.read(identifier)
        if position is not None:
            result[(source_schema, source_table)] = position
    return result


def describe_mirrors(mirrors: MirrorCatalog) -> list[dict[str, Any]]:
    """For ``pgcdc status``: each mirror with its source, slot, position, rows, snapshots and rows set aside."""
    spark = mirrors.spark
    rows = []
    for source_schema, source_table, identifier in mirrors.source_tables():
        count = spark.sql(f"SELECT count(*) AS n FROM {identifier}").collect()[0].n
        snapshots = spark.sql(f"SELECT count(*) AS n FROM {identifier}.snapshots").collect()[0].n
        rejects = mirrors.rejects_identifier_for(source_schema, source_table)
        rejected = (spark.sql(f"SELECT count(*) AS n FROM {rejects}").collect()[0].n
                    if spark.catalog.tableExists(rejects) else 0)
        rows.append(_described(mirrors, identifier, f"{source_schema}.{source_table}", load_table(spark, identifier),
                               count=count, snapshots=snapshots, rejected=rejected))
    return rows


def _described(mirrors: MirrorReads, identifier: str, source: str, table: Any, *, count: int, snapshots: int,
               rejected: int) -> dict[str, Any]:
    """One mirror's row of ``pgcdc status``; ``table``: its Iceberg table (Java's, or its metadata), for the tag."""
    position = mirrors.positions.read(identifier)
    tag = tag_state(table)
    return {"mirror": identifier, "source": source, "slot": mirrors.properties.read(identifier).get(SLOT_PROPERTY),
            "lsn": str(position) if position is not None else None, "rows": count, "snapshots": snapshots,
            "rejected": rejected, "consistent_lsn": None if tag.lsn is None else str(tag.lsn)}


def describe_mirrors_from_metadata(mirrors: MirrorMetadata) -> list[dict[str, Any]] | None:
    """:func:`describe_mirrors`, read from the mirrors' metadata without a JVM; None when a count cannot be read: a
    mirror (or its table of rows set aside) whose current snapshot has delete files only a reader of its rows can
    apply (equality deletes, deletion vectors: :func:`pgcdc.iceberg.table_files.live_rows` counts the rest)."""
    storage = mirrors.reader.storage
    rows = []
    for source_schema, source_table, identifier in mirrors.source_tables():
        table = mirrors.table(identifier)
        if table is None:
            raise MetadataUnreadable(f"{identifier} disappeared while read")
        rejects = mirrors.rejects_table(identifier)
        count = live_rows(table, storage)
        rejected = 0 if rejects is None else live_rows(rejects, storage)
        if count is None or rejected is None:
            return None
        rows.append(_described(mirrors, identifier, f"{source_schema}.{source_table}", table, count=count,
                               snapshots=len(table.snapshots()), rejected=rejected))
    return rows


def consistent_point(described: list[dict[str, Any]]) -> str | None:
    """``pgcdc status``'s line on the consistent tags of the mirrors :func:`describe_mirrors` described: where
    they stand, and how far behind the newest commit (None: no tag yet)."""
    tagged = [row for row in described if row["consistent_lsn"] is not None]
    if not tagged:
        return None
    lsns = {Lsn.parse(row["consistent_lsn"]) for row in tagged}
    newest = max((Lsn.parse(row["lsn"]) for row in described if row["lsn"] is not None), default=None)
    stand = min(lsns)
    behind = "" if newest is None else f", {max(0, int(newest) - int(stand)):,} bytes of WAL behind the newest commit"
    if len(lsns) > 1:
        return (f"consistent point ({CONSISTENT_TAG}): being moved, tags at {', '.join(str(lsn) for lsn in sorted(lsns))} "
                f"on {len(tagged)} of {len(described)} mirrors")
    return f"consistent point ({CONSISTENT_TAG}): {stand} on {len(tagged)} of {len(described)} mirrors{behind}"


def mirrors_streaming_from(mirrors: MirrorReads, slot: str) -> list[tuple[str, Lsn | None]]:
    """(identifier, position) of every mirror that records ``slot`` as the slot it streams from."""
    return [(identifier, mirrors.positions.read(identifier)) for _, _, identifier in mirrors.source_tables()
            if mirrors.properties.read(identifier).get(SLOT_PROPERTY) == slot]


def slot_mirrors_of(mirrors: MirrorReads, slot: str, sources: Collection[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """(source schema, source table, identifier) of the mirrors of ``sources`` that record ``slot`` as the slot
    they stream from (the properties of the others are not read)."""
    return [(source_schema, source_table, identifier)
            for source_schema, source_table, identifier in mirrors.source_tables()
            if (source_schema, source_table) in sources
            and mirrors.properties.read(identifier).get(SLOT_PROPERTY) == slot]
