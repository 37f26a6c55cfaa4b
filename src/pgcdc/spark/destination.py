"""The destination: where the mirrors go (:class:`Destination`, declared once for every command and the Python
API), and what is checked of it before anything is created: the warehouse's storage (a directory, a bucket)
takes a file and gives it back, and the catalog answers and lets pgcdc create its namespace. Each failure is one
problem saying what is wrong (an endpoint nobody answers at, a missing bucket, refused credentials, an
unreachable catalog, a missing jar) and how to fix it, not a Java stack trace after the slot exists."""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pgcdc.errors import ConfigError
from pgcdc.secrets import redact, register_conf_secrets
from pgcdc.spark.settings import (
    DEFAULT_CATALOG,
    DEFAULT_NAMESPACE,
    DEFAULT_WAREHOUSE,
    catalog_settings,
    spark_settings,
    warehouse_uri,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("pgcdc.spark.destination")

# a check says within seconds what is wrong instead of retrying for minutes (the user's own settings win)
FAST_FAILURE_SETTINGS = {
    "spark.hadoop.fs.s3a.attempts.maximum": "1",
    "spark.hadoop.fs.s3a.retry.limit": "1",
    "spark.hadoop.fs.s3a.connection.establish.timeout": "5000",
    "spark.hadoop.fs.s3a.connection.timeout": "10000",
}




@dataclass(frozen=True)
class Destination:
    """Where the mirrors go, and the Spark that writes them: the ``warehouse`` (a directory or a URI such as
    ``s3a://bucket/prefix``), the Iceberg ``catalog`` Spark knows it by, of ``catalog_type`` hadoop (default: the
    warehouse itself), jdbc or rest at ``catalog_uri``, the ``namespace`` holding the mirrors, Spark settings
    (``conf``: ``spark.sql.catalog.<catalog>.*``, ``spark.hadoop.fs.s3a.*``, ...; their secret values never show
    in logs or errors), the Spark ``master`` (None: local) and ``java_options`` for the driver's and executors'
    JVMs. Validated when made.

    >>> Destination(warehouse="s3a://lake/mirrors", catalog_type="jdbc",
    ...             catalog_uri="jdbc:postgresql://db.example:5432/iceberg")  # doctest: +ELLIPSIS
    Destination(warehouse='s3a://lake/mirrors', ...)
    """

    warehouse: str | None = DEFAULT_WAREHOUSE
    catalog: str = DEFAULT_CATALOG
    catalog_type: str | None = None  # None: the type ``conf`` names, else hadoop
    catalog_uri: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    conf: Mapping[str, str] = field(default_factory=dict)
    master: str | None = None
    java_options: str = ""

    def __post_init__(self) -> None:
        register_conf_secrets(self.conf)
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))

    def problems(self) -> list[str]:
        """What is wrong with these settings, each with the fix (empty: nothing)."""
        problems = []
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.catalog):
            problems.append(f"catalog name {self.catalog!r} must be a plain identifier (letters, digits, _)")
        if not self.namespace or "`" in self.namespace:
            problems.append(f"mirror namespace {self.namespace!r} must be a non-empty name without back-quotes")
        try:
            catalog_settings(self.warehouse, self.catalog, conf=self.conf, catalog_type=self.catalog_type,
                             catalog_uri=self.catalog_uri)
        except ConfigError as exc:
            problems.append(str(exc))
        return problems

    def spark_settings(self, *, local: bool = True, short_lived: bool = False) -> dict[str, str]:
        """The settings of a Spark session that writes these mirrors (:func:`pgcdc.spark.settings.spark_settings`)."""
        return spark_settings(self.warehouse, self.catalog, local=local, conf=self.conf,
                              catalog_type=self.catalog_type, catalog_uri=self.catalog_uri, short_lived=short_lived,
                              java_options=self.java_options)


@dataclass(frozen=True)
class DestinationProblem:
    what: str
    fix: str


def check_destination(spark: SparkSession, warehouse: str, catalog: str, namespace: str) -> list[DestinationProblem]:
    """Problems of the warehouse's storage, then of the catalog (none: pgcdc can write its mirrors there)."""
    problems = _check_storage(spark, warehouse, catalog)
    if not problems:
        problems += _check_catalog(spark, catalog, namespace)
    return problems


def _check_storage(spark: SparkSession, warehouse: str, catalog: str) -> list[DestinationProblem]:
    jvm: Any = spark.sparkContext._jvm
    location = spark.conf.get(f"spark.sql.catalog.{catalog}.warehouse", None) or warehouse_uri(warehouse)
    hadoop = spark._jsparkSession.sessionState().newHadoopConf()
    for key, value in _catalog_hadoop_settings(spark, catalog).items():
        hadoop.set(key, value)
    # a file system of its own, not Hadoop's cached one of the same bucket, which may hold other settings
    hadoop.setBoolean(f"fs.{location.split(':', 1)[0]}.impl.disable.cache", True)
    filesystem = None
    try:
        directory = jvm.org.apache.hadoop.fs.Path(location)
        filesystem = directory.getFileSystem(hadoop)
        probe = jvm.org.apache.hadoop.fs.Path(directory, f".pgcdc-check-{uuid.uuid4().hex}")
        stream = filesystem.create(probe, True)
        stream.write(bytearray(b"pgcdc"))
        stream.close()
        length = filesystem.getFileStatus(probe).getLen()
        filesystem.delete(probe, False)
    except Exception as exc:  # py4j's wrapper of the JVM's exception
        return [_storage_problem(location, hadoop, _java_message(exc))]
    finally:
        if filesystem is not None:
            with contextlib.suppress(Exception):
                filesystem.close()
    if length != 5:
        return [DestinationProblem(f"the warehouse {location} gave back {length} bytes of the 5 pgcdc wrote",
                                   "check the storage's consistency settings")]
    return []


