"""A class-data archive for the suite's JVMs (HotSpot's application class-data sharing, CDS).

The suite starts one or more JVMs for most tests that run ``pgcdc`` (each command a cold Spark), and a
cold Spark spends most of its start loading and verifying ~20,000 classes. An archive of those classes,
dumped once by a JVM that ran the same kind of work, is mapped by every later JVM instead: measured here, a
cold Spark session that creates, fills and merges into an Iceberg table used 11 to 13 s of CPU with the archive
and 18 to 19 s without it (8.5 to 9.6 s against 15 s to its result).

The archive belongs to one Java, one Spark and pgcdc's jars: its name carries a digest of them, and it is
made again when they change. It is dumped by a session with no other jars: HotSpot maps an archive into a JVM
whose class path begins with the one it was dumped with, and pgcdc puts the jars a test adds (the object
storage ones) after the Iceberg runtime, at the class path's end. A JVM that cannot use it (another Java, a
damaged file) runs without it: HotSpot checks the archive's header and class paths before mapping it. What the
tests compute does not depend on it.

``make test`` makes it as it installs the test parts (``python tests/jvm_class_archive.py --ensure``); a
suite run without one makes it in the background as it starts (conftest.py), and the JVMs of its first tests
start without it. ``python tests/jvm_class_archive.py PATH [JAR ...]`` makes an archive at PATH."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pgcdc.spark.destination import Destination

# The suite starts dozens of JVMs that live for seconds (each `pgcdc` it runs, each cold Spark) and runs each
# worker's session JVM through thousands of small queries, on a machine whose cores are all busy: CPU spent
# compiling code that runs a few times is CPU taken from the tests. So the quick compiler only (HotSpot's
# optimizing one costs a cold session's first queries twice their time on a busy 2-core machine), and the heap is
# collected by one thread. With the quick compiler alone HotSpot reserves 48 MB for compiled code, which a worker's
# session fills in its first three minutes of tests (then it sweeps the cache at every compilation, and once it
# is full compiles nothing more: all code new to it runs interpreted for the rest of the run): 256 MB, which a
# whole run's session does not fill, and cold code is not flushed from it. The quick compiler keeps HotSpot's
# thresholds: compiling later (CompileThresholdScaling=5) left more to the interpreter
# and cost more than it saved (a `pgcdc run` that copies, one that applies a batch and a `pgcdc status`:
# 28-35 CPU-s against 33-36; a session's maintenance test: 42-43 against 46). What the JVMs compute does not
# depend on any of this. The archive's maker runs with them too: its cold Spark's work and dump took 90 CPU-s with
# HotSpot's defaults, 66 with these (the archive holds the same classes).
SUITE_JAVA_OPTIONS = ("-XX:TieredStopAtLevel=1 -XX:ReservedCodeCacheSize=256m -XX:-UseCodeCacheFlushing "
                      "-XX:+UseSerialGC")

# How long the dump may take once the JVM is told to end (~20 s here).
DUMP_TIMEOUT = 300


def archive_directory() -> Path:
    """Where the archives live: beside the installed packages (the venv), else in the temporary directory."""
    if os.access(sys.prefix, os.W_OK):
        return Path(sys.prefix) / "pgcdc-test-jvm"
    return Path(tempfile.gettempdir()) / f"pgcdc-test-jvm-{os.getuid()}"


def suite_archive() -> Path:
    """The archive the suite's JVMs map: this Java's, this Spark's and pgcdc's jars'."""
    import pyspark

    from pgcdc.spark.session import ensure_java
    from pgcdc.spark.settings import PGCDC_JAR, iceberg_runtime_jar

    java = os.path.realpath(ensure_java())
    jars = [str(PGCDC_JAR), str(iceberg_runtime_jar())]
    # the layout of the class path the archive was dumped with: pgcdc's file system first, the Iceberg runtime
    # after Spark's jars (pgcdc.spark.session.jars_on_the_class_path)
    parts = [java, str(os.stat(java).st_mtime_ns), pyspark.__version__, "iceberg after spark", *jars]
    for jar in jars:  # HotSpot maps an archive only beside the very jars it was made with (size, time)
        with contextlib.suppress(OSError):
            parts.append(f"{os.stat(jar).st_size}:{os.stat(jar).st_mtime_ns}")
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return archive_directory() / f"spark-{digest}.jsa"


def java_options(archive: Path) -> str:
    """The JVM options that map ``archive``. HotSpot's own notes (an archive it cannot use) go to stderr, which
    pgcdc relays as log lines, never to stdout, where a command's output (``--json``) goes."""
    return f"-XX:SharedArchiveFile={archive} -Xshare:auto -Xlog:disable -Xlog:all=warning:stderr"


