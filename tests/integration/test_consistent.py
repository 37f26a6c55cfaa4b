"""One consistent moment across the mirrors: transactions move money between rows of two tables, so the sum over
both is constant at every moment of the source. While pgcdc streams them — maintenance between batches, a batch
held between the commits of its two mirrors, a SIGKILL and a restart — a reader reads both mirrors at the
consistent tag again and again, through Spark and through PyIceberg, and always finds the sum; reading the
newest snapshots instead finds it broken (half a transfer), which shows the test can fail."""

from __future__ import annotations

import dataclasses
import json
import random
import signal
import threading
import time

import psycopg
import pytest

from pgcdc.mirrors.consistent import CONSISTENT_PROPERTY, CONSISTENT_TAG, consistent_tables
from pipeline_support import pipeline_config, run_cli, wait_for
from pyiceberg_reader import hadoop_table

pytestmark = pytest.mark.slow

ACCOUNTS = 40
TOTAL = 2 * ACCOUNTS * 1000
SCHEMA = f"""
CREATE TABLE ledger_a (id int PRIMARY KEY, balance bigint NOT NULL);
CREATE TABLE ledger_b (id int PRIMARY KEY, balance bigint NOT NULL);
INSERT INTO ledger_a SELECT g, 1000 FROM generate_series(1, {ACCOUNTS}) g;
INSERT INTO ledger_b SELECT g, 1000 FROM generate_series(1, {ACCOUNTS}) g;
CREATE PUBLICATION ledger FOR TABLE ledger_a, ledger_b;
"""


def transfers(dsn: str, stop: threading.Event, errors: list[BaseException]) -> None:
    """Each transaction moves an amount from a row of one table to a row of the other."""
    rng = random.Random(30)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                amount, a, b = rng.randrange(1, 50), rng.randrange(1, ACCOUNTS + 1), rng.randrange(1, ACCOUNTS + 1)
                sign = rng.choice((1, -1))
                with conn.transaction():
                    conn.execute("UPDATE ledger_a SET balance = balance - %s WHERE id = %s", (sign * amount, a))
                    conn.execute("UPDATE ledger_b SET balance = balance + %s WHERE id = %s", (sign * amount, b))
                time.sleep(0.01)
    except BaseException as exc:
        errors.append(exc)


class Reader:
    """Reads both mirrors again and again: at the consistent tag (Spark through :func:`consistent_tables`,
    PyIceberg through the tags and the LSN each table records), and at their newest snapshots."""

    def __init__(self, spark, namespace: str, identifiers: list[str]) -> None:
        self.spark, self.namespace, self.identifiers = spark, namespace, identifiers
        self.consistent_reads = {"spark": 0, "pyiceberg": 0}
        self.torn_newest = 0
        self.newest_reads = 0

    def read_once(self) -> None:
        spark = self.spark
        spark.catalog.clearCache()
        point = consistent_tables(spark, self.namespace)
        sums = [point.tables[f"public.{name}"].selectExpr("sum(balance) AS s").collect()[0].s
                for name in ("ledger_a", "ledger_b")]
        assert sum(sums) == TOTAL, f"Spark at the consistent tag ({point.lsn}): {sums}"
        self.consistent_reads["spark"] += 1
        assert self.pyiceberg_sum() == TOTAL
        self.consistent_reads["pyiceberg"] += 1
        newest = [spark.table(identifier).selectExpr("sum(balance) AS s").collect()[0].s
                  for identifier in self.identifiers]
        self.newest_reads += 1
        self.torn_newest += sum(newest) != TOTAL

    def pyiceberg_sum(self, attempts: int = 50) -> int:
        """The sum at the consistent tags, read as a PyIceberg user would: each table's tag and the LSN it
        records, read again until the tables agree."""
        for _ in range(attempts):
            tables = [hadoop_table(self.spark, identifier) for identifier in self.identifiers]
            recorded = {json.loads(t.metadata.properties[CONSISTENT_PROPERTY])["lsn"] for t in tables}
            if len(recorded) == 1:
                total = 0
                for table in tables:
                    snapshot = table.snapshot_by_name(CONSISTENT_TAG)
                    total += sum(table.scan(snapshot_id=snapshot.snapshot_id).to_arrow().column("balance").to_pylist())
                return total
            time.sleep(0.2)
        raise AssertionError("the consistent tags never agreed")


