"""The apply thread's rules (pgcdc.pipeline.applier), over mirrors kept in memory: a batch is confirmed only once
every mirror it touched has committed, counts are of what reached the mirrors, and a run a mirror holds whole
is passed over. The same rules against real Iceberg mirrors: test_pipeline.py, test_signals.py, the crash loops."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from batches import INT4, ITEMS, OTHER, WIDER, batcher, collected, row, transactions

from pgcdc.apply.batch import AppliedChanges
from pgcdc.apply.rejects import SetAside
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Column, Insert, Relation
from pgcdc.pipeline.applier import Applier
from pgcdc.pipeline.config import Progress

pytestmark = pytest.mark.usefixtures("accelerators")  # with the C modules and without


@dataclass
class Mirror:
    position: Lsn | None = None
    rows: int = 0


@dataclass
class Mirrors:
    """Mirrors as the applier sees them, in memory: an apply lands what is past a mirror's position (rule 2)."""

    held: dict[str, Mirror] = field(default_factory=dict)
    fail_on: str | None = None
    applied: list[str] = field(default_factory=list)

    def held_position(self, relation: Relation) -> Lsn | None:
        return self.held.setdefault(relation.name, Mirror()).position

    def mirror(self, relation: Relation) -> Mirror:  # type: ignore[override]
        return self.held.setdefault(relation.name, Mirror())

    def set_aside(self, mirror: Mirror, rejects: pa.Table) -> SetAside:
        return SetAside(rejects.num_rows)

    def apply(self, mirror: Mirror, changes: pa.Table, position: Lsn) -> AppliedChanges:
        name = next(name for name, held in self.held.items() if held is mirror)
        if name == self.fail_on:
            raise RuntimeError(f"the commit to {name} failed")
        fresh = changes if mirror.position is None else changes.filter(
            pc.greater(changes.column("_pgcdc_lsn"), int(mirror.position)))
        self.applied.append(name)
        mirror.rows += fresh.num_rows
        mirror.position = position
        return AppliedChanges(fresh.num_rows, frozenset(pc.unique(fresh.column("_pgcdc_lsn")).to_pylist()), position)


def applier(mirrors: Mirrors, progress: Progress) -> Applier:
    return Applier(None, lambda: None, progress, lambda: None, changelog=False, target=mirrors)  # type: ignore[arg-type]


def a_batch():
    return collected(batcher(), transactions(
        [ITEMS, Insert(None, 1, row(b"1", None, b"a")), OTHER, Insert(None, 2, row(b"9"))],
        [Insert(None, 1, row(b"2", None, b"b")), Insert(None, 1, row(b"3", None, b"c"))],
    ))


def test_a_batch_is_confirmed_at_its_flush_once_every_mirror_committed_and_counted_as_applied():
    mirrors, progress, confirmed = Mirrors(), Progress(), []
    with applier(mirrors, progress) as running:
        running.start(a_batch(), Lsn(1500))
        running.collect(confirmed.append)
    assert confirmed == [Lsn(1500)] and sorted(mirrors.applied) == ["items", "other"]
    assert (progress.rows_applied, progress.transactions_applied, progress.batches_applied) == (4, 2, 1)
    assert progress.applied_lsn == Lsn(2008) and not running.busy


def test_a_replayed_batch_is_not_applied_twice_nor_counted_twice():
    mirrors, progress, confirmed = Mirrors(), Progress(), []
    with applier(mirrors, progress) as running:
        for _ in range(2):  # the server sent it again after a reconnection
            running.start(a_batch(), Lsn(2008))
            running.collect(confirmed.append)
    assert progress.rows_applied == 4 and progress.transactions_applied == 2 and progress.batches_applied == 2
    assert mirrors.applied == ["items", "other"]  # the second time every run was held whole: passed over


def test_a_failed_apply_confirms_nothing_and_raises_its_error():
    mirrors, progress, confirmed = Mirrors(fail_on="other"), Progress(), []
    with applier(mirrors, progress) as running:
        running.start(a_batch(), Lsn(2008))
        with pytest.raises(RuntimeError, match="the commit to other failed"):
            running.collect(confirmed.append)
    assert confirmed == [] and progress.rows_applied == 0 and progress.applied_lsn is None


