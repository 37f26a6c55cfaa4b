"""When a batch goes to the apply thread (pgcdc.pipeline.streaming.hand_over_due): the moment the apply thread is
free once the batch clock has run, at once when full (by its changes or their bytes), never beside a batch
applying. Ages are given, not waited."""

from __future__ import annotations

import pytest
from batches import ITEMS, batcher, collected, row, transactions

from pgcdc.errors import ConfigError
from pgcdc.pgoutput.messages import Insert
from pgcdc.pipeline.config import PipelineConfig
from pgcdc.pipeline.streaming import hand_over_due

CONFIG = PipelineConfig(dsn="host=localhost", publication="pub", batch_max_rows=1000, batch_max_seconds=0.5)


def test_a_batch_waits_for_the_clock_while_the_apply_thread_is_free():
    assert not hand_over_due(full=False, age=0.2, applying=False, config=CONFIG)
    assert hand_over_due(full=False, age=0.5, applying=False, config=CONFIG)


def test_a_batch_older_than_the_clock_waits_for_the_batch_applying_then_goes_at_once():
    # the apply took longer than the clock: the batch grew meanwhile and goes as soon as the apply thread is free
    assert not hand_over_due(full=False, age=3.0, applying=True, config=CONFIG)
    assert hand_over_due(full=False, age=3.0, applying=False, config=CONFIG)


def test_a_full_batch_goes_before_the_clock_but_never_beside_a_batch_applying():
    assert hand_over_due(full=True, age=0.0, applying=False, config=CONFIG)
    assert not hand_over_due(full=True, age=9.0, applying=True, config=CONFIG)


def test_running_until_caught_up_a_quiet_stream_hands_the_batch_over_before_the_clock():
    assert hand_over_due(full=False, age=0.0, applying=False, config=CONFIG, caught_up=True)
    assert not hand_over_due(full=False, age=0.0, applying=True, config=CONFIG, caught_up=True)


def test_the_default_clock_keeps_a_transaction_from_waiting_a_second_for_a_free_apply_thread():
    default = PipelineConfig(dsn="host=localhost", publication="pub")
    assert default.batch_max_seconds < 1.0
    assert hand_over_due(full=False, age=default.batch_max_seconds, applying=False, config=default)


def test_a_batch_is_full_at_its_changes_or_at_the_bytes_they_take():
    inserts = transactions(*[[ITEMS, *[Insert(None, 1, row(str(i).encode(), b"2024-01-01 00:00:00", b"x" * 100))
                                       for i in range(k * 50, k * 50 + 50)]] for k in range(4)])
    batch = collected(batcher(), inserts)
    assert batch.rows == 200 and 200 * 100 < batch.bytes < 200 * 1000  # its Arrow columns, the notes' bytes in them
    assert not batch.full(max_rows=201, max_bytes=batch.bytes + 1)
    assert batch.full(max_rows=200, max_bytes=batch.bytes + 1)
    assert batch.full(max_rows=10**6, max_bytes=batch.bytes)
    with pytest.raises(ConfigError, match="batch-mb"):
        PipelineConfig(dsn="host=localhost", publication="pub", batch_max_bytes=0)
