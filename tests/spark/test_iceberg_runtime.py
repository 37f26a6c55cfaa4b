"""The pinned Iceberg runtime jar really works: create, MERGE, and a property in the same commit."""

import threading
from pathlib import Path

import pytest

from pgcdc.iceberg.table_metadata import TableMetadata
from pgcdc.spark.iceberg_java import (
    java_count,
    java_items,
    load_table,
    metadata_view,
    spark_schema_of,
    with_commit_properties,
)


def test_create_merge_and_snapshot_property(spark, iceberg_namespace):
    table = f"pgcdc.{iceberg_namespace}.merge_check"
    spark.sql(f"CREATE TABLE {table} (id bigint, v string) USING iceberg")
    spark.sql(f"INSERT INTO {table} VALUES (1, 'a'), (2, 'b')")
    source = spark.createDataFrame([(2, "bb"), (3, "c")], "id bigint, v string")
    source.createOrReplaceTempView("merge_source")

    with_commit_properties(spark, {"pgcdc.lsn": "0/16B3748"}, lambda: spark.sql(
        f"MERGE INTO {table} t USING merge_source s ON t.id = s.id "
        "WHEN MATCHED THEN UPDATE SET * WHEN NOT MATCHED THEN INSERT *"))

    rows = [tuple(r) for r in spark.sql(f"SELECT id, v FROM {table} ORDER BY id").collect()]
    assert rows == [(1, "a"), (2, "bb"), (3, "c")]
    snapshots = spark.sql(
        f"SELECT operation, summary['pgcdc.lsn'] AS lsn FROM {table}.snapshots ORDER BY committed_at").collect()
    assert [s.operation for s in snapshots] == ["append", "overwrite"]
    assert snapshots[0].lsn is None
    assert snapshots[1].lsn == "0/16B3748"


def test_a_tables_spark_schema_read_from_iceberg_is_the_one_spark_plans(spark, iceberg_namespace):
    """A mirror opened first in a process takes its Spark schema from its Iceberg table (one call into the JVM), not
    from a planned relation: both must be the very same schema, nested, keyed and evolved columns included, or the
    mirror would be evolved for nothing."""
    identifier = f"pgcdc.{iceberg_namespace}.shapes"
    spark.sql(f"CREATE TABLE {identifier} (id bigint NOT NULL, small int, f float, d double, n decimal(38, 9), "
              "t string, b binary, ok boolean, day date, ts timestamp, ntz timestamp_ntz, "
              "s struct<a: int, b: array<struct<c: string>>>, m map<string, array<bigint>>, l array<decimal(10,2)>) "
              "USING iceberg TBLPROPERTIES ('format-version' = '2')")
    spark.sql(f"ALTER TABLE {identifier} ADD COLUMN added timestamp")
    spark.sql(f"ALTER TABLE {identifier} SET IDENTIFIER FIELDS id")
    assert spark_schema_of(load_table(spark, identifier)) == spark.table(identifier).schema