TABLES = [Relation(None, 10 + number, "public", f"t{number}", "d", (Column(1, "id", INT4, -1),))
          for number in range(6)]


def many_tables_batch():
    """Each of six tables in each of two transactions; items changes schema between them (two segments)."""
    return collected(batcher(), transactions(
        [ITEMS, Insert(None, 1, row(b"1", None, b"a")),
         *[message for number, table in enumerate(TABLES)
           for message in (table, Insert(None, table.relation_id, row(str(number).encode())))]],
        [WIDER, Insert(None, 1, row(b"2", None, b"b", b"x")),
         *[Insert(None, table.relation_id, row(str(10 + number).encode())) for number, table in enumerate(TABLES)]],
    ))


@dataclass
class SideBySide(Mirrors):
    """Mirrors whose applies wait for each other: ``together`` of them must be in flight at once, or none lands."""

    together: int = 3
    threads: dict[str, set[str]] = field(default_factory=dict)
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.barrier = threading.Barrier(self.together)

    def apply(self, mirror: Mirror, changes: pa.Table, position: Lsn) -> AppliedChanges:
        name = next(name for name, held in self.held.items() if held is mirror)
        with self.lock:
            self.threads.setdefault(name, set()).add(threading.current_thread().name)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            with contextlib.suppress(threading.BrokenBarrierError):  # the last few have no partners left
                self.barrier.wait(timeout=2)
            time.sleep(0.01)
            return super().apply(mirror, changes, position)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_the_mirrors_of_a_batch_apply_side_by_side_each_tables_runs_in_order_on_one_thread():
    mirrors, progress, confirmed = SideBySide(together=3), Progress(), []
    with Applier(None, lambda: None, progress, lambda: None, changelog=False, target=mirrors,  # type: ignore[arg-type]
                 apply_workers=3) as running:
        running.start(many_tables_batch(), Lsn(2008))
        running.collect(confirmed.append)
    assert confirmed == [Lsn(2008)]
    assert mirrors.most_in_flight == 3  # never more than the pool, and as many as it holds
    assert sorted(mirrors.applied) == sorted(["items", "items", *[t.name for t in TABLES]])
    assert all(len(threads) == 1 for threads in mirrors.threads.values())  # a table's segments: one thread, in turn
    assert {name: mirror.rows for name, mirror in mirrors.held.items()} == {"items": 2, **{t.name: 2 for t in TABLES}}
    assert (progress.rows_applied, progress.transactions_applied) == (14, 2)


def test_a_mirror_failing_beside_others_fails_the_batch_once_every_other_mirror_ended():
    mirrors, progress, confirmed = SideBySide(together=2, fail_on="t3"), Progress(), []
    with Applier(None, lambda: None, progress, lambda: None, changelog=False, target=mirrors,  # type: ignore[arg-type]
                 apply_workers=4) as running:
        running.start(many_tables_batch(), Lsn(2008))
        with pytest.raises(RuntimeError, match="the commit to t3 failed"):
            running.collect(confirmed.append)
        assert mirrors.in_flight == 0  # no commit still running once the batch has failed
    assert confirmed == [] and progress.rows_applied == 0 and progress.applied_lsn is None
    assert "t3" not in mirrors.applied and len(set(mirrors.applied)) == 6  # the others landed: a replay skips them
    with applier(mirrors, progress) as running:  # the batch sent again: only the failed mirror is applied
        mirrors.fail_on, mirrors.applied = None, []
        running.start(many_tables_batch(), Lsn(2008))
        running.collect(confirmed.append)
    assert confirmed == [Lsn(2008)] and mirrors.applied == ["t3"]


