"""When the slot moves, and why that is safe: every LSN decision pgcdc makes, in one place.

Two kinds of position exist:

- **A mirror's position** is the commit LSN of the last source transaction the mirror holds whole. Every commit
  pgcdc makes to a mirror carries it (``pgcdc.lsn`` in the snapshot summary, in the same atomic commit as the
  data, so data and position never disagree), and the ``pgcdc.position`` table property keeps it where snapshot
  expiry cannot remove it. How it is recorded, and read back — the highest ``pgcdc.lsn`` of the current
  lineage, else the property, refused when it cannot be trusted — and why that survives someone else's
  compaction and expiry, is :mod:`pgcdc.positions`'.
- **The slot's confirmed position** (the flush LSN pgcdc reports to the server) is where the server
  resumes after a restart: it keeps every WAL byte after it and sends again every transaction that
  commits after it, and every prepared transaction whose PREPARE lies at or after it. Every decision about it
  is made here.

The rules, each a function or method below:

1. *Position with the data.* A mirror's apply records :func:`mirror_position` of what it applied.
2. *Replays are skipped.* A change whose commit LSN is at or below its mirror's position is already
   there (:func:`first_unapplied`), so a restart from any earlier slot position applies nothing twice.
3. *The slot follows the mirrors.* A batch's end is confirmed only after every mirror it touched has
   committed (:meth:`Checkpoint.batch_flush`), and never past the PREPARE of a transaction pgcdc still
   holds: the server would not send that transaction again.
4. *A quiet slot keeps moving.* When everything received is applied, nothing is being applied and
   nothing is held, the server's own WAL position is safe to confirm (:meth:`Checkpoint.quiet_flush`):
   otherwise WAL written elsewhere (other databases, other tables) piles up behind an idle slot.
5. *Never backwards.* :meth:`Checkpoint.advance` ignores a position at or below the confirmed one.
6. *A transaction split by a schema change is claimed by its last part.* A schema change inside a
   transaction splits that transaction's changes of one table over two applies; the first must record
   the transaction before it, or rule 2 would skip the rest after a crash between the two commits.
7. *A restart resumes from the slot* (:func:`resume_position`), which is at or below what every mirror
   holds; rule 2 absorbs the difference. It refuses what it cannot trust: an invalidated slot, a missing
   slot while mirrors hold positions (a new slot would start at today's WAL and skip the changes in
   between) and mirror positions beyond the server's WAL (written from another server's history).

Why it is safe: the slot's position never passes a transaction that some mirror does not hold, so
after any crash the server sends again everything that any mirror lacks; rule 2 drops what a mirror
already has. Together: each change lands in each mirror exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pgcdc.errors import ConfigError, PositionCorruptError
from pgcdc.lsn import ZERO, Lsn


class Checkpoint:
    """The slot's side of one streaming run: what may be confirmed now, and what was confirmed.

    >>> checkpoint = Checkpoint(resume_from=Lsn(100))
    >>> checkpoint.advance(checkpoint.batch_flush(Lsn(180), held=Lsn(150)))
    True
    >>> checkpoint.confirmed
    Lsn('0/96')
    """

    def __init__(self, resume_from: Lsn) -> None:
        self.confirmed = resume_from

    @staticmethod
    def batch_flush(batch_end: Lsn, held: Lsn | None) -> Lsn:
        """Rule 3: what a batch ending at ``batch_end`` may confirm once its mirrors committed. ``held`` is the
        PREPARE LSN of the oldest transaction still held (the assembler's ``oldest_pending_lsn``)."""
        return held if held is not None and held < batch_end else batch_end

    @staticmethod
    def quiet_flush(server_wal_end: Lsn | None, *, unapplied: bool, held: Lsn | None) -> Lsn | None:
        """Rule 4: the server's WAL position when nothing received waits to be applied (``unapplied``: a
        batch being collected or applied) and no transaction is held; else None."""
        if unapplied or held is not None or not server_wal_end:
            return None
        return server_wal_end

    def advance(self, lsn: Lsn | None) -> bool:
        """Rule 5: record ``lsn`` as confirmed; False (and nothing changes) when it would not move forward."""
        if lsn is None or lsn <= self.confirmed:
            return False
        self.confirmed = lsn
        return True


@dataclass
class Span:
    """The commit LSNs of one run of a table's changes (a segment), noted in commit order."""

    first: Lsn = ZERO
    last: Lsn = ZERO
    previous: Lsn = ZERO  # the greatest commit LSN below ``last`` in this run

    def note(self, commit_lsn: Lsn) -> None:
        if not self.first:
            self.first = commit_lsn
        if commit_lsn != self.last:
            if self.last:
                self.previous = self.last
            self.last = commit_lsn


def mirror_position(span: Span, following: Span | None, current: Lsn | None) -> Lsn:
    """Rules 1 and 6: the position a mirror records when it applies the run ``span``, where ``following`` is
    the next run of the same table in the batch (after a schema change) and ``current`` the mirror's position.

    When ``following`` starts with the transaction ``span`` ends with, that transaction is split: the run
    claims only the transaction before it, and never less than the mirror already holds."""
    splits_transaction = following is not None and following.first == span.last
    if splits_transaction:
        return max(span.previous, current or ZERO)
    return span.last


def held_whole(span: Span, position: Lsn | None) -> bool:
    """Rule 2 for a whole run: the mirror at ``position`` holds every transaction of ``span``. Such a run is
    passed over before its schema version touches the mirror: replayed after a crash, or before a new copy,
    an older version would drop columns that a later one added."""
    return position is not None and span.last <= position


def first_unapplied(position: Lsn | None) -> int:
    """Rule 2: the lowest commit LSN a mirror at ``position`` does not hold yet (0: it holds nothing)."""
    return 0 if position is None else int(position) + 1


def resume_position(slot: str, confirmed_flush: Lsn | None, *, invalidated: str | None) -> Lsn:
    """Rule 7: where streaming resumes: the slot's confirmed position (None before a slot confirmed anything,
    where the server starts from the slot's own start). ``invalidated`` is the reason a slot lost its WAL
    (None for a usable slot)."""
    if invalidated is not None:
        raise ConfigError(f"replication slot {slot!r} was invalidated ({invalidated}): the WAL it needed is "
                          "gone, so the changes since the mirrors' positions cannot be streamed. Copy every "
                          "table again with --resnapshot (it drops the slot and creates a new one); to keep "
                          "this from recurring, raise max_slot_wal_keep_size or keep pgcdc running")
    return confirmed_flush or ZERO


def refuse_lost_slot(slot: str, namespace: str, positions: Mapping[tuple[str, str], Lsn]) -> None:
    """Rule 7: a missing slot is created afresh only when no mirror holds a position. A slot dropped, or lost
    in a failover to a server it was not synchronized to, would come back at today's WAL and skip silently the
    changes between the mirrors' positions and now."""
    if not positions:
        return
    newest = max(positions.values())
    raise ConfigError(
        f"replication slot {slot!r} does not exist, but {len(positions)} mirrors in namespace "
        f"{namespace!r} hold positions (up to {newest}). The slot was dropped, or lost in a "
        "failover to a server it was not synchronized to; the changes made since those positions are no "
        "longer in any slot, and recreating it would skip them silently. Copy every table again at a fresh "
        "consistent point with --resnapshot (pgcdc run --resnapshot), or point pgcdc at the right server/slot. "
        "If another pgcdc run (its own publication and slot) mirrors these tables into this namespace, take them "
        "out of this publication: each table belongs to one run")


def refuse_positions_ahead(positions: Mapping[tuple[str, str], Lsn], server_lsn: Lsn) -> None:
    """Rule 7: a mirror position beyond the server's WAL is impossible for this source (a mirror written from
    another server, a source restored from an older backup, an altered position): never trusted."""
    ahead = {f"{schema}.{table}": lsn for (schema, table), lsn in positions.items() if lsn > server_lsn}
    if ahead:
        listed = ", ".join(f"{name} at {lsn}" for name, lsn in sorted(ahead.items()))
        raise PositionCorruptError(
            f"mirrors hold positions beyond the source server's current WAL position {server_lsn}: {listed}. They "
            "were not written from this server's history (another server, a source restored from an older "
            "backup, or an altered position), so pgcdc cannot know what they hold. Copy them again: run "
            "with --resnapshot, or drop those mirrors in Spark and run pgcdc")
