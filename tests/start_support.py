"""What a start-up does, seen from outside: whether a ``pgcdc run`` started Java, and whether what it reads of the
mirrors without a JVM is what Spark reads.

:class:`JavaStarts` is a ``JAVA_HOME`` whose ``bin/java`` notes each start, then runs the real Java. pgcdc finds
Java through ``JAVA_HOME`` first (``pgcdc.spark.session.ensure_java``), and Spark's launcher runs
``$JAVA_HOME/bin/java``: every JVM a command starts — and every ``java -version`` asked on the way — passes
through the note. What a JVM computes does not change."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from pgcdc.mirrors.catalog import MirrorCatalog
from pgcdc.mirrors.consistent import tag_state
from pgcdc.mirrors.metadata import MirrorMetadata
from pgcdc.mirrors.status import (
    describe_mirrors,
    describe_mirrors_from_metadata,
    mirrors_streaming_from,
    namespace_positions,
)
from pgcdc.pipeline import PipelineConfig
from pipeline_support import catalog_arguments


class JavaStarts:
    """``env``: the environment under which Java's starts are noted in ``record``."""

    def __init__(self, directory: Path) -> None:
        from pgcdc.spark.session import ensure_java

        real = os.path.realpath(ensure_java())
        home = directory / "noted-jdk"
        (home / "bin").mkdir(parents=True, exist_ok=True)
        self.record = directory / "java-starts"
        java = home / "bin" / "java"
        java.write_text(f'#!/bin/sh\necho "$$ $*" >> {shlex.quote(str(self.record))}\n'
                        f'exec {shlex.quote(real)} "$@"\n')
        java.chmod(0o755)
        self.env = {**os.environ, "JAVA_HOME": str(home)}

    def since(self, mark: int) -> list[str]:
        """The Java starts noted after ``mark`` (a value of :meth:`mark`)."""
        return self.starts()[mark:]

    def mark(self) -> int:
        return len(self.starts())

    def starts(self) -> list[str]:
        return self.record.read_text().splitlines() if self.record.exists() else []


def run_until_caught_up(config: PipelineConfig, java: JavaStarts) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """One ``pgcdc run --until-caught-up``; its output, and the Java starts it made."""
    mark = java.mark()
    result = subprocess.run([sys.executable, "-m", "pgcdc.cli", "run", "--dsn", config.dsn, "-p", config.publication,
                             "--slot", config.slot, *catalog_arguments(config), "--namespace",
                             config.destination.namespace, "--until-caught-up"],
                            capture_output=True, text=True, timeout=900, env=java.env)
    return result, java.since(mark)


def assert_read_alike(config: PipelineConfig, spark) -> bool:
    """What a start reads of the mirrors — which exist, their positions and slots, their tags and properties — is
    the same read without a JVM (:class:`MirrorMetadata`) as through Spark (:class:`MirrorCatalog`); and so is what
    ``pgcdc status`` says of them, counts included, where the metadata holds the counts. Returns whether it did."""
    through_spark = MirrorCatalog(spark, config.destination)
    read_here = MirrorMetadata.of(config.destination)
    described = describe_mirrors_from_metadata(read_here)
    if described is not None:
        assert described == describe_mirrors(through_spark)
    assert read_here.source_tables() == through_spark.source_tables()
    assert namespace_positions(read_here) == namespace_positions(through_spark)
    assert mirrors_streaming_from(read_here, config.slot) == mirrors_streaming_from(through_spark, config.slot)
    for _, _, identifier in through_spark.source_tables():
        assert tag_state(read_here.table(identifier)) == tag_state(through_spark.table(identifier)), identifier
        assert read_here.properties.read(identifier) == through_spark.properties.read(identifier), identifier
    return described is not None
