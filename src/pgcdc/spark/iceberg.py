"""Iceberg operations that need the JVM: commits that carry pgcdc's position in their snapshot summary."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

T = TypeVar("T")


class _JavaCallable:
    """A Python function seen by the JVM as a ``java.util.concurrent.Callable``."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self.result: object = None

    def call(self) -> None:
        self.result = self._fn()

    class Java:
        implements = ["java.util.concurrent.Callable"]


def with_commit_properties(spark: SparkSession, properties: Mapping[str, str], fn: Callable[[], T]) -> T:
    """Run ``fn`` (e.g. a ``MERGE INTO``) so that every Iceberg commit it makes carries ``properties``
    in its snapshot summary: the data and the properties land in one atomic commit.

    Iceberg keeps these properties in a JVM thread-local; py4j's pinned-thread mode runs the
    callback's own JVM calls on the thread that set them.
    """
    from pyspark.java_gateway import ensure_callback_server_started

    context = spark.sparkContext
    gateway: Any = context._gateway
    ensure_callback_server_started(gateway)
    jvm: Any = context._jvm
    java_properties = jvm.java.util.HashMap()
    for key, value in properties.items():
        java_properties.put(str(key), str(value))
    callable_ = _JavaCallable(fn)
    runtime_exception = jvm.java.lang.Class.forName("java.lang.RuntimeException")
    jvm.org.apache.iceberg.spark.CommitMetadata.withCommitProperties(java_properties, callable_, runtime_exception)
    return callable_.result  # type: ignore[return-value]
