"""One consistent moment across all mirrors: a tag on every mirror, moved together, that any engine can read.

A batch is applied as one Iceberg commit per mirror, one mirror after another: a reader that joins two mirrors in
between sees half of a source transaction (an order without its items). Once a batch is applied and confirmed,
every mirror holds exactly the source up to the batch's last commit LSN (:mod:`pgcdc.checkpoint`, rule 3): pgcdc
then points the tag ``pgcdc_consistent`` of every mirror at the snapshot holding that state — the batch's snapshot
for a mirror the batch touched, the current one for the others — and records the LSN it stands for in the same
metadata commit (the ``pgcdc.consistent`` table property). Readers:

- Spark: ``SELECT ... FROM t VERSION AS OF 'pgcdc_consistent'``;
- PyIceberg: ``table.scan(snapshot_id=table.snapshot_by_name('pgcdc_consistent').snapshot_id)``;
- :func:`consistent_tables`: every mirror of a namespace at one LSN, checked.

Iceberg has no commit across tables, so the tags move one table after another: for the moment the moves take
(milliseconds per mirror), a reader that reads tag by tag may find one mirror's tag at the new LSN and another's
at the one before. Each tag's table records the LSN it stands for; :func:`consistent_tables` reads them all and
tries again until they agree; a run stopped in the middle of a move leaves them apart until the next run, which
moves them together before it streams (:func:`settle_tags`). A tag keeps its snapshot from snapshot expiry
(Iceberg's own rule, pgcdc's expiry and ``expire_snapshots`` alike). Other writers and someone else's compaction
do not move it; pgcdc's maintenance moves it onto its own rewrite of the tagged snapshot, which holds the same
rows at the same LSN (:func:`follow_rewrites`), before it expires snapshots.

Tags move on the apply thread right after a batch's commits, so a mirror's snapshot holding the source at the
batch's LSN is its current one (:func:`snapshot_at`) — when that snapshot holds a moment of the source at all:
pgcdc's commits carry their position (``pgcdc.lsn``), someone else's compaction holds its parent's rows, and
another writer's commit, or a mirror copied again at a later point, holds no moment of the batch: the tags
then stay where they are until it does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pgcdc.lsn import Lsn
from pgcdc.positions import LSN_SUMMARY
from pgcdc.spark.iceberg_java import metadata_view

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

log = logging.getLogger("pgcdc.mirrors.consistent")

CONSISTENT_TAG = "pgcdc_consistent"
CONSISTENT_PROPERTY = "pgcdc.consistent"  # JSON: {"lsn": the LSN the tag stands for, "snapshot": its snapshot id}


@dataclass(frozen=True)
class TagState:
    """Where a mirror's consistent tag stands: its snapshot and the LSN it stands for (None: no tag yet)."""

    snapshot_id: int | None
    lsn: Lsn | None


def lineage(table: Any) -> list[tuple[int, Lsn | None]]:
    """(snapshot id, the position it holds) of ``table``'s current lineage, newest first: a snapshot's position is
    its ``pgcdc.lsn``; a commit that carries none holds its parent's when it rewrote files without changing rows
    (someone else's compaction: operation ``replace``), and none when it changed rows (another writer's). A rewrite
    holds its parent's rows whatever position it carries: ``pgcdc maintain`` beside a running pipeline stamps its
    rewrite with the position it read before the step, and a batch may commit in between, beneath the rewrite; the
    parent's position, when the lineage still holds the parent, is the one its rows stand at. A tag is thus never
    put on a rewrite holding rows newer than its stamp."""
    table = metadata_view(table)
    carried = []
    snapshot = table.currentSnapshot()
    while snapshot is not None:
        value = snapshot.summary().get(LSN_SUMMARY)
        carried.append((int(snapshot.snapshotId()), None if value is None else Lsn.parse(str(value)),
                        str(snapshot.operation())))
        parent = snapshot.parentId()
        snapshot = table.snapshot(parent) if parent is not None else None
    position: Lsn | None = None
    held: list[tuple[int, Lsn | None]] = []
    for snapshot_id, value, operation in reversed(carried):  # oldest first
        if operation != "replace" or not held:  # (a rewrite whose parent was expired: its stamp is all there is)
            position = value if value is not None else position if operation == "replace" else None
        held.append((snapshot_id, position))
    return held[::-1]


