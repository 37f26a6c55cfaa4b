"""Table maintenance keeps exactly-once: positions survive compaction, expiry of every snapshot that carried
them (pgcdc's own and others'), kills during and right after each maintenance step, and maintenance jobs of
others running beside the stream."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import pytest

from pgcdc.errors import PositionCorruptError
from pgcdc.lsn import Lsn
from pgcdc.mirrors.catalog import MirrorCatalog
from pgcdc.mirrors.maintenance import (
    MaintainedTable,
    Maintainer,
    MaintenancePolicy,
    maintain_table,
    table_health,
)
from pgcdc.pipeline import Pipeline
from pgcdc.positions import RECORD_PROPERTY
from pgcdc.spark.destination import Destination
from pgcdc.spark.iceberg_java import load_table
from pipeline_support import (
    SHOP_TABLES,
    Workload,
    assert_mirrors_equal,
    catch_up_in_process,
    expire_all_but_the_newest,
    pipeline_config,
    prepare_source,
    run_cli,
    run_in_background,
    wait_for,
    wait_for_transactions,
)

pytestmark = pytest.mark.slow

# every table due at once, everything but the newest snapshot expired
EAGER = MaintenancePolicy(interval_seconds=0, data_files=2, delete_files=1, snapshots=2, snapshots_kept=1,
                          snapshot_max_age_seconds=0, check_seconds=0)
CHANGES = """
UPDATE shop.customers SET balance = balance + 1 WHERE id % 3 = 0;
DELETE FROM shop.customers WHERE id % 7 = 0;
INSERT INTO shop.customers (id, name) SELECT g, 'new ' || g FROM generate_series({start}, {start} + 20) g;
INSERT INTO shop.audit VALUES ('same', 'twice', '2024-01-01'), ('same', 'twice', '2024-01-01');
DELETE FROM shop.audit WHERE what = 'seed 3';
UPDATE shop.audit SET what = 'changed' WHERE what = 'seed 4';
UPDATE shop.events SET score = -score WHERE id % 5 = 0;
"""


def lineage_positions(spark, identifier: str) -> list[str]:
    return [row.lsn for row in spark.sql(
        f"SELECT s.summary['pgcdc.lsn'] AS lsn FROM {identifier}.snapshots s JOIN {identifier}.history h "
        "ON s.snapshot_id = h.snapshot_id WHERE h.is_current_ancestor AND s.summary['pgcdc.lsn'] IS NOT NULL"
    ).collect()]


def assert_changelog_whole(spark, mirrors: MirrorCatalog) -> int:
    """No change is in a change log twice; returns how many changes the logs hold."""
    total = 0
    for identifier, _ in mirrors.all_tables():
        if not identifier.endswith("__changes`"):
            continue
        row = spark.sql(f"SELECT count(*) AS n, count(DISTINCT commit_lsn_value, ordinal) AS d FROM {identifier}"
                        ).collect()[0]
        assert row.n == row.d, f"{identifier}: {row.n - row.d} changes logged twice"
        total += row.n
    return total


@pytest.mark.long
def test_positions_survive_compaction_and_expiry_of_every_snapshot_that_carried_them(pg, spark, caplog):
    prepare_source(pg, rows=120)
    # no consistent tags: a tag keeps the snapshot it points at, which carries the position (test_consistent.py)
    config = pipeline_config(pg, spark, changelog=True, maintenance=EAGER, consistent_seconds=None)
    catch_up_in_process(config, spark)
    with caplog.at_level(logging.INFO, logger="pgcdc.mirrors.maintenance"):
        for round_ in range(2):
            pg.execute(CHANGES.format(start=10_000 + 100 * round_))
            pipeline = catch_up_in_process(config, spark)
    assert "maintained" in caplog.text, "the pipeline maintained no mirror while streaming"
    mirrors: MirrorCatalog = pipeline.mirrors
    # a keyed mirror, a keyless one (REPLICA IDENTITY FULL) and a change log
    tables = [mirrors.identifier_for("shop", "customers"), mirrors.identifier_for("shop", "audit"),
              mirrors.changelog_identifier_for("shop", "customers")]

    # pgcdc's own maintenance: each commit carries the position, expiry keeps the newest snapshot only
    before = {identifier: mirrors.positions.read(identifier) for identifier in tables}
    for identifier in tables:
        maintain_table(spark, identifier, mirrors.positions.carried(identifier), EAGER,
                       orphan_age_seconds=0)  # nobody writes these tables now
        health = table_health(spark, identifier)
        # the row-delta writer's delete files are all dropped once compaction leaves them nothing to delete, on a
        # table with array columns too (whose position deletes Iceberg cannot rewrite)
        assert health.snapshots == 1 and health.delete_files == 0 and health.data_files <= 1, (identifier, health)
        assert lineage_positions(spark, identifier) == [str(before[identifier])]
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)

    # someone else's compaction (no pgcdc.lsn) followed by expiry of everything but it: the property holds on
    for identifier in tables:
        name = identifier.split(".", 1)[1]
        spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{name}', options => map('rewrite-all', 'true'))")
        expire_all_but_the_newest(spark, name)
        assert lineage_positions(spark, identifier) == [], f"{identifier} still carries its position"
        assert MirrorCatalog(spark, config.destination).positions.read(
            identifier) == before[identifier]
    logged = assert_changelog_whole(spark, mirrors)
    pg.execute(CHANGES.format(start=20_000))
    catch_up_in_process(config, spark)
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    assert assert_changelog_whole(spark, mirrors) > logged


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
def test_a_commit_in_flight_when_its_snapshots_were_expired(spark, iceberg_namespace, keyed):
    """The property written after a commit lags it: a mark set before the commit tells that a crash fell
    between the two. Keyed rows resume from the position before (replays rewrite rows with what they hold);
    rows without a key cannot, and the error says how to recover."""
    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint NOT NULL, v string) USING iceberg "
              f"TBLPROPERTIES ('format-version' = '2', 'pgcdc.key' = '{'id' if keyed else ''}')")
    mirrors = MirrorCatalog(spark, Destination(namespace=iceberg_namespace))
    for lsn in ("0/10", "0/20"):
        spark.range(2).selectExpr("id", "'x' AS v").writeTo(identifier).option(
            "snapshot-property.pgcdc.lsn", lsn).append()
    mirrors.positions.record(identifier, Lsn.parse("0/10"), pending=Lsn.parse("0/20"))  # then killed
    assert mirrors.positions.read(identifier) == Lsn.parse("0/20")  # the lineage tells
    name = identifier.split(".", 1)[1]
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{name}', options => map('rewrite-all', 'true'))")
    expire_all_but_the_newest(spark, name)
    if keyed:
        assert mirrors.positions.read(identifier) == Lsn.parse("0/10")
    else:
        with pytest.raises(PositionCorruptError, match="DROP TABLE"):
            mirrors.positions.read(identifier)
    mirrors.positions.record(identifier, Lsn.parse("0/20"))  # what a finished commit leaves
    assert mirrors.positions.read(identifier) == Lsn.parse("0/20")
    assert '"pending"' not in load_table(spark, identifier).properties().get(RECORD_PROPERTY)


def test_stray_files_are_removed_and_young_ones_kept(spark, iceberg_namespace):
    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint) USING iceberg")
    spark.range(5).writeTo(identifier).option("snapshot-property.pgcdc.lsn", "0/5").append()
    data = Path(str(load_table(spark, identifier).location()).removeprefix("file:")) / "data"
    stray = data / "stray.parquet"
    stray.write_bytes(b"left by a crash")
    policy = MaintenancePolicy()
    result = maintain_table(spark, identifier, {"pgcdc.lsn": "0/5"}, policy, steps=["remove-orphans"])
    assert result.steps["remove-orphans"] == 0 and stray.exists()  # younger than the safe age
    result = maintain_table(spark, identifier, {"pgcdc.lsn": "0/5"}, policy, steps=["remove-orphans"],
                            orphan_age_seconds=0)
    assert result.steps["remove-orphans"] == 1 and not stray.exists()
    assert spark.table(identifier).count() == 5
    assert MaintenancePolicy(orphan_age_seconds=60).problems()  # below an hour: refused


def test_expiry_deletes_what_only_expired_snapshots_held_and_keeps_what_a_tag_or_the_newest_holds(
        spark, iceberg_namespace):
    from pyiceberg_reader import assert_reads_alike, hadoop_table

    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint, v string) USING iceberg TBLPROPERTIES ("
              "'format-version' = '2', 'write.delete.mode' = 'merge-on-read')")

    def files_held(snapshot_id: int) -> dict[str, int]:  # data (0) and delete files (1), by path
        return {row.file_path.removeprefix("file:"): row.content for row in spark.sql(
            f"SELECT file_path, content FROM {identifier}.files VERSION AS OF {snapshot_id}").collect()}

    def compact() -> None:
        spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{identifier.split('.', 1)[1]}', "
                  "options => map('rewrite-all', 'true', 'remove-dangling-deletes', 'true'))")

    spark.range(10).coalesce(1).selectExpr("id", "'first' AS v").writeTo(identifier).append()
    spark.sql(f"ALTER TABLE {identifier} CREATE TAG kept")
    spark.sql(f"DELETE FROM {identifier} WHERE id = 1")  # a position delete file
    compact()  # the tagged snapshot's data file is left to it alone
    spark.range(10, 20).coalesce(1).selectExpr("id", "'second' AS v").writeTo(identifier).append()
    spark.sql(f"DELETE FROM {identifier} WHERE id = 15")
    compact()  # left to the snapshots before: a data file of each compaction's, and delete files
    snapshots = [row.snapshot_id for row in spark.sql(
        f"SELECT snapshot_id FROM {identifier}.snapshots ORDER BY committed_at").collect()]
    tagged = spark.sql(f"SELECT snapshot_id FROM {identifier}.refs WHERE name = 'kept'").collect()[0].snapshot_id
    kept = {*files_held(tagged), *files_held(snapshots[-1])}
    held = {path: content for snapshot in snapshots for path, content in files_held(snapshot).items()}
    only_expired = set(held) - kept
    contents = [held[path] for path in only_expired]
    assert len(snapshots) == 6 and contents.count(0) >= 2 and contents.count(1) >= 1, held
    assert all(Path(path).exists() for path in only_expired)
    rows = sorted(tuple(row) for row in spark.table(identifier).collect())
    at_tag = sorted(tuple(row) for row in spark.sql(f"SELECT * FROM {identifier} VERSION AS OF 'kept'").collect())

    policy = MaintenancePolicy(snapshots_kept=1, snapshot_max_age_seconds=0)
    result = maintain_table(spark, identifier, {}, policy, steps=["expire"])

    assert result.steps["expire"] == 4  # every snapshot but the newest and the tagged one
    assert sorted(row.snapshot_id for row in spark.sql(f"SELECT snapshot_id FROM {identifier}.snapshots")
                  .collect()) == sorted([tagged, snapshots[-1]])
    assert not any(Path(path).exists() for path in only_expired), only_expired
    assert all(Path(path).exists() for path in kept)
    assert sorted(tuple(row) for row in spark.table(identifier).collect()) == rows
    assert sorted(tuple(row) for row in spark.sql(
        f"SELECT * FROM {identifier} VERSION AS OF 'kept'").collect()) == at_tag
    assert assert_reads_alike(spark, identifier, hadoop_table(spark, identifier)) == 18  # a reader not pgcdc's
    assert assert_reads_alike(spark, identifier, hadoop_table(spark, identifier), snapshot_id=tagged) == 10
    assert maintain_table(spark, identifier, {}, policy, steps=["expire"]).steps["expire"] == 0

    # young snapshots past the bound: the table is brought back to the newest half of it, the tagged one kept
    for value in range(4):
        spark.createDataFrame([(100 + value, "young")], "id bigint, v string").writeTo(identifier).append()
    young = [row.snapshot_id for row in spark.sql(
        f"SELECT snapshot_id FROM {identifier}.snapshots ORDER BY committed_at").collect()]
    assert len(young) == 6
    bounded = MaintenancePolicy(snapshots=6, snapshots_kept=1, snapshot_max_age_seconds=3600)
    assert maintain_table(spark, identifier, {}, bounded, steps=["expire"]).steps["expire"] == 2
    assert sorted(row.snapshot_id for row in spark.sql(f"SELECT snapshot_id FROM {identifier}.snapshots")
                  .collect()) == sorted([tagged, *young[-3:]])
    assert spark.table(identifier).count() == 22


def test_a_table_left_unchanged_for_an_interval_is_compacted_of_its_last_delete_files(spark, iceberg_namespace):
    """Below the thresholds a streamed table is left alone; once the stream leaves it unchanged for an interval,
    the delete files every read pays for are compacted away."""
    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint, v string) USING iceberg TBLPROPERTIES ("
              "'format-version' = '2', 'write.delete.mode' = 'merge-on-read')")
    spark.range(10).coalesce(1).selectExpr("id", "'x' AS v").writeTo(identifier).option(
        "snapshot-property.pgcdc.lsn", "0/10").append()
    spark.sql(f"DELETE FROM {identifier} WHERE id < 3")
    assert table_health(spark, identifier).delete_files == 1
    clock = [0.0]
    policy = MaintenancePolicy(check_seconds=0)  # the defaults: 8 delete files, 300 s between maintenances
    maintainer = Maintainer(lambda: spark, policy, lambda: [MaintainedTable(identifier, lambda: {"pgcdc.lsn": "0/10"})],
                            clock=lambda: clock[0])
    assert maintainer.turn() is None  # first seen now
    clock[0] = policy.interval_seconds - 1
    assert maintainer.turn() is None  # not yet an interval unchanged
    spark.sql(f"DELETE FROM {identifier} WHERE id = 3")  # the stream writes to it again
    clock[0] = policy.interval_seconds + 1
    assert maintainer.turn() is None  # changed since: the interval starts again
    clock[0] = 2 * policy.interval_seconds + 1
    result = maintainer.turn()
    assert result is not None and result.after is not None
    assert result.after.delete_files == 0 and result.after.data_files == 1
    assert sorted(r.id for r in spark.table(identifier).collect()) == list(range(4, 10))


def small_mirror(spark, identifier: str, partitioned: bool = False) -> None:
    """A streamed-looking small table: three data files, position deletes on two of them, one data file that
    predates a column (its rows read NULL there)."""
    partitioning = "PARTITIONED BY (bucket(2, id)) " if partitioned else ""
    spark.sql(f"CREATE TABLE {identifier} (id bigint, v string) USING iceberg {partitioning}TBLPROPERTIES ("
              "'format-version' = '2', 'write.delete.mode' = 'merge-on-read', 'write.update.mode' = 'merge-on-read')")
    for start in (0, 10):
        spark.range(start, start + 10).coalesce(1).selectExpr("id", "concat('v', id) AS v").writeTo(
            identifier).option("snapshot-property.pgcdc.lsn", f"0/{start + 10}").append()
    spark.sql(f"ALTER TABLE {identifier} ADD COLUMN w int")
    spark.range(20, 25).coalesce(1).selectExpr("id", "concat('v', id) AS v", "CAST(id AS int) AS w").writeTo(
        identifier).append()
    spark.sql(f"DELETE FROM {identifier} WHERE id IN (3, 12, 21)")
    spark.sql(f"UPDATE {identifier} SET v = 'changed' WHERE id = 4")


def rows_of(spark, identifier: str) -> list[tuple]:
    return sorted((r.id, r.v, r.w) for r in spark.table(identifier).collect())


@pytest.mark.parametrize("partitioned", [False, True], ids=["unpartitioned", "partitioned"])
def test_a_small_table_is_compacted_in_the_driver_into_one_file_per_partition_and_no_delete_file(
        spark, iceberg_namespace, caplog, partitioned):
    identifier = f"pgcdc.{iceberg_namespace}.t"
    small_mirror(spark, identifier, partitioned)
    expected = rows_of(spark, identifier)
    assert table_health(spark, identifier).delete_files > 0
    with caplog.at_level(logging.INFO, logger="pgcdc.mirrors.small_compaction"):
        result = maintain_table(spark, identifier, {"pgcdc.lsn": "0/99"}, EAGER,
                                steps=["compact-data", "compact-deletes"])
    assert "in the driver" in caplog.text, "the small table went to Spark's compaction"
    assert result.after is not None and result.after.delete_files == 0
    assert result.after.data_files == (2 if partitioned else 1)
    assert rows_of(spark, identifier) == expected
    table = load_table(spark, identifier)
    snapshot = table.currentSnapshot()
    assert str(snapshot.operation()) == "replace" and snapshot.summary().get("pgcdc.lsn") == "0/99"
    # every engine reads it: PyIceberg too, straight from the table's metadata
    from pyiceberg.table import StaticTable

    read = StaticTable.from_metadata(str(table.operations().current().metadataFileLocation())).scan().to_arrow()
    assert sorted(zip(*(read.column(c).to_pylist() for c in ("id", "v", "w")), strict=True)) == expected


def test_a_large_table_s_compaction_costs_what_changed_until_its_deletes_remove_a_share_of_its_rows(
        spark, iceberg_namespace, monkeypatch):
    """A large mirror (made large here by lowering the bounds) keeps its full-size file and the deletes on it: its
    small files are packed and its delete files merged into one. Once its deletes remove DELETED_SHARE of its rows,
    the files they touch are rewritten without them. Every reader reads the same rows throughout."""
    from pyiceberg.table import StaticTable

    from pgcdc.mirrors import maintenance, small_compaction

    monkeypatch.setattr(maintenance, "WHOLE_REWRITE_BYTES", 0)
    monkeypatch.setattr(small_compaction, "SMALL_ROWS", 0)
    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint, v string) USING iceberg TBLPROPERTIES ("
              "'format-version' = '2', 'write.delete.mode' = 'merge-on-read', 'write.update.mode' = 'merge-on-read')")
    spark.range(0, 10_000).coalesce(1).selectExpr("id", "concat('v', id) AS v").writeTo(identifier).append()
    large = [row.file_path for row in spark.sql(f"SELECT file_path FROM {identifier}.files").collect()]
    # the full-size file is the target size: within the sizes a compaction leaves as they are
    size = spark.sql(f"SELECT file_size_in_bytes FROM {identifier}.files").collect()[0][0]
    spark.sql(f"ALTER TABLE {identifier} SET TBLPROPERTIES ('write.target-file-size-bytes' = '{size}')")
    for start in (10_000, 10_010, 10_020):  # a stream's small files
        spark.range(start, start + 10).coalesce(1).selectExpr("id", "concat('v', id) AS v").writeTo(
            identifier).append()
    for ids in ("id IN (1, 2)", "id IN (3, 10005)"):  # deletes on the large file, one on a small one
        spark.sql(f"DELETE FROM {identifier} WHERE {ids}")

    def rows() -> list[tuple]:
        read = spark.table(identifier).collect()
        table = load_table(spark, identifier)
        other = StaticTable.from_metadata(str(table.operations().current().metadataFileLocation())).scan().to_arrow()
        assert sorted(zip(other.column("id").to_pylist(), other.column("v").to_pylist(), strict=True)) == sorted(
            (r.id, r.v) for r in read), "PyIceberg reads what Spark reads"
        return sorted((r.id, r.v) for r in read)

    expected = rows()
    result = maintain_table(spark, identifier, {"pgcdc.lsn": "0/99"}, EAGER, steps=["compact-data", "compact-deletes"])
    assert result.after is not None and result.after.delete_files == 1  # merged, kept on the large file
    files = [row.file_path for row in spark.sql(f"SELECT file_path FROM {identifier}.data_files").collect()]
    assert large[0] in files and len(files) == 2, files  # the large file kept, the small ones packed into one
    assert rows() == expected
    # deletes of a tenth of its rows: now every file they touch is rewritten without them
    spark.sql(f"DELETE FROM {identifier} WHERE id % 9 = 0")
    expected = rows()
    result = maintain_table(spark, identifier, {"pgcdc.lsn": "0/99"}, EAGER, steps=["compact-data", "compact-deletes"])
    assert result.after is not None and result.after.delete_files == 0
    data_files = spark.sql(f"SELECT file_path FROM {identifier}.data_files").collect()
    assert large[0] not in [row.file_path for row in data_files]
    assert rows() == expected


def test_a_delete_landing_during_a_small_table_s_compaction_makes_the_compaction_change_nothing(
        spark, iceberg_namespace, monkeypatch):
    """The compaction read the rows of a snapshot; a delete of one of them commits before the compaction does:
    Iceberg refuses the compaction (the row would come back), its files are removed, the delete stands."""
    import pgcdc.mirrors.small_compaction as small_compaction
    from pgcdc.spark.iceberg_java import is_commit_conflict

    identifier = f"pgcdc.{iceberg_namespace}.t"
    small_mirror(spark, identifier)
    data = Path(str(load_table(spark, identifier).location()).removeprefix("file:")) / "data"
    files_before = set(data.rglob("*.parquet"))
    monkeypatch.setattr(small_compaction, "injection_point",
                        lambda name: spark.sql(f"DELETE FROM {identifier} WHERE id = 7") and None)
    expected = [row for row in rows_of(spark, identifier) if row[0] != 7]
    with pytest.raises(Exception) as refused:
        small_compaction.compact_small_table(spark, load_table(spark, identifier), {"pgcdc.lsn": "0/99"})
    assert is_commit_conflict(refused.value), refused.value
    assert rows_of(spark, identifier) == expected
    stray = set(data.rglob("*.parquet")) - files_before
    assert len(stray) == 1, "the concurrent delete wrote one delete file; the compaction's file is removed"
    assert table_health(spark, identifier).delete_files > 0


def test_a_table_rests_for_four_times_as_long_as_its_last_maintenance_took(spark, iceberg_namespace):
    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint, v string) USING iceberg TBLPROPERTIES ("
              "'format-version' = '2', 'write.delete.mode' = 'merge-on-read')")
    spark.range(10).coalesce(1).selectExpr("id", "'x' AS v").writeTo(identifier).append()
    clock = [0.0]
    policy = MaintenancePolicy(interval_seconds=0, delete_files=1, check_seconds=0)
    maintainer = Maintainer(lambda: spark, policy, lambda: [MaintainedTable(identifier, dict)],
                            clock=lambda: clock[0])
    spark.sql(f"DELETE FROM {identifier} WHERE id = 0")
    first = maintainer.turn()
    assert first is not None and first.after is not None and first.after.delete_files == 0
    spark.sql(f"DELETE FROM {identifier} WHERE id = 1")  # due again at once by the thresholds ...
    clock[0] = 4 * first.seconds - 0.1
    assert maintainer.turn() is None  # ... but resting
    clock[0] = 4 * first.seconds
    second = maintainer.turn()
    assert second is not None and second.after is not None and second.after.delete_files == 0


# each kill lands inside a step, or right after the steps before it
KILLS = ["maintain.small-commit:1", "maintain.expire:1", "maintain.done:1"]
MAINTAIN_EAGERLY = ("--maintenance-interval", "0", "--compact-data-files", "2", "--compact-delete-files", "1",
                    "--snapshots-kept", "1", "--snapshot-retention-minutes", "0", "--changelog")


@pytest.mark.long(5)
def test_killed_during_and_right_after_maintenance_steps_loses_and_duplicates_nothing(pg, spark):
    pg.server.require(15, "two-phase decoding")
    prepare_source(pg, rows=200)
    config = pipeline_config(pg, spark, changelog=True)
    fired = []
    with Workload(pg.dsn, seed=16) as workload:
        wait_for_transactions(workload, 20)
        for spec in KILLS:
            process = run_cli(config, *MAINTAIN_EAGERLY, env={"PGCDC_INJECT": spec})
            try:
                process.wait(timeout=120)
            except Exception:
                process.kill()
                process.wait()
            output = process.stdout.read() if process.stdout else ""
            assert process.returncode == -signal.SIGKILL, f"{spec}: exited {process.returncode}\n{output[-3000:]}"
            fired.append(spec)
        assert not workload.errors, workload.errors
    pipeline = catch_up_in_process(config, spark)
    figures = assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    assert_changelog_whole(spark, pipeline.mirrors)
    print(f"kills survived: {fired}; {figures}")


@pytest.mark.long(3)
# deleting by equality (a user's choice, maintenance beside the applies): make soak
@pytest.mark.parametrize("deletes", [pytest.param("equality", marks=pytest.mark.soak), "position"])
def test_maintenance_beside_or_between_the_row_delta_writers_applies(pg, spark, caplog, deletes, monkeypatch):
    """Equality deletes name keys, which a compaction keeps reaching: batches commit while pgcdc's own
    maintenance of a mirror runs (each side's commit retried over the other's by Iceberg). Position deletes name
    files a compaction replaces: a table's rewrites run between two applies, never beside one, while the stream
    goes on (expiry runs beside them). Either way nothing is lost or doubled."""
    from pgcdc.pipeline.applier import _Gap

    prepare_source(pg, rows=200)
    eager = MaintenancePolicy(interval_seconds=0, data_files=3, delete_files=2, check_seconds=0)
    config = pipeline_config(pg, spark, changelog=True, batch_max_seconds=0.2, maintenance=eager, deletes=deletes)
    catch_up_in_process(config, spark)
    pipeline = Pipeline(config, spark=spark)
    mirrors = pipeline.mirrors

    def maintenances() -> list[tuple[float, float]]:
        return [(record.created - float(record.args[1]), record.created) for record in caplog.records
                if record.name == "pgcdc.mirrors.maintenance" and record.msg.startswith("maintained")]

    def commits() -> tuple[list[tuple[str, float]], list[float]]:
        """(table, time) of every batch's commit, to the mirrors and their change logs, and the times of the
        rewrites' commits."""
        batches, rewrites = [], []
        for schema_table in SHOP_TABLES:
            for identifier in (mirrors.identifier_for(*schema_table.split(".")),
                               mirrors.changelog_identifier_for(*schema_table.split("."))):
                batches_and_rewrites(identifier, schema_table, batches, rewrites)
        return batches, rewrites

    def batches_and_rewrites(identifier: str, table: str, batches: list, rewrites: list) -> None:
        from pyspark.errors import AnalysisException
        try:
            snapshots = spark.sql(f"SELECT committed_at, operation FROM {identifier}.snapshots "
                                  "WHERE summary['pgcdc.lsn'] IS NOT NULL").collect()
        except AnalysisException:  # a change log the workload never wrote to
            return
        for row in snapshots:
            at = row.committed_at.timestamp()
            if row.operation == "replace":
                rewrites.append(at)
            else:
                batches.append((table, at))

    def applied_during_maintenance() -> list[tuple[str, float]]:
        """(table, seconds into the maintenance) of every batch's commit made while a maintenance ran."""
        windows = maintenances()
        return [(table, at - start) for table, at in commits()[0] for start, end in windows if start < at < end]

    gaps: list[tuple[float, float]] = []  # (start, end) of each gap between two applies the rewrites ran in
    run_in_gap = _Gap.run

    def timed(gap: _Gap) -> None:
        start = time.time()
        try:
            run_in_gap(gap)
        finally:
            gaps.append((start, time.time()))
    monkeypatch.setattr(_Gap, "run", timed)

    looked_after = [0]  # maintenances whose window was searched already

    def done() -> bool:
        if deletes == "equality":
            # a window is searched once, when its maintenance has ended: every commit made inside it is in
            # the tables' metadata by then (each poll of five tables' snapshots costs the session's JVM)
            ended = len(maintenances())
            if ended == looked_after[0]:
                return False
            looked_after[0] = ended
            return bool(applied_during_maintenance())
        return len(maintenances()) >= 4

    with caplog.at_level(logging.INFO, logger="pgcdc.mirrors.maintenance"), Workload(pg.dsn, seed=5):
        runner, failures = run_in_background(pipeline)
        try:
            wait_for(lambda: bool(failures) or done(), 400,
                     "a batch committed while a maintenance ran" if deletes == "equality" else "4 maintenances")
        finally:
            pipeline.stop()
            runner.join(timeout=300)
    assert not failures, failures
    batches, rewrites = commits()
    if deletes == "position":  # every rewrite in a gap, and no batch's commit in one
        assert rewrites and all(any(start <= at <= end for start, end in gaps) for at in rewrites), (rewrites, gaps)
        assert [(table, at) for table, at in batches if any(start < at < end for start, end in gaps)] == []
    else:
        assert gaps == []
    catch_up_in_process(config, spark)
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    assert_changelog_whole(spark, mirrors)


