"""A local S3 server and a JDBC catalog for the demo and benchmarks (and the test suite): mirrors on object
storage behind a real Iceberg catalog, on one machine, offline.

The parts are not in pgcdc's default install (``make demo-object-store`` and ``make test`` add them): a local
S3 server (``moto_server`` from PyPI's ``moto[server]``; the bucket is created with boto3), Hadoop's s3a
client (``hadoop-aws-3.3.1.jar`` and ``aws-java-sdk-bundle-1.11.901.jar``, both needed, shipped in PyPI's
``sagemaker-pyspark==1.4.5`` source archive) and the PostgreSQL JDBC driver (Debian's
``libpostgresql-jdbc-java``) for Iceberg's JDBC catalog, whose tables live in a database of a PostgreSQL
server (the demo's embedded one).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql

from pgcdc.embedded import free_port
from pgcdc.errors import ConfigError

POSTGRES_JDBC_JARS = ("/usr/share/java/postgresql.jar",)
S3A_JARS = ("hadoop-aws-3.3.1.jar", "aws-java-sdk-bundle-1.11.901.jar")


def s3a_jars() -> list[str]:
    """``hadoop-aws-3.3.1.jar`` and ``aws-java-sdk-bundle-1.11.901.jar`` (both needed by s3a), if installed."""
    import importlib.util

    # found, not imported: importing the package runs its wrappers, which import pyspark.ml (~0.2 s of CPU)
    spec = importlib.util.find_spec("sagemaker_pyspark")
    if spec is None or not spec.submodule_search_locations:
        return []
    jars = Path(next(iter(spec.submodule_search_locations))) / "jars"
    found = [jars / name for name in S3A_JARS]
    return [str(jar) for jar in found] if all(jar.is_file() for jar in found) else []


def postgres_jdbc_jar() -> str | None:
    return next((jar for jar in POSTGRES_JDBC_JARS if os.path.isfile(jar)), None)


def object_store_jars() -> list[str]:
    """The jars of s3a and of the JDBC catalog's driver that are installed (a Spark may start with them unused)."""
    jdbc = postgres_jdbc_jar()
    return s3a_jars() + ([jdbc] if jdbc else [])


def moto_server_program() -> str | None:
    """``moto_server`` beside this interpreter (a venv's), else on PATH."""
    beside = Path(sys.executable).with_name("moto_server")
    return str(beside) if beside.exists() else shutil.which("moto_server")


def missing_parts() -> list[str]:
    """What a local S3 server with a JDBC catalog still needs here, each with the command that installs it."""
    missing = []
    if not s3a_jars():
        missing.append("Hadoop's s3a jars (pip install --no-deps sagemaker-pyspark==1.4.5)")
    if postgres_jdbc_jar() is None:
        missing.append("the PostgreSQL JDBC driver (apt-get install libpostgresql-jdbc-java)")
    if moto_server_program() is None:  # moto[server] brings boto3, which creates the bucket
        missing.append("the local S3 server moto_server (pip install 'moto[server]==5.2.5')")
    return missing


def wait_for_port(port: int, process: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout} s")


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class S3Server:
    """A local S3 server; its credentials are checked by nobody but look like real ones in every setting (so
    that a secret key that shows anywhere is caught)."""

    endpoint: str
    access_key: str = "pgcdc-local-access"
    secret_key: str = field(default_factory=lambda: f"s3-secret-{uuid.uuid4().hex}")

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key)

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def hadoop_settings(self, prefix: str = "") -> dict[str, str]:
        """The s3a settings that reach this server (``prefix`` ``spark.hadoop.`` for Spark conf, ``hadoop.``
        for a catalog's own settings)."""
        return {f"{prefix}fs.s3a.{key}": value for key, value in {
            "endpoint": self.endpoint, "endpoint.region": "us-east-1", "path.style.access": "true",
            "connection.ssl.enabled": "false", "access.key": self.access_key, "secret.key": self.secret_key,
            "aws.credentials.provider": "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider",
        }.items()}


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """``moto_server`` on a free loopback port, in its own process (a workload and Spark's Python tasks keep
    this interpreter busy), stopped afterwards."""
    program = moto_server_program()
    if program is None:
        raise ConfigError("moto_server is not installed: pip install 'moto[server]==5.2.5'")
    port = free_port()
    process = subprocess.Popen([program, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, process, "moto_server")
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        stop_process(process)


@dataclass
class CatalogSetup:
    """An Iceberg catalog on S3 as pgcdc is told about it: the ``Destination`` fields that name it."""

    catalog: str
    catalog_type: str
    catalog_uri: str
    warehouse: str
    spark_conf: dict[str, str]

    def config_overrides(self) -> dict:
        """The fields of a :class:`pgcdc.Destination` that name this catalog and its warehouse."""
        return {"catalog": self.catalog, "catalog_type": self.catalog_type, "catalog_uri": self.catalog_uri,
                "warehouse": self.warehouse, "conf": dict(self.spark_conf)}

    def cli_arguments(self) -> list[str]:
        arguments = ["--catalog", self.catalog, "--catalog-type", self.catalog_type, "--catalog-uri",
                     self.catalog_uri, "--warehouse", self.warehouse]
        for key, value in self.spark_conf.items():
            arguments += ["--conf", f"{key}={value}"]
        return arguments


def catalog_database(dsn: str, name: str) -> str:
    """A fresh database ``name`` for a catalog's own tables on the server at ``dsn``; its JDBC URI."""
    drop_database(dsn, name)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    return f"jdbc:postgresql://{params.get('host', '127.0.0.1')}:{params.get('port', 5432)}/{name}"


def drop_database(dsn: str, name: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def dsn_user(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn).get("user", "postgres"))


@contextlib.contextmanager
def jdbc_catalog(dsn: str, s3: S3Server, bucket: str, catalog: str = "s3jdbc") -> Iterator[CatalogSetup]:
    """Iceberg's JDBC catalog ``catalog`` in a new database of the server at ``dsn`` (dropped afterwards), its
    tables in ``s3a://bucket/jdbc``."""
    name = f"iceberg_jdbc_{os.getpid()}"
    uri = catalog_database(dsn, name)
    password = f"jdbc-secret-{uuid.uuid4().hex}"  # a local server trusts every password; none may show
    try:
        yield CatalogSetup(catalog, "jdbc", uri, f"s3a://{bucket}/jdbc", {
            "spark.jars": ",".join(object_store_jars()), **s3.hadoop_settings("spark.hadoop."),
            f"spark.sql.catalog.{catalog}.jdbc.user": dsn_user(dsn),
            f"spark.sql.catalog.{catalog}.jdbc.password": password,
        })
    finally:
        drop_database(dsn, name)


@contextlib.contextmanager
def s3_jdbc_store(dsn: str, bucket: str, catalog: str = "s3jdbc") -> Iterator[tuple[S3Server, CatalogSetup]]:
    """A local S3 server with ``bucket`` and a JDBC catalog on the server at ``dsn``; a ConfigError naming what
    is missing when a part is not installed."""
    missing = missing_parts()
    if missing:
        raise ConfigError(f"a local S3 server with a JDBC catalog needs {', '.join(missing)}")
    with s3_server() as s3:
        s3.create_bucket(bucket)
        with jdbc_catalog(dsn, s3, bucket, catalog) as setup:
            yield s3, setup