def snapshot_at(table: Any, lsn: Lsn) -> int | None:
    """The snapshot of ``table`` holding exactly the source up to ``lsn``: its newest snapshot at or below it, when
    the table is not ahead of ``lsn`` (a mirror copied again at a later point holds no snapshot of the moment
    before: its older snapshots miss what changed while it was held). None when there is none."""
    held = lineage(table)
    if not held or held[0][1] is None or held[0][1] > lsn:
        return None
    return held[0][0]  # moves follow applies: the current snapshot is the newest at or below ``lsn``


def tag_state(table: Any) -> TagState:
    table = metadata_view(table)
    refs = table.refs()
    ref = refs.get(CONSISTENT_TAG) if refs is not None else None
    recorded = table.properties().get(CONSISTENT_PROPERTY)
    lsn = None
    if recorded is not None:
        try:
            lsn = Lsn.parse(json.loads(str(recorded))["lsn"])
        except (ValueError, KeyError, TypeError):
            lsn = None
    return TagState(None if ref is None else int(ref.snapshotId()), lsn)


def follow_rewrites(table: Any) -> bool:
    """After pgcdc's maintenance rewrote ``table``'s files (compaction, manifests: commits of operation
    ``replace``, the same rows), its tag moves from the snapshot rewritten to the rewrite, at the same LSN: the
    tag's reader reads the compacted files, and expiry can let the old ones go. False when the tag stays (none,
    already current, or a commit that changed rows lies between)."""
    view = metadata_view(table)
    state = tag_state(view)
    snapshot = view.currentSnapshot()
    if state.snapshot_id is None or state.lsn is None or snapshot is None:
        return False
    current = int(snapshot.snapshotId())
    while snapshot is not None and int(snapshot.snapshotId()) != state.snapshot_id:
        if str(snapshot.operation()) != "replace":
            return False
        parent = snapshot.parentId()
        snapshot = view.snapshot(parent) if parent is not None else None
    if snapshot is None or current == state.snapshot_id:
        return False
    _point_tag(table, current, state.lsn, state=state)
    return True


POINT_ATTEMPTS = 5  # a tag's commit made again after one lost to another commit (pgcdc.iceberg.Tags.point: why)


def _point_tag(table: Any, snapshot_id: int, lsn: Lsn, *, state: TagState | None = None) -> None:
    """The tag on ``snapshot_id`` and ``lsn`` recorded, in one metadata commit (none when both already are); made
    again on the table refreshed when a commit landed meanwhile (Iceberg's transaction does not refresh a tag's
    update). In the JVM (``pgcdc.iceberg.Tags.point``) where pgcdc's jar is there; else here, from ``state``, the
    tag as last read (read now when not given)."""
    from pgcdc.spark.iceberg_java import iceberg_classes

    tags = iceberg_classes().tags
    if tags is not None:
        tags.point(table, CONSISTENT_TAG, snapshot_id, CONSISTENT_PROPERTY, _recorded(lsn, snapshot_id))
        return
    _point_tag_here(table, snapshot_id, lsn, state if state is not None else tag_state(table))


def _point_tag_here(table: Any, snapshot_id: int, lsn: Lsn, state: TagState) -> None:
    """:func:`_point_tag` through the Java API, call by call (a session without pgcdc's jar)."""
    from pgcdc.spark.iceberg_java import is_commit_conflict

    for attempt in range(1, POINT_ATTEMPTS + 1):
        if state.snapshot_id == snapshot_id and state.lsn == lsn:
            return
        try:
            transaction = table.newTransaction()
            manage = transaction.manageSnapshots()
            manage = manage.replaceTag(CONSISTENT_TAG, snapshot_id) if state.snapshot_id is not None \
                else manage.createTag(CONSISTENT_TAG, snapshot_id)
            manage.commit()
            transaction.updateProperties().set(CONSISTENT_PROPERTY, _recorded(lsn, snapshot_id)).commit()
            transaction.commitTransaction()
            return
        except Exception as exc:
            if attempt == POINT_ATTEMPTS or not is_commit_conflict(exc):
                raise
            table.refresh()
            state = tag_state(table)


