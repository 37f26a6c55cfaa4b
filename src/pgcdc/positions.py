"""A mirror's position: where it is recorded, how it is read back, and why it survives other writers.

A mirror's position is the commit LSN of the last source transaction it holds whole (:mod:`pgcdc.checkpoint`'s
rule 1). It is recorded in two places, both in the mirror's own Iceberg metadata, so any reader can find it:

1. **``pgcdc.lsn`` in a snapshot's summary.** Every commit pgcdc makes to a mirror carries it: a batch's row
   delta, a MERGE, the copy's overwrite, and also every maintenance commit that changes no row (compaction,
   delete files, manifests), which carries the position read just before. The data and the position land in
   one atomic commit, so they never disagree. A ``__rejects`` table's commits carry ``pgcdc.ordinal`` too: the
   last change it holds is (commit LSN, ordinal).
2. **The ``pgcdc.position`` table property** (:class:`PositionRecord`, JSON): the position again, where snapshot
   expiry cannot remove it. Another writer may commit (a user's ``rewrite_data_files``, a catalog's optimizer)
   and then expire every snapshot pgcdc made; the summaries are gone, the property stays.

Reading (:func:`mirror_position`), each rule a pure function of what the metadata holds:

- the **highest** ``pgcdc.lsn`` among the snapshots of the current lineage (the highest, not the newest: a
  ``pgcdc maintain`` beside a running pipeline may commit on top of a newer data commit, carrying the position
  it read before it);
- when no snapshot of the lineage carries one, the property. The row-delta writer sets it in its commit's own
  transaction (exact). After a commit pgcdc does not build itself (Spark's MERGE, an append) it is written just
  after, so it is a lower bound of what the table holds. For a keyed mirror a lower bound is safe: the changes
  replayed after it are upserts and deletes by key that leave each row as it is. For a keyless mirror (REPLICA
  IDENTITY FULL) or a change log, a replay would add rows twice; there the commit is first marked *pending* in
  the property (``{"lsn": before, "pending": after}``) and the mark cleared after (:class:`PositionRecording`).
  A mark found with no snapshot left to tell whether that commit landed is refused, with the way out (copy the
  table again), never guessed;
- a value that is not an LSN is refused, never trusted.

Why a position can be trusted after someone else's compaction and expiry: compaction changes no row, so the
rows still hold exactly the position the newest pgcdc commit recorded; a compaction pgcdc runs carries that
position on, and one it does not run leaves the older summaries in the lineage until expiry, after which the
property answers. Nothing here reads rows: the position is metadata only.

The Spark side (reading the lineage through Iceberg's Java API, writing the property) is
:mod:`pgcdc.mirrors.positions`; what the slot may confirm is :mod:`pgcdc.checkpoint`'s.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pgcdc.errors import PositionCorruptError
from pgcdc.lsn import Lsn

log = logging.getLogger("pgcdc.positions")

LSN_SUMMARY = "pgcdc.lsn"  # in a snapshot's summary: the mirror's position after that commit
ORDINAL_SUMMARY = "pgcdc.ordinal"  # with pgcdc.lsn, the last change a __rejects table holds
RECORD_PROPERTY = "pgcdc.position"  # the table property: a PositionRecord


@dataclass(frozen=True)
class PositionRecord:
    """The ``pgcdc.position`` property: the position a table holds, and, while a commit that must not be replayed
    from a lower bound is in flight, the position it commits (``pending``)."""

    lsn: Lsn
    pending: Lsn | None = None

    def encode(self) -> str:
        record: dict[str, str] = {"lsn": str(self.lsn)}
        if self.pending is not None:
            record["pending"] = str(self.pending)
        return json.dumps(record, sort_keys=True)

    @classmethod
    def parse(cls, value: str) -> PositionRecord:
        """The record a property value holds; ValueError when it holds none."""
        try:
            record = json.loads(value)
            pending = record.get("pending")
            return cls(Lsn.parse(record["lsn"]), None if pending is None else Lsn.parse(pending))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a position record: {value!r}") from exc

    def settled_behind(self, position: Lsn) -> bool:
        """No commit pending, and behind ``position``: a maintenance beside the stream may bring it forward."""
        return self.pending is None and self.lsn < position


def summary_position(identifier: str, value: str) -> Lsn:
    """A snapshot summary's ``pgcdc.lsn``; refused (with the way out) when it is not an LSN."""
    try:
        return Lsn.parse(value)
    except ValueError:
        raise PositionCorruptError(
            f"mirror {identifier} stores {LSN_SUMMARY}={value!r}, which is not an LSN: its position cannot be "
            "trusted, so pgcdc will not guess what it holds. Copy the table again (DROP TABLE "
            f"{identifier} in Spark, then run pgcdc, which recopies it at a fresh consistent point), or roll it "
            "back to an earlier snapshot with the Iceberg procedure system.rollback_to_snapshot") from None