def test_a_tables_metadata_read_in_one_round_trip_answers_as_the_java_table_does(spark, iceberg_namespace):
    """metadata_view reads a Java table's metadata as JSON in one round trip; every rule that reads a table
    (positions, tags, health) reads it instead of the Java API: it must answer the same, snapshot by snapshot."""
    identifier = f"pgcdc.{iceberg_namespace}.viewed"
    spark.sql(f"CREATE TABLE {identifier} (id bigint, v string) USING iceberg "
              "TBLPROPERTIES ('format-version' = '2', 'pgcdc.position' = '{\"lsn\": \"0/10\", \"x\": [1, 2]}')")
    for lsn in ("0/10", "0/20"):
        with_commit_properties(spark, {"pgcdc.lsn": lsn}, lambda: spark.sql(
            f"INSERT INTO {identifier} VALUES (1, 'a'), (2, 'b')"))
    spark.sql(f"DELETE FROM {identifier} WHERE id = 1")
    spark.sql(f"CALL pgcdc.system.rewrite_data_files(table => '{identifier.split('.', 1)[1]}', "
              "options => map('rewrite-all', 'true'))")
    table = load_table(spark, identifier)
    first = java_items(table.snapshots())[0]
    table.manageSnapshots().createTag("held", first.snapshotId()).commit()
    table.refresh()

    view = metadata_view(table)
    assert isinstance(view, TableMetadata)
    assert metadata_view(view) is view
    java_snapshots = java_items(table.snapshots())
    assert len(view.snapshots()) == len(java_snapshots) == java_count(table.snapshots()) == 4
    for snapshot in java_snapshots:
        seen = view.snapshot(snapshot.snapshotId())
        assert seen.parentId() == (None if snapshot.parentId() is None else int(snapshot.parentId()))
        assert seen.operation() == str(snapshot.operation())
        summary = {str(key): str(snapshot.summary().get(key)) for key in java_items(snapshot.summary().keySet())}
        assert dict(seen.summary()) == {k: v for k, v in summary.items() if k != "operation"}
    assert view.currentSnapshot().snapshotId() == table.currentSnapshot().snapshotId()
    assert view.currentSnapshot().operation() == "replace"
    assert {name: (ref.snapshotId(), ref.type) for name, ref in view.refs().items()} == {
        str(name): (int(table.refs().get(name).snapshotId()), "tag" if table.refs().get(name).isTag() else "branch")
        for name in java_items(table.refs().keySet())}
    assert view.refs()["held"].snapshotId() == first.snapshotId()
    assert dict(view.properties()) == {str(key): str(table.properties().get(key))
                                       for key in java_items(table.properties().keySet())}
    assert view.properties()["pgcdc.position"] == '{"lsn": "0/10", "x": [1, 2]}'


def test_a_metadata_file_is_read_once_and_every_new_version_or_table_made_again_is_read_afresh(
        spark, iceberg_namespace, monkeypatch):
    """A view is shared by every reader of the same metadata file of the same table (read-only), never by a newer
    version, a transaction's staged metadata, or a table dropped and made again at the same place (a Hadoop
    catalog starts it over at v1.metadata.json)."""
    identifier = f"pgcdc.{iceberg_namespace}.viewed_once"
    create = (f"CREATE TABLE {identifier} (id bigint) USING iceberg "
              "TBLPROPERTIES ('format-version' = '2', 'made' = 'first')")
    spark.sql(create)
    first = metadata_view(load_table(spark, identifier))
    assert metadata_view(load_table(spark, identifier)) is first
    with pytest.raises(TypeError):
        first.properties()["made"] = "changed"  # type: ignore[index]

    table = load_table(spark, identifier)
    transaction = table.newTransaction()
    transaction.updateProperties().set("made", "staged").commit()
    staged = metadata_view(transaction.table())
    assert staged.properties()["made"] == "staged" and metadata_view(transaction.table()) is not staged
    transaction.commitTransaction()
    second = metadata_view(load_table(spark, identifier))
    assert second is not first and second.properties()["made"] == "staged"
    assert first.properties()["made"] == "first"

    spark.sql(f"DROP TABLE {identifier}")
    spark.sql(create.replace("'first'", "'again'"))
    again = load_table(spark, identifier)
    assert str(again.operations().current().metadataFileLocation()).endswith("/v1.metadata.json")
    assert metadata_view(again).properties()["made"] == "again"

    # views are kept up to a number of snapshots in all: one holding more is read each time
    from pgcdc.spark import iceberg_java as iceberg

    spark.sql(f"INSERT INTO {identifier} VALUES (1)")
    monkeypatch.setattr(iceberg, "_VIEWS_SNAPSHOTS_KEPT", 0)
    grown = load_table(spark, identifier)
    assert metadata_view(grown) is not metadata_view(grown)


