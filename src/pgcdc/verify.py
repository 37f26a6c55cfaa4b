"""Source vs mirror, row for row: what the demo prints and the end-to-end tests assert.

The source table is read now with COPY, each value in PostgreSQL's own text
output (the server is the oracle for what a value is), and converted with the
same typed values policy the stream uses; the mirror is read through Spark. Rows compare
as whole rows (not counts), in any order, NaN equal to NaN.
"""

from __future__ import annotations

import hashlib
import io
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
import pyarrow as pa
import pyarrow.csv as pa_csv
from psycopg import sql

from pgcdc.errors import ConversionError
from pgcdc.mirrors.catalog import quote
from pgcdc.replication.options import with_session_settings
from pgcdc.replication.published import published_tables
from pgcdc.spark.arrow import plain_rows

if TYPE_CHECKING:
    from pgcdc.pipeline import Pipeline
    from pgcdc.types import TableConverter


def copy_csv_query(schema: str, table: str, columns: list[str], row_filter: str | None = None, *,
                   partitioned: bool = False) -> sql.Composed:
    """COPY of the columns of the table's own rows (a partitioned table's: its partitions'; an inheritance
    parent's without its children's, which are published as tables of their own), of those a publication's
    ``row_filter`` keeps, as CSV with every non-null value quoted (see read_csv_columns)."""
    select = sql.SQL("SELECT {} FROM {} {}.{}").format(
        sql.SQL(", ").join(sql.Identifier(c) for c in columns), sql.SQL("" if partitioned else "ONLY"),
        sql.Identifier(schema), sql.Identifier(table))
    if row_filter is not None:  # the server catalog's text of the filter (pg_publication_tables.rowfilter)
        select = sql.SQL("{} WHERE {}").format(select, sql.SQL(row_filter))
    return sql.SQL("COPY ({}) TO STDOUT (FORMAT csv, NULL '', FORCE_QUOTE *)").format(select)


def read_csv_columns(data: bytes, width: int) -> list[pa.Array]:
    """The columns of a whole COPY CSV output (see :func:`copy_csv_query`) as string arrays: an unquoted empty
    field is NULL, ``""`` the empty string."""
    names = [f"c{i}" for i in range(width)]
    table = pa_csv.read_csv(
        io.BytesIO(data), read_options=pa_csv.ReadOptions(column_names=names),
        parse_options=pa_csv.ParseOptions(newlines_in_values=True),
        convert_options=pa_csv.ConvertOptions(column_types={n: pa.string() for n in names}, null_values=[""],
                                              strings_can_be_null=True, quoted_strings_can_be_null=False))
    return [table.column(i).combine_chunks() for i in range(width)]


@dataclass(frozen=True)
class TableComparison:
    table: str
    source_rows: int
    mirror_rows: int
    source_checksum: str
    mirror_checksum: str
    missing_in_mirror: tuple[str, ...]
    unexpected_in_mirror: tuple[str, ...]
    # source rows holding a value that cannot be mirrored (their changes stop pgcdc, or go to <table>__rejects):
    # compared with nothing, listed as the server prints them
    unmirrorable: tuple[str, ...] = ()

    @property
    def lost(self) -> int:
        """Source rows the mirror lacks (counting repeats)."""
        return len(self.missing_in_mirror)

    @property
    def extra(self) -> int:
        """Mirror rows beyond the source's: duplicates, stale versions, rows deleted at the source."""
        return len(self.unexpected_in_mirror)

    @property
    def equal(self) -> bool:
        return self.source_checksum == self.mirror_checksum and self.source_rows == self.mirror_rows

    def describe(self) -> str:
        lines = [f"{self.table}: source {self.source_rows} rows, mirror {self.mirror_rows} rows"]
        lines += [f"  only in source: {row}" for row in self.missing_in_mirror[:10]]
        lines += [f"  only in mirror: {row}" for row in self.unexpected_in_mirror[:10]]
        lines += [f"  cannot be mirrored: {row}" for row in self.unmirrorable[:10]]
        return "\n".join(lines)


def _canonical_rows(table: pa.Table) -> list[str]:
    # repr makes NaN equal to NaN and keeps types apart ('1' vs 1); sorting makes order irrelevant
    return sorted(repr(tuple(row.values())) for row in plain_rows(table))


def _checksum(rows: list[str]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(row.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:12]


def _convert_source(converter: TableConverter, columns: list) -> tuple[pa.Table, tuple[str, ...]]:
    """The source's rows converted as pgcdc converts them, and (row by row, only when some value fails) the
    rows holding a value that cannot be converted, as the server printed them."""
    try:
        return pa.Table.from_batches([converter.convert_columns(columns, binary=False).batch]), ()
    except ConversionError:
        pass
    converted, unconvertible = [], []
    for row in range(len(columns[0])):
        values = [column.slice(row, 1) for column in columns]
        try:
            converted.append(converter.convert_columns(values, binary=False).batch)
        except ConversionError:
            unconvertible.append(repr(tuple(value[0].as_py() for value in values)))
    return pa.Table.from_batches(converted, schema=converter.arrow_schema), tuple(unconvertible)


def compare_publication(pipeline: Pipeline, dsn: str, publication: str) -> list[TableComparison]:
    """Compare every table of ``publication`` with its mirror."""
    results = []
    with psycopg.connect(with_session_settings(dsn), autocommit=True) as conn:
        pipeline.load_types(conn)
        for table in published_tables(conn, publication):
            relation = table.relation
            converter = pipeline.converter_for(relation)
            names = [c.name for c in relation.columns]
            data = bytearray()
            with conn.cursor().copy(copy_csv_query(relation.namespace, relation.name, names, table.row_filter,
                                                     partitioned=table.partitioned)) as copy:
                for chunk in copy:
                    data += chunk
            columns = read_csv_columns(bytes(data), len(names)) if data else [[] for _ in names]
            source, unmirrorable = _convert_source(converter, columns)
            identifier = pipeline.mirrors.identifier_for(relation.namespace, relation.name)
            # one statement: a DataFrame's select resolves each column name with round trips of its own
            batches = pipeline.spark.sql(f"SELECT {', '.join(quote(n) for n in names)} FROM {identifier}"
                                         )._collect_as_arrow() if names else []
            mirror = pa.Table.from_batches(batches).cast(source.schema) if batches else source.schema.empty_table()
            source_rows, mirror_rows = _canonical_rows(source), _canonical_rows(mirror)
            source_count, mirror_count = Counter(source_rows), Counter(mirror_rows)
            results.append(TableComparison(
                table=f"{relation.namespace}.{relation.name}",
                source_rows=len(source_rows), mirror_rows=len(mirror_rows),
                source_checksum=_checksum(source_rows), mirror_checksum=_checksum(mirror_rows),
                missing_in_mirror=tuple((source_count - mirror_count).elements()),
                unexpected_in_mirror=tuple((mirror_count - source_count).elements()),
                unmirrorable=unmirrorable,
            ))
    return results
