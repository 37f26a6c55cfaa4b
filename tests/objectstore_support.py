"""Object storage and Iceberg catalogs for the suite, all real and local: an S3 server (``moto_server`` from
PyPI's ``moto[server]``), Hadoop's s3a client (``hadoop-aws`` and the AWS SDK bundle, shipped in PyPI's
``sagemaker-pyspark`` source archive), a JDBC catalog in a database of the PostgreSQL under test (Debian's
``libpostgresql-jdbc-java``), and a REST catalog served by ``objectstore/RestCatalogServer.java`` (test code,
compiled here with ``javac``) over another such JDBC catalog. The Makefile's test path installs them all.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

POSTGRES_JDBC_JARS = ("/usr/share/java/postgresql.jar",)
REST_SERVER_SOURCE = Path(__file__).with_name("objectstore") / "RestCatalogServer.java"


def s3a_jars() -> list[str]:
    """``hadoop-aws-3.3.1.jar`` and ``aws-java-sdk-bundle-1.11.901.jar`` (both needed by s3a), if installed."""
    try:
        import sagemaker_pyspark
    except ImportError:
        return []
    jars = Path(sagemaker_pyspark.__file__).parent / "jars"
    found = [jars / "hadoop-aws-3.3.1.jar", jars / "aws-java-sdk-bundle-1.11.901.jar"]
    return [str(jar) for jar in found] if all(jar.is_file() for jar in found) else []


def postgres_jdbc_jar() -> str | None:
    return next((jar for jar in POSTGRES_JDBC_JARS if os.path.isfile(jar)), None)


def object_store_jars() -> list[str]:
    """The jars the suite's Spark starts with when they are installed (they cost nothing unused)."""
    jdbc = postgres_jdbc_jar()
    return s3a_jars() + ([jdbc] if jdbc else [])


def require_object_store() -> None:
    missing = []
    if not s3a_jars():
        missing.append("the s3a jars (pip install --no-deps sagemaker-pyspark==1.4.5)")
    if postgres_jdbc_jar() is None:
        missing.append("the PostgreSQL JDBC driver (apt-get install libpostgresql-jdbc-java)")
    if shutil.which("moto_server", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) \
            is None:
        missing.append("moto_server (pip install 'moto[server]')")
    if missing:
        pytest.skip(f"object storage tests need {', '.join(missing)}; make test installs them")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_for_port(port: int, process: subprocess.Popen, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout} s")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class S3Server:
    """A local S3 server; its credentials are checked by nobody but look like real ones in every setting."""

    endpoint: str
    access_key: str = "pgcdc-test-access"
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
    """``moto_server`` on a free loopback port, in its own process (the workload and Spark's Python tasks keep
    this one's interpreter busy), stopped afterwards."""
    require_object_store()
    port = free_port()
    executable = Path(sys.executable).with_name("moto_server")
    process = subprocess.Popen([str(executable) if executable.exists() else "moto_server", "-H", "127.0.0.1",
                                "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_port(port, process, "moto_server")
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        _stop(process)


@dataclass
class CatalogSetup:
    """An Iceberg catalog on S3 as pgcdc is told about it: the ``PipelineConfig`` fields that name it."""

    catalog: str
    catalog_type: str
    catalog_uri: str
    warehouse: str
    spark_conf: dict[str, str]

    def config_overrides(self) -> dict:
        return {"catalog": self.catalog, "catalog_type": self.catalog_type, "catalog_uri": self.catalog_uri,
                "warehouse": self.warehouse, "spark_conf": dict(self.spark_conf)}

    def cli_arguments(self) -> list[str]:
        arguments = ["--catalog", self.catalog, "--catalog-type", self.catalog_type, "--catalog-uri",
                     self.catalog_uri, "--warehouse", self.warehouse]
        for key, value in self.spark_conf.items():
            arguments += ["--conf", f"{key}={value}"]
        return arguments


def _catalog_database(server, name: str) -> str:
    """A database for a catalog's own tables on the PostgreSQL under test; its JDBC URI."""
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    params = psycopg.conninfo.conninfo_to_dict(server.dsn)
    return f"jdbc:postgresql://{params.get('host', '127.0.0.1')}:{params.get('port', 5432)}/{name}"


def _drop_database(server, name: str) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _user(server) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(server.dsn).get("user", "postgres"))


@contextlib.contextmanager
def jdbc_catalog(server, s3: S3Server, bucket: str) -> Iterator[CatalogSetup]:
    """Iceberg's JDBC catalog in a database of the server under test, its tables in ``s3a://bucket/jdbc``."""
    name = f"iceberg_jdbc_{os.getpid()}"
    uri = _catalog_database(server, name)
    catalog = "s3jdbc"
    password = f"jdbc-secret-{uuid.uuid4().hex}"  # the embedded server trusts every password; none may show
    try:
        yield CatalogSetup(catalog, "jdbc", uri, f"s3a://{bucket}/jdbc", {
            "spark.jars": ",".join(object_store_jars()), **s3.hadoop_settings("spark.hadoop."),
            f"spark.sql.catalog.{catalog}.jdbc.user": _user(server),
            f"spark.sql.catalog.{catalog}.jdbc.password": password,
        })
    finally:
        _drop_database(server, name)


@contextlib.contextmanager
def rest_catalog(server, s3: S3Server, bucket: str) -> Iterator[CatalogSetup]:
    """A REST catalog (``RestCatalogServer.java``) over a JDBC catalog in a database of the server under test,
    its tables in ``s3a://bucket/rest``; every request must carry the catalog's token."""
    from pgcdc.spark.session import ensure_java, iceberg_runtime_jar

    javac = shutil.which("javac")
    if javac is None:
        pytest.skip("the REST catalog test server is compiled with javac, and this machine has no JDK "
                    "(apt-get install openjdk-17-jdk-headless)")
    require_object_store()
    java = ensure_java()
    import pyspark

    classpath = os.pathsep.join([str(iceberg_runtime_jar()), str(Path(pyspark.__file__).parent / "jars" / "*"),
                                 *object_store_jars()])
    name = f"iceberg_rest_{os.getpid()}"
    uri = _catalog_database(server, name)
    token = f"rest-token-{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory(prefix="pgcdc-rest-") as work:
        subprocess.run([javac, "-nowarn", "-cp", classpath, "-d", work, str(REST_SERVER_SOURCE)], check=True,
                       capture_output=True, timeout=300)
        properties = Path(work) / "catalog.properties"
        settings = {"uri": uri, "jdbc.user": _user(server), "jdbc.schema-version": "V1",
                    "warehouse": f"s3a://{bucket}/rest", "io-impl": "org.apache.iceberg.hadoop.HadoopFileIO",
                    "required-token": token, **s3.hadoop_settings("hadoop.")}
        properties.write_text("".join(f"{k}={v}\n".replace(":", "\\:") for k, v in settings.items()))
        process = subprocess.Popen([java, "-cp", os.pathsep.join([work, classpath]),
                                    "org.apache.iceberg.rest.RestCatalogServer", str(properties)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                   text=True)
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line.startswith("listening on "):
                raise RuntimeError(f"the REST catalog server did not start: {line!r}")
            catalog = "s3rest"
            yield CatalogSetup(catalog, "rest", f"http://127.0.0.1:{int(line.split()[-1])}", f"s3a://{bucket}/rest", {
                "spark.jars": ",".join(object_store_jars()), **s3.hadoop_settings("spark.hadoop."),
                f"spark.sql.catalog.{catalog}.token": token,
            })
        finally:
            _stop(process)
            _drop_database(server, name)
