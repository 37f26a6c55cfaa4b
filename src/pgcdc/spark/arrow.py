"""Arrow tables into Spark DataFrames, without pandas and without a Python object per value."""

from __future__ import annotations

import itertools
import threading
from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import StructType

_MAX_ROWS_PER_PARTITION = 64_000
_LOCAL_RELATION_THRESHOLD = "spark.sql.execution.arrow.localRelationThreshold"
# the session's setting is changed for the length of one call: calls from the mirrors applied side by side take
# turns, so that none restores a value another one set
_THRESHOLD_LOCK = threading.Lock()
_VIEW_NUMBERS = itertools.count(1)


def spark_arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow layout Spark expects for ``schema`` (e.g. timestamps as us with UTC, strings as utf8)."""
    from pyspark.sql.pandas.types import to_arrow_schema

    return to_arrow_schema(schema)


def plain_type(data_type: pa.DataType) -> pa.DataType:
    """``data_type`` with dates and timestamps as their integers, recursively.

    Python's ``datetime`` holds years 1-9999 only; PostgreSQL's dates, timestamps and their infinities reach
    far beyond, so any step that takes values through Python objects works on this form and casts back.
    """
    if pa.types.is_date32(data_type):
        return pa.int32()
    if pa.types.is_timestamp(data_type):
        return pa.int64()
    if pa.types.is_list(data_type):
        return pa.list_(plain_type(data_type.value_type))
    if pa.types.is_struct(data_type):
        return pa.struct([pa.field(f.name, plain_type(f.type)) for f in data_type])
    return data_type


def plain_values(array: pa.Array | pa.ChunkedArray) -> list[Any]:
    """``array``'s values as Python objects, dates and timestamps as integers (see :func:`plain_type`)."""
    return array.cast(plain_type(array.type)).to_pylist()


def plain_rows(table: pa.Table) -> list[dict[str, Any]]:
    """``table``'s rows as dicts, dates and timestamps as integers (see :func:`plain_type`)."""
    return table.cast(pa.schema([pa.field(f.name, plain_type(f.type)) for f in table.schema])).to_pylist()


def from_plain_values(values: list[Any], data_type: pa.DataType) -> pa.Array:
    """The inverse of :func:`plain_values`."""
    return pa.array(values, plain_type(data_type)).cast(data_type)


def from_plain_rows(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.Table:
    """The inverse of :func:`plain_rows`."""
    plain = pa.schema([pa.field(f.name, plain_type(f.type)) for f in schema])
    return pa.Table.from_pylist(rows, schema=plain).cast(schema)


def arrow_to_dataframe(spark: SparkSession, table: pa.Table, schema: StructType) -> DataFrame:
    """A DataFrame over ``table``'s rows typed by ``schema``, shipped to the JVM as Arrow IPC.

    This is the path PySpark itself uses for pandas input (one file or socket, one batch per
    partition), fed with Arrow directly. Executors receive the data through the JVM, so it works
    on a cluster as well as locally.
    """
    from pyspark.serializers import Serializer
    from pyspark.sql import DataFrame

    expected = spark_arrow_schema(schema)
    table = table.select(expected.names).cast(expected)
    batches = table.to_batches(max_chunksize=_MAX_ROWS_PER_PARTITION)  # none for an empty table: schema only

    class _ArrowStream(Serializer):
        def dump_stream(self, iterator, stream):
            with pa.RecordBatchStreamWriter(stream, expected) as writer:
                for batch in iterator:
                    writer.write_batch(batch)

    context = spark.sparkContext
    jvm: Any = context._jvm
    jiter = context._serialize_to_jvm(
        batches,
        _ArrowStream(),
        lambda filename: jvm.PythonSQLUtils.readArrowStreamFromFile(filename),
        lambda: jvm.ArrowIteratorServer(),
    )
    # Below this many bytes Spark turns the Arrow batches into rows on the driver, one thread, and plans a
    # local relation whose projections it then evaluates interpreted, also on the driver: about a third of
    # the JVM's work per applied change. At 0 the batches become an RDD whose tasks convert them, in
    # parallel on the executors. The setting is read during the call only.
    conf = spark.conf
    with _THRESHOLD_LOCK:
        previous = conf.get(_LOCAL_RELATION_THRESHOLD, None)
        conf.set(_LOCAL_RELATION_THRESHOLD, "0")
        try:
            jdf = jvm.PythonSQLUtils.toDataFrame(jiter, schema.json(), spark._jsparkSession)
        finally:
            if previous is None:
                conf.unset(_LOCAL_RELATION_THRESHOLD)
            else:
                conf.set(_LOCAL_RELATION_THRESHOLD, previous)
    return DataFrame(jdf, spark)


def temporary_view(frame: DataFrame, purpose: str) -> str:
    """A name of this session under which SQL reads ``frame``: its own, as the mirrors of a batch are applied side
    by side in one session, each with its statements' views."""
    name = f"_pgcdc_{purpose}_{next(_VIEW_NUMBERS)}"
    frame.createOrReplaceTempView(name)
    return name


def spark_fields(schema: pa.Schema, names: tuple[str, ...]) -> list:
    """Spark fields for plain (non-source) columns of ``schema``, typed from the change table's Arrow types."""
    from pyspark.sql.pandas.types import from_arrow_type
    from pyspark.sql.types import StructField

    return [StructField(name, from_arrow_type(schema.field(name).type)) for name in names]
