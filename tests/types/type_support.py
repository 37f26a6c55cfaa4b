"""What the type tests share: a table's changes read from a slot, and a table read as the snapshot reads it."""

from __future__ import annotations

import psycopg
import pyarrow as pa

from pgcdc.pgoutput import Insert, Relation, TupleData, Type, decode
from pgcdc.spark.snapshot import convert_copy_binary, copy_binary_query, text_output_functions
from pgcdc.types import TableConverter, TypeRegistry


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
