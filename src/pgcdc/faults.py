"""Injection points: named places where a fault test can kill pgcdc at a chosen instant.

Crash tests need to hit the narrow windows that random kills rarely reach: between the
commits of two mirrors in one batch, during a mirror's commit, during the initial copy, while a
prepared transaction is held. The code marks those places with :func:`injection_point`;
``PGCDC_INJECT`` arms one of them for a run (off, the cost is one dictionary lookup):

    PGCDC_INJECT=apply.between-mirrors          kill the process at the first hit
    PGCDC_INJECT=apply.mirror:3                  ... at the third hit
    PGCDC_INJECT=apply.mirror:1:0.4              ... 0.4 s after the first hit (inside the mirror's apply)
    PGCDC_INJECT=apply.mirror:1:0.4:INT          ... sends SIGINT instead (a user's Ctrl-C; or TERM)
    PGCDC_INJECT=apply.before-confirm:1:8:PAUSE ... holds the thread there for 8 s (a slow store or catalog)
    PGCDC_INJECT=apply.mirror:2,snapshot.copy:1:3:PAUSE   several, comma-separated

The fault is SIGKILL of the whole process: no handler, no ``finally``, no flush, exactly
what an OOM kill or a lost machine does; INT and TERM test what a stop asked for does; PAUSE makes one step
slow, as a loaded object store or catalog does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

POINTS = (
    "snapshot.copy",          # a table's copy job is about to run
    "snapshot.rejects",       # the rows a copy set aside committed to a __rejects table, the copy not yet
    "apply.mirror",           # a mirror's apply (row delta, MERGE or overwrite) is about to run
    "apply.delta-write",      # a mirror's row-delta files are about to be written
    "apply.delta-deletes",    # its data file written, its equality-delete file not yet
    "apply.delta-commit",     # a mirror's row-delta files written, their commit not yet made
    "apply.rejects",          # changes set aside committed to a __rejects table, the mirror's commit not yet made
    "apply.fill",             # columns added to a mirror, their existing rows not yet given the source's default
    "apply.between-mirrors",  # one mirror of a batch committed, another not yet (or still being applied)
    "apply.beside-commits",   # one mirror of a batch committed while another is being applied beside it
    "apply.before-confirm",   # every mirror of a batch committed, the slot not yet told
    "assembler.prepared",     # a prepared transaction is held, its COMMIT PREPARED not yet seen
    "index.manifest",         # a key index kept on disk wrote a new run, its manifest still names the one before
    # table maintenance (pgcdc.mirrors.maintenance): each step about to run, and every step done
    "maintain.compact-data",
    "maintain.small-commit",  # a small table's compacted file written in the driver, its commit not yet made
    "maintain.compact-deletes",
    "maintain.rewrite-manifests",
    "maintain.expire",
    "maintain.remove-orphans",
    "maintain.done",
)


@dataclass(frozen=True)
class _Armed:
    point: str
    hit: int
    delay: float
    signal: signal.Signals | None = signal.SIGKILL  # None: pause the thread for ``delay`` seconds


_SIGNALS: dict[str, signal.Signals | None] = {"KILL": signal.SIGKILL, "INT": signal.SIGINT, "TERM": signal.SIGTERM,
                                              "PAUSE": None}


def _parse(value: str | None) -> dict[str, _Armed]:
    armed: dict[str, _Armed] = {}
    for spec in filter(None, (value or "").split(",")):
        parts = spec.split(":")
        if parts[0] not in POINTS or len(parts) > 4 or (len(parts) == 4 and parts[3] not in _SIGNALS):
            raise ValueError(f"PGCDC_INJECT={value!r}: expected POINT[:HIT[:DELAY_SECONDS[:KILL|INT|TERM|PAUSE]]], "
                             "comma-separated, with POINT one of " + ", ".join(POINTS))
        hit = int(parts[1]) if len(parts) > 1 else 1
        delay = float(parts[2]) if len(parts) > 2 else 0.0
        armed[parts[0]] = _Armed(parts[0], hit, delay, _SIGNALS[parts[3]] if len(parts) == 4 else signal.SIGKILL)
    return armed


_armed = _parse(os.environ.get("PGCDC_INJECT"))
_hits: dict[str, int] = {}
_HITS_LOCK = threading.Lock()


def injection_point(name: str) -> None:
    """Kill this process here (or whatever ``PGCDC_INJECT`` asks) if it arms ``name`` and this is the armed hit."""
    armed = _armed.get(name) if _armed else None
    if armed is None:
        return
    with _HITS_LOCK:  # the mirrors of a batch are applied on several threads: each hit counted once
        _hits[name] = count = _hits.get(name, 0) + 1
    if count != armed.hit:
        return
    if armed.signal is None:
        time.sleep(armed.delay)
    elif armed.delay > 0:
        timer = threading.Timer(armed.delay, _fire, args=(armed.signal,))
        timer.daemon = True
        timer.start()
    else:
        _fire(armed.signal)


def _fire(sent: signal.Signals) -> None:
    os.kill(os.getpid(), sent)