def _catalog_hadoop_settings(spark: SparkSession, catalog: str) -> dict[str, str]:
    """The catalog's own Hadoop settings (``spark.sql.catalog.<catalog>.hadoop.*``), which its tables use."""
    prefix = f"spark.sql.catalog.{catalog}.hadoop."
    jvm: Any = spark.sparkContext._jvm
    settings = jvm.scala.collection.JavaConverters.mapAsJavaMap(spark._jsparkSession.conf().getAll())
    return {str(key)[len(prefix):]: str(settings[key]) for key in settings.keySet() if str(key).startswith(prefix)}


def _storage_problem(location: str, hadoop: Any, message: str) -> DestinationProblem:
    scheme = location.split(":", 1)[0]
    bucket = location.split("://", 1)[1].split("/", 1)[0] if "://" in location else ""
    endpoint = hadoop.get(f"fs.s3a.bucket.{bucket}.endpoint") or hadoop.get("fs.s3a.endpoint") or "AWS's default"
    if re.search(r"No FileSystem for scheme|ClassNotFoundException.*(S3AFileSystem|com\.amazonaws)", message):
        return DestinationProblem(
            f"Spark cannot open {scheme}:// locations: its Hadoop has no client for them ({message})",
            "add the client's jars with --conf spark.jars=...: for s3a:// hadoop-aws (of Spark's Hadoop version, "
            "3.3.x) and the AWS SDK bundle it was built with (see docs/pipeline.md, 'Object storage')")
    if re.search(r"NoSuchBucket|[Bb]ucket .*does not exist|The specified bucket does not exist", message):
        return DestinationProblem(f"the bucket {bucket!r} of --warehouse {location} does not exist at {endpoint}",
                                  "create the bucket, or correct the bucket name in --warehouse")
    unreachable = DestinationProblem(f"nothing answers at the object store endpoint {endpoint} ({message})",
                                     "check spark.hadoop.fs.s3a.endpoint (host, port, http/https and "
                                     "fs.s3a.connection.ssl.enabled) and the network path to it")
    # a connection that never opened, before anything else: the message also names the probe's file, whose
    # random name may hold "403"
    if re.search(r"UnknownHost|Connection refused|ConnectException|connect timed out", message):
        return unreachable
    if re.search(r"AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|\b403\b|Forbidden|No AWS Credentials|"
                 r"NoAuthWithAWSException|credentials", message):
        return DestinationProblem(
            f"the object store at {endpoint} refused pgcdc's credentials for {location} ({message})",
            "check spark.hadoop.fs.s3a.access.key/secret.key (or the AWS_* variables, or the credentials "
            "provider) and that they may write in the bucket")
    if re.search(r"Unable to execute HTTP|SdkClientException", message):
        return unreachable
    return DestinationProblem(f"pgcdc cannot write in the warehouse {location}: {message}",
                              "check --warehouse and the storage's settings (--conf spark.hadoop.*)")


def _check_catalog(spark: SparkSession, catalog: str, namespace: str) -> list[DestinationProblem]:
    uri = spark.conf.get(f"spark.sql.catalog.{catalog}.uri", None)
    kind = spark.conf.get(f"spark.sql.catalog.{catalog}.type", None) or "configured"
    where = f"the {kind} catalog {catalog!r}" + (f" at {uri}" if uri else "")
    try:
        spark.sql(f"CREATE NAMESPACE IF NOT EXISTS `{catalog}`.`{namespace}`").collect()
        spark.sql(f"SHOW TABLES IN `{catalog}`.`{namespace}`").collect()
    except Exception as exc:
        message = _java_message(exc)
        if re.search(r"NotAuthorized|\b40[13]\b|Forbidden|password authentication failed|authentication", message):
            fix = ("check the catalog's credentials (spark.sql.catalog.<catalog>.jdbc.user/jdbc.password for "
                   "jdbc, .token or .credential for rest)")
            return [DestinationProblem(f"{where} refused pgcdc's credentials ({message})", fix)]
        if re.search(r"Connection refused|ConnectException|UnknownHost|No suitable driver|timed out|"
                     r"Connect to .* failed|Unable to|Failed to connect", message):
            fix = ("check --catalog-uri and that the catalog runs and is reachable from here; a JDBC catalog "
                   "also needs its database's JDBC driver in spark.jars")
            return [DestinationProblem(f"{where} cannot be reached ({message})", fix)]
        return [DestinationProblem(f"{where} refused to create namespace {namespace!r}: {message}",
                                   "check the catalog's settings (--catalog-type, --catalog-uri, --conf "
                                   f"spark.sql.catalog.{catalog}.*)")]
    return []


def _java_message(exc: BaseException) -> str:
    """The JVM's exception as one line: its class and message and those of its causes, secrets removed."""
    java = getattr(exc, "java_exception", None) or getattr(exc, "_origin", None)
    parts: list[str] = []
    while java is not None and len(parts) < 6:
        parts.append(f"{java.getClass().getName()}: {java.getMessage()}")
        java = java.getCause()
    text = "; caused by ".join(parts) if parts else str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return redact(" ".join(text.split()))[:600]
