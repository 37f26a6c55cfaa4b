"""Hostile input: mutated pgoutput bytes, corrupt or unwritable spill files, corrupt stored positions.

Each is detected and reported, never trusted: the decoder raises only DecodeError, a spill file
is checked frame by frame, a mirror position that is not an LSN stops the pipeline."""

from __future__ import annotations

import importlib.util
import pickle
import sys
from pathlib import Path

import pytest

from pgcdc.errors import PositionCorruptError, SpillCorruptError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput import Commit, StreamCommit
from pgcdc.replication import ReplicationOptions, SqlInterfaceReader
from pgcdc.spark.destination import Destination
from pgcdc.transactions import Transaction, TransactionAssembler

ROOT = Path(__file__).resolve().parents[2]


def _load_fuzzer():
    spec = importlib.util.spec_from_file_location("pgcdc_bench_fuzz", ROOT / "bench" / "fuzz.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_fuzzed_bytes_raise_only_decode_error_quickly_and_in_flat_memory():
    """The suite's share of bench/fuzz.py (which runs 1,000,000 inputs): both tuple parsers."""
    result = _load_fuzzer().run(inputs=30_000, seed=len(sys.argv))
    print({k: v for k, v in result.items() if k != "examples"})
    assert result["other_exceptions"] == 0, result["examples"]
    assert result["decoded"] > 0 and result["decode_errors"] > 0  # the mutations reach both outcomes
    assert result["rss_growth_after_warmup_mb"] < 50
    assert result["slowest_input_ms"] < 2_000  # no input makes the decoder loop or blow up


@pytest.fixture
def big_transaction(pg):
    """The messages of one streamed transaction with every kind of spilled change: inserts, key and non-key
    updates, deletes, a rolled-back savepoint, a schema change, a truncate and a transactional message."""
    pg.server.require(14, "streamed transactions")
    pg.execute("CREATE TABLE items (id int PRIMARY KEY, note text)")
    pg.execute("CREATE TABLE other (id int PRIMARY KEY)")
    pg.execute("CREATE PUBLICATION pub FOR TABLE items, other")
    pg.execute("SELECT pg_create_logical_replication_slot('s', 'pgoutput')")
    with pg.connect() as conn, conn.transaction():
        conn.execute("SET LOCAL logical_decoding_work_mem = '64kB'")
        conn.execute("INSERT INTO items SELECT i, repeat('v', 80) FROM generate_series(1, 3000) i")
        conn.execute("INSERT INTO other VALUES (1), (2)")
        conn.execute("SAVEPOINT sp")
        conn.execute("INSERT INTO items SELECT i, 'rolled back' FROM generate_series(5001, 5500) i")
        conn.execute("ROLLBACK TO SAVEPOINT sp")
        conn.execute("UPDATE items SET note = 'changed' WHERE id <= 500")
        conn.execute("UPDATE items SET id = id + 10000 WHERE id BETWEEN 501 AND 600")
        conn.execute("DELETE FROM items WHERE id BETWEEN 601 AND 700")
        conn.execute("ALTER TABLE items ADD COLUMN extra int")
        conn.execute("INSERT INTO items VALUES (9999, 'after the change', 7)")
        conn.execute("SELECT pg_logical_emit_message(true, 'p', 'inside')")
        conn.execute("TRUNCATE other")
    options = ReplicationOptions("pub", proto_version=2, streaming="on")
    return [m for _, m in SqlInterfaceReader(pg.dsn, slot="s", options=options).messages()]


def _assemble(messages, assembler: TransactionAssembler, before_commit=None) -> Transaction:
    for message in messages:
        if isinstance(message, Commit | StreamCommit) and before_commit is not None:
            before_commit()
        for item in assembler.feed(message):
            if isinstance(item, Transaction):
                return item
    raise AssertionError("no transaction committed")


def _summary(transaction: Transaction) -> list[tuple]:
    return [(c.op, c.ordinal, c.relation and (c.relation.name, c.relation.columns), c.new, c.old, c.key,
             tuple(r.name for r in c.truncate_relations), c.message) for c in transaction.changes()]


def test_a_spilled_transaction_reads_back_exactly_as_held_in_memory(big_transaction, tmp_path):
    in_memory = _summary(_assemble(big_transaction, TransactionAssembler()))
    spilled = _assemble(big_transaction, TransactionAssembler(memory_limit_bytes=16 << 10, spill_dir=tmp_path))
    assert spilled.spilled
    assert _summary(spilled) == in_memory
    ops = [change[0] for change in in_memory]
    assert {"I", "U", "D", "T", "M"} <= set(ops)
    assert len([1 for c in in_memory if c[0] == "I" and c[2][0] == "items"]) == 3001  # savepoint rows dropped
    spilled.close()
    assert list(tmp_path.iterdir()) == []


def _damage(tmp_path: Path, how: str) -> None:
    (path,) = tmp_path.iterdir()
    data = bytearray(path.read_bytes())
    if how == "flipped byte":
        data[len(data) // 2] ^= 0x10
    elif how == "truncated":
        del data[len(data) - 7:]
    elif how == "replaced by a pickle":
        data = bytearray(pickle.dumps([("evil", "payload")]))
    elif how == "frame length":
        data[16:20] = b"\x7f\xff\xff\xff"
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flipped byte", "truncated", "replaced by a pickle", "frame length"])
def test_a_damaged_spill_file_is_detected_not_trusted(big_transaction, tmp_path, how):
    assembler = TransactionAssembler(memory_limit_bytes=16 << 10, spill_dir=tmp_path)
    transaction = _assemble(big_transaction, assembler, before_commit=lambda: _damage(tmp_path, how))
    with pytest.raises(SpillCorruptError, match=r"corrupt .*not trusted"):
        list(transaction.changes())
    transaction.close()


def test_an_unwritable_spill_directory_stops_with_what_to_do(big_transaction, tmp_path):
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(SpillCorruptError, match=r"cannot spill transaction .*--spill-dir"):
        _assemble(big_transaction, TransactionAssembler(memory_limit_bytes=16 << 10, spill_dir=missing))


def test_a_corrupt_stored_position_stops_the_pipeline(pg, spark):
    from pgcdc.pipeline import Pipeline, PipelineConfig
    from pgcdc.spark.iceberg_java import load_table, with_commit_properties

    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO t VALUES (1, 'a')")
    pg.execute("CREATE PUBLICATION pub FOR TABLE t")
    warehouse = spark.conf.get("spark.sql.catalog.pgcdc.warehouse")
    config = PipelineConfig(dsn=pg.dsn, publication="pub", slot="corrupt", batch_max_seconds=0.5,
                            destination=Destination(warehouse=warehouse, namespace=f"corrupt_{pg.name}"))
    pipeline = Pipeline(config, spark=spark)
    pipeline.run(until_caught_up=True, handle_signals=False)
    mirror = pipeline.mirrors.identifier_for("public", "t")
    assert pipeline.mirrors.positions.read(mirror) is not None

    # a commit carrying a damaged position, then one without (a maintenance commit)
    table = load_table(spark, mirror)
    sound = table.currentSnapshot().snapshotId()
    with_commit_properties(spark, {"pgcdc.lsn": "not-an-lsn"}, lambda: spark.sql(f"INSERT INTO {mirror} VALUES (-1, 'x')"))
    spark.sql(f"DELETE FROM {mirror} WHERE id = -1")
    with pytest.raises(PositionCorruptError, match=r"not an LSN.*cannot be trusted.*rollback_to_snapshot"):
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
    # the way out the error names: back to the snapshot before the damage
    table.refresh()
    table.manageSnapshots().rollbackTo(sound).commit()
    Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)

    # a position from another server's history (beyond this server's WAL) is refused too
    with_commit_properties(spark, {"pgcdc.lsn": str(Lsn(0xFFFF_0000_0000_0000))},
                           lambda: spark.sql(f"INSERT INTO {mirror} VALUES (-2, 'y')"))
    with pytest.raises(PositionCorruptError, match="beyond the source server's current WAL position"):
        Pipeline(config, spark=spark).run(until_caught_up=True, handle_signals=False)
