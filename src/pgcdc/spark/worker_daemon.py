"""Spark's Python worker daemon, with the modules of pgcdc's tasks imported once.

Spark starts one daemon per executor (``python -m`` of ``spark.python.daemon.module``) and forks a worker
from it for each Python task slot. Every fresh worker of Spark's own daemon imports pyarrow, libpq's
drivers and pgcdc's converters again when its first task arrives: about 0.4 s of CPU each, paid
again whenever Spark starts new workers (after an idle minute, or with more slots). Imported here once,
before the daemon forks, the workers start with them loaded (their memory shared, copy-on-write). A module
that cannot be imported here is left to the task that needs it, which reports the error as before.

Two costs that pyspark's worker pays before every task (a copy's range, a batch's conversion) go too:

- It runs a full garbage collection after each task. The modules imported here are tens of thousands of
  objects that live as long as the process: frozen (``gc.freeze``) before the fork, no collection walks
  them again (measured here: 11 ms a collection, 0.001 ms frozen).
- It calls ``importlib.invalidate_caches()`` before each task, and Python 3.11's zip importer then parses the
  whole directory of every zip on the path again (pyspark's own zip: ~800 entries, 22 ms here). Python 3.12
  reads it again only when an import needs it; here it is read again only when the zip changed on disk.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys

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


def reread_zip_directories_only_when_changed() -> None:
    """Make ``zipimporter.invalidate_caches`` read an archive's directory again only when the archive's size
    or modification time differ from the last read (Python < 3.12; later versions need nothing)."""
    if sys.version_info >= (3, 12):
        return
    import zipimport

    reread = zipimport.zipimporter.invalidate_caches
    read_as_of: dict[str, tuple[int, int]] = {}

    def invalidate_caches(self: zipimport.zipimporter) -> None:
        try:
            stat = os.stat(self.archive)
        except OSError:
            reread(self)
            return
        version = (stat.st_mtime_ns, stat.st_size)
        if read_as_of.get(self.archive) != version:
            reread(self)
            read_as_of[self.archive] = version

    zipimport.zipimporter.invalidate_caches = invalidate_caches  # type: ignore[method-assign]


if __name__ == "__main__":
    preload()
    reread_zip_directories_only_when_changed()
    from pyspark.daemon import manager

    gc.freeze()
    manager()
