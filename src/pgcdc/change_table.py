"""The change table: the one contract between the batcher, which builds it, and the apply, which reads it.

A change table holds one source table's changes of a batch: the source columns (the row after the
change; the old key's row for a DELETE), then the metadata columns named by :class:`ChangeColumns`.
It is plain Arrow, so the writing rooms receive no replication objects; :func:`change_schema` is its one
schema, and :func:`build_change_table` its one builder.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from pgcdc.errors import ConversionError, ProtocolError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import PG_EPOCH_UNIX_MICROS, TupleData
from pgcdc.pgoutput.tuple_store import GatheredColumn, gather, new_store
from pgcdc.transactions import ChangeRun

if TYPE_CHECKING:
    from pgcdc.transactions import Change, Transaction
    from pgcdc.types import TableConverter


class ChangeColumns:
    """Names of the metadata columns of a change table, beside the source columns."""

    OP = "_pgcdc_op"  # 'I', 'U', 'D' or 'T'
    LSN = "_pgcdc_lsn"  # commit LSN of the transaction (int64)
    ORDINAL = "_pgcdc_ordinal"  # position of the change in its transaction
    UNCHANGED = "_pgcdc_unchanged"  # list<string>: columns holding an unchanged TOAST value
    OLD_KEY = "_pgcdc_old_key"  # struct of the key columns, set only when an UPDATE changed the key
    XID = "_pgcdc_xid"
    COMMIT_TS = "_pgcdc_commit_ts"
    ORIGIN = "_pgcdc_origin"
    BEFORE = "_pgcdc_before"  # struct of the source columns: the old image, when the server sent one
    SEQ = "_pgcdc_seq"  # internal to the apply: total order of the events derived from the changes
    FILL_KEY = "_pgcdc_fill_key"  # internal to the apply: take unchanged values from the mirror row under this key

    ALL = (OP, LSN, ORDINAL, UNCHANGED, OLD_KEY, XID, COMMIT_TS, ORIGIN, BEFORE)


C = ChangeColumns


def change_schema(source: pa.Schema, key_columns: Iterable[str]) -> pa.Schema:
    """The schema of a change table of a source table with columns ``source`` and key ``key_columns``."""
    key_fields = [source.field(k) for k in key_columns if k in source.names]
    return pa.schema([
        *source,
        pa.field(C.OP, pa.string()),
        pa.field(C.LSN, pa.int64()),
        pa.field(C.ORDINAL, pa.int64()),
        pa.field(C.UNCHANGED, pa.list_(pa.string())),
        pa.field(C.OLD_KEY, pa.struct(key_fields)),
        pa.field(C.XID, pa.int64()),
        pa.field(C.COMMIT_TS, pa.timestamp("us", tz="UTC")),
        pa.field(C.ORIGIN, pa.string()),
        pa.field(C.BEFORE, pa.struct(list(source))),
    ])


Pending = tuple["Transaction", "Change | ChangeRun"]  # a change, or a run of them, with its transaction


def build_change_table(changes: Iterable[Pending], converter: TableConverter, key_columns: tuple[str, ...]
                       ) -> pa.Table:
    """Turn one table's changes — single :class:`~pgcdc.transactions.Change` objects or runs of them
    (:class:`~pgcdc.transactions.ChangeRun`), each with its transaction — into the change table
    :func:`pgcdc.apply.batch.apply_changes` takes. Runs are gathered column by column from the bytes the server sent,
    with no Python object per value."""
    relation = converter.relation
    width = len(relation.columns)
    names = [c.name for c in relation.columns]
    key_index = [names.index(k) for k in key_columns if k in names]

    pieces: list[tuple[object, np.ndarray | None]] = []
    ordinals: list[np.ndarray | list[int]] = []
    transactions: list[Transaction] = []
    counts: list[int] = []
    packed = packed_txn = None  # single changes in a row of one transaction share a store
    for txn, item in changes:
        if isinstance(item, ChangeRun):
            if len(item) == 0:
                continue
            packed = None
            pieces.append((item.store, item.selection))
            ordinals.append(item.ordinal_array())
            transactions.append(txn)
            counts.append(len(item))
            continue
        if packed is None or packed_txn is not txn:
            packed, packed_txn = new_store(width), txn
            pieces.append((packed, None))
            ordinals.append([])
            transactions.append(txn)
            counts.append(0)
        _pack(packed, item, width)
        ordinals[-1].append(item.ordinal)  # type: ignore[union-attr]
        counts[-1] += 1
    gathered = gather(pieces, width, key_index)
    rows = len(gathered.ops)

    lsns = np.repeat(np.array([int(t.commit_lsn) for t in transactions], np.int64), counts)
    lsn_for_errors = Lsn(int(lsns.max())) if rows else None
    after_rows = converter.convert_split(*_columns(gathered.after, rows), lsn=lsn_for_errors)
    before_rows = converter.convert_split(*_columns(gathered.before, rows), lsn=lsn_for_errors)

    source = converter.arrow_schema
    schema = change_schema(source, key_columns)
    no_before = pa.array(np.frombuffer(gathered.has_before, np.bool_) == 0, pa.bool_())
    before_struct = pa.StructArray.from_arrays(before_rows.batch.columns, fields=list(source), mask=no_before)
    old_key_type = schema.field(C.OLD_KEY).type
    old_key = pa.StructArray.from_arrays(
        [before_rows.batch.column(source.get_field_index(f.name)) for f in old_key_type], fields=list(old_key_type),
        mask=pa.array(np.frombuffer(gathered.key_changed, np.bool_) == 0, pa.bool_())) if old_key_type.num_fields \
        else pa.nulls(rows, old_key_type)
    origins = [t.origin for t in transactions]
    return pa.Table.from_arrays([
        *after_rows.batch.columns,
        pa.Array.from_buffers(pa.binary(1), rows, [None, pa.py_buffer(gathered.ops)]).cast(pa.string()),
        pa.array(lsns, pa.int64()),
        pa.array(np.concatenate([np.asarray(o, np.int64) for o in ordinals]) if ordinals else np.empty(0, np.int64),
                 pa.int64()),
        _unchanged_lists(after_rows.unchanged, rows),
        old_key,
        pa.array(np.repeat(np.array([t.xid for t in transactions], np.int64), counts), pa.int64()),
        pa.array(np.repeat(np.array([t.commit_ts for t in transactions], np.int64), counts) + PG_EPOCH_UNIX_MICROS,
                 pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        pa.nulls(rows, pa.string()) if all(origin is None for origin in origins) else
        pa.array(origins, pa.string()).take(pa.array(np.repeat(np.arange(len(origins)), counts))),
        before_struct,
    ], schema=schema)


def _pack(store: object, change: Change, width: int) -> None:
    """A single change into a store, as a run of one."""
    if change.op == "T":
        store.add("T", None, None, None, change.ordinal, -1)  # type: ignore[attr-defined]
        return
    for image in (change.new, change.old, change.key):
        _fit(image, width)
    store.add(change.op, change.new, change.old, change.key, change.ordinal, -1)  # type: ignore[attr-defined]


def _columns(gathered: list[GatheredColumn], rows: int) -> tuple[list, list[bytes]]:
    """Gathered columns as the converter takes them: Arrow binary arrays (gathered in C) or lists, and kinds."""
    values: list = []
    for column in gathered:
        if column.buffers is None:
            values.append(column.values)
            continue
        offsets, offset_width, data, validity, nulls = column.buffers
        values.append(pa.Array.from_buffers(pa.large_binary() if offset_width == 8 else pa.binary(), rows,
                                            [pa.py_buffer(validity) if nulls else None, pa.py_buffer(offsets),
                                             pa.py_buffer(data)], null_count=nulls))
    return values, [column.kinds for column in gathered]


def _unchanged_lists(unchanged: dict[str, pa.BooleanArray], rows: int) -> pa.Array:
    """Per row, the names of its columns holding an unchanged TOAST value (in column order)."""
    names = list(unchanged)
    if not names:
        return pa.ListArray.from_arrays(pa.array(np.zeros(rows + 1, np.int32)), pa.array([], pa.string()))
    flags = np.stack([unchanged[name].to_numpy(zero_copy_only=False) for name in names], axis=1)
    row, column = np.nonzero(flags)
    offsets = np.zeros(rows + 1, np.int32)
    np.cumsum(np.bincount(row, minlength=rows), out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(names, pa.string()).take(pa.array(column)))


def _fit(tuple_data: TupleData | None, width: int) -> TupleData:
    if tuple_data is None:
        return TupleData("n" * width, (None,) * width)
    if len(tuple_data) != width:
        raise ProtocolError(f"a row has {len(tuple_data)} columns where the Relation message before it has {width}: "
                            "the server sent a row that does not match its table's description")
    return tuple_data


# -- changes whose values cannot be converted --------------------------------------------------------------------

REJECTS_SCHEMA = pa.schema([
    pa.field("op", pa.string()),
    pa.field("commit_lsn", pa.string()),
    pa.field("commit_lsn_value", pa.int64()),
    pa.field("ordinal", pa.int64()),
    pa.field("xid", pa.int64()),
    pa.field("commit_ts", pa.timestamp("us", tz="UTC")),
    pa.field("error", pa.string()),
    pa.field("value_format", pa.string()),  # 'text': the server's text of each value; 'binary': hex of its bytes
    pa.field("new_values", pa.map_(pa.string(), pa.string())),  # column -> value (NULL for NULL)
    pa.field("old_values", pa.map_(pa.string(), pa.string())),  # the old row or key, when the server sent one
    pa.field("unchanged_toast", pa.list_(pa.string())),
])


COPIED = "S"  # the op of a row a copy set aside: the table's row at the copy's consistent point


def copied_rejects(rows: list[tuple[str, tuple[tuple[str, str | None], ...]]], consistent_lsn: Lsn) -> pa.Table:
    """Rows of :data:`REJECTS_SCHEMA` for the rows a copy at ``consistent_lsn`` set aside, each (error, its
    columns' values as hex of the bytes COPY sent): op ``S``, numbered in the copy's order."""
    return pa.Table.from_pylist([{
        "op": COPIED, "commit_lsn": str(consistent_lsn), "commit_lsn_value": int(consistent_lsn), "ordinal": ordinal,
        "xid": None, "commit_ts": None, "error": error, "value_format": "binary", "new_values": list(values),
        "old_values": None, "unchanged_toast": []} for ordinal, (error, values) in enumerate(rows)],
        schema=REJECTS_SCHEMA)


def build_change_table_setting_aside(changes: list[Pending], converter: TableConverter,
                                     key_columns: tuple[str, ...]) -> tuple[list[pa.Table], pa.Table | None]:
    """:func:`build_change_table`, with the changes whose values cannot be converted set aside whole and raw:
    returns the change tables of the others and one table of the rejected (:data:`REJECTS_SCHEMA`), or None.
    The whole run is converted at once; only a run that fails is halved until the failing changes stand alone."""
    try:
        return [build_change_table(changes, converter, key_columns)], None
    except ConversionError as exc:
        if _count(changes) == 1:
            txn, change = next(expanded(changes))
            return _removal(txn, change, converter, key_columns), rejected_changes([(txn, change, str(exc))], converter)
        first_half, second_half = _halves(changes)
        first, first_rejected = build_change_table_setting_aside(first_half, converter, key_columns)
        second, second_rejected = build_change_table_setting_aside(second_half, converter, key_columns)
        rejected = [t for t in (first_rejected, second_rejected) if t is not None]
        return first + second, pa.concat_tables(rejected) if rejected else None


def _count(changes: list[Pending]) -> int:
    return sum(len(item) if isinstance(item, ChangeRun) else 1 for _, item in changes)


def _halves(changes: list[Pending]) -> tuple[list[Pending], list[Pending]]:
    """Two halves of the changes: of the list, or of its one run."""
    changes = [(txn, item) for txn, item in changes if not isinstance(item, ChangeRun) or len(item)]
    if len(changes) > 1:
        middle = len(changes) // 2
        return changes[:middle], changes[middle:]
    [(txn, run)] = changes
    assert isinstance(run, ChangeRun)
    middle = len(run) // 2
    return [(txn, run.part(0, middle))], [(txn, run.part(middle, len(run)))]


def expanded(changes: Iterable[Pending]) -> Iterator[tuple[Transaction, Change]]:
    """Each change as a :class:`~pgcdc.transactions.Change` object (runs taken apart), with its transaction."""
    from pgcdc.transactions import Change

    for txn, item in changes:
        if not isinstance(item, ChangeRun):
            yield txn, item
            continue
        selection = range(len(item.store)) if item.selection is None else item.selection.tolist()
        for index, ordinal in zip(selection, item.ordinal_array().tolist(), strict=True):
            op, _, _, new, old, key = item.store.change(index)
            yield txn, Change(txn.commit_lsn, ordinal, op, item.relation, new=new, old=old, key=key)


def _removal(txn: Transaction, change: Change, converter: TableConverter, key_columns: tuple[str, ...]
             ) -> list[pa.Table]:
    """For an UPDATE set aside: the change table of a DELETE of the row as it was, so that the mirror does not keep
    it: a row the mirror cannot hold is not in it, whether a copy or the stream met it (and its __rejects table
    tells why). Nothing when the row cannot be named (a table without a key sent no old row) or its key itself
    cannot be converted."""
    if change.op != "U":
        return []
    from pgcdc.transactions import Change

    old = change.old if change.old is not None else change.key
    if old is None and change.new is not None:  # the key did not change: it is in the new row
        names = [c.name for c in converter.relation.columns]
        kept = {names.index(k) for k in key_columns if k in names}
        if not kept:
            return []
        old = TupleData("".join(kind if i in kept else "n" for i, kind in enumerate(change.new.kinds)),
                        tuple(value if i in kept else None for i, value in enumerate(change.new.values)))
    if old is None:
        return []
    try:
        return [build_change_table([(txn, Change(change.commit_lsn, change.ordinal, "D", change.relation, key=old))],
                                   converter, key_columns)]
    except ConversionError:
        return []


def first_unconvertible(changes: list[Pending], converter: TableConverter,
                        key_columns: tuple[str, ...]) -> tuple[Transaction, Change, ConversionError] | None:
    """The first change of ``changes`` whose values cannot be converted, with its error (None: every one can)."""
    _, rejected = build_change_table_setting_aside(changes, converter, key_columns)
    if rejected is None:
        return None
    lsn, ordinal = rejected.column("commit_lsn_value")[0].as_py(), rejected.column("ordinal")[0].as_py()
    for txn, change in expanded(changes):
        if int(txn.commit_lsn) == lsn and change.ordinal == ordinal:
            return txn, change, ConversionError(rejected.column("error")[0].as_py())
    return None


def describe_row(change: Change, converter: TableConverter, key_columns: tuple[str, ...]) -> str:
    """The row a change is about, by its key's values as the server sent them (all columns without a key)."""
    image = change.new if change.new is not None else change.old if change.old is not None else change.key
    if image is None:
        return "(no row image)"
    columns = converter.relation.columns
    shown = [k for k in key_columns if k in {c.name for c in columns}] or [c.name for c in columns]
    values: dict[str, object] = dict(raw_values(image, converter))
    # the key's values as pgcdc reads them; the raw text (or hex) where even those cannot be converted
    only_shown = TupleData("".join(k if c.name in shown else "n" for c, k in zip(columns, image.kinds, strict=False)),
                           tuple(v if c.name in shown else None for c, v in zip(columns, image.values, strict=False)))
    try:
        batch = converter.convert([only_shown]).batch
        values.update({name: batch.column(batch.schema.get_field_index(name))[0].as_py() for name in shown})
    except (ConversionError, ValueError, OverflowError):
        pass
    return "(" + ", ".join(f"{name}={values[name]!r}" for name in shown) + ")"


def raw_values(image: TupleData, converter: TableConverter) -> dict[str, str | None]:
    """Each column's value as the server sent it: text as text, binary as hex, NULL and unchanged TOAST as None."""
    values: dict[str, str | None] = {}
    for column, kind, value in zip(converter.relation.columns, image.kinds, image.values, strict=False):
        if kind == "t" and value is not None:
            values[column.name] = bytes(value).decode("utf-8", "replace")
        elif kind == "b" and value is not None:
            values[column.name] = bytes(value).hex()
        else:
            values[column.name] = None
    return values


def rejected_changes(rejected: list[tuple[Transaction, Change, str]], converter: TableConverter) -> pa.Table:
    """Rows of :data:`REJECTS_SCHEMA` for changes set aside with their errors."""
    rows = []
    for txn, change, error in rejected:
        old = change.old if change.old is not None else change.key
        images = [image for image in (change.new, old) if image is not None]
        rows.append({
            "op": change.op, "commit_lsn": str(txn.commit_lsn), "commit_lsn_value": int(txn.commit_lsn),
            "ordinal": change.ordinal, "xid": txn.xid, "commit_ts": txn.commit_ts + PG_EPOCH_UNIX_MICROS,
            "error": error, "value_format": "binary" if any("b" in i.kinds for i in images) else "text",
            "new_values": list(raw_values(change.new, converter).items()) if change.new is not None else None,
            "old_values": list(raw_values(old, converter).items()) if old is not None else None,
            "unchanged_toast": [c.name for c, kind in zip(converter.relation.columns, change.new.kinds, strict=False)
                                if kind == "u"] if change.new is not None else [],
        })
    plain = REJECTS_SCHEMA.set(REJECTS_SCHEMA.get_field_index("commit_ts"), pa.field("commit_ts", pa.int64()))
    return pa.Table.from_pylist(rows, schema=plain).cast(REJECTS_SCHEMA)