@pytest.mark.parametrize("read_in_turn", [16, 0], ids=["steps-in-the-calling-thread", "steps-on-the-worker-pool"])
def test_a_copy_replacing_every_row_of_a_table_leaves_only_its_own_files(spark, iceberg_namespace, monkeypatch,
                                                                        commit_steps_chosen, read_in_turn):
    """A copy's commit over a table that holds rows (three commits: three manifests) removes every file before it,
    whether its steps run in the calling thread or, past MANIFESTS_READ_IN_TURN manifests, on Iceberg's pool."""
    import os
    import uuid

    import pyarrow as pa

    from pgcdc.iceberg.locations import local_path
    from pgcdc.iceberg.parquet import layout_schema, parquet_footer, write_parquet
    from pgcdc.spark import iceberg_java as iceberg
    from pgcdc.spark.iceberg_java import parquet_compression, parquet_layout, replace_with_files

    monkeypatch.setattr(iceberg, "MANIFESTS_READ_IN_TURN", read_in_turn)
    identifier = f"pgcdc.{iceberg_namespace}.recopied"
    spark.sql(f"CREATE TABLE {identifier} (id bigint, v string) USING iceberg TBLPROPERTIES ('format-version' = '2')")
    for batch in range(3):
        spark.sql(f"INSERT INTO {identifier} VALUES ({batch}, 'old')")
    table = load_table(spark, identifier)
    schema = layout_schema(parquet_layout(table))
    path = str(table.locationProvider().newDataLocation(f"{uuid.uuid4()}.parquet"))
    os.makedirs(os.path.dirname(local_path(path)), exist_ok=True)
    rows = pa.table({"id": pa.array([10, 11], pa.int64()), "v": pa.array(["new", "new"])}).cast(schema)
    write_parquet(rows.to_batches(), local_path(path), schema, parquet_compression(table))
    size = os.path.getsize(local_path(path))
    with open(local_path(path), "rb") as file:
        replace_with_files(spark, table, [(path, size, parquet_footer(file, size))], {"pgcdc.lsn": "0/10"})
    assert commit_steps_chosen == [read_in_turn > 0]
    assert sorted(tuple(row) for row in spark.table(identifier).collect()) == [(10, "new"), (11, "new")]
    assert [row.file_path for row in spark.sql(f"SELECT file_path FROM {identifier}.files").collect()] == [path]


@pytest.mark.parametrize("caching", ["false", "true"])
def test_a_table_is_loaded_as_its_catalog_holds_it_now_whether_or_not_the_catalog_caches_tables(
        spark, iceberg_namespace, caching):
    """pgcdc's catalogs load tables afresh; a catalog a user set to cache them (Iceberg's default) holds a table as
    it first loaded it: what pgcdc reads of it is read again."""
    catalog = f"cache_{caching}"
    for key, value in {"": "org.apache.iceberg.spark.SparkCatalog", ".type": "hadoop", ".cache-enabled": caching,
                       ".warehouse": spark.conf.get("spark.sql.catalog.pgcdc.warehouse")}.items():
        spark.conf.set(f"spark.sql.catalog.{catalog}{key}", value)
    writer = f"pgcdc.{iceberg_namespace}.t"  # another writer: the session's own catalog
    spark.sql(f"CREATE TABLE {writer} (id bigint) USING iceberg")
    spark.range(3).writeTo(writer).append()
    reader = f"`{catalog}`.`{iceberg_namespace}`.`t`"
    first = load_table(spark, reader).currentSnapshot().snapshotId()
    spark.range(3, 5).writeTo(writer).append()
    assert load_table(spark, reader).currentSnapshot().snapshotId() != first
    assert load_table(spark, reader).currentSnapshot().snapshotId() == \
        load_table(spark, writer).currentSnapshot().snapshotId()