def start_making(archive: Path) -> subprocess.Popen[bytes] | None:
    """Start making ``archive`` in the background, unless it exists; returns the maker. The archive appears
    whole (renamed into place) once made: JVMs that start before then run without it (an archive that is
    not there is skipped silently), the later ones map it. Its output goes to ``make.log`` beside it."""
    for partial in archive.parent.glob("spark-*.*.partial"):  # a dump whose maker was killed (~100 MB each)
        maker_pid = partial.suffixes[-2].lstrip(".")
        if maker_pid.isdigit() and not _running(int(maker_pid)):
            with contextlib.suppress(OSError):
                partial.unlink()
    if archive.exists():
        return None
    archive.parent.mkdir(parents=True, exist_ok=True)
    for stale in archive.parent.glob("spark-*.jsa"):  # another Java, Spark or jar set: of no use any more
        with contextlib.suppress(OSError):
            stale.unlink()
    with open(archive.parent / "make.log", "wb") as log:
        return subprocess.Popen([sys.executable, __file__, str(archive)], stdout=log, stderr=subprocess.STDOUT)


def _running(pid: int) -> bool:
    """Whether a process ``pid`` runs (a maker's partial dump is its own until it ends)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def report(maker: subprocess.Popen[bytes] | None, archive: Path) -> str | None:
    """At the end of the run: what became of the maker, when it failed or is still at work (it is stopped)."""
    if maker is None:
        return None
    if maker.poll() is None:
        maker.kill()
        return f"the JVM class archive was still being made at the end of the run; stopped ({archive.parent})"
    if maker.returncode != 0 or not archive.exists():
        log = (archive.parent / "make.log").read_text(errors="replace")[-2000:]
        return f"no JVM class archive could be made (exit {maker.returncode}): the JVMs ran without one\n{log}"
    return None


def _make(archive: Path) -> None:
    """Run a cold Spark through the kinds of work the suite's JVMs do (Iceberg DDL, writes, MERGE, deletes,
    metadata tables, a Python task, a maintenance procedure), then let the JVM end normally: HotSpot dumps the
    classes it loaded as it exits. The dump goes to a file of its own, renamed into place once whole."""
    from pyspark import SparkContext

    from pgcdc.spark.session import spark_session

    partial = archive.with_suffix(f".{os.getpid()}.partial")
    os.environ["PGCDC_JAVA_OPTIONS"] = " ".join(filter(None, [
        os.environ.get("PGCDC_JAVA_OPTIONS", SUITE_JAVA_OPTIONS), f"-XX:ArchiveClassesAtExit={partial}", "-Xlog:disable"]))
    warehouse = tempfile.mkdtemp(prefix="pgcdc-class-archive-")
    try:
        spark = spark_session(Destination(warehouse=warehouse))
        statements = [
            "CREATE NAMESPACE IF NOT EXISTS pgcdc.warm",
            "CREATE TABLE pgcdc.warm.t (id bigint, name string, price decimal(12, 2), at timestamp, tags array<string>)"
            " USING iceberg TBLPROPERTIES ('format-version'='2', 'write.delete.mode'='merge-on-read', "
            "'write.update.mode'='merge-on-read', 'write.merge.mode'='merge-on-read')",
            "INSERT INTO pgcdc.warm.t SELECT id, CAST(id AS string), id * 1.5, current_timestamp(), array('a') "
            "FROM range(1000)",
            "MERGE INTO pgcdc.warm.t t USING (SELECT id, 'z' AS name FROM range(0, 2000, 7)) s ON t.id = s.id "
            "WHEN MATCHED AND s.id % 2 = 0 THEN DELETE WHEN MATCHED THEN UPDATE SET t.name = s.name "
            "WHEN NOT MATCHED THEN INSERT (id, name) VALUES (s.id, s.name)",
            "DELETE FROM pgcdc.warm.t WHERE id < 10",
            "CALL pgcdc.system.rewrite_data_files(table => 'warm.t', options => map('min-input-files', '1'))",
            "CALL pgcdc.system.expire_snapshots(table => 'warm.t', retain_last => 1)",
        ]
        for statement in statements:
            spark.sql(statement).collect()
        spark.sql("SELECT snapshot_id, summary FROM pgcdc.warm.t.snapshots").collect()
        spark.sql("SELECT count(*) FROM pgcdc.warm.t.files").collect()
        spark.range(1000).mapInArrow(lambda batches: batches, "id long").count()
        spark.stop()
        gateway = SparkContext._gateway
        process = gateway.proc if gateway is not None else None
        if process is None or process.stdin is None:
            raise SystemExit("the JVM was not started by this process")
        process.stdin.close()  # the gateway's JVM exits when its stdin ends, and dumps its classes as it does
        process.wait(timeout=DUMP_TIMEOUT)
        if not partial.exists():
            raise SystemExit(f"the JVM ended (exit {process.returncode}) without writing {partial}")
        os.replace(partial, archive)
    finally:
        shutil.rmtree(warehouse, ignore_errors=True)
        with contextlib.suppress(OSError):
            partial.unlink()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    if sys.argv[1:] == ["--ensure"]:  # make test's install step: the suite's archive, made now if missing
        wanted = suite_archive()
        maker = start_making(wanted)
        if maker is not None:
            maker.wait()
            print(report(maker, wanted) or f"JVM class archive for the tests made: {wanted}")
    else:
        _make(Path(sys.argv[1]))
