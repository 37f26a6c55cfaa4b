"""The tables of a copy copied side by side (pgcdc.pipeline.snapshotter), each table's copy stood in for: how many
run at once, the largest first, and what a failure, a value that stops one table, or an interrupt leaves. The same
copies into real mirrors, killed and interrupted: test_crash_loop.py, test_signals.py, test_operator_safety.py."""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
from batches import INT4

from pgcdc.errors import ConversionError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Column, Relation
from pgcdc.pipeline.config import PipelineConfig, Progress
from pgcdc.pipeline.snapshotter import Snapshotter
from pgcdc.replication.published import PublishedTable


def published(count: int) -> list[PublishedTable]:
    return [PublishedTable(Relation(None, 100 + n, "public", f"t{n}", "d", (Column(1, "id", INT4, -1),)),
                           estimated_rows=10 * n, pages=1) for n in range(count)]


class Copies:
    """Stands in for each table's copy: records which run at once, and fails or stops where told."""

    def __init__(self, seconds: float = 0.05, fail: str | None = None, stop: str | None = None) -> None:
        self.seconds, self.fail, self.stop = seconds, fail, stop
        self.started: list[str] = []
        self.running = 0
        self.most = 0
        self.lock = threading.Lock()

    def __call__(self, table: PublishedTable, snapshot_name: str, consistent_lsn: Lsn) -> int:
        with self.lock:
            self.started.append(table.name)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if table.name == self.fail:  # a quarter of the way: the other copies started are still under way
                time.sleep(self.seconds / 4)
                raise RuntimeError(f"the copy of {table.name} failed")
            time.sleep(self.seconds)
            if table.name == self.stop:
                raise ConversionError(f"a value of {table.name} cannot be converted")
            return table.estimated_rows
        finally:
            with self.lock:
                self.running -= 1


class Namespaces:
    """The mirrors' catalog as the copy sees it before its tables start: the namespaces it makes."""

    def __init__(self, copies: Copies) -> None:
        self.copies, self.made, self.looked = copies, [], []

    def ensure_namespace(self, schema: str) -> None:
        assert not self.copies.started, "namespaces are made before any table's copy starts"
        self.made.append(schema)

    def look_at(self, tables: list[tuple[str, str]], each=None) -> None:
        assert not self.copies.started, "the mirrors are looked at before any table's copy starts"
        self.looked.extend(tables)


def snapshotter(copies: Copies, workers: int) -> Snapshotter:
    config = PipelineConfig(dsn="dbname=x", publication="p", copy_workers=workers)
    tables = SimpleNamespace(mirrors=Namespaces(copies))
    copier = Snapshotter(config, tables, None, Progress(), lambda phase: None, lambda: None)  # type: ignore[arg-type]
    copier._copy_table = copies  # type: ignore[method-assign]
    return copier


def test_tables_are_copied_side_by_side_the_largest_first():
    copies = Copies()
    copier = snapshotter(copies, workers=4)
    copied = copier._copy(published(10), "snap", Lsn(100))
    assert copier.tables.mirrors.made == ["public"]  # once, before the mirrors are made side by side
    assert copied == {f"public.t{n}": 10 * n for n in range(10)}
    assert copies.most == 4  # as many at once as asked, never more
    assert copies.started[:4] == ["t9", "t8", "t7", "t6"]
    one = Copies(seconds=0.01)
    assert len(snapshotter(one, workers=1)._copy(published(3), "snap", Lsn(1))) == 3
    assert one.most == 1 and one.started == ["t0", "t1", "t2"]  # one worker: in the publication's order


def test_a_failed_copy_starts_no_further_table_and_waits_for_those_under_way():
    copies = Copies(seconds=0.2, fail="t9")
    copied: dict[str, int] = {}
    with pytest.raises(RuntimeError, match="the copy of t9 failed"):
        snapshotter(copies, workers=3)._copy(published(10), "snap", Lsn(100), copied)
    assert copies.running == 0  # nothing still copying when the failure is raised
    assert copies.started == ["t9", "t8", "t7"]  # those under way finished; no other started
    assert copied == {"public.t8": 80, "public.t7": 70}  # what the mirrors hold: the slot keeps backing them


def test_a_value_that_stops_one_table_lets_the_others_be_copied_and_names_both():
    copies = Copies(stop="t2")
    with pytest.raises(ConversionError) as raised:
        snapshotter(copies, workers=2)._copy(published(4), "snap", Lsn(100))
    assert "a value of t2 cannot be converted" in str(raised.value)
    assert "copied: public.t0, public.t1, public.t3; not copied: public.t2" in str(raised.value)


def test_an_interrupt_starts_no_further_table_and_waits_for_the_copies_under_way():
    copies = Copies(seconds=0.3)
    copier = snapshotter(copies, workers=2)
    copied: dict[str, int] = {}

    def interrupted(signum, frame):  # what pgcdc's handler does at a Ctrl-C during a copy (pipeline/signals.py)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            copier._copy(published(6), "snap", Lsn(100), copied)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert copies.running == 0 and copies.started == ["t5", "t4"]
    assert copied == {"public.t5": 50, "public.t4": 40}
