"""When a mirror is due for maintenance, what a turn does, and which settings are refused."""

from __future__ import annotations

import functools

import pytest

from pgcdc.errors import ConfigError
from pgcdc.mirrors.maintenance import Maintainer, MaintenancePolicy, TableHealth, due_steps
from pgcdc.pipeline import PipelineConfig

POLICY = MaintenancePolicy(data_files=10, delete_files=4, snapshots=50, snapshots_kept=5,
                           orphan_interval_seconds=3600)


def health(snapshots=3, data_files=1, delete_files=0, orphans_removed_at=1000.0) -> TableHealth:
    return TableHealth(snapshots, data_files, delete_files, manifests=1, orphans_removed_at=orphans_removed_at)


@pytest.mark.parametrize(("policy", "every"), [
    (MaintenancePolicy(), 10.0),  # the interval (300 s) is longer than the look
    (MaintenancePolicy(interval_seconds=4), 4.0),  # a table due every 4 s is looked at as often
    (MaintenancePolicy(interval_seconds=0), 1.0),  # as soon as due, but a look reads metadata: once a second
    (MaintenancePolicy(interval_seconds=0, check_seconds=0), 0.0),  # asked for
])
def test_tables_are_looked_at_as_often_as_their_interval_allows(policy, every):
    assert policy.check_every == every
    clock = [100.0]
    maintainer = Maintainer(lambda: None, policy, lambda: [], clock=lambda: clock[0])
    assert maintainer.ready()  # at the start
    assert maintainer.turn() is None  # no table yet
    clock[0] += every - 0.01
    assert not maintainer.ready() or every == 0.0
    clock[0] += 0.01
    assert maintainer.ready()


def test_a_healthy_table_is_left_alone():
    assert due_steps(health(), POLICY, now=2000.0) == []


@pytest.mark.parametrize("table", [health(data_files=10), health(delete_files=4)], ids=["data", "deletes"])
def test_many_files_compact_and_expire_what_compaction_replaced(table):
    assert due_steps(table, POLICY, now=2000.0) == ["compact-data", "compact-deletes", "rewrite-manifests"]
    assert due_steps(health(snapshots=6, data_files=10), POLICY, now=2000.0)[-1] == "expire"


def test_a_settled_table_is_compacted_of_any_delete_file_and_left_alone_without_one():
    assert due_steps(health(delete_files=1), POLICY, now=2000.0) == []
    assert due_steps(health(delete_files=1), POLICY, now=2000.0, settled=True) == [
        "compact-data", "compact-deletes", "rewrite-manifests"]
    assert due_steps(health(data_files=5), POLICY, now=2000.0, settled=True) == []


GIB = 1 << 30


def test_a_large_mirror_is_due_for_what_its_batches_added_not_for_its_size():
    # 40 GiB in 80 full files of 512 MiB, no compaction in its history: due at the policy's count of files beyond
    # those, not at every look
    large = functools.partial(TableHealth, 3, manifests=1, orphans_removed_at=1000.0, rows=400_000_000,
                              data_bytes=40 * GIB)
    assert due_steps(large(80 + 9, 0), POLICY, now=2000.0) == []
    assert due_steps(large(80 + 10, 0), POLICY, now=2000.0)[0] == "compact-data"
    assert due_steps(large(80, 4), POLICY, now=2000.0)[0] == "compact-data"
    # after a compaction that left 300 files (some small, packed no further): the files added since count
    assert due_steps(large(300 + 9, 0, compacted_data_files=300), POLICY, now=2000.0) == []
    assert due_steps(large(300 + 10, 0, compacted_data_files=300), POLICY, now=2000.0)[0] == "compact-data"
    # 100,000,000 narrow rows in 180 MB are large too: their rewrite is what costs
    narrow = TableHealth(3, 2, 0, manifests=1, orphans_removed_at=None, rows=100_000_000, data_bytes=180 << 20,
                         compacted_data_files=1)
    assert due_steps(narrow, POLICY, now=2000.0) == []
    # at rest, its few merged delete files stay (a rewrite of every file they touch would cost its 40 GiB)
    assert due_steps(large(80, 1), POLICY, now=2000.0, settled=True) == []
    # a table below WHOLE_REWRITE_BYTES counts every file, and is compacted of any delete at rest
    small = functools.partial(TableHealth, 3, manifests=1, orphans_removed_at=1000.0, rows=1_000_000,
                              data_bytes=100 << 20)
    assert due_steps(small(10, 0), POLICY, now=2000.0)[0] == "compact-data"
    assert due_steps(small(1, 1), POLICY, now=2000.0, settled=True)[0] == "compact-data"


