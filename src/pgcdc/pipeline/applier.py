"""Apply scheduling: one batch at a time applied to the mirrors on the apply thread.

While a batch is applied, the stream's thread goes on reading, decoding and converting the next one. The
mirrors a batch touches are applied side by side on a bounded pool (``apply_workers`` threads; one after another
with the change log, see docs/pipeline.md): each mirror's
segments in order on one thread, different mirrors at once, since most of a commit waits on storage and the
catalog (metadata files written, the catalog's pointer swapped), and Arrow, Parquet and the JVM run outside
the GIL. A batch is confirmed (the position :meth:`pgcdc.checkpoint.Checkpoint.batch_flush` gave it) only once
every mirror it touched has committed: when any fails, the others are waited for and the batch fails whole,
its position unconfirmed; each mirror's own position (``pgcdc.lsn``, in the same commit as its rows) tells a
replay what it holds already (:func:`pgcdc.checkpoint.held_whole`), so mirrors that committed are not written
twice. Maintenance runs on a thread of its own beside the applies, one table at a time: expiry and the
removal of orphan files always (their commits and the batches' are retried over each other by Iceberg), and the
rewrites (compaction, manifests) too when batches delete by equality, whose deletes name keys; when they delete by
position (the default, and the MERGE writer) a table's rewrites run on the apply thread in a gap between two
applies — a compaction beside them replaces the very files their deletes name, and one of the two would keep
losing — which the stream's loop grants when no batch is due, or once the rewrites have waited several looks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import pyarrow as pa

from pgcdc.checkpoint import held_whole, mirror_position
from pgcdc.faults import injection_point
from pgcdc.index.mirror_index import IndexBudget
from pgcdc.lsn import Lsn
from pgcdc.mirrors.maintenance import Maintainer, MaintenanceCancelled, MaintenancePolicy, mirror_tables
from pgcdc.pipeline.batcher import Batch, Segment
from pgcdc.pipeline.config import Progress
from pgcdc.pipeline.tables import SourceTables
from pgcdc.pipeline.workers import DaemonThreads

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.apply.batch import AppliedChanges
    from pgcdc.apply.rejects import SetAside
    from pgcdc.mirrors.catalog import MirrorTable
    from pgcdc.pgoutput.messages import Relation

log = logging.getLogger("pgcdc.pipeline")

T = TypeVar("T")

COMMIT_ATTEMPTS = 8  # a mirror's apply, when concurrent commits of others keep conflicting with it


@dataclass
class Applied:
    """What the apply of one batch put into the mirrors: the changes they did not hold yet (a replay after a
    reconnection or a crash holds some or all of its changes already), those set aside, and the transactions
    they belong to."""

    seconds: float = 0.0
    changes: int = 0
    rejected: int = 0
    mirrors: int = 0  # the mirrors the batch touched
    commit_lsns: set[int] = field(default_factory=set)
    step_seconds: dict[str, float] = field(default_factory=dict)  # per step of the mirrors' applies


@dataclass
class Applying:
    """A batch on the apply thread, and the position its success makes safe to confirm."""

    batch: Batch
    flush: Lsn
    future: Future[Applied]


class Applier:
    """``with Applier(...) as applier``: :meth:`start` a batch, :meth:`collect` it (waiting if need be)."""

    def __init__(self, tables: SourceTables, spark: Callable[[], SparkSession], progress: Progress,
                 emit: Callable[[], None], *, changelog: bool, writer: str = "delta", deletes: str = "position",
                 index_memory_bytes: int | None = None, index_dir: str | None = None,
                 maintenance: MaintenancePolicy | None = None,
                 consistent_seconds: float | None = None, target: MirrorTarget | None = None,
                 apply_workers: int = 1, batch_seconds: float = 0.5) -> None:
        """``target``: what batches are applied to (default: the mirrors in Iceberg, through ``spark``, written by
        ``writer``, deleting by ``deletes``, their key indexes within ``index_memory_bytes``, those that do not fit
        kept on disk in ``index_dir``). ``apply_workers``:
        how many mirrors of a batch are applied at once. ``batch_seconds``: the batch clock.
        ``consistent_seconds``: how often at most the mirrors' consistent tags move to the last batch applied
        (0: after every batch; None: never; :mod:`pgcdc.mirrors.consistent`)."""
        self.tables = tables
        self.target = target or SparkMirrors(tables, spark, changelog=changelog, writer=writer, deletes=deletes,
                                             budget=IndexBudget(index_memory_bytes, index_dir))
        self._spark = spark
        self.progress = progress
        self._emit = emit
        self._changelog = changelog
        self._executor = DaemonThreads("pgcdc-apply")
        self._mirror_workers = DaemonThreads("pgcdc-apply-mirror", apply_workers) if apply_workers > 1 else None
        self._opening = threading.Lock()  # mirrors are opened (created, evolved, filled) one at a time
        # equality deletes name keys, which a compaction running beside the applies keeps reaching; position
        # deletes name files, which a compaction replaces: then the rewrites run in a gap between two applies
        beside = writer == "delta" and deletes == "equality"
        self._maintenance_executor = DaemonThreads("pgcdc-maintain")
        self.applying: Applying | None = None
        self._rate_window: list[tuple[float, int]] = []
        self.maintainer = Maintainer(spark, maintenance or MaintenancePolicy(enabled=False), self._maintained,
                                     between=None if beside else self._between_applies)
        self._maintaining: Future[object] | None = None
        self._gap_lock = threading.Lock()
        self._gap_wanted: _Gap | None = None  # rewrites waiting for a gap between two applies
        self._consistent_seconds = consistent_seconds
        self._tags_moved_at = float("-inf")
        self._tagged: list[str] | None = None  # the mirrors whose tags move: those streamed from this slot
        self._moving: Future[object] | None = None
        # the tags' moves, beside the applies (move_tags), their mirrors two at a time
        self._tag_executor = DaemonThreads("pgcdc-tags")
        self._tag_workers = DaemonThreads("pgcdc-tag-mirror", 2)
        self._untagged: Lsn | None = None  # the last batch applied, when the tags have not moved to it yet
        # what ran on the apply thread since the last batch (what a batch handed over meanwhile waited for), and how
        # long a batch may wait for the apply thread before that is logged
        self._ran_between: list[tuple[str, float]] = []
        self._patience = max(1.0, 2 * batch_seconds)

    def __enter__(self) -> Applier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._executor.shutdown()
        self._maintenance_executor.shutdown()
        self._tag_executor.shutdown()
        self._tag_workers.shutdown()
        if self._mirror_workers is not None:
            self._mirror_workers.shutdown()
        close = getattr(self.target, "close", None)
        # a clean stop, no apply running: the indexes kept on disk are saved, so the next start reads nothing (after
        # a failure they are left as they are: an apply may still be using them, and the next start catches up)
        if close is not None and exc_info[0] is None and not self.busy:
            close(save=True)

    def stop_maintenance(self, timeout: float) -> None:
        """Cancel the maintenance turn in flight, if any (its Spark jobs: a step cut short commits nothing), and
        wait for it up to ``timeout`` seconds; one still running then is left to end with the process."""
        running = self._maintaining
        if running is None or running.done():
            return
        self.maintainer.cancel()
        try:
            running.result(timeout=timeout)
        except TimeoutError:
            log.warning("a maintenance still runs %.0fs after it was cancelled; stopping without it (a step cut "
                        "short changes nothing, and runs again at the next maintenance)", timeout)
        except Exception:
            pass

    def finish_tag_move(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the consistent tags being moved (milliseconds a mirror): a move
        cut short leaves tags at two LSNs, which the next run settles (:meth:`settle_tags`)."""
        moving = self._moving
        if moving is None or moving.done():
            return
        try:
            moving.result(timeout=timeout)
        except TimeoutError:
            log.warning("the consistent tags are still moving %.0fs on; the next run finishes moving them", timeout)
        except Exception as exc:
            log.warning("moving the consistent tags failed: %s (the next run moves them)", exc)

    @property
    def busy(self) -> bool:
        return self.applying is not None

    def done(self) -> bool:
        return self.applying is not None and self.applying.future.done()

    def start(self, batch: Batch, flush: Lsn) -> None:
        """Hand ``batch`` to the apply thread; nothing else may be applying."""
        assert self.applying is None
        self.progress.applying_rows = batch.rows
        handed = time.monotonic()
        self.applying = Applying(batch, flush, self._executor.submit(lambda: self._apply(batch, handed)))

    def maintain(self, *, batch_due: bool = False) -> None:
        """Between two messages of the stream: grant the gap a maintenance's rewrites wait for, when no batch
        applies and none is due (``batch_due``) — or when they have waited ``MAINTENANCE_OVERDUE_LOOKS`` looks (a
        stream that always has a batch due would never leave them one); then start a maintenance turn, on its own
        thread beside the applies, when one may be due and none runs."""
        self._grant_gap(batch_due)
        if not self.maintainer.ready():
            return
        if self._maintaining is not None and not self._maintaining.done():
            return
        self._maintaining = self._maintenance_executor.submit(self._maintenance_turn)

    def _grant_gap(self, batch_due: bool) -> None:
        if self.busy:
            return
        with self._gap_lock:
            gap = self._gap_wanted
            if gap is None or (batch_due and time.monotonic() - gap.asked < self.maintainer.patience):
                return
            self._gap_wanted = None
        # the batch handed over next waits behind it on the apply thread, and says so when that is long
        self._executor.submit(self._noted(gap.what, gap.run))

    def _between_applies(self, what: str, call: Callable[[], None]) -> None:
        """(On the maintenance thread.) ``call`` run on the apply thread in a gap between two applies, once the
        stream's loop grants one (:meth:`maintain`); raises :class:`MaintenanceCancelled` when the run stops
        first."""
        gap = _Gap(what, call, self.maintainer)
        with self._gap_lock:
            self._gap_wanted = gap
        while True:
            try:
                gap.ran.result(timeout=0.2)
                return
            except TimeoutError:
                if not self.maintainer.cancelled:
                    continue
                with self._gap_lock:
                    if self._gap_wanted is gap:  # not granted: it never runs
                        self._gap_wanted = None
                        raise MaintenanceCancelled(what) from None
                # granted as the run stopped: it runs (or refuses to, cancelled) on the apply thread shortly

    def _maintenance_turn(self) -> object:
        started = time.monotonic()
        try:
            result = self.maintainer.turn()
        finally:
            self.progress.maintenance_seconds += time.monotonic() - started
        if result is not None:
            self.progress.maintenance_turns += 1
        return result

    def _maintained(self) -> list:
        tables: list[tuple[str, bool, Callable[[], Any]]] = []
        for mirror in self.tables.opened_mirrors():  # none before a copy or a batch: no Spark started for them
            tables.append((mirror.identifier, False, functools.partial(getattr, mirror, "iceberg_table")))
            if self._changelog and mirror.changelog_position is not None:
                tables.append((mirror.changelog_identifier, False, _none))
            if mirror.rejects_position is not None:
                tables.append((mirror.rejects_identifier, True, _none))
        return mirror_tables(self.tables.mirrors, tables) if tables else []

    def collect(self, confirm: Callable[[Lsn], None]) -> None:
        """Wait for the batch applying (raising its error), then ``confirm`` what it made durable and count it."""
        applying, self.applying = self.applying, None
        if applying is None:
            return
        applied = applying.future.result()
        batch = applying.batch
        confirm(applying.flush)
        progress = self.progress
        progress.rows_applied += applied.changes
        progress.rows_rejected += applied.rejected
        progress.transactions_applied += len(applied.commit_lsns)
        progress.batches_applied += 1
        progress.applied_lsn = batch.last_end_lsn
        progress.last_batch_seconds = applied.seconds
        for step, seconds in applied.step_seconds.items():
            progress.apply_step_seconds[step] = progress.apply_step_seconds.get(step, 0.0) + seconds
        progress.applying_rows = 0
        self._rate_window.append((time.monotonic(), progress.rows_applied))
        self._rate_window = self._rate_window[-20:]
        (t0, r0), (t1, r1) = self._rate_window[0], self._rate_window[-1]
        progress.rows_per_s = (r1 - r0) / (t1 - t0) if t1 > t0 else 0.0
        log.info("applied %d changes of %d transactions up to %s in %.2fs over %d mirrors%s", applied.changes,
                 len(applied.commit_lsns), batch.last_commit_lsn, applied.seconds, applied.mirrors,
                 f" ({applied.rejected} set aside)" if applied.rejected else "")
        self._emit()
        if batch.last_commit_lsn is not None:
            self._untagged = batch.last_commit_lsn
            self.move_tags()

    def settle_tags(self, start: Lsn) -> None:
        """Before streaming from the slot's confirmed position ``start``: mirrors get their first consistent tag
        there, and tags a stopped run left at different LSNs move together."""
        if self._consistent_seconds is None:
            return
        from pgcdc.mirrors.consistent import settle_tags, settled_lsn

        targets = self._tag_targets()
        if not targets:
            return
        # tags at rest need no move, which a start reads without starting Spark (SourceTables.read_mirrors)
        lsn = self.tables.read_mirrors(lambda mirrors: settled_lsn({identifier: mirrors.table(identifier)
                                                                    for identifier in targets}, start))
        if lsn is None:
            log.info("moving the consistent tags before streaming (a mirror without a tag, tags apart, or a commit "
                     "since they moved)")
            lsn = settle_tags(self._spark(), targets, start)
        if lsn is not None:
            self.progress.consistent_lsn = lsn

    def move_tags(self, *, now: bool = False) -> None:
        """Once a batch is applied and confirmed every mirror holds the source up to its last commit: the tags move
        there, at most every ``consistent_seconds`` — or ``now`` (a run's end). Called after each batch and while
        the stream waits, so that the tags reach the last batch of a burst once the interval has passed.

        A move runs beside the applies, on threads of its own: over hundreds of mirrors it takes seconds (a metadata
        commit each), which a batch handed over meanwhile must not wait for. A batch's commit and a tag's commit on
        one mirror at once are both metadata commits Iceberg retries on the other's (a tag names the snapshot at the
        move's position, which a later commit leaves in place)."""
        lsn = self._untagged
        if self._consistent_seconds is None or lsn is None or self.busy or (
                self._moving is not None and not self._moving.done()):
            return
        started = time.monotonic()
        if not now and started - self._tags_moved_at < self._consistent_seconds:
            return
        from pgcdc.mirrors.consistent import move_tags

        self._tags_moved_at, self._untagged = started, None
        targets = self._tag_targets()

        def move() -> None:
            began = time.monotonic()
            try:
                moved = move_tags(self._spark(), targets, lsn, each=self._tag_workers.run_all)
            except Exception as exc:  # the mirrors are right: only the tags lag, until the next move
                from pgcdc.spark.iceberg_java import failure_text

                log.warning("moving the consistent tags to %s failed: %s (they move again after the next batch)",
                            lsn, failure_text(exc))
                return
            finally:
                self.progress.tag_moves += 1
                self.progress.tag_move_seconds += time.monotonic() - began
            if moved == len(targets):
                self.progress.consistent_lsn = lsn
            log.debug("consistent tags of %d of %d mirrors moved to %s in %.2fs", moved, len(targets), lsn,
                      time.monotonic() - started)

        self._moving = self._tag_executor.submit(move)

    def _each(self, call: Callable[[Any], T], items: list[Any]) -> list[T]:
        """``call`` of every item: side by side on the mirrors' pool when there is one (the mirrors of a batch), else
        one after another."""
        workers = self._mirror_workers
        if workers is None or len(items) < 2:
            return [call(item) for item in items]
        return workers.run_all(call, items)

    def _tag_targets(self) -> list[str]:
        """The mirrors streamed from this run's slot: those in the namespace at the start, and those made since."""
        if self._tagged is None:
            from pgcdc.mirrors.status import mirrors_streaming_from

            slot = self.tables.config.slot
            self._tagged = [identifier for identifier, _ in self.tables.read_mirrors(
                lambda mirrors: mirrors_streaming_from(mirrors, slot))]
        return sorted({*self._tagged, *(mirror.identifier for mirror in self.tables.opened_mirrors())})

    def _noted(self, what: str, call: Callable[[], T]) -> Callable[[], T]:
        """``call``, its time noted for the next batch on the apply thread, which may have waited behind it."""
        def noted() -> T:
            began = time.monotonic()
            try:
                return call()
            finally:
                self._ran_between.append((what, time.monotonic() - began))
        return noted

    def _apply(self, batch: Batch, handed: float) -> Applied:
        """Apply every segment of ``batch`` to its mirror (from the apply thread: one mirror after another, or side by
        side on the pool when there is one); returns what was applied, once every mirror has committed."""
        started = time.monotonic()
        ran, self._ran_between = self._ran_between, []
        if started - handed > self._patience:
            # the batch waited behind work between applies: say which, since the lag it costs is otherwise unexplained
            log.info("the batch of %d changes waited %.1fs for the apply thread: %s", batch.rows, started - handed,
                     "; ".join(f"{what} {seconds:.1f}s" for what, seconds in ran) or "the batch before it")
        # the mirror with the most rows first: the batch lasts as long as its slowest mirror
        tables = sorted(batch.tables.values(), key=lambda segments: -sum(c.num_rows for s in segments for c in s.chunks))
        progress = _BatchProgress(len(tables))
        # every mirror ends, committed or failed, before the batch does
        outcomes = self._each(functools.partial(self._apply_table, progress=progress), tables)
        outcome = Applied(mirrors=len(tables))
        for applied in outcomes:
            outcome.changes += applied.changes
            outcome.rejected += applied.rejected
            outcome.commit_lsns |= applied.commit_lsns
            for step, seconds in applied.step_seconds.items():
                outcome.step_seconds[step] = outcome.step_seconds.get(step, 0.0) + seconds
        injection_point("apply.before-confirm")
        outcome.seconds = time.monotonic() - started
        return outcome

    def _apply_table(self, segments: list[Segment], progress: _BatchProgress) -> Applied:
        """One source table's segments of a batch, in order, into its mirror."""
        outcome = Applied()
        target = self.target
        for index, segment in enumerate(segments):
            with self._opening:
                if held_whole(segment.span, target.held_position(segment.relation)):
                    continue
                mirror = target.mirror(segment.relation)
            following = segments[index + 1].span if index + 1 < len(segments) else None
            position = mirror_position(segment.span, following, mirror.position)
            if segment.rejects:  # first: its own position makes a replay after a crash here harmless
                rejected = target.set_aside(mirror, pa.concat_tables(segment.rejects))
                outcome.rejected += rejected.changes
                outcome.commit_lsns |= rejected.commit_lsns
                injection_point("apply.rejects")
            if not segment.chunks:  # every change of the run was set aside
                continue
            injection_point("apply.mirror")
            progress.begin()
            try:
                changes = target.apply(mirror, pa.concat_tables(segment.chunks), position)
            finally:
                others_committing = progress.end()
            for step, seconds in changes.seconds.items():
                outcome.step_seconds[step] = outcome.step_seconds.get(step, 0.0) + seconds
            outcome.changes += changes.changes
            outcome.commit_lsns |= changes.commit_lsns
            if others_committing:
                injection_point("apply.beside-commits")
        if progress.table_done():
            injection_point("apply.between-mirrors")
        return outcome


