"""A live slot through the walsender into committed transactions: streamed, parallel, two-phase, origins,
schema changes, truncates, connection loss, and the SQL interface giving the same transactions."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import psycopg
import pytest

from pgcdc.lsn import Lsn
from pgcdc.pgoutput import Message
from pgcdc.replication import LogicalReplicationStream, ReplicationOptions, SlotManager, SqlInterfaceReader
from pgcdc.transactions import Transaction, TransactionAssembler, TransactionReader

STREAM_SMALL = " options='-c logical_decoding_work_mem=64kB'"


@dataclass
class Received:
    transactions: list[tuple[Transaction, list]] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    reconnects: int = 0
    prepared_gids: list[str] = field(default_factory=list)  # what the assembler held at the last event
    held_lsn: Lsn | None = None  # the position the slot must not pass, at the last event

    def ids(self, table: str) -> list[int]:
        return [int(c.new.values[0]) for _, changes in self.transactions for c in changes
                if c.op == "I" and c.relation.name == table]


def consume(dsn: str, slot: str, options: ReplicationOptions, until, *, timeout: float = 60.0,
            on_event=None, **reader_options) -> Received:
    """Stream ``slot`` like a consumer that applies each transaction and confirms it, until ``until(received)``."""
    stream = LogicalReplicationStream(dsn, slot=slot, options=options, max_backoff=1.0)
    received = Received()

    def events():
        for event in stream.events(idle_timeout=0.5):
            if on_event is not None:
                on_event(event, received)
            yield event

    reader = TransactionReader(events(), on_message=received.messages.append, **reader_options)
    deadline = time.monotonic() + timeout
    try:
        for item in reader:
            if isinstance(item, Transaction):
                received.transactions.append((item, list(item.changes())))
                stream.confirm(item.end_lsn)
                continue
            received.reconnects = reader.reconnections
            received.prepared_gids = reader.assembler.prepared_gids
            received.held_lsn = reader.oldest_pending_lsn()
            if until(received) or time.monotonic() > deadline:
                break
    finally:
        stream.close()
    return received


def make_slot(pg, name: str = "s", *, two_phase: bool = False) -> None:
    with SlotManager(pg.dsn).create(name, two_phase=two_phase, export_snapshot=False):
        pass


@pytest.fixture
def items(pg):
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, note text)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE items")
    return pg


@pytest.mark.parametrize("proto", [2, 3, 4])
def test_large_transaction_streams_and_drops_the_rolled_back_savepoint(items, proto):
    items.server.require({2: 14, 3: 15, 4: 16}[proto], f"protocol {proto}")
    make_slot(items)
    with items.connect() as conn, conn.transaction():
        xid = conn.execute("SELECT txid_current() % 4294967296").fetchone()[0]
        conn.execute("INSERT INTO items SELECT i, repeat('x', 50) FROM generate_series(1, 3000) i")
        conn.execute("SAVEPOINT undo")
        conn.execute("INSERT INTO items SELECT i, 'undone' FROM generate_series(10001, 12000) i")
        conn.execute("ROLLBACK TO SAVEPOINT undo")
        conn.execute("UPDATE items SET note = 'updated' WHERE id <= 100")
    received = consume(items.dsn + STREAM_SMALL, "s", ReplicationOptions("pub", proto_version=proto),
                       lambda r: r.transactions)
    [(txn, changes)] = received.transactions
    assert txn.xid == xid
    assert received.ids("items") == list(range(1, 3001))
    assert [c.op for c in changes].count("U") == 100
    assert [c.ordinal for c in changes] == list(range(len(changes)))


def test_parallel_streams_interleave_and_release_in_commit_order(items):
    items.server.require(16, "streaming 'parallel' (protocol 4)")
    make_slot(items)
    first, second = items.connect(), items.connect()
    try:
        first.execute("BEGIN")
        second.execute("BEGIN")
        for round_ in range(3):
            first.execute("INSERT INTO items SELECT i, 'first' FROM generate_series(%s::int, %s::int) i",
                          (round_ * 1000 + 1, round_ * 1000 + 1000))
            second.execute("INSERT INTO items SELECT i, 'second' FROM generate_series(%s::int, %s::int) i",
                           (100000 + round_ * 1000 + 1, 100000 + round_ * 1000 + 1000))
        second.execute("COMMIT")
        first.execute("COMMIT")
    finally:
        first.close()
        second.close()
    starts = []

    def watch(event, _):
        if type(event.message).__name__ == "StreamStart":
            starts.append(event.message.xid)

    received = consume(items.dsn + STREAM_SMALL, "s", ReplicationOptions("pub"), lambda r: len(r.transactions) == 2,
                       on_event=watch)
    (txn_a, changes_a), (txn_b, changes_b) = received.transactions
    assert txn_a.commit_lsn < txn_b.commit_lsn
    assert {c.new.values[1] for c in changes_a} == {b"second"} and len(changes_a) == 3000
    assert {c.new.values[1] for c in changes_b} == {b"first"} and len(changes_b) == 3000
    assert len({x for i, x in enumerate(starts) if i == 0 or starts[i - 1] != x}) == 2
    assert any(starts[i] != starts[i + 1] for i in range(len(starts) - 1))  # the chunks interleaved


def test_two_phase_held_until_commit_prepared_also_across_a_server_restart(items):
    items.server.require(15, "two-phase decoding (protocol 3)")
    make_slot(items, two_phase=True)
    with items.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO items VALUES (1, 'prepared')")
        conn.execute("PREPARE TRANSACTION 'kept'")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO items VALUES (2, 'rolled back')")
        conn.execute("PREPARE TRANSACTION 'dropped'")
        conn.execute("ROLLBACK PREPARED 'dropped'")
    held = consume(items.dsn, "s", ReplicationOptions("pub"), lambda r: r.prepared_gids == ["kept"], timeout=30)
    assert held.transactions == []
    assert held.held_lsn is not None  # the flush position stays before the PREPARE
    slot = SlotManager(items.dsn).get("s")
    assert slot.confirmed_flush_lsn <= held.held_lsn

    items.server.restart()
    with items.connect() as conn:
        conn.execute("COMMIT PREPARED 'kept'")
    received = consume(items.dsn, "s", ReplicationOptions("pub"), lambda r: r.transactions)
    [(txn, changes)] = received.transactions
    assert txn.gid == "kept"
    assert [c.new.values for c in changes] == [(b"1", b"prepared")]


def test_origin_none_skips_replicated_changes(items):
    items.server.require(16, "the origin option")
    make_slot(items, "any_origin")
    make_slot(items, "no_origin")
    origin = f"upstream_{items.name}"  # origins are cluster-wide: one per test database
    with items.connect() as conn:
        conn.execute("SELECT pg_replication_origin_create(%s)", (origin,))
        conn.execute("SELECT pg_replication_origin_session_setup(%s)", (origin,))
        conn.execute("INSERT INTO items VALUES (1, 'replicated')")
        conn.execute("SELECT pg_replication_origin_session_reset()")
        conn.execute("INSERT INTO items VALUES (2, 'local')")
    everything = consume(items.dsn, "any_origin", ReplicationOptions("pub", origin="any"),
                         lambda r: len(r.transactions) == 2)
    assert everything.ids("items") == [1, 2]
    assert [t.origin for t, _ in everything.transactions] == [origin, None]
    local = consume(items.dsn, "no_origin", ReplicationOptions("pub", origin="none"), lambda r: r.transactions)
    assert local.ids("items") == [2]
    items.execute("SELECT pg_replication_origin_drop(%s)", (origin,))


def test_schema_changes_and_truncates_carry_their_relation_versions(items):
    items.execute("CREATE TABLE other (id int PRIMARY KEY)")
    items.execute("ALTER PUBLICATION pub ADD TABLE other")
    make_slot(items)
    with items.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO items VALUES (1, 'before')")
        conn.execute("ALTER TABLE items ADD COLUMN extra int")
        conn.execute("INSERT INTO items VALUES (2, 'after', 7)")
        conn.execute("INSERT INTO other VALUES (1)")
    items.execute("TRUNCATE items, other")
    items.execute("SELECT pg_logical_emit_message(false, 'pgcdc', 'heartbeat')")
    received = consume(items.dsn, "s", ReplicationOptions("pub"), lambda r: len(r.transactions) == 2 and r.messages)
    (_, changes), (_, truncate) = received.transactions
    first, second, _ = changes
    assert [c.name for c in first.relation.columns] == ["id", "note"]
    assert [c.name for c in second.relation.columns] == ["id", "note", "extra"]
    assert second.new.values == (b"2", b"after", b"7")
    [change] = truncate
    assert change.op == "T" and {r.name for r in change.truncate_relations} == {"items", "other"}
    assert received.messages[0].content == b"heartbeat" and not received.messages[0].transactional


def test_terminated_backend_and_server_restart_lose_and_duplicate_nothing(items):
    make_slot(items)
    stop = threading.Event()
    written: list[int] = []

    def writer():
        with items.connect() as conn:
            next_id = 1
            while not stop.is_set():
                try:
                    conn.execute("INSERT INTO items SELECT i, 'w' FROM generate_series(%s::int, %s::int) i",
                                  (next_id, next_id + 9))
                    written.extend(range(next_id, next_id + 10))
                    next_id += 10
                except psycopg.OperationalError:
                    return  # the restart ended this session; what committed is in `written`
                time.sleep(0.01)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    disruptions = []

    def disrupt(event, received):
        count = len(received.transactions)
        if count >= 20 and "terminate" not in disruptions:
            disruptions.append("terminate")
            items.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = 's'")
        elif count >= 40 and "restart" not in disruptions:
            disruptions.append("restart")
            stop.set()
            thread.join()
            items.server.restart(mode="immediate")

    received = consume(items.dsn, "s", ReplicationOptions("pub"),
                       lambda r: "restart" in disruptions and r.ids("items") and written
                       and max(r.ids("items")) >= max(written), on_event=disrupt, timeout=120)
    stop.set()
    thread.join()
    assert disruptions == ["terminate", "restart"]
    assert received.reconnects >= 2
    ids = received.ids("items")
    assert len(ids) == len(set(ids))  # nothing twice
    assert set(written) <= set(ids)  # nothing committed is lost


def test_sql_interface_gives_the_walsender_messages(items):
    make_slot(items, "by_walsender")
    make_slot(items, "by_sql")
    with items.connect() as conn:
        conn.execute("INSERT INTO items SELECT i, 'x' FROM generate_series(1, 50) i")
        conn.execute("UPDATE items SET note = 'y' WHERE id < 10")
        conn.execute("DELETE FROM items WHERE id > 40")
    options = ReplicationOptions("pub")
    via_sql = [m for _, m in SqlInterfaceReader(items.dsn, slot="by_sql", options=options).messages()]
    collected = []

    def keep(event, _):
        if event.message is not None:
            collected.append(event.message)

    consume(items.dsn, "by_walsender", options, lambda r: len(r.transactions) == 3, on_event=keep)
    assert collected == via_sql


def test_spill_to_disk_and_cleanup(items, tmp_path):
    make_slot(items)
    items.execute("INSERT INTO items SELECT i, repeat('v', 100) FROM generate_series(1, 5000) i")
    spilled = []

    def watch(event, _):
        spilled.extend(tmp_path.iterdir())

    received = consume(items.dsn, "s", ReplicationOptions("pub", proto_version=1), lambda r: r.transactions,
                       on_event=watch, memory_limit_bytes=64 << 10, spill_dir=tmp_path)
    assert spilled, "a 5000-row transaction over a 64 kB limit goes to disk"
    assert received.ids("items") == list(range(1, 5001))
    assert list(tmp_path.iterdir()) == []  # removed once the transaction was consumed
    (tmp_path / "pgcdc-spill-999999999-1-x").write_bytes(b"left by a crashed process")
    TransactionAssembler(spill_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_slot_manager_errors_say_what_to_do(items):
    slots = SlotManager(items.dsn)
    with slots.create("made", export_snapshot=True) as created:
        assert created.snapshot_name and isinstance(created.consistent_point, Lsn)
        with items.connect() as conn, conn.transaction():
            conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            conn.execute(psycopg.sql.SQL("SET TRANSACTION SNAPSHOT {}").format(created.snapshot_name))
    from pgcdc.errors import ConfigError

    with pytest.raises(ConfigError, match="already exists"), slots.create("made"):
        pass
    with pytest.raises(ConfigError, match="does not exist"):
        slots.drop("never_made")
    assert [s.name for s in slots.list()] == ["made"]
    slots.drop("made")
    assert slots.get("made") is None