def test_a_large_mirror_rewrites_the_files_its_deletes_touch_once_they_remove_a_share_of_its_rows():
    from pgcdc.mirrors.maintenance import DELETED_SHARE, WHOLE_REWRITE_BYTES, rewrites_every_deleted_file

    def table(data_bytes: int, position_deletes: int) -> TableHealth:
        return TableHealth(3, 10, 5, manifests=1, orphans_removed_at=None, rows=1_000_000, data_bytes=data_bytes,
                           position_deletes=position_deletes)

    assert rewrites_every_deleted_file(table(WHOLE_REWRITE_BYTES, 0))
    assert not rewrites_every_deleted_file(table(WHOLE_REWRITE_BYTES + 1, int(DELETED_SHARE * 1_000_000) - 1))
    assert rewrites_every_deleted_file(table(WHOLE_REWRITE_BYTES + 1, int(DELETED_SHARE * 1_000_000)))


def test_many_snapshots_expire_alone():
    assert due_steps(health(snapshots=50), POLICY, now=2000.0) == ["expire"]


def test_orphans_are_looked_for_once_per_interval_and_not_before_the_clock_starts():
    assert due_steps(health(orphans_removed_at=None), POLICY, now=10**9) == []
    assert due_steps(health(orphans_removed_at=1000.0), POLICY, now=1000.0 + 3600) == ["remove-orphans"]


@pytest.mark.parametrize("settings, message", [
    ({"orphan_age_seconds": 600}, "at least an hour"),
    ({"snapshots_kept": 0}, "snapshots_kept"),
    ({"data_files": 0}, "data_files"),
])
def test_unsafe_settings_are_refused_with_the_fix(settings, message):
    with pytest.raises(ConfigError, match=message):
        PipelineConfig(dsn="dbname=x", publication="p", maintenance=MaintenancePolicy(**settings))


def test_maintenance_is_on_by_default_and_can_be_turned_off():
    assert PipelineConfig(dsn="dbname=x", publication="p").maintenance.enabled
    assert not MaintenancePolicy(enabled=False).enabled


def _thrown(jvm, kind: str):
    """A Java exception of ``kind`` as Iceberg throws it (its message arguments are Java varargs)."""
    exceptions = jvm.org.apache.iceberg.exceptions
    no_arguments = jvm.java.util.ArrayList().toArray()
    if kind == "validation":
        return exceptions.ValidationException("Found conflicting files that can contain records", no_arguments)
    if kind == "commit-failed":
        return exceptions.CommitFailedException("Version 7 already exists", no_arguments)
    if kind == "state-unknown":
        return exceptions.CommitStateUnknownException(jvm.java.lang.RuntimeException("timed out"))
    return jvm.java.lang.IllegalStateException("Table or view not found")


@pytest.mark.parametrize("kind, retried", [("validation", True), ("commit-failed", True), ("state-unknown", False),
                                           ("other", False)])
def test_only_commits_that_lost_to_a_concurrent_one_are_applied_again(spark, kind, retried):
    """Recognised by the Java exception's class, through py4j, whatever Spark wraps it in."""
    from pgcdc.spark.iceberg_java import is_commit_conflict

    jvm = spark.sparkContext._jvm
    with pytest.raises(Exception) as raised:  # py4j's error around the Java exception, as a failed commit raises it
        jvm.org.apache.iceberg.relocated.com.google.common.base.Throwables.throwIfUnchecked(_thrown(jvm, kind))
    assert is_commit_conflict(raised.value) is retried


