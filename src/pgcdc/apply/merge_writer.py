"""The MERGE writer (``--apply merge``, and mirrors the row-delta writer cannot write): a reduced batch committed
by one Spark ``MERGE INTO`` per mirror (after a TRUNCATE, one overwrite), its position set in the same commit by
Iceberg's ``CommitMetadata.withCommitProperties``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pyarrow as pa

from pgcdc.apply.mirror_reads import key_ranges, whole_row_match
from pgcdc.apply.reduce import KEYED
from pgcdc.change_table import ChangeColumns as C
from pgcdc.mirrors.catalog import MirrorTable, quote
from pgcdc.positions import carried_summary
from pgcdc.spark.arrow import arrow_to_dataframe, temporary_view
from pgcdc.spark.iceberg_java import with_commit_properties

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from pgcdc.lsn import Lsn


def merge(spark: SparkSession, mirror: MirrorTable, kind: str, rows: pa.Table, removed: pa.Table | None, lsn: Lsn,
          *, keys: tuple[str, ...] = (), replace_all: bool = False) -> None:
    """One commit: ``rows`` written, what ``removed`` names gone (keys, or whole keyless rows) — or, with
    ``replace_all``, every row replaced by ``rows`` — ``lsn`` in its snapshot summary."""
    from pyspark.sql.types import StringType, StructField, StructType

    names = list(mirror.spec.spark_schema.names)
    if replace_all or removed is None:
        _write_rows(spark, mirror, rows, lsn, overwrite=replace_all)
        return
    source = rows.select(names).schema
    marked = pa.concat_tables([_marked(removed.select(list(keys) if kind == KEYED else names), source, "D"),
                               _marked(rows, source, "U")])
    schema = StructType([*mirror.spec.spark_schema.fields, StructField(C.OP, StringType())])
    source_view = temporary_view(arrow_to_dataframe(spark, marked, schema), "source")
    columns = ", ".join(quote(n) for n in names)
    values = ", ".join("s." + quote(n) for n in names)
    if kind == KEYED:
        # one source row per key (Iceberg's MERGE allows no more): a key is either written or deleted
        on = " AND ".join([f"t.{quote(k)} = s.{quote(k)}" for k in keys] + key_ranges(marked, list(keys)))
        assignments = ", ".join(f"{quote(n)} = s.{quote(n)}" for n in names)
        statement = (
            f"MERGE INTO {mirror.identifier} t USING {source_view} s ON {on} "
            f"WHEN MATCHED AND s.{C.OP} = 'D' THEN DELETE "
            f"WHEN MATCHED THEN UPDATE SET {assignments} "
            f"WHEN NOT MATCHED AND s.{C.OP} = 'U' THEN INSERT ({columns}) VALUES ({values})")
    else:  # rows match on every column; every copy of a deleted row goes, the ones that stay are among the rows
        statement = (
            f"MERGE INTO {mirror.identifier} t USING {source_view} s ON s.{C.OP} = 'D' AND {whole_row_match(names)} "
            f"WHEN MATCHED THEN DELETE "
            f"WHEN NOT MATCHED AND s.{C.OP} = 'U' THEN INSERT ({columns}) VALUES ({values})")
    try:
        with_commit_properties(spark, carried_summary(lsn), lambda: spark.sql(statement))
    finally:
        spark.catalog.dropTempView(source_view)


def _marked(table: pa.Table, source: pa.Schema, op: str) -> pa.Table:
    """``table`` in the ``source`` columns (those it lacks NULL) with ``_pgcdc_op`` set to ``op``."""
    columns = [table.column(field.name).cast(field.type) if field.name in table.column_names
               else pa.nulls(table.num_rows, field.type) for field in source]
    return pa.Table.from_arrays([*columns, pa.array([op] * table.num_rows, pa.string())],
                                schema=source.append(pa.field(C.OP, pa.string())))


def _write_rows(spark: SparkSession, mirror: MirrorTable, rows: pa.Table, lsn: Lsn, *, overwrite: bool) -> None:
    from pyspark.sql.functions import lit

    frame = arrow_to_dataframe(spark, rows.select(list(mirror.spec.spark_schema.names)), mirror.spec.spark_schema)
    writer = frame.writeTo(mirror.identifier)
    for key, value in carried_summary(lsn).items():
        writer = writer.option(f"snapshot-property.{key}", value)
    writer = (writer
              # key columns are required in the mirror; the rows carry them, typed nullable by Arrow
              .option("check-nullability", "false"))
    if overwrite:
        writer.overwrite(lit(True))
    else:
        writer.append()
