"""Spark's Python worker daemon, with the modules of pgcdc's tasks imported once.

Spark starts one daemon per executor (``python -m`` of ``spark.python.daemon.module``) and forks a worker
from it for each Python task slot. Every fresh worker of Spark's own daemon imports pyarrow, libpq's
drivers and pgcdc's converters again when its first task arrives: about 0.4 s of CPU each, paid
again whenever Spark starts new workers (after an idle minute, or with more slots). Imported here once,
before the daemon forks, the workers start with them loaded (their memory shared, copy-on-write). A module
that cannot be imported here is left to the task that needs it, which reports the error as before."""

from __future__ import annotations

import contextlib
import importlib

TASK_MODULES = (
    "pyarrow",
    "pyarrow.compute",
    "pyarrow.fs",
    "pyarrow.parquet",
    "psycopg2",
    "pgcdc.spark.snapshot",
    "pgcdc.types.convert",
)


def preload() -> None:
    for name in TASK_MODULES:
        with contextlib.suppress(Exception):
            importlib.import_module(name)


if __name__ == "__main__":
    preload()
    from pyspark.daemon import manager

    manager()