def test_expiry_keeps_the_retention_age_until_a_table_holds_too_many_snapshots():
    """Snapshots older than the retention age go; past ``snapshots`` of them, the oldest beyond the newest half of
    that many go too however young (a mirror committing every second would hold thousands within the hour)."""
    from pgcdc.mirrors.maintenance import expiry_cutoff

    now = 10_000.0
    policy = MaintenancePolicy(snapshots=10, snapshots_kept=2, snapshot_max_age_seconds=3600)
    young = [int((now - 60 + second) * 1000) for second in range(9)]  # a minute old, a second apart
    assert expiry_cutoff(young, policy, now) == (now - 3600) * 1000  # below the bound: the age alone
    ten = [*young, int(now * 1000)]
    cutoff = expiry_cutoff(ten, policy, now)
    assert sum(time >= cutoff for time in ten) == 5  # the newest half stay: expired are those before the cutoff
    old = [int((now - 7200 + second) * 1000) for second in range(10)]
    assert expiry_cutoff(old, policy, now) == (now - 3600) * 1000  # all older than the age: the age decides
    assert expiry_cutoff(ten, MaintenancePolicy(snapshots=10, snapshots_kept=8), now) == sorted(ten)[-8]
    assert expiry_cutoff(ten, MaintenancePolicy(snapshots=10, snapshots_kept=20), now) == \
        int((now - 3600) * 1000)  # kept covers them all: nothing beyond the age


def test_a_look_reads_a_kept_table_in_one_call_and_commits_nothing(spark, iceberg_namespace, monkeypatch):
    """Hundreds of mirrors are looked at every few seconds, on the apply thread: a look reads the pipeline's kept
    table in one call into the JVM (not the table's whole metadata as JSON, nor a load from the catalog), and a
    table never cleaned of orphans gets its clock in memory, not in a commit of its own."""
    import pgcdc.mirrors.maintenance as maintenance
    from pgcdc.mirrors.maintenance import ORPHANS_REMOVED_PROPERTY, MaintainedTable
    from pgcdc.spark.iceberg_java import load_table

    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint) USING iceberg TBLPROPERTIES ('format-version' = '2')")
    for _ in range(2):
        spark.range(3).coalesce(1).writeTo(identifier).append()
    name = identifier.split(".", 1)[1]
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{name}', options => map('rewrite-all', 'true'))")
    spark.range(3).coalesce(1).writeTo(identifier).append()
    kept = load_table(spark, identifier)
    looked = maintenance._looked_health(spark, kept)
    assert looked == maintenance._health(spark, kept, count_manifests=False)
    assert (looked.data_files, looked.compacted_data_files) == (2, 1)  # one file since the compaction
    reads = []
    for name in ("_health", "table_health"):
        read = getattr(maintenance, name)
        monkeypatch.setattr(maintenance, name, lambda *a, _read=read, **k: reads.append(1) or _read(*a, **k))
    clock = [0.0]
    policy = MaintenancePolicy(check_seconds=0, interval_seconds=0, data_files=3)
    maintainer = Maintainer(lambda: spark, policy, lambda: [MaintainedTable(identifier, dict, lambda: kept)],
                            clock=lambda: clock[0])
    snapshots = len(list(kept.snapshots()))
    for _ in range(3):
        clock[0] += 1
        assert maintainer.turn() is None  # one data file: not due
    assert reads == []
    kept.refresh()
    assert len(list(kept.snapshots())) == snapshots and kept.properties().get(ORPHANS_REMOVED_PROPERTY) is None
    for _ in range(2):
        spark.range(3).coalesce(1).writeTo(identifier).append()
    kept.refresh()  # as the pipeline's next batch does
    clock[0] += 1
    result = maintainer.turn()  # three data files now: compacted
    assert result is not None and result.after is not None and result.after.data_files == 1
    assert load_table(spark, identifier).properties().get(ORPHANS_REMOVED_PROPERTY) is not None