def test_a_commit_conflicting_after_its_change_log_landed_is_retried_without_logging_the_batch_twice(
        pg, spark, caplog, monkeypatch):
    """The change log's append commits first; a compaction of the mirror lands between the moment the mirror's
    batch resolved its rows' positions and its commit, which conflicts (its deletes name the files the compaction
    replaced). The retry appends nothing to the log again: it holds every change once, and the mirror every row."""
    from pgcdc.apply.row_delta import RowDeltaWriter

    prepare_source(pg, rows=200)
    config = pipeline_config(pg, spark, changelog=True, maintenance=MaintenancePolicy(enabled=False))
    catch_up_in_process(config, spark)
    compacted = []
    commit = RowDeltaWriter.commit

    def compact_then_commit(writer, *args, **kwargs):
        name = str(writer.table.name()).split(".", 1)[1]
        if name.endswith("shop.customers") and not compacted:
            spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{name}', "
                      "options => map('rewrite-all', 'true'))").collect()
            compacted.append(name)
        return commit(writer, *args, **kwargs)

    monkeypatch.setattr(RowDeltaWriter, "commit", compact_then_commit)
    pg.execute(CHANGES.format(start=10_000))
    with caplog.at_level(logging.WARNING, logger="pgcdc.pipeline"):
        pipeline = catch_up_in_process(config, spark)
    assert compacted and "shop.customers: the commit conflicted with a concurrent one" in caplog.text, caplog.text
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    assert assert_changelog_whole(spark, pipeline.mirrors) > 0


