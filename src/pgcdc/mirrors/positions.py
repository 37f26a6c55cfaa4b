"""Mirror positions read from and written to Iceberg metadata, through Iceberg's Java API: no query to plan,
which a start-up with many mirrors would pay per mirror. What the values mean and which one wins is
:mod:`pgcdc.positions`'; this module only reaches them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pgcdc.lsn import Lsn
from pgcdc.mirrors.properties import KEY_PROPERTY
from pgcdc.positions import (
    LSN_SUMMARY,
    ORDINAL_SUMMARY,
    RECORD_PROPERTY,
    PositionRecording,
    carried_summary,
    mirror_position,
    record_to_write,
    rejects_position,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("pgcdc.mirrors.catalog")


def position_facts(table: Any) -> tuple[list[str], str | None, bool]:
    """What a table's metadata holds of its position (:func:`pgcdc.positions.mirror_position`'s arguments): the
    ``pgcdc.lsn`` each snapshot of its current lineage carries, its ``pgcdc.position`` property, and whether it is
    keyed. ``table``: Iceberg's ``Table`` through the JVM, or the same read without one
    (:class:`pgcdc.iceberg.table_metadata.TableMetadata`)."""
    from pgcdc.spark.iceberg_java import light_view

    table = light_view(table, (LSN_SUMMARY,))
    lineage: list[str] = []
    snapshot = table.currentSnapshot()
    while snapshot is not None:
        value = snapshot.summary().get(LSN_SUMMARY)
        if value is not None:
            lineage.append(str(value))
        parent = snapshot.parentId()
        snapshot = table.snapshot(parent) if parent is not None else None  # None: expired
    properties = table.properties()
    record = properties.get(RECORD_PROPERTY)
    return lineage, None if record is None else str(record), bool(properties.get(KEY_PROPERTY))


def table_position(identifier: str, table: Any) -> Lsn | None:
    """Where the table ``identifier`` stands (:func:`pgcdc.positions.mirror_position` over :func:`position_facts`)."""
    lineage, record, keyed = position_facts(table)
    return mirror_position(identifier, lineage, record, keyed=keyed)


class MirrorPositions:
    """The positions of the tables of one catalog (mirrors, change logs, ``__rejects`` tables)."""

    def __init__(self, spark: SparkSession) -> None:
        self.spark = spark
        # tables seen to exist: asking the catalog is a table load (a round trip to a catalog service and a read
        # of the table's metadata), which a batch asked for each table it touched; this process drops a table
        # only through forget()
        self._existing: set[str] = set()

    def exists(self, identifier: str) -> bool:
        if identifier in self._existing:
            return True
        if not self.spark.catalog.tableExists(identifier):
            return False
        self._existing.add(identifier)
        return True

    def seen(self, identifier: str) -> None:
        """``identifier`` was loaded: it exists."""
        self._existing.add(identifier)

    def forget(self, identifier: str) -> None:
        """``identifier`` is being dropped: whether it exists is asked of the catalog again."""
        self._existing.discard(identifier)

    def read_if_exists(self, identifier: str) -> Lsn | None:
        """:meth:`read` of a table that may not exist yet (a change log before its first append): None then."""
        return self.read(identifier) if self.exists(identifier) else None

    def read(self, identifier: str, *, table: Any = None) -> Lsn | None:
        """Where a mirror (or change log) stands (:func:`pgcdc.positions.mirror_position`); None: it holds none,
        or it cannot be read (a table whose creation was interrupted: it is copied again). ``table``: its Iceberg
        table, when loaded already."""
        from py4j.protocol import Py4JJavaError
        from pyspark.errors import AnalysisException

        from pgcdc.spark.iceberg_java import load_table

        try:
            lineage, record, keyed = position_facts(table if table is not None else load_table(self.spark, identifier))
        except (AnalysisException, Py4JJavaError) as exc:
            log.warning("mirror %s cannot be read (%s); it will be copied again", identifier,
                        str(exc).strip().splitlines()[0])
            return None
        return mirror_position(identifier, lineage, record, keyed=keyed)

    def record(self, identifier: str, position: Lsn | None, *, pending: Lsn | None = None,
               advance_only: bool = False) -> None:
        """Write the ``pgcdc.position`` property (one metadata commit; none when it already says this, see
        :func:`pgcdc.positions.record_to_write`)."""
        if position is None:
            return
        from pgcdc.spark.iceberg_java import load_table

        table = load_table(self.spark, identifier)
        current = table.properties().get(RECORD_PROPERTY)
        value = record_to_write(None if current is None else str(current), position, pending=pending,
                                advance_only=advance_only)
        if value is not None:
            table.updateProperties().set(RECORD_PROPERTY, value).commit()

    def recording(self, identifier: str, *, before: Lsn | None, upto: Lsn, held: Callable[[], Lsn | None],
                  whole: bool, deferred: bool = False) -> PositionRecording:
        """:class:`pgcdc.positions.PositionRecording` over this catalog."""
        return PositionRecording(self, identifier, before=before, upto=upto, held=held, whole=whole,
                                 deferred=deferred)

    def read_rejects(self, identifier: str) -> tuple[int, int] | None:
        """(commit LSN, ordinal) of the last change a ``__rejects`` table holds (None: none, or no such table)."""
        if not self.exists(identifier):
            return None
        carried = self.spark.sql(
            f"SELECT s.summary['{LSN_SUMMARY}'] AS lsn, s.summary['{ORDINAL_SUMMARY}'] AS ordinal "
            f"FROM {identifier}.snapshots s JOIN {identifier}.history h ON s.snapshot_id = h.snapshot_id "
            f"WHERE h.is_current_ancestor AND s.summary['{ORDINAL_SUMMARY}'] IS NOT NULL").collect()
        newest = None
        if not carried:
            rows = self.spark.sql(f"SELECT commit_lsn AS lsn, ordinal FROM {identifier} "
                                  "ORDER BY commit_lsn_value DESC, ordinal DESC LIMIT 1").collect()
            newest = (rows[0].lsn, rows[0].ordinal) if rows else None
        return rejects_position(identifier, [(row.lsn, row.ordinal) for row in carried], newest)

    def carried(self, identifier: str, *, rejects: bool = False) -> dict[str, str]:
        """The snapshot properties that a commit changing no row of ``identifier`` (compaction, a manifest
        rewrite) carries to keep the table's position ({} for a table holding none). The ``pgcdc.position``
        property is brought up to date first: expiry after commits that carry nothing (anyone's compaction)
        leaves the position there."""
        if rejects:  # its rows tell its position exactly, whatever expiry removes
            held = self.read_rejects(identifier)
            return {} if held is None else carried_summary(Lsn(held[0]), held[1])
        position = self.read(identifier)
        if position is None:
            return {}
        self.record(identifier, position, advance_only=True)
        return carried_summary(position)
