"""Where an apply's time goes: wall seconds per named step, cheap enough to keep on every batch.

The applier adds them up per run (:class:`pgcdc.pipeline.config.Progress`), and ``bench/pipeline.py`` prints them
beside its figures: what a batch's fixed cost is made of, and which step bounds the lag.
"""

from __future__ import annotations

import time


class StepClock:
    """Laps of one apply: each :meth:`lap` charges the time since the previous one to the step it names."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.seconds[step] = self.seconds.get(step, 0.0) + now - self._last
        self._last = now
