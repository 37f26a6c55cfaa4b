"""Columns added with a default PostgreSQL never writes into the rows: the mirror's existing rows given that value.

A non-volatile default (a constant, ``now()``) is kept in the catalog (``pg_attribute.attmissingval``), not in
the rows, and logical decoding never sends it. The promise is recorded in the mirror's ``pgcdc.fill`` property
before the columns are added (:func:`expect_fill`), kept until every existing row holds the value (:func:`fill`),
so a crash anywhere in between fills again before anything else is applied.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pgcdc.mirrors.catalog import MirrorCatalog, MirrorTable, TableSpec, quote
from pgcdc.mirrors.properties import FILL_PROPERTY
from pgcdc.positions import carried_summary

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("pgcdc.mirrors.catalog")


def expect_fill(mirrors: MirrorCatalog, spec: TableSpec, values: Mapping[str, str | None]) -> None:
    """Record, before the columns are added, that the existing rows of these new columns must get ``values`` (the
    source's text): a crash between adding them and :func:`fill` leaves the promise."""
    identifier = mirrors.identifier_for(spec.source_schema, spec.source_table)
    pending = json.loads(mirrors.properties.read(identifier).get(FILL_PROPERTY) or "{}")
    pending.update(values)
    mirrors.properties.set(identifier, {FILL_PROPERTY: json.dumps(pending)})
    mirrors.forget(spec.source_schema, spec.source_table)  # opened again, the mirror reads the promise back


def fill(mirrors: MirrorCatalog, mirror: MirrorTable, values: pa.Table) -> None:
    """Set every row's columns of ``values`` (one row) to its values, then forget the promise. Runs before any
    change carrying these columns is applied, so every row it touches predates them (and a replay after a crash
    in between does the same again). The commit carries the mirror's unchanged position."""
    from pyspark.sql.types import StructType

    from pgcdc.spark.arrow import arrow_to_dataframe
    from pgcdc.spark.iceberg_java import with_commit_properties

    spark = mirrors.spark
    schema = StructType([mirror.schema[name] for name in values.column_names])
    arrow_to_dataframe(spark, values, schema).createOrReplaceTempView("_pgcdc_fill")
    assignments = ", ".join(f"t.{quote(n)} = s.{quote(n)}" for n in values.column_names)
    statement = f"MERGE INTO {mirror.identifier} t USING _pgcdc_fill s ON true WHEN MATCHED THEN UPDATE SET {assignments}"
    with_commit_properties(spark, carried_summary(mirror.position), lambda: spark.sql(statement))
    log.info("%s: existing rows given the value PostgreSQL gives them in %s", mirror.spec.source,
             ", ".join(values.column_names))
    forget_fill(mirrors, mirror)


def forget_fill(mirrors: MirrorCatalog, mirror: MirrorTable) -> None:
    """Drop the promise of :func:`expect_fill` (kept, or made moot by a copy that replaced every row)."""
    mirrors.properties.unset(mirror.identifier, FILL_PROPERTY)
    mirror.pending_fill = {}
