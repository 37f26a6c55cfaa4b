"""The change log (``--changelog``): every change a mirror receives, as one row of ``<table>__changes``: op,
position, transaction, before and after images. Appended before the mirror's commit, in a commit of its own that
carries its own position, so a replay after a crash appends nothing twice."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.change_table import ChangeColumns as C
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import MirrorTable, cannot_widen, ddl_type, quote
from pgcdc.positions import carried_summary
from pgcdc.spark.arrow import arrow_to_dataframe, spark_fields

if TYPE_CHECKING:
    from pyspark.sql import SparkSession
    from pyspark.sql.types import StructType

log = logging.getLogger("pgcdc.apply.batch")


def append_changelog(spark: SparkSession, mirror: MirrorTable, changes: pa.Table, lsn: Lsn) -> Lsn | None:
    """Every change of ``changes`` (those the change log does not hold yet) as one row of ``<mirror>__changes``,
    in one commit recording ``lsn``; returns the change log's position then (None: nothing appended)."""
    if changes.num_rows == 0:
        return None
    names = list(mirror.spec.spark_schema.names)
    after_type = pa.struct([changes.schema.field(n) for n in names])
    after = pa.StructArray.from_arrays([changes.column(n).combine_chunks() for n in names], fields=list(after_type),
                                       mask=pc.equal(changes.column(C.OP), "T").combine_chunks())
    log_table = pa.table({
        "op": changes.column(C.OP),
        "commit_lsn": pa.array([str(Lsn(v)) for v in changes.column(C.LSN).to_pylist()], pa.string()),
        "commit_lsn_value": changes.column(C.LSN),
        "ordinal": changes.column(C.ORDINAL),
        "commit_ts": changes.column(C.COMMIT_TS),
        "xid": changes.column(C.XID),
        "origin": changes.column(C.ORIGIN),
        "unchanged_toast": changes.column(C.UNCHANGED),
        "before": changes.column(C.BEFORE),
        "after": after,
    })
    from pyspark.sql.types import StructField, StructType

    image = StructType(list(mirror.spec.spark_schema.fields))
    plain = tuple(name for name in log_table.column_names if name not in ("before", "after"))
    schema = StructType([*spark_fields(log_table.schema, plain),
                         StructField("before", image), StructField("after", image)])
    frame = arrow_to_dataframe(spark, log_table, schema)
    writer = frame.writeTo(mirror.changelog_identifier).option("merge-schema", "true")
    for key, value in carried_summary(lsn).items():
        writer = writer.option(f"snapshot-property.{key}", value)
    if spark.catalog.tableExists(mirror.changelog_identifier):
        if mirror.changelog_image != image:
            _keep_older_images(spark, mirror.changelog_identifier, image)
        writer.append()
    else:
        (writer.using("iceberg").tableProperty("format-version", "2")
         .tableProperty("write.spark.accept-any-schema", "true").create())
    mirror.changelog_image = image
    return lsn


def _keep_older_images(spark: SparkSession, identifier: str, image: StructType) -> None:
    """A column whose type changed to one Iceberg cannot change in place (``int`` to ``text``, a smaller
    scale): its older values stay in the change log under ``<column>__<old type>`` in the before and after
    images, and the column is added again in its place with its new type."""
    from pyspark.sql.types import StructType

    current = spark.table(identifier).schema
    for side in ("before", "after"):
        held = current[side].dataType
        assert isinstance(held, StructType)
        for name in cannot_widen(held, image):
            kept = f"{name}__{held[name].dataType.simpleString()}"
            number = 1
            while kept in held.names:  # changed more than once
                number += 1
                kept = f"{name}__{held[name].dataType.simpleString()}_{number}"
            log.info("%s: %s.%s changed type; its older values are kept as %s.%s", identifier, side, name, side,
                     kept)
            spark.sql(f"ALTER TABLE {identifier} RENAME COLUMN {side}.{quote(name)} TO {quote(kept)}")
            # in the older one's place: a write's row image must list the columns in the table's order
            spark.sql(f"ALTER TABLE {identifier} ADD COLUMN {side}.{quote(name)} {ddl_type(image[name].dataType)} "
                      f"AFTER {quote(kept)}")