def mirror_position(identifier: str, lineage: Iterable[str], record: str | None, *, keyed: bool) -> Lsn | None:
    """Where a mirror (or change log) stands, from what its metadata holds: ``lineage``, the ``pgcdc.lsn`` values
    the snapshots of its current lineage carry (any order); ``record``, its ``pgcdc.position`` property (None:
    unset); ``keyed``: its rows have a key (a replay from a lower bound leaves them as they are). None: it holds
    no position. Raises PositionCorruptError for what cannot be trusted (see the module)."""
    carried = [summary_position(identifier, value) for value in lineage]
    if carried:
        return max(carried)
    if record is None:
        return None
    try:
        recorded = PositionRecord.parse(record)
    except ValueError:
        raise PositionCorruptError(
            f"{identifier} stores {RECORD_PROPERTY}={record!r}, which is not a position record, and no snapshot "
            "of it carries pgcdc.lsn any more: pgcdc cannot know which changes it holds. Copy it again (DROP "
            f"TABLE {identifier} in Spark, then run pgcdc)") from None
    if recorded.pending is None:
        return recorded.lsn
    if keyed:
        log.warning("%s: its snapshots carrying pgcdc.lsn were expired while a commit was in flight; resuming "
                    "from %s, the last position known to be whole (its changes are upserts: applied again, they "
                    "leave the rows as they are)", identifier, recorded.lsn)
        return recorded.lsn
    raise PositionCorruptError(
        f"{identifier} was being written up to {recorded.pending} (from {recorded.lsn}) when pgcdc stopped, and "
        "every snapshot that would tell whether that commit landed was expired since (by snapshot expiry that "
        "pgcdc did not run). Its rows have no key, so replaying the changes could add them twice and skipping "
        "them could lose them. Copy it again: DROP TABLE "
        f"{identifier} in Spark (and its __changes/__rejects tables), then run pgcdc")


def rejects_position(identifier: str, carried: Iterable[tuple[object, object]],
                     newest_row: tuple[object, object] | None) -> tuple[int, int] | None:
    """(commit LSN, ordinal) of the last change a ``__rejects`` table holds: the highest its lineage's summaries
    carry (``carried``: their ``pgcdc.lsn`` and ``pgcdc.ordinal``), else (those snapshots expired) its newest row's
    (its rows are exactly the changes it took). None: it holds none."""
    pairs = list(carried) or ([newest_row] if newest_row is not None else [])
    if not pairs:
        return None
    try:
        return max((int(Lsn.parse(str(lsn))), int(str(ordinal))) for lsn, ordinal in pairs)
    except (ValueError, TypeError):
        raise PositionCorruptError(
            f"{identifier} stores {LSN_SUMMARY}/{ORDINAL_SUMMARY} values that are not a position "
            f"({', '.join(f'{lsn!r}/{ordinal!r}' for lsn, ordinal in pairs[:3])}), so pgcdc cannot know which "
            "changes it holds. Roll it back to an earlier snapshot with the Iceberg procedure "
            "system.rollback_to_snapshot, or drop it") from None


def carried_summary(position: Lsn | None, ordinal: int | None = None) -> dict[str, str]:
    """The snapshot-summary properties a commit holding ``position`` carries ({} for none): a data commit's, or a
    maintenance commit's that changes no row (the position read just before)."""
    if position is None:
        return {}
    summary = {LSN_SUMMARY: str(position)}
    if ordinal is not None:
        summary[ORDINAL_SUMMARY] = str(ordinal)
    return summary


def record_to_write(current: str | None, position: Lsn, *, pending: Lsn | None = None,
                    advance_only: bool = False) -> str | None:
    """The ``pgcdc.position`` value to write over ``current`` for a table holding ``position`` (and maybe being
    written up to ``pending``); None when nothing is to be written: it says so already, or, with
    ``advance_only`` (a maintenance beside the stream, whose position may be behind an apply's, or whose apply
    may be pending), it is not a settled position behind this one."""
    value = PositionRecord(position, pending).encode()
    if current == value:
        return None
    if advance_only and current is not None:
        try:
            if not PositionRecord.parse(current).settled_behind(position):
                return None
        except ValueError:
            return None
    return value


class PositionStore(Protocol):
    """Where :class:`PositionRecording` writes the property (:class:`pgcdc.mirrors.positions.MirrorPositions`)."""

    def exists(self, identifier: str) -> bool: ...

    def record(self, identifier: str, position: Lsn | None, *, pending: Lsn | None = None,
               advance_only: bool = False) -> None: ...


class PositionRecording:
    """``with PositionRecording(...):`` around a commit that moves a table from ``before`` to ``upto`` and carries
    ``upto`` in its snapshot summary: afterwards the property records ``held()`` (what the table holds then), where
    expiry cannot remove it. With ``whole`` (tables without a key, change logs: a replay from a lower bound would
    double rows) the commit is first marked pending, so that a record left behind by a crash between the commit
    and the record is known for what it is — on entering, or with ``deferred`` when the caller calls
    :meth:`mark_pending`: a commit that writes the property in its own metadata commit needs no mark."""

    def __init__(self, store: PositionStore, identifier: str, *, before: Lsn | None, upto: Lsn,
                 held: Callable[[], Lsn | None], whole: bool, deferred: bool = False) -> None:
        self._store, self._identifier = store, identifier
        self._before, self._upto, self._held, self._whole = before, upto, held, whole
        self._deferred = deferred
        self._written = False

    def __enter__(self) -> PositionRecording:
        if not self._deferred:
            self.mark_pending()
        return self

    def mark_pending(self) -> None:
        """Mark the commit pending (tables with ``whole``): before a commit that does not write the property."""
        if self._whole and self._before is not None and self._before < self._upto \
                and self._store.exists(self._identifier):
            self._store.record(self._identifier, self._before, pending=self._upto)

    def written_by_commit(self) -> None:
        """The commit set the property itself, in its own metadata commit (:func:`commit_properties`): exact, and
        nothing is left to write — reading the table back to find that out would cost a batch two table loads."""
        self._written = True

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None or self._written:
            return  # a pending mark stays: whether the commit landed is read from the table on the next try
        held = self._held()
        if held is not None and self._store.exists(self._identifier):
            self._store.record(self._identifier, held)


def commit_properties(position: Lsn) -> tuple[Mapping[str, str], Mapping[str, str]]:
    """(snapshot summary, table properties) of a commit that sets ``position`` in its own metadata commit, the
    property included (the row-delta writer's): exact, nothing pending."""
    return carried_summary(position), {RECORD_PROPERTY: PositionRecord(position).encode()}
