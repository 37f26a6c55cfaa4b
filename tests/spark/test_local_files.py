"""pgcdc's local file system for Spark (src/pgcdc/spark/java): Hadoop's own, checksums included, whose
permissions are set in the JVM instead of by a chmod process per file. It must leave on disk exactly what
Hadoop's own leaves, and be what a local session's ``file:`` paths and mirrors are written with."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import zipfile
from pathlib import Path

import pytest
from py4j.protocol import Py4JJavaError

from pgcdc.spark.settings import LOCAL_FILE_SYSTEM, PGCDC_JAR, iceberg_runtime_jar, spark_settings

SOURCES = Path(__file__).parents[2] / "src" / "pgcdc" / "spark" / "java"


def test_a_local_session_writes_files_with_pgcdcs_file_system_and_a_cluster_with_hadoops():
    local = spark_settings("/w")
    assert local["spark.hadoop.fs.file.impl"] == LOCAL_FILE_SYSTEM
    assert local["spark.driver.extraClassPath"] == str(PGCDC_JAR)
    assert local["spark.executor.extraClassPath"] == str(PGCDC_JAR)
    assert PGCDC_JAR.is_file()
    # a class path of the user's own keeps its entries, first; a file system of the user's own is theirs
    mine = spark_settings("/w", conf={"spark.driver.extraClassPath": "/opt/mine.jar",
                                      "spark.hadoop.fs.file.impl": "org.example.Files"})
    assert mine["spark.driver.extraClassPath"] == os.pathsep.join(["/opt/mine.jar", str(PGCDC_JAR)])
    assert mine["spark.hadoop.fs.file.impl"] == "org.example.Files"
    # a cluster's executors may not have the jar on their class path: Hadoop's own file system there; its driver
    # loads the jar beside the Iceberg runtime, whose classes pgcdc.iceberg.Partitions calls
    cluster = spark_settings("/w", local=False)
    assert "spark.hadoop.fs.file.impl" not in cluster
    assert not [key for key in cluster if key.endswith("extraClassPath")]
    assert cluster["spark.jars"].split(",")[:2] == [str(iceberg_runtime_jar()), str(PGCDC_JAR)]


def test_the_shipped_jar_is_what_its_sources_compile_to(tmp_path):
    if shutil.which("javac") is None:
        pytest.skip("needs a JDK's javac (make test installs one)")
    spec = importlib.util.spec_from_file_location("build_jar", SOURCES / "build_jar.py")
    assert spec is not None and spec.loader is not None
    build_jar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_jar)
    built = build_jar.build(tmp_path / "built.jar")
    with zipfile.ZipFile(built) as fresh, zipfile.ZipFile(PGCDC_JAR) as shipped:
        assert fresh.namelist() == shipped.namelist()
        for name in fresh.namelist():
            assert fresh.read(name) == shipped.read(name), f"{name} differs from its source: run make jar"


def _file_systems(spark):
    """pgcdc's local file system as the session resolves ``file:``, and Hadoop's own, each new (uncached)."""
    jvm = spark._jvm
    conf = spark._jsc.hadoopConfiguration()
    ours = jvm.org.apache.hadoop.fs.FileSystem.newInstance(jvm.java.net.URI("file:///"), conf)
    hadoops = jvm.org.apache.hadoop.fs.LocalFileSystem()
    hadoops.initialize(jvm.java.net.URI("file:///"), conf)
    return ours, hadoops


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_files_directories_permissions_and_checksums_are_as_hadoops_own_leaves_them(spark, tmp_path):
    jvm = spark._jvm
    ours, hadoops = _file_systems(spark)
    assert ours.getClass().getName() == LOCAL_FILE_SYSTEM
    assert ours.getRawFileSystem().getClass().getName() == f"{LOCAL_FILE_SYSTEM}$RawLocalFileSystem"
    FsPermission = jvm.org.apache.hadoop.fs.permission.FsPermission

    def write(fs, root: Path) -> None:
        path = jvm.org.apache.hadoop.fs.Path(f"file://{root}/a/b/data.bin")
        out = fs.create(path, False)  # its directories made on the way, as Iceberg's writers do
        out.write(bytes(range(256)) * 40)
        out.close()
        fs.mkdirs(jvm.org.apache.hadoop.fs.Path(f"file://{root}/made"))
        for name, mode in (("private", 0o600), ("group", 0o750), ("everyone", 0o777), ("none", 0o000)):
            file = jvm.org.apache.hadoop.fs.Path(f"file://{root}/{name}")
            fs.create(file, False).close()
            fs.setPermission(file, FsPermission(mode))
        # a mode java.nio cannot set (the sticky bit) goes Hadoop's way
        fs.mkdirs(jvm.org.apache.hadoop.fs.Path(f"file://{root}/sticky"))
        fs.setPermission(jvm.org.apache.hadoop.fs.Path(f"file://{root}/sticky"), FsPermission(0o1777))

    write(ours, tmp_path / "ours")
    write(hadoops, tmp_path / "hadoops")
    left = {path.relative_to(tmp_path / "ours"): (_mode(path), path.read_bytes() if path.is_file() else None)
            for path in (tmp_path / "ours").rglob("*")}
    right = {path.relative_to(tmp_path / "hadoops"): (_mode(path), path.read_bytes() if path.is_file() else None)
             for path in (tmp_path / "hadoops").rglob("*")}
    assert left == right
    # what was asked for, and the checksum beside every file
    assert left[Path("private")][0] == 0o600 and left[Path("everyone")][0] == 0o777 and left[Path("none")][0] == 0
    assert _mode(tmp_path / "ours" / "sticky") == 0o1777
    assert Path("a/b/.data.bin.crc") in left

    # the checksums are still read: a damaged file is refused, as by Hadoop's own
    data = tmp_path / "ours" / "a" / "b" / "data.bin"
    damaged = bytearray(data.read_bytes())
    damaged[100] ^= 0xFF
    data.write_bytes(bytes(damaged))
    stream = ours.open(jvm.org.apache.hadoop.fs.Path(f"file://{data}"))
    try:
        with pytest.raises(Py4JJavaError, match="ChecksumException"):
            jvm.org.apache.commons.io.IOUtils.toByteArray(stream)
    finally:
        stream.close()
    # a file that is not there is named as Hadoop's own names it
    with pytest.raises(Py4JJavaError, match="FileNotFoundException"):
        ours.setPermission(jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path}/missing"), FsPermission(0o644))


def test_a_local_sessions_jars_are_on_its_class_path_after_sparks_own(spark):
    """The session's JVM (started by pgcdc, with the object storage jars when they are installed) loads the
    Iceberg runtime and every jar of its settings from its class path, after Spark's jars, and no executor
    fetches a copy of them."""
    from pgcdc.local_object_store import object_store_jars
    from pgcdc.spark.settings import iceberg_runtime_jar

    jvm = spark._jvm
    class_path = str(jvm.java.lang.System.getProperty("java.class.path")).split(os.pathsep)
    jars = [str(iceberg_runtime_jar()), *object_store_jars()]
    assert class_path[-len(jars):] == jars, class_path
    spark_jar = next(i for i, entry in enumerate(class_path) if os.path.basename(entry).startswith("spark-core_"))
    assert spark_jar < len(class_path) - len(jars)
    system = jvm.java.lang.ClassLoader.getSystemClassLoader()
    names = ["org.apache.iceberg.Table", "org.apache.iceberg.spark.SparkCatalog"]
    if object_store_jars():
        names += ["org.apache.hadoop.fs.s3a.S3AFileSystem", "org.postgresql.Driver"]
    for name in names:
        assert jvm.java.lang.Class.forName(name).getClassLoader().equals(system), name
    assert spark.sparkContext.getConf().get("spark.jars", "") == ""
    spark.sql("SELECT count(*) FROM range(10)").collect()  # a task ran: nothing was fetched for it
    root = Path(str(jvm.org.apache.spark.SparkFiles.getRootDirectory()))
    assert not [path.name for path in root.glob("*.jar")]