@pytest.mark.long
def test_a_concurrent_compaction_job_conflicts_are_retried(pg, spark, caplog):
    """Someone's own rewrite_data_files, in its own Spark session, beside the stream."""
    prepare_source(pg, rows=200)
    config = pipeline_config(pg, spark, changelog=True, batch_max_seconds=0.3,
                             maintenance=MaintenancePolicy(enabled=False))
    catch_up_in_process(config, spark)
    pipeline = Pipeline(config, spark=spark)
    other = spark.newSession()
    name = f"{config.destination.namespace}.shop.customers"
    rewrites = {"done": 0, "failed": 0}
    stop = threading.Event()

    def compact() -> None:
        while not stop.is_set():
            try:
                other.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{name}', "
                          "options => map('min-input-files', '2', 'delete-file-threshold', '1'))").collect()
                rewrites["done"] += 1
            except Exception:  # lost to pgcdc's commit: the job's own problem, as for any writer
                rewrites["failed"] += 1
            stop.wait(0.5)  # a job that runs again and again, leaving Spark's scheduler to the stream between

    with caplog.at_level(logging.WARNING, logger="pgcdc.pipeline"), Workload(pg.dsn, seed=3):
        runner, failures = run_in_background(pipeline)
        compactor = threading.Thread(target=compact, daemon=True)
        compactor.start()
        try:
            wait_for(lambda: (pipeline.progress.batches_applied >= 6 and rewrites["done"] >= 2) or bool(failures),
                     400, "batches applied beside the compaction job")
        finally:
            stop.set()
            compactor.join(timeout=300)
    pipeline.stop()
    runner.join(timeout=300)
    assert not failures, failures
    retried = caplog.text.count("conflicted with a concurrent one")
    catch_up_in_process(config, spark)
    assert_mirrors_equal(config, spark, pg.dsn, SHOP_TABLES)
    assert_changelog_whole(spark, pipeline.mirrors)
    print(f"foreign compactions: {rewrites}; pgcdc commits retried: {retried}")
    assert rewrites["done"] > 0
