"""What the type tests share: a table's changes read from a slot, and a table read as the snapshot reads it."""

from __future__ import annotations

from types import SimpleNamespace

import psycopg
import pyarrow as pa

from pgcdc.change_table import build_change_table
from pgcdc.errors import ConversionError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput import Insert, Relation, TupleData, Type, decode, encode
from pgcdc.pgoutput.tuple_store import new_store
from pgcdc.spark.snapshot import convert_copy_binary, copy_binary_query, text_output_functions
from pgcdc.transactions import ChangeRun
from pgcdc.types import ConversionOptions, TableConverter, TypeRegistry


def slot_inserts(conn: psycopg.Connection, slot: str, publication: str, registry: TypeRegistry, *, binary: bool,
                 consume: bool = True) -> tuple[Relation, list[TupleData]]:
    """The Relation and the inserted tuples of ``publication`` waiting in ``slot`` (protocol 1), values in
    binary or text as asked (checked); Type messages teach ``registry``."""
    changes = conn.execute(
        f"SELECT data FROM pg_logical_slot_{'get' if consume else 'peek'}_binary_changes(%s, NULL, NULL, "
        "'proto_version', '1', 'publication_names', %s, 'binary', %s)",
        (slot, publication, "true" if binary else "false")).fetchall()
    relation, tuples = None, []
    for (data,) in changes:
        message = decode(data, proto_version=1, in_stream=False)
        if isinstance(message, Relation):
            relation = message
        elif isinstance(message, Type):
            registry.observe(message)
        elif isinstance(message, Insert):
            tuples.append(message.new)
            assert set(message.new.kinds) <= ({"b", "n"} if binary else {"t", "n"})
    assert relation is not None, f"no changes of {publication} in slot {slot}"
    return relation, tuples


def copied(conn: psycopg.Connection, schema: str, table: str, converter: TableConverter) -> pa.Table:
    """The table as the snapshot reads it: COPY binary (types without a binary decoder as text), split,
    converted; in id order."""
    names = [column.name for column in converter.relation.columns]
    text_outputs = text_output_functions(conn, converter)
    data = bytearray()
    with conn.cursor().copy(copy_binary_query(schema, table, names, text_outputs=text_outputs)) as copy:
        for chunk in copy:
            data += chunk
    result = pa.Table.from_batches(list(convert_copy_binary(bytes(data), names, converter, text_outputs,
                                                            source=f"{schema}.{table}")),
                                   schema=converter.arrow_schema)
    return result.sort_by("id")


STREAMED_AT = Lsn(1)  # the commit LSN of the rows streamed_rows converts, unless told


def streamed_rows(relation: Relation, tuples: list[TupleData], registry: TypeRegistry,
                  options: ConversionOptions | None = None, lsn: Lsn = STREAMED_AT) -> pa.Table:
    """Inserted rows as the pipeline converts them: each Insert kept as the bytes the server sends (a
    TupleStore), gathered column by column into a change table (its source columns returned). Checked against
    the rows converted directly (:meth:`TableConverter.convert`): the same values, or the same refusal (the
    gathered path's error raised)."""
    converter = TableConverter(relation, registry, options)
    names = [column.name for column in relation.columns]

    def gathered() -> pa.Table:
        store = new_store(len(relation.columns))
        for ordinal, row in enumerate(tuples):
            wire = encode(Insert(None, relation.relation_id, row), proto_version=1, in_stream=False)
            assert store.add_wire(wire, False, ordinal, -1)
        txn = SimpleNamespace(commit_lsn=lsn, xid=1, commit_ts=0, origin=None)
        key = tuple(column.name for column in relation.columns if column.is_key)
        return build_change_table([(txn, ChangeRun(relation, store))], converter, key).select(names)

    outcomes: list[pa.Table | ConversionError] = []
    for route in (gathered, lambda: pa.Table.from_batches([converter.convert(tuples, lsn=lsn).batch])):
        try:
            outcomes.append(route())
        except ConversionError as exc:
            outcomes.append(exc)
    mine, direct = outcomes
    if isinstance(mine, ConversionError) or isinstance(direct, ConversionError):
        assert isinstance(mine, ConversionError) and isinstance(direct, ConversionError), (mine, direct)
        raise mine
    assert mine.schema == direct.schema and all(_printed(mine.column(n)) == _printed(direct.column(n))
                                                for n in mine.column_names), (mine, direct)
    return mine


def _storage(data_type: pa.DataType) -> pa.DataType:
    """Dates and timestamps as the integers they hold: Python's datetime ends in 9999."""
    if pa.types.is_date32(data_type):
        return pa.int32()
    if pa.types.is_timestamp(data_type) or pa.types.is_date64(data_type):
        return pa.int64()
    if pa.types.is_list(data_type):
        return pa.list_(_storage(data_type.value_type))
    if pa.types.is_struct(data_type):
        return pa.struct([pa.field(f.name, _storage(f.type)) for f in data_type])
    return data_type


def _printed(column: pa.ChunkedArray) -> list[str]:
    """Values as Python prints them: NaN equals NaN, -0.0 differs from 0.0."""
    return [repr(v) for v in column.cast(_storage(column.type)).to_pylist()]


def streamed_column(relation: Relation, tuples: list[TupleData], registry: TypeRegistry,
                    options: ConversionOptions | None, lsn: Lsn, column: str = "v") -> pa.Array:
    """One column of :func:`streamed_rows`."""
    return streamed_rows(relation, tuples, registry, options, lsn).column(column).combine_chunks()
