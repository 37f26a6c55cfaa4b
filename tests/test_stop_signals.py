"""What SIGINT and SIGTERM do to a pipeline, without a server: a stop in order, then at once."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from pgcdc.pipeline.config import Progress
from pgcdc.pipeline.signals import stop_on_signals


def test_the_first_signal_asks_for_a_stop_the_second_stops_at_once_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGTERM)
    stop, progress = threading.Event(), Progress(phase="streaming")
    with stop_on_signals(stop, progress):
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.is_set() and progress.stop_signal == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_during_the_initial_copy_stops_at_once_through_the_callers_own_handler():
    heard = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: heard.append(signum))
    try:
        stop, progress = threading.Event(), Progress(phase="snapshot")
        with stop_on_signals(stop, progress), pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert heard == [signal.SIGINT] and stop.is_set()
    finally:
        signal.signal(signal.SIGINT, previous)