class _Gap:
    """A table's rewrites waiting for a gap between two applies: the maintenance thread waits for :attr:`ran`."""

    def __init__(self, what: str, call: Callable[[], None], maintainer: Maintainer) -> None:
        self.what = what
        self._call = call
        self._maintainer = maintainer
        self.asked = time.monotonic()
        self.ran: Future[None] = Future()

    def run(self) -> None:
        """(On the apply thread.) Its outcome goes to the maintenance thread, not to the apply thread."""
        try:
            if self._maintainer.cancelled:
                raise MaintenanceCancelled(self.what)
            self._call()
        except BaseException as exc:
            self.ran.set_exception(exc)
        else:
            self.ran.set_result(None)


class _BatchProgress:
    """How far the mirrors of one batch are: the windows a kill is aimed at (:mod:`pgcdc.faults`) are told apart
    by it."""

    def __init__(self, tables: int) -> None:
        self._lock = threading.Lock()
        self._tables_left = tables
        self._committing = 0

    def begin(self) -> None:
        with self._lock:
            self._committing += 1

    def end(self) -> bool:
        """One mirror's apply ended: whether another mirror of the batch is being applied meanwhile."""
        with self._lock:
            self._committing -= 1
            return self._committing > 0

    def table_done(self) -> bool:
        """One table's segments are applied: whether a mirror of the batch is yet to be (or being) applied."""
        with self._lock:
            self._tables_left -= 1
            return self._tables_left > 0


