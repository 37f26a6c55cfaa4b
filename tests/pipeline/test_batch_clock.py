"""When a batch goes to the apply thread (pgcdc.pipeline.streaming.hand_over_due): the moment the apply thread is
free once the batch clock has run, at once when full, never beside a batch applying. Ages are given, not waited."""

from __future__ import annotations

from pgcdc.pipeline.config import PipelineConfig
from pgcdc.pipeline.streaming import hand_over_due

CONFIG = PipelineConfig(dsn="host=localhost", publication="pub", batch_max_rows=1000, batch_max_seconds=0.5)


def test_a_batch_waits_for_the_clock_while_the_apply_thread_is_free():
    assert not hand_over_due(rows=10, age=0.2, applying=False, config=CONFIG)
    assert hand_over_due(rows=10, age=0.5, applying=False, config=CONFIG)


def test_a_batch_older_than_the_clock_waits_for_the_batch_applying_then_goes_at_once():
    # the apply took longer than the clock: the batch grew meanwhile and goes as soon as the apply thread is free
    assert not hand_over_due(rows=10, age=3.0, applying=True, config=CONFIG)
    assert hand_over_due(rows=10, age=3.0, applying=False, config=CONFIG)


def test_a_full_batch_goes_before_the_clock_but_never_beside_a_batch_applying():
    assert hand_over_due(rows=1000, age=0.0, applying=False, config=CONFIG)
    assert not hand_over_due(rows=5000, age=9.0, applying=True, config=CONFIG)


def test_running_until_caught_up_a_quiet_stream_hands_the_batch_over_before_the_clock():
    assert hand_over_due(rows=1, age=0.0, applying=False, config=CONFIG, caught_up=True)
    assert not hand_over_due(rows=1, age=0.0, applying=True, config=CONFIG, caught_up=True)


def test_the_default_clock_keeps_a_transaction_from_waiting_a_second_for_a_free_apply_thread():
    default = PipelineConfig(dsn="host=localhost", publication="pub")
    assert default.batch_max_seconds < 1.0
    assert hand_over_due(rows=1, age=default.batch_max_seconds, applying=False, config=default)