def test_python_tasks_are_forked_from_pgcdcs_daemon_with_the_copys_modules_imported(spark):
    def probe(_):
        import os
        import sys

        with open(f"/proc/{os.getppid()}/cmdline", "rb") as cmdline:
            parent = cmdline.read().replace(b"\0", b" ").decode()
        import pyspark

        yield (parent, sorted(name for name in ("pyarrow.parquet", "psycopg2", "pgcdc.spark.snapshot", "pandas")
                              if name in sys.modules), pyspark.__file__, [p for p in sys.path if p.endswith(".zip")])

    [(parent, loaded, pyspark_file, zips)] = spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()
    assert "-m pgcdc.spark.worker_daemon" in parent, parent
    # pandas: pyarrow imports it when it is installed (it is, here: a test dependency)
    assert loaded == ["pandas", "pgcdc.spark.snapshot", "psycopg2", "pyarrow.parquet"], loaded
    # pyspark from its installed, compiled package, not from Spark's zip of the same files
    import pyspark

    assert pyspark_file == pyspark.__file__ and not any(z.endswith("pyspark.zip") for z in zips), (pyspark_file, zips)


def test_python_tasks_neither_collect_the_imported_modules_nor_parse_unchanged_zips_again(spark):
    """pyspark's worker collects garbage after each task and invalidates import caches before each one; the
    daemon's imported modules are frozen out of collections, and a zip on the path that has not changed is
    not parsed again."""
    def probe(_):
        import gc
        import importlib
        import sys
        import zipimport

        reads = []
        read_directory = zipimport._read_directory
        zipimport._read_directory = lambda archive: reads.append(archive) or read_directory(archive)
        try:
            importlib.invalidate_caches()
        finally:
            zipimport._read_directory = read_directory
        yield gc.get_freeze_count(), [p for p in sys.path if p.endswith(".zip")], reads

    [(frozen, zips, reads)] = spark.sparkContext.parallelize([0], 1).mapPartitions(probe).collect()
    assert frozen > 10_000  # pyarrow, psycopg2 and pgcdc's converters: tens of thousands of objects
    # of Spark's zips only py4j's stays on the path, when the py4j installed is not the version Spark ships (as
    # here: pyspark 3.5 ships 0.10.9.7); an unchanged zip is not read again
    from importlib import metadata

    import pyspark

    shipped = sorted(Path(pyspark.__file__).parent.joinpath("python", "lib").glob("py4j-*-src.zip"))
    assert [Path(z).name for z in zips if Path(z).parent == shipped[0].parent] == [
        z.name for z in shipped if z.name != f"py4j-{metadata.version('py4j')}-src.zip"], zips
    assert reads == []


ZIP_CHANGED_ON_DISK = """
import importlib, os, sys, zipfile
from pgcdc.spark.worker_daemon import reread_zip_directories_only_when_changed

reread_zip_directories_only_when_changed()
archive = os.path.join(sys.argv[1], "modules.zip")
with zipfile.ZipFile(archive, "w") as z:
    z.writestr("first.py", "VALUE = 1")
sys.path.insert(0, archive)
import first
importlib.invalidate_caches()
with zipfile.ZipFile(archive, "w") as z:
    z.writestr("first.py", "VALUE = 1")
    z.writestr("second.py", "VALUE = 2")
importlib.invalidate_caches()
import second
print(first.VALUE, second.VALUE)
"""


