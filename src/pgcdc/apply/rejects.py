"""``<table>__rejects``: the changes (and the rows of a copy) set aside under ``--on-conversion-error
quarantine``, whole and raw (:data:`pgcdc.change_table.REJECTS_SCHEMA`). Committed before the mirror's own
commit, each commit recording the last change it holds (``pgcdc.lsn`` and ``pgcdc.ordinal``): a replay after a
crash sets nothing aside twice (see :func:`pgcdc.positions.rejects_position`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.change_table import COPIED
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import MirrorTable
from pgcdc.mirrors.properties import sql_string
from pgcdc.positions import carried_summary
from pgcdc.spark.arrow import arrow_to_dataframe, spark_fields

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


@dataclass(frozen=True)
class SetAside:
    """What an append to a ``__rejects`` table added: the changes, their transactions' commit LSNs, and the
    table's position after it ((commit LSN, ordinal) of its last change; None: nothing added)."""

    changes: int = 0
    commit_lsns: frozenset[int] = frozenset()
    position: tuple[int, int] | None = None


def append_rejects(spark: SparkSession, mirror: MirrorTable, rejects: pa.Table) -> SetAside:
    """Append changes set aside (:data:`pgcdc.change_table.REJECTS_SCHEMA`) to ``<mirror>__rejects``, skipping
    those it holds already, in one commit that records the last one held (rule 2, by commit LSN and ordinal,
    since a transaction split by a schema change sets changes aside from two runs); returns what was added."""
    rejects = rejects.take(pc.sort_indices(rejects, sort_keys=[("commit_lsn_value", "ascending"),
                                                               ("ordinal", "ascending")]))
    if mirror.rejects_position is not None:
        held_lsn, held_ordinal = mirror.rejects_position
        lsns, ordinals = rejects.column("commit_lsn_value"), rejects.column("ordinal")
        rejects = rejects.filter(pc.or_(pc.greater(lsns, held_lsn),
                                        pc.and_(pc.equal(lsns, held_lsn), pc.greater(ordinals, held_ordinal))))
    if rejects.num_rows == 0:
        return SetAside()
    return SetAside(rejects.num_rows, frozenset(pc.unique(rejects.column("commit_lsn_value")).to_pylist()),
                    _write_rejects(spark, mirror, rejects))


def replace_copied_rejects(spark: SparkSession, mirror: MirrorTable, rejects: pa.Table) -> tuple[int, int] | None:
    """The rows a copy of ``mirror`` set aside (:func:`pgcdc.change_table.copied_rejects`, maybe none) into its
    ``__rejects`` table, committed before the copy. The rows an earlier copy set aside and never committed (their
    position is past the mirror's: a run stopped between that commit and its copy's) are deleted first, so a copy
    made again sets nothing aside twice. Returns the table's position after (None: nothing added)."""
    identifier = mirror.rejects_identifier
    if spark.catalog.tableExists(identifier):
        held = -1 if mirror.position is None else int(mirror.position)
        spark.sql(f"DELETE FROM {identifier} WHERE op = {sql_string(COPIED)} AND commit_lsn_value > {held}")
    return _write_rejects(spark, mirror, rejects) if rejects.num_rows else None


def _write_rejects(spark: SparkSession, mirror: MirrorTable, rejects: pa.Table) -> tuple[int, int]:
    """Append ``rejects`` (ordered) to the mirror's ``__rejects`` table, created if need be, in one commit that
    records the last one (``pgcdc.lsn`` and ``pgcdc.ordinal``); returns that position."""
    from pyspark.sql.types import StructType

    last_lsn, last_ordinal = rejects.column("commit_lsn_value")[-1].as_py(), rejects.column("ordinal")[-1].as_py()
    frame = arrow_to_dataframe(spark, rejects, StructType(spark_fields(rejects.schema, tuple(rejects.column_names))))
    writer = frame.writeTo(mirror.rejects_identifier)
    for key, value in carried_summary(Lsn(last_lsn), last_ordinal).items():
        writer = writer.option(f"snapshot-property.{key}", value)
    if spark.catalog.tableExists(mirror.rejects_identifier):
        writer.append()
    else:
        writer.using("iceberg").tableProperty("format-version", "2").create()
    return last_lsn, last_ordinal
