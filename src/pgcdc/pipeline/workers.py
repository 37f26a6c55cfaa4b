"""Daemon threads that run submitted calls: the apply thread, the pool the mirrors of a batch apply on, the
tables of a copy copied side by side."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


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