def _recorded(lsn: Lsn, snapshot_id: int) -> str:
    """The ``pgcdc.consistent`` property of a tag on ``snapshot_id`` standing for ``lsn``."""
    return json.dumps({"lsn": str(lsn), "snapshot": snapshot_id}, sort_keys=True)


def move_tags(spark: SparkSession, identifiers: list[str], lsn: Lsn, *,
              each: Callable[[Callable[[Any], Any], list[Any]], list[Any]] | None = None) -> int:
    """Every mirror's consistent tag pointed at its snapshot holding the source up to ``lsn``, and ``lsn`` recorded
    (one metadata commit a mirror), or none: while a mirror holds no snapshot at ``lsn`` (copied again, or first,
    at a later point) the tags stay where they are. Returns how many moved. ``each(call, items)``: ``call`` of
    every item, in any order or side by side (default: one after another); the tables are loaded, then their tags
    moved, that way: a move over hundreds of mirrors waits on storage and the catalog per mirror."""
    from pgcdc.spark.iceberg_java import iceberg_classes, load_table

    each = each or (lambda call, items: [call(item) for item in items])
    loaded = each(lambda identifier: (identifier, load_table(spark, identifier)), identifiers)
    tables = dict(loaded)
    tags = iceberg_classes().tags

    def target(identifier: str) -> tuple[str, int | None]:
        """(identifier, its snapshot at ``lsn``): in the JVM, one call a mirror, where pgcdc's jar is there;
        else from its metadata read here as JSON."""
        table = tables[identifier]
        return identifier, snapshot_at(metadata_view(table), lsn) if tags is None else _java_target(tags, table, lsn)

    targets = dict(each(target, identifiers))
    placed = {identifier: snapshot for identifier, snapshot in targets.items() if snapshot is not None}
    ahead = [identifier for identifier in identifiers if identifier not in placed]
    if ahead:
        log.info("consistent tags stay: %s hold%s no snapshot of the source at %s (copied at a later point, or "
                 "written by another writer since)", ", ".join(ahead), "s" if len(ahead) == 1 else "", lsn)
        return 0
    each(lambda identifier: _point_tag(tables[identifier], placed[identifier], lsn), identifiers)
    return len(identifiers)


def _java_target(tags: Any, table: Any, lsn: Lsn) -> int | None:
    """:func:`snapshot_at` of ``table`` through ``pgcdc.iceberg.Tags`` (pgcdc's jar)."""
    target = int(tags.target(table, LSN_SUMMARY, str(lsn)))
    return None if target < 0 else target


def settled_lsn(tables: Mapping[str, Any], start: Lsn) -> Lsn | None:
    """The LSN the consistent tags of ``tables`` (by identifier; None: no such table) stand for when a run starting
    from the slot's confirmed position ``start`` need not move them: every tag at ``start``, or every tag at one LSN
    on its table's current snapshot — nothing was committed since they moved, and a move would only label the same
    snapshots with ``start``. None: they must move (a mirror without a tag, tags at different LSNs, a commit since
    a tag moved). ``tables``: Iceberg's ``Table`` through the JVM, or read without one
    (:class:`pgcdc.iceberg.table_metadata.TableMetadata`)."""
    if not tables or any(table is None for table in tables.values()):
        return None
    states = {identifier: tag_state(table) for identifier, table in tables.items()}
    lsns = {state.lsn for state in states.values()}
    if lsns == {start}:
        return start
    if len(lsns) != 1 or None in lsns:
        return None
    for identifier, table in tables.items():
        current = table.currentSnapshot()
        if current is None or states[identifier].snapshot_id != int(current.snapshotId()):
            return None
    return next(iter(lsns))