def test_the_consistent_tag_never_shows_half_a_transaction_where_the_newest_snapshots_do(pg, spark):
    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="ledger", batch_max_seconds=0.3)
    mirrors = [f"`pgcdc`.`{config.destination.namespace}`.`public`.`{name}`" for name in ("ledger_a", "ledger_b")]
    reader = Reader(spark, config.destination.namespace, mirrors)
    stop, errors = threading.Event(), []
    workload = threading.Thread(target=transfers, args=(pg.dsn, stop, errors), daemon=True)
    common = ("--consistent-every", "0", "--maintenance-interval", "0", "--compact-data-files", "4")
    # the third batch holds 4 s between the commits of its two mirrors: the newest snapshots are torn meanwhile
    first = run_cli(config, *common, env={"PGCDC_INJECT": "apply.between-mirrors:3:4:PAUSE"})
    try:
        workload.start()
        wait_for(lambda: spark.catalog.tableExists(mirrors[1]) and _tagged(spark, mirrors), 300,
                 "the first consistent tags")
        # reads go on through the third batch's pause (the newest snapshots torn), for 25 s at most
        deadline = time.monotonic() + 25
        while time.monotonic() < deadline and not (reader.torn_newest and reader.newest_reads > 10):
            reader.read_once()
        first.send_signal(signal.SIGKILL)  # in the middle of whatever it does: applies, tag moves, maintenance
        first.wait()
        second = run_cli(config, *common)
        try:
            for _ in range(10):
                reader.read_once()
            stop.set()
            workload.join(timeout=60)
            assert not errors, errors
            wait_for(lambda: _caught_up(pg, config), 300, "the run to apply every transfer")
            reader.read_once()
        finally:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=120)
    finally:
        stop.set()
        for process in (first,):
            if process.poll() is None:
                process.kill()
    print(f"consistent reads: {reader.consistent_reads}; newest snapshots torn in {reader.torn_newest} of "
          f"{reader.newest_reads} reads")
    assert min(reader.consistent_reads.values()) > 10
    assert reader.torn_newest > 0, "the newest snapshots were never read torn: the test could not have failed"


def _tagged(spark, identifiers: list[str]) -> bool:
    from pgcdc.spark.iceberg_java import load_table

    return all(load_table(spark, identifier).refs().containsKey(CONSISTENT_TAG) for identifier in identifiers)


def _caught_up(pg, config) -> bool:
    row = pg.execute("SELECT confirmed_flush_lsn >= pg_current_wal_lsn() FROM pg_replication_slots "
                     "WHERE slot_name = %s", (config.slot,))
    return bool(row and row[0][0])


