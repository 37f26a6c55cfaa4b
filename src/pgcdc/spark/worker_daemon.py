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
    # pyarrow imports pandas, when it is installed, the first time it is given Python objects (to tell whether
    # they are pandas'): in each forked worker at its first task (~0.4 s of CPU) unless here, once
    "pandas",
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


def import_pyspark_compiled() -> None:
    """Spark puts its Python sources first on the daemon's path as zips (``pyspark.zip``, ``py4j-*-src.zip``),
    and Python compiles each module it imports from a zip again in every process, caching no bytecode: ~0.3 s of
    CPU per daemon (measured here: importing pyspark's daemon and worker, 0.5 s from the zips, 0.2 s from the
    installed packages). When the zips are those of the pyspark installed beside pgcdc (pip's pyspark is its own
    Spark home: the zips are its own files, made from the same sources), the installed packages, compiled as they
    were installed, are imported instead. Zips of another Spark home stay first."""
    from importlib.machinery import PathFinder

    directories = [entry for entry in sys.path if not entry.endswith(".zip")]
    spec = PathFinder.find_spec("pyspark", directories)
    if spec is None or not spec.submodule_search_locations:
        return
    lib = os.path.realpath(os.path.join(next(iter(spec.submodule_search_locations)), "python", "lib"))
    py4j = _installed_version("py4j") if PathFinder.find_spec("py4j", directories) is not None else None
    for entry in [entry for entry in sys.path if entry.endswith(".zip")]:
        if os.path.dirname(os.path.realpath(entry)) != lib:
            continue
        name = os.path.basename(entry)
        if name == "pyspark.zip" or (py4j is not None and name == f"py4j-{py4j}-src.zip"):
            sys.path.remove(entry)


def _installed_version(distribution: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


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
    import_pyspark_compiled()  # before anything imports pyspark
    preload()
    reread_zip_directories_only_when_changed()
    from pyspark.daemon import manager

    gc.freeze()
    manager()
