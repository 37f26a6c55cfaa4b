"""Process settings for streaming work."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def streaming_gc(threshold: int = 50_000) -> Iterator[None]:
    """Fewer, cheaper garbage collections while streaming.

    A stream allocates millions of small acyclic objects (messages, tuple data, changes); with the
    default threshold the collector runs every 700 allocations and rescans everything alive, which
    costs as much as the decoding itself. Objects alive at start (imports, Spark's py4j state) are
    frozen out of the scans; the threshold is restored on exit.
    """
    previous = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(threshold, previous[1], previous[2])
    try:
        yield
    finally:
        gc.set_threshold(*previous)
        gc.unfreeze()