def test_expiry_keeps_the_tagged_snapshot_readable_and_exact(pg, spark):
    """The tag stays on an old snapshot while later batches land and every expiry runs — pgcdc's maintenance and
    Iceberg's expire_snapshots keeping one snapshot — and the tagged snapshot still reads, through Spark and
    PyIceberg, exactly the rows the source held at the LSN the tag records."""
    from pgcdc.mirrors.consistent import tag_state
    from pgcdc.mirrors.maintenance import MaintenancePolicy, maintain_table, table_health
    from pgcdc.spark.iceberg_java import load_table
    from pipeline_support import catch_up_in_process, expire_all_but_the_newest

    pg.execute(SCHEMA)
    config = pipeline_config(pg, spark, publication="ledger", consistent_seconds=0)
    mirrors = [f"`pgcdc`.`{config.destination.namespace}`.`public`.`{name}`" for name in ("ledger_a", "ledger_b")]
    catch_up_in_process(config, spark)

    def transfer_round(count: int) -> None:
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            for i in range(count):
                with conn.transaction():
                    conn.execute("UPDATE ledger_a SET balance = balance - %s WHERE id = %s", (i, i % ACCOUNTS + 1))
                    conn.execute("UPDATE ledger_b SET balance = balance + %s WHERE id = %s", (i, i % ACCOUNTS + 1))

    transfer_round(30)
    catch_up_in_process(config, spark)
    at_tag = {name: sorted(pg.execute(f"SELECT id, balance FROM {name}")) for name in ("ledger_a", "ledger_b")}
    tagged = {identifier: tag_state(load_table(spark, identifier)) for identifier in mirrors}
    assert len({state.lsn for state in tagged.values()}) == 1 and None not in {s.snapshot_id for s in tagged.values()}

    # later batches, the tags left where they are; then every expiry, keeping the newest snapshot only
    for _ in range(3):
        transfer_round(10)
        pipeline = catch_up_in_process(dataclasses.replace(config, consistent_seconds=None), spark)
    eager = MaintenancePolicy(interval_seconds=0, snapshots_kept=1, snapshot_max_age_seconds=0, check_seconds=0)
    for identifier in mirrors:
        before = table_health(spark, identifier).snapshots
        maintain_table(spark, identifier, pipeline.mirrors.positions.carried(identifier), eager, steps=["expire"])
        expire_all_but_the_newest(spark, identifier.split(".", 1)[1])
        after = table_health(spark, identifier).snapshots
        assert after < before and after == 2, (identifier, before, after)  # the newest, and the tagged one

    for identifier, name in zip(mirrors, ("ledger_a", "ledger_b"), strict=True):
        state = tag_state(load_table(spark, identifier))
        assert state == tagged[identifier]
        read = spark.read.option("snapshot-id", state.snapshot_id).table(identifier).collect()
        assert sorted((row.id, row.balance) for row in read) == at_tag[name]
        table = hadoop_table(spark, identifier)
        rows = table.scan(snapshot_id=table.snapshot_by_name(CONSISTENT_TAG).snapshot_id).to_arrow()
        read = zip(rows.column("id").to_pylist(), rows.column("balance").to_pylist(), strict=True)
        assert sorted(read) == at_tag[name]
    point = consistent_tables(spark, config.destination.namespace)
    assert point.lsn == tagged[mirrors[0]].lsn
    from pgcdc.mirrors.status import consistent_point, describe_mirrors

    shown = consistent_point(describe_mirrors(pipeline.mirrors))  # pgcdc status's line
    assert shown is not None and f"{point.lsn} on 2 of 2 mirrors" in shown, shown

    # someone else's compaction holds the same rows: the next move puts the tag on it
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{mirrors[0].split('.', 1)[1]}', "
              "options => map('rewrite-all', 'true'))")
    compacted = load_table(spark, mirrors[0]).currentSnapshot()
    assert str(compacted.operation()) == "replace"
    pg.execute("UPDATE ledger_b SET balance = balance + 1 WHERE id = 1")
    catch_up_in_process(config, spark)
    moved = {identifier: tag_state(load_table(spark, identifier)) for identifier in mirrors}
    assert moved[mirrors[0]].snapshot_id == compacted.snapshotId() and moved[mirrors[0]].lsn > point.lsn
    assert len({state.lsn for state in moved.values()}) == 1

    # pgcdc's own maintenance moves the tag onto its compaction (same rows, same LSN) before expiring: the
    # tagged snapshot is the only one left
    maintain_table(spark, mirrors[1], pipeline.mirrors.positions.carried(mirrors[1]), eager)
    followed = tag_state(load_table(spark, mirrors[1]))
    assert followed.lsn == moved[mirrors[1]].lsn and followed.snapshot_id != moved[mirrors[1]].snapshot_id
    assert followed.snapshot_id == load_table(spark, mirrors[1]).currentSnapshot().snapshotId()
    assert table_health(spark, mirrors[1]).snapshots == 1
    rows = spark.read.option("snapshot-id", followed.snapshot_id).table(mirrors[1]).collect()
    assert sorted((row.id, row.balance) for row in rows) == sorted(pg.execute("SELECT id, balance FROM ledger_b"))
    moved[mirrors[1]] = followed

    # another writer's rows are no moment of the source: the tags stay until the mirror holds one again
    spark.sql(f"INSERT INTO {mirrors[0]} VALUES (1000, 0)")
    pg.execute("UPDATE ledger_b SET balance = balance + 1 WHERE id = 1")
    catch_up_in_process(config, spark)
    assert {identifier: tag_state(load_table(spark, identifier)) for identifier in mirrors} == moved


