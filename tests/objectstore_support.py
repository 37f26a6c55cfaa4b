"""Object storage and Iceberg catalogs for the suite, all real and local: the local S3 server, s3a settings and
JDBC catalog of :mod:`pgcdc.local_object_store` (shared with the demo and the benchmarks), and a REST catalog
served by ``objectstore/RestCatalogServer.java`` (test code, compiled here with ``javac``) over another such
JDBC catalog. The Makefile's test path installs them all.
"""

from __future__ import annotations

import contextlib
import hashlib
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
BUCKET = "pgcdc-mirrors"  # the shared S3 server's bucket (conftest.py)


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


def compiled_rest_server(javac: str, classpath: str) -> Path:
    """``RestCatalogServer.java`` compiled against ``classpath``: once per source, JDK and jar set, kept beside the
    suite's JVM class archive (a few seconds of CPU and ~15 s of a busy machine's time saved in each later run)."""
    from jvm_class_archive import archive_directory

    parts = [REST_SERVER_SOURCE.read_text(), os.path.realpath(javac), classpath]
    for entry in classpath.split(os.pathsep):
        for jar in sorted(Path(entry).parent.glob(Path(entry).name)) if "*" in entry else [Path(entry)]:
            with contextlib.suppress(OSError):
                parts.append(f"{jar}:{jar.stat().st_size}")
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    classes = archive_directory() / f"rest-catalog-server-{digest}"
    if not classes.is_dir():
        classes.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f"{classes.name}.", dir=classes.parent))
        subprocess.run([javac, "-nowarn", "-cp", classpath, "-d", str(work), str(REST_SERVER_SOURCE)], check=True,
                       capture_output=True, timeout=300)
        try:
            work.rename(classes)  # whole or not at all; a worker that compiled it at the same time keeps its own
        except OSError:
            shutil.rmtree(work, ignore_errors=True)
    return classes


@contextlib.contextmanager
def rest_catalog(server, s3: S3Server, bucket: str) -> Iterator[CatalogSetup]:
    """A REST catalog (``RestCatalogServer.java``) over a JDBC catalog in a database of the server under test,
    its tables in ``s3a://bucket/rest``; every request must carry the catalog's token."""
    from pgcdc.spark.session import ensure_java
    from pgcdc.spark.settings import iceberg_runtime_jar

    javac = shutil.which("javac")
    if javac is None:
        pytest.skip("the REST catalog test server is compiled with javac, and this machine has no JDK "
                    "(apt-get install openjdk-17-jdk-headless)")
    require_object_store()
    java = ensure_java()
    import pyspark

    classpath = os.pathsep.join([str(iceberg_runtime_jar()), str(Path(pyspark.__file__).parent / "jars" / "*"),
                                 *object_store_jars()])
    classes = compiled_rest_server(javac, classpath)
    name = f"iceberg_rest_{os.getpid()}"
    uri = catalog_database(server.dsn, name)
    token = f"rest-token-{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory(prefix="pgcdc-rest-") as work:
        properties = Path(work) / "catalog.properties"
        settings = {"uri": uri, "jdbc.user": dsn_user(server.dsn), "jdbc.schema-version": "V1",
                    "warehouse": f"s3a://{bucket}/rest", "io-impl": "org.apache.iceberg.hadoop.HadoopFileIO",
                    "required-token": token, **s3.hadoop_settings("hadoop.")}
        properties.write_text("".join(f"{k}={v}\n".replace(":", "\\:") for k, v in settings.items()))
        # a server of a few minutes' light work: the quick compiler only, as the suite's other JVMs (conftest.py)
        process = subprocess.Popen([java, "-XX:TieredStopAtLevel=1", "-cp", os.pathsep.join([str(classes), classpath]),
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