def test_snapshots_of_a_resting_table_are_expired_before_its_interval_ends(spark, iceberg_namespace):
    """A mirror a batch commits to every second gathers hundreds of snapshots within one interval, each rewritten
    into every metadata file: past ``snapshots`` of them, expiry runs without waiting for the interval."""
    from pgcdc.mirrors.maintenance import MaintainedTable
    from pgcdc.spark.iceberg_java import load_table

    identifier = f"pgcdc.{iceberg_namespace}.t"
    spark.sql(f"CREATE TABLE {identifier} (id bigint) USING iceberg TBLPROPERTIES ('format-version' = '2')")
    kept = load_table(spark, identifier)

    def commits(count: int) -> None:
        for _ in range(count):
            spark.range(1).coalesce(1).writeTo(identifier).append()
        kept.refresh()

    clock = [0.0]
    policy = MaintenancePolicy(check_seconds=0, interval_seconds=1000, data_files=1000, delete_files=1000,
                               snapshots=6, snapshots_kept=1, snapshot_max_age_seconds=3600)
    maintainer = Maintainer(lambda: spark, policy, lambda: [MaintainedTable(identifier, dict, lambda: kept)],
                            clock=lambda: clock[0])
    commits(6)
    first = maintainer.turn()  # due: the table's first maintenance, which starts its interval
    assert first is not None and first.after is not None and first.after.snapshots == 3
    commits(2)
    clock[0] += 1
    assert maintainer.turn() is None  # resting, and 5 snapshots: nothing to do yet
    commits(2)
    clock[0] += 1
    expired = maintainer.turn()  # resting, but 7 snapshots: expired without waiting for the interval
    assert expired is not None and expired.steps == {"expire": 4} and expired.after is not None
    assert expired.after.snapshots == 3 and expired.after.data_files == 10


@pytest.mark.parametrize("turn_seconds, maintained", [(60.0, 3), (0.0, 1)], ids=["within", "spent"])
def test_a_turn_maintains_due_tables_until_it_has_spent_its_time(spark, iceberg_namespace, monkeypatch,
                                                                  turn_seconds, maintained):
    """Hundreds of small mirrors, each due every interval: one table a turn would leave most of them behind. A turn
    goes on to the next due table while it has taken less than its time; the first it maintains whatever it
    takes."""
    import pgcdc.mirrors.maintenance as maintenance
    from pgcdc.mirrors.maintenance import MaintainedTable
    from pgcdc.spark.iceberg_java import load_table

    monkeypatch.setattr(maintenance, "TURN_SECONDS", turn_seconds)
    tables = []
    for name in ("a", "b", "c"):
        identifier = f"pgcdc.{iceberg_namespace}.{name}"
        spark.sql(f"CREATE TABLE {identifier} (id bigint) USING iceberg TBLPROPERTIES ('format-version' = '2')")
        for _ in range(3):
            spark.range(1).coalesce(1).writeTo(identifier).append()
        tables.append(MaintainedTable(identifier, dict, functools.partial(load_table, spark, identifier)))
    policy = MaintenancePolicy(check_seconds=0, data_files=3)
    maintainer = Maintainer(lambda: spark, policy, lambda: tables, clock=lambda: 0.0)
    assert maintainer.turn() is not None
    assert [r.identifier for r in maintainer.results] == [t.identifier for t in tables][:maintained]
    assert [maintenance.table_health(spark, t.identifier).data_files for t in tables] == \
        [1] * maintained + [3] * (3 - maintained)


def test_a_java_failure_is_logged_by_its_own_line_not_py4j_s(spark):
    """A warning names what failed in the JVM (a tag's move lost to a commit, say), not only the call py4j made."""
    from pgcdc.spark.iceberg_java import failure_text

    jvm = spark.sparkContext._jvm
    with pytest.raises(Exception) as raised:
        jvm.org.apache.iceberg.relocated.com.google.common.base.Throwables.throwIfUnchecked(
            _thrown(jvm, "commit-failed"))
    assert failure_text(raised.value) == \
        "org.apache.iceberg.exceptions.CommitFailedException: Version 7 already exists"
    assert failure_text(ValueError("a plain one\nsecond line")) == "a plain one"