def settle_tags(spark: SparkSession, identifiers: list[str], start: Lsn) -> Lsn | None:
    """At a run's start, from the slot's confirmed position ``start``, which every mirror holds whole: the tags
    move there — a first run's after its initial copy, and tags a run stopped in the middle of moving (some at
    one LSN, some at the one before). When a mirror is ahead of ``start`` (a batch applied but not confirmed
    before a stop; the stream sends it again), tags left at different LSNs move to the newest of them instead,
    which every mirror held whole when it was recorded. Tags at rest stay as they are (:func:`settled_lsn`).
    Returns the LSN the tags stand for (None: none yet)."""
    from pgcdc.spark.iceberg_java import light_view, load_table

    if not identifiers:
        return None
    # what the tag rules read of each mirror (refs, properties, each snapshot's operation and position)
    tables = {identifier: light_view(load_table(spark, identifier), (LSN_SUMMARY,)) for identifier in identifiers}
    standing = settled_lsn(tables, start)
    if standing is not None:
        return standing
    states = {identifier: tag_state(table) for identifier, table in tables.items()}
    if move_tags(spark, identifiers, start) == len(identifiers):
        return start
    recorded = {state.lsn for state in states.values()}
    if None in recorded or len(recorded) == 1:
        return None if None in recorded else next(iter(recorded))
    newest = max(lsn for lsn in recorded if lsn is not None)
    log.info("consistent tags found at different LSNs (a run stopped while moving them): moving them to %s",
             newest)
    behind = [identifier for identifier, state in states.items() if state.lsn != newest]
    return newest if move_tags(spark, behind, newest) == len(behind) else None


@dataclass(frozen=True)
class ConsistentTables:
    """Every mirror of a namespace at one moment of the source: DataFrames by source table (``schema.table``)."""

    lsn: Lsn
    tables: dict[str, DataFrame]


def consistent_tables(spark: SparkSession, namespace: str = "mirror", catalog: str = "pgcdc", *,
                      slot: str | None = None, attempts: int = 50, wait_seconds: float = 0.2) -> ConsistentTables:
    """Every mirror of ``namespace`` (those streamed from ``slot``, when the namespace holds the mirrors of several
    runs) read at its consistent tag, all at one LSN: the tags' recorded LSNs are read and compared, and read
    again while a run is moving them (up to ``attempts`` times).

    >>> point = pgcdc.consistent_tables(spark, "mirror")                                    # doctest: +SKIP
    >>> point.tables["shop.orders"].join(point.tables["shop.order_items"], "order_id")     # doctest: +SKIP
    """
    from pgcdc.errors import PgcdcError
    from pgcdc.mirrors.catalog import MirrorCatalog
    from pgcdc.mirrors.properties import SLOT_PROPERTY
    from pgcdc.spark.destination import Destination
    from pgcdc.spark.iceberg_java import load_table

    mirrors = MirrorCatalog(spark, Destination(catalog=catalog, namespace=namespace, warehouse=None))
    sources = [(schema, table, identifier) for schema, table, identifier in mirrors.source_tables()
               if slot is None or mirrors.properties.read(identifier).get(SLOT_PROPERTY) == slot]
    for _ in range(attempts):
        states = {(schema, table): tag_state(load_table(spark, identifier))
                  for schema, table, identifier in sources}
        lsns = {state.lsn for state in states.values()}
        if len(lsns) == 1 and None not in lsns and all(s.snapshot_id is not None for s in states.values()):
            lsn = next(iter(lsns))
            assert lsn is not None
            return ConsistentTables(lsn, {
                f"{schema}.{table}": spark.read.option("snapshot-id", states[(schema, table)].snapshot_id).table(
                    identifier) for schema, table, identifier in sources})
        time.sleep(wait_seconds)
    raise PgcdcError(f"the consistent tags of namespace {namespace!r} did not agree on one LSN in {attempts} reads "
                     "(a run is moving them, or none has moved them yet: pgcdc run moves them once a batch is "
                     "applied)")
