"""Crash loop: SIGKILL the pipeline again and again under a steady mixed workload, restart it each time,
and prove at the end that every mirror equals its source row for row (nothing lost, nothing twice).

Random instants rarely hit the narrow windows, so most kills are aimed with injection points
(``PGCDC_INJECT``, see :mod:`pgcdc.faults`): during the initial copy, inside each writer's commit, between
the commits of two mirrors of one batch, after the commits but before the slot is told, and while a
prepared transaction is held between PREPARE and COMMIT PREPARED."""

from __future__ import annotations

import time

import pytest

from pipeline_support import FLOOD_PAUSE, crash_loop

pytestmark = pytest.mark.slow

# (injection point spec or None for a random instant) — one round each, with the default (row-delta) writer:
# the initial copy, the writer's own windows (before its files, between its data and delete files, after both
# but before the commit, which also folds the mirror's small file), between two mirrors' commits and while the
# mirrors of a batch commit side by side, a prepared
# transaction held, after every commit but before the slot is told, a key index on disk between its new run and its
# manifest; random instants in make soak
ROUNDS = [
    "snapshot.copy:2:0.3",        # the initial copy: one table copied, the next mid-copy
    "index.manifest:2",           # the first batch: a key index's run on disk written, its manifest not yet
    "apply.delta-write:1",        # before the batch's files
    "apply.delta-deletes:2",      # the data file written, the delete file not
    "apply.between-mirrors:1",    # one mirror of a batch committed, another not yet
    "apply.beside-commits:1",     # one mirror committed while others of its batch are being applied beside it
    "assembler.prepared:1",       # PREPARE received and held, COMMIT PREPARED not yet
    "apply.delta-commit:3",       # both files written, the commit not made
    "apply.before-confirm:1",     # all mirrors committed, the slot not yet told
]

# the MERGE writer's windows
MERGE_ROUNDS = [
    "apply.mirror:1:0.6",          # inside a MERGE
    "apply.between-mirrors:2",
    None,
    "apply.mirror:3:1.5",
    "apply.before-confirm:1",
]


@pytest.mark.long(5)
def test_killed_in_every_window_loses_and_duplicates_nothing(pg, spark, tmp_path):
    # the mirrors of a batch applied side by side (--apply-workers 4): one after another is every other test's;
    # every key index kept on disk (--index-memory-mb 0), each restart opening what the killed run saved
    crash_loop(pg, spark, ROUNDS, seed=20261122, aim_timeout=120, apply_workers=4, index_memory_mb=0,
               index_dir=str(tmp_path / "indexes"))


@pytest.mark.soak
def test_killed_inside_the_merge_writer_loses_and_duplicates_nothing(pg, spark):
    # the copy made first: every kill lands in the applies
    crash_loop(pg, spark, MERGE_ROUNDS, seed=20261125, aim_timeout=150, copied_first=True, apply_writer="merge",
               workload_pause=FLOOD_PAUSE)


@pytest.mark.soak
@pytest.mark.timeout(3600)  # 27 restarts, each starting a JVM: longer than the suite's per-test limit
def test_soak_crash_loop_of_many_kills(pg, spark):
    crash_loop(pg, spark, [*ROUNDS, None] * 3 + MERGE_ROUNDS, seed=int(time.time()), workload_pause=FLOOD_PAUSE)