def test_a_zip_changed_on_disk_is_read_again_when_import_caches_are_invalidated(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ZIP_CHANGED_ON_DISK, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2"]


FIRST_COMMITS_FROM_THREADS = """
import json, logging, sys, threading, time
import pytest

from pgcdc.spark.iceberg_java import java_count, java_items, load_table, metadata_view, with_commit_properties
from pgcdc.iceberg.table_metadata import TableMetadata
from pgcdc.spark.destination import Destination
from pgcdc.spark.session import spark_session

spark = spark_session(Destination(warehouse=sys.argv[1]))
tables = [f"pgcdc.first.commit_{n}" for n in range(6)]
spark.sql("CREATE NAMESPACE pgcdc.first")
for table in tables:
    spark.sql(f"CREATE TABLE {table} (id bigint) USING iceberg")
start = threading.Barrier(len(tables))
failures = []


class SlowServerThread(logging.Handler):
    # py4j's server thread, once started, waits its turn for the interpreter: here for a whole second

    def emit(self, record):
        if record.getMessage() == "Callback Server Starting":
            time.sleep(1)


logging.getLogger("py4j.java_gateway").addHandler(SlowServerThread(logging.INFO))
logging.getLogger("py4j.java_gateway").setLevel(logging.INFO)


def commit(n, table):
    start.wait()
    time.sleep(n * 0.002)  # staggered, as the writers' threads are: later ones find the server starting
    try:
        with_commit_properties(spark, {"pgcdc.lsn": f"0/{n + 1}"},
                               lambda: spark.sql(f"INSERT INTO {table} VALUES ({n})"))
    except BaseException as exc:
        failures.append(str(exc)[:2000])

threads = [threading.Thread(target=commit, args=(n, table)) for n, table in enumerate(tables)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
landed = {table: [(r.lsn, r.id) for r in spark.sql(
    f"SELECT s.summary['pgcdc.lsn'] AS lsn, t.id FROM {table}.snapshots s, {table} t").collect()]
    for table in tables}
print(json.dumps({"failures": failures, "landed": landed}))
"""


@pytest.mark.spark  # a Spark of its own, in a fresh process
def test_a_processs_first_commits_made_from_many_threads_at_once_all_land_with_their_properties(tmp_path):
    """A process's first commit starts py4j's callback server (Iceberg calls back into Python to run the
    statement). The row-delta writers commit from several threads: when the first commits come from several
    at once, none may call Java before the server listens and Java knows its port. A fresh process, since
    a callback server once started cannot be stopped and started again in one."""
    import json
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FIRST_COMMITS_FROM_THREADS, str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failures"] == []
    assert result["landed"] == {f"pgcdc.first.commit_{n}": [[f"0/{n + 1}", n]] for n in range(6)}


def test_a_commit_waiting_for_a_tables_lock_in_the_jvm_looks_again_within_milliseconds(spark, iceberg_namespace):
    """Commits to one Hadoop-catalog table from the process (a batch's, a tag's move, a maintenance step) take turns
    under the JVM's default lock manager, which polls every 5 s unless told otherwise (and reads no catalog's
    settings): pgcdc has it look again every few milliseconds. A commit kept waiting by the lock lands once it is
    released."""
    import re

    from pgcdc.spark.iceberg_java import COMMIT_LOCK_POLL_MS, iceberg_classes

    iceberg_classes()
    jvm = spark.sparkContext._jvm
    locks = jvm.org.apache.iceberg.util.LockManagers.defaultLockManager()
    assert locks.acquireIntervalMs() == COMMIT_LOCK_POLL_MS
    identifier = f"pgcdc.{iceberg_namespace}.locked"
    spark.sql(f"CREATE TABLE {identifier} (id bigint) USING iceberg")
    table = load_table(spark, identifier)
    current = str(table.operations().current().metadataFileLocation())
    number = int(re.search(r"/v(\d+)\.metadata\.json$", current).group(1))
    following = re.sub(r"/v\d+\.metadata\.json$", f"/v{number + 1}.metadata.json", current)
    assert locks.acquire(following, "the test")
    committed: list[BaseException | None] = []

    def commit() -> None:
        try:
            table.updateProperties().set("locked", "no more").commit()
            committed.append(None)
        except BaseException as exc:
            committed.append(exc)
    thread = threading.Thread(target=commit)
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive() and not committed  # waits for the lock
    assert locks.release(following, "the test")
    thread.join(timeout=60)
    assert committed == [None]
    assert load_table(spark, identifier).properties().get("locked") == "no more"
