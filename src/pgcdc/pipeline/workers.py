"""Daemon threads that run submitted calls: the apply thread, the pool the mirrors of a batch apply on, the
tables of a copy copied side by side."""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, wait
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("pgcdc.pipeline")


class DaemonThreads:
    """Daemon threads (one by default) running the calls submitted to them: one thread runs them in order, several
    take them as they come. Unlike a ThreadPoolExecutor's workers, which the interpreter joins at exit, they never
    keep a stopping process alive: a second Ctrl-C stops at once, and a maintenance cut short at a stop is not
    waited for past its bound."""

    def __init__(self, name: str, threads: int = 1) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, name=name if threads == 1 else f"{name}-{number}",
                                          daemon=True) for number in range(1, threads + 1)]
        for thread in self._threads:
            thread.start()

    def submit(self, call: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((future, call))
        return future

    def run_all(self, call: Callable[[Any], T], items: Iterable[Any]) -> list[T]:
        """``call`` of every item on these threads, returning once every one has ended: their results in the items'
        order, or the first failure raised (the others logged). Nothing is still running when it returns or
        raises: interrupted while it waits (a Ctrl-C), the calls not started yet are cancelled and those under way
        waited for."""
        futures = [self.submit(functools.partial(call, item)) for item in items]
        try:
            wait(futures)
        except BaseException:
            for future in futures:
                future.cancel()  # (one already running goes on)
            wait(futures)
            raise
        failed = [error for future in futures if (error := future.exception()) is not None]
        for extra in failed[1:]:
            log.warning("failed beside the first failure: %s",
                        (str(extra).strip().splitlines() or [type(extra).__name__])[0][:300])
        if failed:
            raise failed[0]
        return [future.result() for future in futures]

    def shutdown(self) -> None:
        for _ in self._threads:
            self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            future, call = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:
                future.set_exception(exc)
