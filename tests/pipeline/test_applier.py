"""The apply thread's rules (pgcdc.pipeline.applier), over mirrors kept in memory: a batch is confirmed only once
every mirror it touched has committed, counts are of what reached the mirrors, and a run a mirror holds whole
is passed over. The same rules against real Iceberg mirrors: test_pipeline.py, test_signals.py, the crash loops."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from batches import ITEMS, OTHER, batcher, collected, row, transactions

from pgcdc.apply.batch import AppliedChanges
from pgcdc.apply.rejects import SetAside
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Insert, Relation
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