class MirrorTarget(Protocol):
    """What the applier applies a batch to: the mirrors, as the writers see them (:class:`SparkMirrors`)."""

    def held_position(self, relation: Relation) -> Lsn | None: ...

    def mirror(self, relation: Relation) -> MirrorTable: ...

    def set_aside(self, mirror: MirrorTable, rejects: pa.Table) -> SetAside: ...

    def apply(self, mirror: MirrorTable, changes: pa.Table, position: Lsn) -> AppliedChanges: ...


class SparkMirrors:
    """The mirrors in Iceberg, written through Spark's JVM: each apply records the positions it committed."""

    def __init__(self, tables: SourceTables, spark: Callable[[], SparkSession], *, changelog: bool,
                 writer: str, deletes: str = "position", budget: IndexBudget | None = None) -> None:
        self.tables = tables
        self._spark = spark
        self._changelog = changelog
        self._writer = writer
        self._deletes = deletes
        self._budget = budget

    def held_position(self, relation: Relation) -> Lsn | None:
        return self.tables.held_position(relation.namespace, relation.name, changelog=self._changelog)

    def close(self, *, save: bool) -> None:
        """Frees the mirrors' key indexes, saving those kept on disk when ``save``."""
        if self._budget is not None:
            self._budget.close(save=save)

    def mirror(self, relation: Relation) -> MirrorTable:
        return self.tables.mirror_for(relation)

    def set_aside(self, mirror: MirrorTable, rejects: pa.Table) -> SetAside:
        from pgcdc.apply.rejects import append_rejects

        rejected = append_rejects(self._spark(), mirror, rejects)
        if rejected.position is not None:
            mirror.rejects_position = rejected.position
        return rejected

    def apply(self, mirror: MirrorTable, changes: pa.Table, position: Lsn) -> AppliedChanges:
        """One mirror's changes (and its change log's), retried when a commit of someone else's beside pgcdc's
        (a compaction job, a catalog's optimizer) conflicts with it: the failed commit changed nothing, and the
        retry skips what the change log already holds."""
        from pgcdc.spark.iceberg_java import is_commit_conflict

        attempt = 1
        while True:
            try:
                return self._apply_once(mirror, changes, position)
            except Exception as exc:
                if attempt == COMMIT_ATTEMPTS or not is_commit_conflict(exc):
                    raise
                attempt += 1
                log.warning("%s: the commit conflicted with a concurrent one (%s); applying again (attempt %d of "
                            "%d)", mirror.spec.source, str(exc).splitlines()[0][:300], attempt, COMMIT_ATTEMPTS)
                self._reread_changelog_position(mirror)
                time.sleep(min(0.5 * 2 ** attempt, 10.0))

    def _reread_changelog_position(self, mirror: MirrorTable) -> None:
        """The change log's commit comes first and lands on its own: when the mirror's commit then conflicts, the
        log already holds the batch. Its position is read back from the table, as a restart would, so that the
        next attempt appends only what the log lacks."""
        if self._changelog:
            mirror.changelog_position = self.tables.mirrors.positions.read_if_exists(mirror.changelog_identifier)

    def _apply_once(self, mirror: MirrorTable, changes: pa.Table, position: Lsn) -> AppliedChanges:
        from pgcdc.apply.batch import apply_changes

        positions = self.tables.mirrors.positions
        # positions go into table properties too, where expiry of snapshots cannot remove them
        with contextlib.ExitStack() as recordings:
            if self._changelog:
                recordings.enter_context(positions.recording(
                    mirror.changelog_identifier, before=mirror.changelog_position, upto=position,
                    held=lambda: mirror.changelog_position, whole=True))
            recording = recordings.enter_context(positions.recording(
                mirror.identifier, before=mirror.position, upto=position, held=lambda: mirror.position,
                whole=not mirror.spec.key_columns, deferred=True))
            applied = apply_changes(self._spark(), mirror, changes, lsn=position, changelog=self._changelog,
                                    writer=self._writer, deletes=self._deletes, budget=self._budget,
                                    before_merge=recording.mark_pending)
            if applied.recorded:
                recording.written_by_commit()
            # the one place a mirror's positions move after an apply: before the recordings write them down
            if applied.changelog_position is not None:
                mirror.changelog_position = applied.changelog_position
            if applied.position is not None:
                mirror.position = applied.position
            return applied


def _none() -> None:
    """No kept table (:class:`pgcdc.mirrors.maintenance.MaintainedTable`): a change log or ``__rejects`` table."""
    return None
