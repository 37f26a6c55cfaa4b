"""The Spark settings that write a destination's mirrors: Iceberg's runtime jar and extensions, the catalog
(hadoop, jdbc or rest) and its warehouse, and the defaults of a local session. Pure Python: a
:class:`pgcdc.spark.destination.Destination` is checked with them before any JVM starts, and
:func:`pgcdc.spark.session.spark_session` starts one with them."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from pgcdc.errors import ConfigError
from pgcdc.secrets import register_conf_secrets

DEFAULT_WAREHOUSE = "warehouse"
DEFAULT_CATALOG = "pgcdc"
DEFAULT_NAMESPACE = "mirror"
ICEBERG_EXTENSIONS = "org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions"
LOG_CONFIG = Path(__file__).with_name("log4j2.properties")
# pgcdc's Java classes (java/, make jar): Hadoop's local file system setting permissions without a chmod process
# per file, and the partitions of the row-delta writer's files (pgcdc.iceberg.Partitions)
PGCDC_JAR = Path(__file__).with_name("pgcdc-hadoop.jar")
LOCAL_FILE_SYSTEM = "pgcdc.hadoop.LocalFileSystem"
CLASS_PATH_SETTINGS = ("spark.driver.extraClassPath", "spark.executor.extraClassPath")


def iceberg_runtime_jar() -> Path:
    """The Iceberg 1.10.2 Spark 3.5 runtime jar shipped by ``snowpark-connect-deps-iceberg``."""
    try:
        import snowpark_connect_deps_iceberg
    except ImportError as exc:
        raise ConfigError(
            "the Iceberg runtime is missing: pip install snowpark-connect-deps-iceberg==1.0.2") from exc
    jars = Path(snowpark_connect_deps_iceberg.__file__).parent / "jars"
    matches = sorted(jars.glob("iceberg-spark-runtime-3.5_2.12-*.jar"))
    if not matches:
        raise ConfigError(f"no iceberg-spark-runtime-3.5_2.12 jar in {jars}")
    return matches[-1]


CATALOG_TYPES = ("hadoop", "jdbc", "rest")
HADOOP_FILE_IO = "org.apache.iceberg.hadoop.HadoopFileIO"
# HotSpot's optimizing compiler pays off over minutes of work; a JVM that lives for a few queries spends more CPU
# compiling than running (measured here: a cold session's first queries took half the wall time without it)
SHORT_LIVED_JVM = "-XX:TieredStopAtLevel=1"
# The driver's garbage collector on a machine of two cores or fewer, unless the options choose one: the JVM picks G1
# there, whose barriers and concurrent threads cost the batches' commits (py4j calls, metadata JSON, manifests:
# small objects, short-lived) about a third more JVM CPU than the serial collector, and which grows the heap to its
# bound (measured here on 2 cores: 9.4 against 6.8 ms of JVM CPU a commit; 1,791 against 750 MiB resident over
# 200 mirrors). On more cores the JVM's own choice stands.
SMALL_MACHINE_COLLECTOR = "-XX:+UseSerialGC"
SMALL_MACHINE_CORES = 2


def driver_collector(java_options: str, cores: int | None = None) -> str:
    """The garbage collector option pgcdc adds to its driver's JVM (empty: none): the serial collector on a machine
    of ``SMALL_MACHINE_CORES`` or fewer (``cores``: this process's, by default), unless ``java_options`` choose a
    collector themselves.

    >>> driver_collector("", cores=2), driver_collector("-XX:+UseG1GC", cores=2), driver_collector("", cores=8)
    ('-XX:+UseSerialGC', '', '')
    """
    if re.search(r"-XX:[+-]Use\w*GC\b", java_options):
        return ""
    return SMALL_MACHINE_COLLECTOR if (machine_cores() if cores is None else cores) <= SMALL_MACHINE_CORES else ""


def machine_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def spark_settings(
    warehouse: str | os.PathLike[str] | None = None,
    catalog: str = DEFAULT_CATALOG,
    *,
    local: bool = True,
    conf: Mapping[str, str] | None = None,
    catalog_type: str | None = None,
    catalog_uri: str | None = None,
    short_lived: bool = False,
    java_options: str | None = None,
) -> dict[str, str]:
    """The Spark settings pgcdc needs: the Iceberg runtime and extensions, and a catalog named ``catalog`` on
    ``warehouse`` (default ``./warehouse``). Add them to your own session's builder:

    >>> spark = SparkSession.builder.config(map=pgcdc.spark_settings("/data/iceberg")).getOrCreate()  # doctest: +SKIP

    ``catalog_type`` is hadoop (default), jdbc or rest (the latter two need ``catalog_uri``); ``conf`` entries
    override every default, and a ``spark.jars`` among them is added to the Iceberg runtime, not put in its
    place (object storage needs e.g. ``hadoop-aws`` and the AWS SDK bundle there). ``short_lived``: the JVM
    answers a few metadata questions and ends (``status``, ``check``), so it compiles with the quick compiler
    only. ``java_options`` (default: the ``PGCDC_JAVA_OPTIONS`` environment variable) are added to the driver's and
    executors' JVMs.
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", catalog):
        raise ConfigError(f"catalog name {catalog!r} must be a plain identifier (letters, digits, _)")
    conf = dict(conf or {})
    register_conf_secrets(conf)
    # a cluster's driver loads pgcdc's jar beside the Iceberg runtime its classes call (a local JVM has it on its
    # class path from its start, below)
    jars = [str(iceberg_runtime_jar())] + ([] if local else [str(PGCDC_JAR)])
    jars += [jar.strip() for jar in conf.pop("spark.jars", "").split(",") if jar.strip() and jar.strip() not in jars]
    java_options = " ".join(filter(None, [f"-Dlog4j.configurationFile={LOG_CONFIG.as_uri()}",
                                          SHORT_LIVED_JVM if short_lived else "",
                                          (os.environ.get("PGCDC_JAVA_OPTIONS", "") if java_options is None
                                           else java_options).strip()]))
    driver_options = " ".join(filter(None, [java_options, driver_collector(java_options)]))
    settings = {"spark.jars": ",".join(jars), "spark.sql.extensions": ICEBERG_EXTENSIONS,
                **catalog_settings(warehouse, catalog, conf=conf, catalog_type=catalog_type,
                                   catalog_uri=catalog_uri),
                "spark.sql.session.timeZone": "UTC",
                "spark.ui.showConsoleProgress": "false",
                # s3a deletes the directory markers above each file it writes, in a request of its own, for clients
                # older than Hadoop 3.2.2 that took a directory holding one for empty: Iceberg's writes make no
                # markers, so each commit made five requests that deleted nothing (a third of a small commit's)
                "spark.hadoop.fs.s3a.directory.marker.retention": "keep",
                "spark.sql.adaptive.enabled": "true",
                # Python workers forked with the copy's modules already imported (spark/worker_daemon.py)
                "spark.python.daemon.module": "pgcdc.spark.worker_daemon",
                "spark.driver.extraJavaOptions": driver_options,
                "spark.executor.extraJavaOptions": java_options}
    if local:
        settings["spark.sql.shuffle.partitions"] = "4"
        settings["spark.default.parallelism"] = "4"
        settings["spark.driver.memory"] = "2g"
        # Files of a local warehouse written by Hadoop's file system, whose permissions pgcdc's subclass sets in
        # the JVM: Hadoop's own starts a chmod process for each file and its checksum (pip's pyspark has no
        # Hadoop native library): ~3 ms of CPU each, measured here, where creating a small file costs ~1 ms in
        # all (the maintenance and apply tests: 182 -> 149 s of CPU without those processes). On the class path
        # from the JVM's start (spark-submit reads files before spark.jars are loaded); a local master's
        # executors are JVMs of this machine, where the jar is. A cluster's executors may not have it: there,
        # Hadoop's own.
        settings["spark.hadoop.fs.file.impl"] = LOCAL_FILE_SYSTEM
        for key in CLASS_PATH_SETTINGS:
            settings[key] = os.pathsep.join(filter(None, [conf.pop(key, ""), str(PGCDC_JAR)]))
    settings.update(conf)
    return settings


# PostgreSQL's SQLSTATEs for a connection it ended: admin_shutdown, crash_shutdown, cannot_connect_now
POSTGRESQL_CONNECTION_ENDED = "57P01,57P02,57P03"


def catalog_settings(warehouse: str | os.PathLike[str] | None, catalog: str = DEFAULT_CATALOG, *,
                     conf: Mapping[str, str] | None = None, catalog_type: str | None = None,
                     catalog_uri: str | None = None) -> dict[str, str]:
    """The ``spark.sql.catalog.<catalog>.*`` settings of an Iceberg catalog of ``catalog_type`` (hadoop, jdbc
    or rest; default: the type ``conf`` names, else hadoop) at ``catalog_uri``, its tables under ``warehouse``.
    A ``catalog-impl`` in ``conf`` (Glue, Nessie, ...) is left to choose for itself."""
    prefix = f"spark.sql.catalog.{catalog}"
    conf = conf or {}
    chosen = catalog_type or conf.get(f"{prefix}.type") or ("" if conf.get(f"{prefix}.catalog-impl") else "hadoop")
    uri = catalog_uri or conf.get(f"{prefix}.uri")
    settings = {
        prefix: "org.apache.iceberg.spark.SparkCatalog",
        # Positions are read back from table metadata: always see other writers' latest commits.
        f"{prefix}.cache-enabled": "false",
    }
    if chosen:
        settings[f"{prefix}.type"] = chosen
    if catalog_type is not None and catalog_type not in CATALOG_TYPES:
        raise ConfigError(f"--catalog-type {catalog_type!r} must be one of {', '.join(CATALOG_TYPES)}; other "
                          f"catalogs (hive, glue, nessie) are set with --conf {prefix}.type=... or "
                          f"{prefix}.catalog-impl=...")
    if chosen in ("jdbc", "rest"):
        scheme = "jdbc:" if chosen == "jdbc" else "http"
        example = "jdbc:postgresql://db.example:5432/iceberg" if chosen == "jdbc" else "https://catalog.example/api"
        if not uri:
            raise ConfigError(f"a {chosen} catalog needs its address: --catalog-uri {example}")
        if not uri.startswith(scheme):
            raise ConfigError(f"--catalog-uri {uri!r} is not the address of a {chosen} catalog; give one such as "
                              f"{example}")
        settings[f"{prefix}.uri"] = uri
        # S3FileIO needs the AWS SDK v2 (iceberg-aws-bundle); Hadoop's FileIO reaches s3a://, hdfs:// and files
        settings[f"{prefix}.io-impl"] = HADOOP_FILE_IO
    if chosen == "jdbc":
        settings[f"{prefix}.jdbc.schema-version"] = "V1"  # the schema that also holds views
        # a catalog connection PostgreSQL ended (its server restarted or failed over, the backend terminated) is
        # opened again and the call retried, as Iceberg does for its own list of connection errors
        settings[f"{prefix}.retryable_status_codes"] = POSTGRESQL_CONNECTION_ENDED
    if chosen == "rest" and warehouse is None:
        return settings  # a REST catalog knows where its tables go
    settings[f"{prefix}.warehouse"] = warehouse_uri(warehouse)
    return settings


def warehouse_uri(warehouse: str | os.PathLike[str] | None) -> str:
    """A warehouse as Iceberg wants it: a local path (default ``./warehouse``) as an absolute ``file:`` URI,
    any other URI (``s3a://``, ``hdfs://``) as it is."""
    warehouse_text = str(warehouse or "warehouse")
    is_uri = re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", warehouse_text) is not None  # s3a://, file:/, hdfs://
    if is_uri and not warehouse_text.startswith("file:"):
        return warehouse_text
    return Path(warehouse_text.removeprefix("file:")).resolve().as_uri()