def test_mirrors_apply_side_by_side_by_default_one_after_another_with_a_change_log_where_more_is_refused():
    from pgcdc.errors import ConfigError
    from pgcdc.pipeline.config import DEFAULT_APPLY_WORKERS, PipelineConfig

    assert PipelineConfig(dsn="dbname=x", publication="p").mirror_workers == DEFAULT_APPLY_WORKERS > 1
    assert PipelineConfig(dsn="dbname=x", publication="p", changelog=True).mirror_workers == 1
    assert PipelineConfig(dsn="dbname=x", publication="p", apply_workers=1).mirror_workers == 1
    assert PipelineConfig(dsn="dbname=x", publication="p", apply_workers=3).mirror_workers == 3
    with pytest.raises(ConfigError, match="--apply-workers 4 cannot be used with --changelog yet"):
        PipelineConfig(dsn="dbname=x", publication="p", apply_workers=4, changelog=True)
    with pytest.raises(ConfigError, match="apply workers 0 must be 1 to 64"):
        PipelineConfig(dsn="dbname=x", publication="p", apply_workers=0)


def test_a_tables_rewrites_run_on_the_apply_thread_in_a_gap_a_batch_due_first_for_three_looks(caplog):
    """Batches deleting by position name the files a compaction replaces: a maintenance (on its own thread) hands a
    table's rewrites to the apply thread, which runs them between two applies once the stream's loop grants a gap:
    never while a batch applies, not while a batch is due until they have waited three looks, at once when none is.
    The batch handed over meanwhile waits behind them and says so. A stop cancels rewrites still waiting."""
    from pgcdc.mirrors.maintenance import MaintenanceCancelled, MaintenancePolicy

    mirrors, progress, confirmed = Mirrors(), Progress(), []
    policy = MaintenancePolicy(enabled=False, check_seconds=0.2)  # no turn of its own; three looks: 0.6 s
    ran: list[tuple[str, str]] = []

    def rewrites(name: str, seconds: float = 0.0):
        def call() -> None:
            time.sleep(seconds)
            ran.append((name, threading.current_thread().name))
        return call

    def asked(name: str, seconds: float = 0.0) -> tuple[threading.Thread, list[BaseException]]:
        failures: list[BaseException] = []

        def ask() -> None:
            try:
                running.maintainer.between(f"the rewrites of {name}", rewrites(name, seconds))
            except BaseException as exc:
                failures.append(exc)
        thread = threading.Thread(target=ask)
        thread.start()
        while running._gap_wanted is None:
            time.sleep(0.01)
        return thread, failures

    with caplog.at_level("INFO", logger="pgcdc.pipeline"), Applier(
            None, lambda: None, progress, lambda: None, changelog=False, target=mirrors,  # type: ignore[arg-type]
            maintenance=policy) as running:
        assert running.maintainer.between is not None  # deleting by position (the default): rewrites need a gap
        running.start(a_batch(), Lsn(100))
        thread, failures = asked("t1", seconds=1.1)
        running.maintain(batch_due=False)  # a batch applies: no gap
        running.collect(confirmed.append)
        running.maintain(batch_due=True)  # a batch due goes first
        time.sleep(0.1)
        assert ran == []
        running.maintain(batch_due=False)
        running.start(a_batch(), Lsn(200))  # handed over during the rewrites: waits behind them
        running.collect(confirmed.append)
        thread.join()
        assert ran == [("t1", "pgcdc-apply")] and not failures and confirmed == [Lsn(100), Lsn(200)]
        assert any("waited" in record.message and "the rewrites of t1" in record.message for record in caplog.records)

        thread, failures = asked("t2")
        running.maintain(batch_due=True)
        time.sleep(0.7)
        assert ran[1:] == []
        running.maintain(batch_due=True)  # waited three looks: before the batch due
        thread.join()
        assert ran[1:] == [("t2", "pgcdc-apply")] and not failures

        thread, failures = asked("t3")
        running.maintainer.cancel()  # the stop
        thread.join()
        running.maintain(batch_due=False)
        assert ran[2:] == [] and running._gap_wanted is None
        assert len(failures) == 1 and isinstance(failures[0], MaintenanceCancelled)
    equality = Applier(None, lambda: None, progress, lambda: None,  # type: ignore[arg-type]
                       changelog=False, target=mirrors, deletes="equality", maintenance=policy)
    with equality:
        assert equality.maintainer.between is None  # deletes naming keys: rewrites run beside the applies
