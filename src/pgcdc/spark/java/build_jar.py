"""Build ``pgcdc/spark/pgcdc-hadoop.jar`` from the Java sources beside this file (``make jar``).

The jar is shipped with pgcdc, so that no Java compiler is needed where pgcdc runs; ``javac --release 17`` (the
oldest Java Spark 3.5 runs on here) compiles the sources against the Hadoop API that pyspark ships and the Iceberg
runtime pgcdc runs with, and the jar is
written byte for byte the same from the same classes (sorted entries, fixed times), so that a test can tell that
the shipped jar is what these sources compile to.

    python src/pgcdc/spark/java/build_jar.py [OUTPUT]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SOURCES = Path(__file__).parent
JAR = SOURCES.parent / "pgcdc-hadoop.jar"
JAVA_RELEASE = "17"


def hadoop_api_jar() -> Path:
    import pyspark

    jars = sorted((Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar"))
    if not jars:
        raise SystemExit("no hadoop-client-api jar in pyspark's jars: is pyspark installed?")
    return jars[-1]


def compile_classes(into: Path) -> list[Path]:
    """Compile every source into ``into``; returns the class files, relative to it."""
    javac = shutil.which("javac")
    if javac is None:
        raise SystemExit("building the jar needs a JDK's javac (apt-get install default-jdk-headless)")
    sources = sorted(str(path) for path in SOURCES.rglob("*.java"))
    from pgcdc.spark.settings import iceberg_runtime_jar

    class_path = os.pathsep.join([str(hadoop_api_jar()), str(iceberg_runtime_jar())])
    subprocess.run([javac, "--release", JAVA_RELEASE, "-encoding", "UTF-8", "-nowarn", "-cp", class_path,
                    "-d", str(into), *sources], check=True)
    return sorted(path.relative_to(into) for path in into.rglob("*.class"))


def build(output: Path = JAR) -> Path:
    with tempfile.TemporaryDirectory(prefix="pgcdc-jar-") as scratch:
        classes = Path(scratch)
        with zipfile.ZipFile(output, "w") as jar:  # each entry says how it is compressed
            for relative in compile_classes(classes):
                entry = zipfile.ZipInfo(relative.as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
                entry.external_attr = 0o644 << 16
                entry.compress_type = zipfile.ZIP_DEFLATED
                jar.writestr(entry, (classes / relative).read_bytes())
    return output


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else JAR))
