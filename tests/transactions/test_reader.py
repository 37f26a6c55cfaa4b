"""The reader of committed transactions on its own, fed events as the replication stream yields them."""

from __future__ import annotations

import pytest

from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import (
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    Insert,
    Message,
    Prepare,
    Relation,
    TupleData,
    Type,
)
from pgcdc.replication import ReplicationEvent
from pgcdc.transactions import Tick, Transaction, TransactionReader

pytestmark = pytest.mark.usefixtures("accelerators")  # with the C modules and without

ITEMS = Relation(None, 16400, "public", "items", "d", (Column(1, "id", 23, -1),))


def event(message) -> ReplicationEvent:
    return ReplicationEvent(message, Lsn(0), Lsn(0))


RECONNECTED = ReplicationEvent(None, Lsn(0), Lsn(0), reconnected=True)
IDLE = ReplicationEvent(None, Lsn(0), Lsn(0))


def committed(xid: int, commit_lsn: int, *ids: int) -> list[ReplicationEvent]:
    return [event(Begin(Lsn(commit_lsn), 0, xid)), event(ITEMS),
            *[event(Insert(None, ITEMS.relation_id, TupleData("t", (str(i).encode(),)))) for i in ids],
            event(Commit(0, Lsn(commit_lsn), Lsn(commit_lsn + 8), 0))]


def prepared(xid: int, prepare_lsn: int, gid: str) -> list[ReplicationEvent]:
    return [event(BeginPrepare(Lsn(prepare_lsn), Lsn(prepare_lsn + 8), 0, xid, gid)), event(ITEMS),
            event(Insert(None, ITEMS.relation_id, TupleData("t", (b"99",)))),
            event(Prepare(0, Lsn(prepare_lsn), Lsn(prepare_lsn + 8), 0, xid, gid))]


def ids(txn: Transaction) -> list[int]:
    return [int(c.new.values[0]) for c in txn.changes()]


def test_every_event_gives_a_tick_after_the_transactions_it_completed():
    reader = TransactionReader([*committed(700, 100, 1, 2), IDLE])
    items = [ids(item) if isinstance(item, Transaction) else item for item in reader]
    assert items == [Tick.RECEIVED] * 4 + [[1, 2], Tick.RECEIVED, Tick.IDLE]


def test_a_reconnection_drops_what_was_held_and_the_replay_is_read_once():
    # a transaction cut by the lost connection, and a prepared one held: the server sends both again
    events = [*prepared(701, 150, "g"), *committed(700, 200, 1)[:3], RECONNECTED,
              *prepared(701, 150, "g"), *committed(700, 200, 1, 2),
              event(CommitPrepared(0, Lsn(300), Lsn(308), 0, 701, "g"))]
    reader = TransactionReader(events)
    seen = [(ids(item), item.gid) for item in reader.transactions()]
    assert seen == [([1, 2], None), ([99], "g")]
    assert reader.reconnections == 1


def test_the_position_the_slot_must_not_pass_follows_the_held_prepared_transaction():
    reader = TransactionReader([*prepared(701, 150, "g"), event(CommitPrepared(0, Lsn(300), Lsn(308), 0, 701, "g"))])
    items = iter(reader)
    held = []
    for _ in range(4):
        next(items)
        held.append(reader.oldest_pending_lsn())
    assert held == [None, None, None, Lsn(150)]
    assert isinstance(next(items), Transaction)
    assert next(items) is Tick.RECEIVED and reader.oldest_pending_lsn() is None


def test_type_and_logical_messages_go_to_their_callbacks_and_transactions_are_closed_once_read(tmp_path):
    types, messages = [], []
    note = Message(None, False, Lsn(5), "app", b"hello")
    custom = Type(None, 16500, "public", "mood")
    events = [event(custom), event(note), *committed(700, 100, *range(2000))]
    reader = TransactionReader(events, memory_limit_bytes=4 << 10, spill_dir=tmp_path,
                               on_type=types.append, on_message=messages.append)
    for txn in reader.transactions():
        assert txn.spilled and list(tmp_path.iterdir())
        assert ids(txn) == list(range(2000))
    assert types == [custom] and messages == [note]
    assert list(tmp_path.iterdir()) == []  # the spill file went with the transaction
