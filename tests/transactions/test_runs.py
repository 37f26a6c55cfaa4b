"""A transaction's row changes as runs per table (Transaction.runs), the columnar form the batcher takes: the same
changes, ordinals and order per table as Transaction.changes gives, for streamed transactions with a rolled-back
savepoint, truncates and messages between them, spilled or not, fed as decoded messages or as raw changes."""

from __future__ import annotations

import pytest

from pgcdc.change_table import expanded
from pgcdc.errors import ProtocolError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput import (
    Begin,
    Column,
    Commit,
    Delete,
    Insert,
    Message,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Update,
    encode,
)
from pgcdc.pgoutput.decode import decode_raw
from pgcdc.transactions import Change, ChangeRun, Transaction, TransactionAssembler

ITEMS = Relation(700, 1, "public", "items", "d", (Column(1, "id", 23, -1), Column(0, "note", 25, -1)))
WIDER = Relation(700, 1, "public", "items", "d", (*ITEMS.columns, Column(0, "extra", 25, -1)))
OTHER = Relation(700, 2, "public", "other", "f", (Column(0, "a", 23, -1),))
TOP, SAVEPOINT = 700, 701


def row(*values: bytes | None) -> TupleData:
    return TupleData("".join("n" if v is None else "u" if v == b"?" else "t" for v in values),
                     tuple(None if v in (None, b"?") else v for v in values))


def streamed_body() -> list:
    """A streamed transaction over two chunks: two tables interleaved, a savepoint rolled back, an ALTER TABLE,
    a truncate and a logical message between the rows."""
    first = [StreamStart(TOP, True), ITEMS, OTHER]
    for i in range(30):
        first.append(Insert(TOP, 1, row(str(i).encode(), b"x" * 40)))
        first.append(Insert(TOP, 2, row(str(i).encode())))
    first += [Insert(SAVEPOINT, 1, row(b"1000", b"undone")), Update(SAVEPOINT, 1, None, None, row(b"1", b"undone")),
              Update(TOP, 1, row(b"2", None), None, row(b"20", b"?")),  # the key changed, note unchanged TOAST
              Update(TOP, 2, None, row(b"3"), row(b"33")), Delete(TOP, 2, None, row(b"4")), StreamStop()]
    second = [StreamStart(TOP, False), Message(TOP, True, Lsn(5), "p", b"inside"), Truncate(TOP, 0, (2,)),
              Insert(TOP, 2, row(b"99")), WIDER, Insert(TOP, 1, row(b"7", b"wide", b"e")),
              Delete(TOP, 1, row(b"7", None, None), None), StreamStop(), StreamAbort(TOP, SAVEPOINT),
              StreamCommit(TOP, 0, Lsn(9000), Lsn(9008), 0)]
    return first + second


def plain_body() -> list:
    relation = Relation(None, 1, "public", "items", "d", ITEMS.columns)
    body = [Begin(Lsn(500), 0, 42), relation]
    body += [Insert(None, 1, row(str(i).encode(), b"y")) for i in range(25)]
    body += [Truncate(None, 0, (1,)), Insert(None, 1, row(b"1", b"after")), Commit(0, Lsn(500), Lsn(508), 0)]
    return body


def as_raw(messages: list) -> list:
    """The row changes as the stream hands them to the pipeline: raw, checked, their tuples left as bytes."""
    raw, in_stream = [], False
    for message in messages:
        if isinstance(message, StreamStart):
            in_stream = True
        elif isinstance(message, StreamStop):
            in_stream = False
        if isinstance(message, Insert | Update | Delete):
            message = decode_raw(encode(message, proto_version=4, in_stream=in_stream), in_stream=in_stream)
        raw.append(message)
    return raw


def assembled(messages: list, **options) -> Transaction:
    assembler = TransactionAssembler(**options)
    found = [item for message in messages for item in assembler.feed(message) if isinstance(item, Transaction)]
    assert len(found) == 1
    return found[0]


def summary(changes) -> list[tuple]:
    return [(c.ordinal, c.op, c.relation and c.relation.name, c.relation and len(c.relation.columns), c.new, c.old,
             c.key, tuple(r.name for r in c.truncate_relations), c.message) for c in changes]


def from_runs(txn: Transaction) -> list[Change]:
    items = list(txn.runs())
    assert all(isinstance(item, ChangeRun | Change) for item in items)
    changes = [change for _, change in expanded((txn, item) for item in items)]
    # per table, the runs come in the order of the table's changes
    for name in {c.relation.name for c in changes if c.relation is not None}:
        ordinals = [c.ordinal for c in changes if c.relation is not None and c.relation.name == name]
        assert ordinals == sorted(ordinals)
    return sorted(changes, key=lambda c: c.ordinal)


@pytest.mark.parametrize("body", [streamed_body, plain_body])
@pytest.mark.parametrize("raw", [False, True], ids=["messages", "raw"])
@pytest.mark.parametrize("limit", [256 << 20, 1 << 10], ids=["in memory", "spilled"])
def test_runs_hold_the_changes_one_by_one_holds(accelerators, tmp_path, body, raw, limit):
    messages = as_raw(body()) if raw else body()
    txn = assembled(messages, memory_limit_bytes=limit, spill_dir=tmp_path)
    assert txn.spilled == (limit < 1 << 20)
    one_by_one = summary(txn.changes())
    assert summary(from_runs(txn)) == one_by_one
    assert [c[0] for c in one_by_one] == list(range(len(one_by_one)))
    if body is streamed_body:
        assert b"undone" not in [v for c in one_by_one if c[4] is not None for v in c[4].values]  # savepoint gone
        assert [c[1] for c in one_by_one].count("I") == 62 and "T" in [c[1] for c in one_by_one]
    reference = summary(assembled(body()).changes())  # messages, in memory
    assert one_by_one == reference
    txn.close()
    assert list(tmp_path.iterdir()) == []


def test_a_row_of_another_width_than_its_relation_is_a_protocol_error(accelerators):
    relation = Relation(None, 1, "public", "items", "d", ITEMS.columns)
    for messages in ([Begin(Lsn(1), 0, 1), relation, Insert(None, 1, row(b"1"))],
                     as_raw([Begin(Lsn(1), 0, 1), relation, Insert(None, 1, row(b"1", b"x", b"y"))])):
        with pytest.raises(ProtocolError, match=r"a row has . columns where the Relation message before it has 2"):
            assembled([*messages, Commit(0, Lsn(1), Lsn(2), 0)])
