"""Object storage and Iceberg catalogs for the suite, all real and local: the local S3 server, s3a settings and
JDBC catalog of :mod:`pgcdc.local_object_store` (shared with the demo and the benchmarks), and a REST catalog
served by ``objectstore/RestCatalogServer.java`` (test code, compiled here with ``javac``) over another such
JDBC catalog. The Makefile's test path installs them all.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pgcdc import local_object_store
from pgcdc.local_object_store import (
    CatalogSetup,
    S3Server,
    catalog_database,
    drop_database,
    dsn_user,
    missing_parts,
    object_store_jars,
    stop_process,
)

REST_SERVER_SOURCE = Path(__file__).with_name("objectstore") / "RestCatalogServer.java"


def require_object_store() -> None:
    missing = missing_parts()
    if missing:
        pytest.skip(f"object storage tests need {', '.join(missing)}; make test installs them")


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    require_object_store()
    with local_object_store.s3_server() as server:
        yield server


def jdbc_catalog(server, s3: S3Server, bucket: str) -> contextlib.AbstractContextManager[CatalogSetup]:
    """Iceberg's JDBC catalog in a database of the server under test, its tables in ``s3a://bucket/jdbc``."""
    return local_object_store.jdbc_catalog(server.dsn, s3, bucket)


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
    uri = catalog_database(server.dsn, name)
    token = f"rest-token-{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory(prefix="pgcdc-rest-") as work:
        subprocess.run([javac, "-nowarn", "-cp", classpath, "-d", work, str(REST_SERVER_SOURCE)], check=True,
                       capture_output=True, timeout=300)
        properties = Path(work) / "catalog.properties"
        settings = {"uri": uri, "jdbc.user": dsn_user(server.dsn), "jdbc.schema-version": "V1",
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
            stop_process(process)
            drop_database(server.dsn, name)