def test_the_jvm_s_reads_of_a_lineage_are_python_s(spark, iceberg_namespace):
    """A tag's move finds its snapshot in the JVM (pgcdc.iceberg.Tags, one call a mirror), readers and the start of
    a run in Python (snapshot_at); a mirror's position is read from a few facts the JVM hands over
    (pgcdc.iceberg.Facts), or from the whole metadata: each pair holds to one rule over every kind of lineage —
    pgcdc's commits, someone's compaction, a compaction stamped before a batch beneath it, another writer's commit,
    a rewrite whose parent expired."""
    from pgcdc.lsn import Lsn
    from pgcdc.mirrors.consistent import _java_target, snapshot_at
    from pgcdc.mirrors.maintenance import MaintenancePolicy, maintain_table
    from pgcdc.mirrors.positions import position_facts
    from pgcdc.spark.iceberg_java import iceberg_classes, light_view, load_table, metadata_view

    tags = iceberg_classes().tags
    assert tags is not None, "pgcdc's jar is on the test session's class path"
    identifier = f"pgcdc.{iceberg_namespace}.t"
    name = identifier.split(".", 1)[1]
    spark.sql(f"CREATE TABLE {identifier} (id bigint) USING iceberg TBLPROPERTIES ('format-version' = '2')")
    probes = [Lsn.parse(text) for text in ("0/50", "0/100", "0/150", "0/200", "0/300", "1/0")]
    seen = []

    def agree(step: str) -> None:
        table = load_table(spark, identifier)
        view = metadata_view(table)
        python = [snapshot_at(view, lsn) for lsn in probes]
        assert [_java_target(tags, table, lsn) for lsn in probes] == python, step
        light = light_view(table, ("pgcdc.lsn",))
        assert "pgcdc.iceberg.Facts" in light.location and position_facts(table) == position_facts(view), step
        assert [snapshot_at(light, lsn) for lsn in probes] == python, step
        seen.append(python)

    agree("no snapshot")
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ('pgcdc.key' = 'id', 'pgcdc.position' = "
              """'{"lsn": "0/90"}')""")
    agree("a position recorded")
    for lsn in ("0/100", "0/100"):  # two batches' files, for a compaction to rewrite
        spark.range(2).coalesce(1).writeTo(identifier).option("snapshot-property.pgcdc.lsn", lsn).append()
    agree("pgcdc's commits")
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{name}', options => map('rewrite-all', 'true'))")
    agree("someone's compaction, no stamp: its parent's position")
    spark.range(1).coalesce(1).writeTo(identifier).option("snapshot-property.pgcdc.lsn", "0/200").append()
    maintain_table(spark, identifier, {"pgcdc.lsn": "0/100"}, MaintenancePolicy(), steps=["compact-data"])
    agree("a compaction stamped before a batch beneath it: the batch's position")
    spark.sql(f"CALL pgcdc.system.expire_snapshots(table => '{name}', retain_last => 1, "
              "older_than => TIMESTAMP '2999-01-01 00:00:00')")
    agree("a rewrite whose parent expired: its own stamp")
    spark.range(1).coalesce(1).writeTo(identifier).append()
    agree("another writer's commit: no position")
    assert any(target is not None for targets in seen for target in targets)
    assert seen[-1] == [None] * len(probes)


def test_a_tag_moves_though_a_batch_commits_during_its_move(spark, iceberg_namespace):
    """The tags move beside the applies: a batch may commit to a mirror while its tag's move is in flight. Iceberg's
    transaction then fails instead of retrying (a tag's update keeps the metadata it was made from: "Table metadata
    refresh is required"), so the move is made again on the table refreshed. Shown on the Python path, where the
    batch can be made to land inside the move; pgcdc.iceberg.Tags.point retries the same way."""
    from pgcdc.lsn import Lsn
    from pgcdc.mirrors.consistent import TagState, _point_tag_here, tag_state
    from pgcdc.spark.iceberg_java import load_table

    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint) USING iceberg TBLPROPERTIES ('format-version' = '2')")

    def batch(lsn: str) -> int:
        spark.range(1).coalesce(1).writeTo(identifier).option("snapshot-property.pgcdc.lsn", lsn).append()
        return int(load_table(spark, identifier).currentSnapshot().snapshotId())

    class BatchDuringTheMove:
        """The table, whose first transaction's commit lets a batch commit just before it."""

        def __init__(self, table):
            self.table, self.landed = table, []

        def __getattr__(self, name):
            return getattr(self.table, name)

        def newTransaction(self):
            transaction, landed = self.table.newTransaction(), self.landed

            class Committing:
                def __getattr__(self, name):
                    return getattr(transaction, name)

                def commitTransaction(self):
                    if not landed:
                        landed.append(batch("0/20"))
                    return transaction.commitTransaction()

            return Committing()

    first = batch("0/10")
    table = BatchDuringTheMove(load_table(spark, identifier))
    _point_tag_here(table, first, Lsn.parse("0/10"), tag_state(table.table))
    assert table.landed, "no batch landed during the move"
    assert tag_state(load_table(spark, identifier)) == TagState(first, Lsn.parse("0/10"))
