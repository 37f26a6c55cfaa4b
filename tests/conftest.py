"""Shared fixtures: one real PostgreSQL per session, an empty database of its own per test (emptied again per
hypothesis example; a finished test's, emptied and renamed, where nothing of that test is left), one Spark per
session.

``PGCDC_TEST_DSN`` points the suite at an external server instead of the embedded
PostgreSQL 18 (e.g. ``host=/var/run/postgresql user=postgres dbname=postgres``);
tests that need a newer server than that one skip with the reason.

``PGCDC_TEST_PURE_PYTHON=1`` runs every test with pgcdc's optional C modules switched off (the pure-Python
paths, as where they cannot be built), in the test's process and, through ``PGCDC_NO_C_EXTENSIONS``, in the
pgcdc processes it starts (the crash loops' runs); the ``accelerators`` fixture runs a test both ways.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from psycopg import sql

from jvm_class_archive import SUITE_JAVA_OPTIONS
from pgcdc.embedded import EmbeddedPostgres
from pgcdc.spark.destination import Destination

warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")

# the suite's JVM options (jvm_class_archive.py says why)
os.environ.setdefault("PGCDC_JAVA_OPTIONS", SUITE_JAVA_OPTIONS)

# Real servers make examples slow and uneven: no per-example deadline, and a bounded example count.
settings.register_profile("default", deadline=None, max_examples=100,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("thorough", deadline=None, max_examples=2000,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

_databases = itertools.count(1)


@dataclasses.dataclass
class TestServer:
    """The PostgreSQL server under test; ``embedded`` is None for an external server."""

    __test__ = False  # not a test class

    dsn: str
    version_num: int
    embedded: EmbeddedPostgres | None
    # databases of finished tests, emptied and checked, that the next tests take under a name of their own
    spare_databases: list[str] = dataclasses.field(default_factory=list)

    def dsn_for(self, dbname: str) -> str:
        return psycopg.conninfo.make_conninfo(self.dsn, dbname=dbname)

    @property
    def major(self) -> int:
        return self.version_num // 10000

    def require(self, major: int, why: str) -> None:
        if self.major < major:
            pytest.skip(f"needs PostgreSQL {major}+ ({why}); the server under test is {self.major}")

    def client_program(self, name: str) -> str:
        if self.embedded is not None:
            return str(self.embedded.bin_dir / name)
        found = shutil.which(name)
        if found is None:
            pytest.skip(f"{name} is not on PATH for the external server")
        return found

    def restart(self, mode: str = "fast") -> None:
        if self.embedded is None:
            pytest.skip("restarting needs the embedded server")
        self.embedded.restart(mode=mode)


@dataclasses.dataclass
class TestDatabase:
    """A fresh database on the server under test."""

    __test__ = False

    server: TestServer
    name: str

    @property
    def dsn(self) -> str:
        return self.server.dsn_for(self.name)

    def connect(self, **kwargs) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True, **kwargs)

    def execute(self, query: str, params: tuple | None = None) -> list[tuple]:
        with self.connect() as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []


@pytest.fixture(scope="session")
def pg_server() -> Iterator[TestServer]:
    external = os.environ.get("PGCDC_TEST_DSN")
    if external:
        with psycopg.connect(external) as conn:
            version = int(conn.execute("SHOW server_version_num").fetchone()[0])
            level = conn.execute("SHOW wal_level").fetchone()[0]
        if level != "logical":
            pytest.exit(f"PGCDC_TEST_DSN server has wal_level={level}; set wal_level=logical and restart it")
        test_server = TestServer(external, version, None)
        yield test_server
        for name in test_server.spare_databases:
            drop_database(test_server, name)
        return
    with EmbeddedPostgres() as server:
        with psycopg.connect(server.dsn) as conn:
            version = int(conn.execute("SHOW server_version_num").fetchone()[0])
        yield TestServer(server.dsn, version, server)  # its data directory goes with it, spares and all


def drop_database(server: TestServer, name: str) -> None:
    """Drop a test database with what would block it: its slots, prepared transactions and sessions."""
    release_slots(server, name)
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def empty_database(server: TestServer, name: str) -> None:
    """Bring a test database back to what CREATE DATABASE makes (no slots, publications, prepared transactions
    or objects of ours): milliseconds, where creating and dropping one costs a quarter of a second here."""
    release_slots(server, name)
    with psycopg.connect(server.dsn_for(name), autocommit=True) as conn:
        for (publication,) in conn.execute("SELECT pubname FROM pg_publication").fetchall():
            conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(publication)))
        owner = conn.execute("SELECT nspowner::regrole::text FROM pg_namespace WHERE nspname = 'public'").fetchone()
        schemas = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname NOT LIKE 'pg\\_%' "
                               "AND nspname <> 'information_schema'").fetchall()
        for (schema,) in schemas:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        # the public schema as a new database has it: its owner, and before PostgreSQL 15 CREATE for everyone
        conn.execute(sql.SQL("CREATE SCHEMA public AUTHORIZATION {}").format(
            sql.SQL(owner[0]) if owner else sql.SQL("CURRENT_USER")))
        conn.execute("GRANT USAGE ON SCHEMA public TO PUBLIC" if server.major >= 15
                     else "GRANT USAGE, CREATE ON SCHEMA public TO PUBLIC")
        leftovers = conn.execute("SELECT count(*) FROM pg_class WHERE relnamespace NOT IN "
                                 "(SELECT oid FROM pg_namespace WHERE nspname LIKE 'pg\\_%' "
                                 "OR nspname = 'information_schema')").fetchone()[0]
        assert leftovers == 0, f"database {name} still holds {leftovers} relations after emptying it"


# A query that counts, in each catalog of a database's own objects (not the cluster's), the objects made after
# CREATE DATABASE (the new public schema aside): one of a test left in any of them keeps the database from another
_LEFTOVERS_QUERY = r"""
SELECT string_agg(format('SELECT %L, count(*) FROM pg_catalog.%I WHERE oid >= 16384%s', c.relname, c.relname,
                         CASE c.relname WHEN 'pg_namespace' THEN ' AND nspname <> ''public''' ELSE '' END),
                  ' UNION ALL ')
FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'oid' AND NOT a.attisdropped
WHERE c.relnamespace = 'pg_catalog'::regnamespace AND c.relkind = 'r' AND NOT c.relisshared"""


def recycle_database(server: TestServer, name: str) -> None:
    """Make a test's database again as CREATE DATABASE made it, for the next test: its sessions ended, emptied
    (:func:`empty_database`), its settings reset. Raises when anything of the test is left that emptying does
    not remove (a cast, a large object, a grant on or a comment about the database, a role's setting in it,
    another owner, a temporary schema): such a database is dropped instead."""
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        for _ in range(100):  # the sessions the test left (a reader, a pgcdc it killed), as DROP ... (FORCE) does
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = %s AND pid <> pg_backend_pid()", (name,))
            if not admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (name,)).fetchone()[0]:
                break
            time.sleep(0.05)
        else:
            raise RuntimeError(f"the sessions of {name} do not end")
        admin.execute(sql.SQL("ALTER DATABASE {} RESET ALL").format(sql.Identifier(name)))
        empty_database(server, name)
        database = admin.execute(
            "SELECT d.oid, d.datacl IS NULL AND d.datconnlimit = -1 AND d.datallowconn AND NOT d.datistemplate "
            "AND d.datdba = (SELECT oid FROM pg_roles WHERE rolname = current_user) "
            "AND d.dattablespace = (SELECT oid FROM pg_tablespace WHERE spcname = 'pg_default') "
            "FROM pg_database d WHERE d.datname = %s", (name,)).fetchone()
        assert database is not None and database[1], f"{name} is no longer as CREATE DATABASE made it"
        shared = admin.execute(
            "SELECT (SELECT count(*) FROM pg_db_role_setting WHERE setdatabase = %(oid)s) "
            "+ (SELECT count(*) FROM pg_subscription WHERE subdbid = %(oid)s) "
            "+ (SELECT count(*) FROM pg_shdescription WHERE objoid = %(oid)s)", {"oid": database[0]}).fetchone()[0]
        assert shared == 0, f"{name} still has settings, subscriptions or a comment of a test"
    with psycopg.connect(server.dsn_for(name), autocommit=True) as conn:
        left = [row for row in conn.execute(conn.execute(_LEFTOVERS_QUERY).fetchone()[0]).fetchall() if row[1]]
        assert not left, f"{name} still holds objects of a test: {left}"


def release_slots(server: TestServer, name: str) -> None:
    """Drop a test database's slots and prepared transactions, ending the sessions that hold them."""
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            "WHERE database = %s AND active_pid IS NOT NULL", (name,))
        for (gid,) in admin.execute("SELECT gid FROM pg_prepared_xacts WHERE database = %s", (name,)).fetchall():
            with psycopg.connect(server.dsn_for(name), autocommit=True) as conn:
                conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
        for _ in range(50):
            slots = admin.execute("SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = %s",
                                  (name,)).fetchall()
            if not slots:
                break
            for slot, pid in slots:
                if pid is not None:
                    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                    continue
                with contextlib.suppress(psycopg.errors.ObjectInUse):
                    admin.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            time.sleep(0.1)


@contextlib.contextmanager
def fresh_database(server: TestServer) -> Iterator[TestDatabase]:
    """An empty database of a name no test had, given back afterwards: emptied and kept for the next test when
    nothing of this one is left in it, else dropped with its slots. A spare is renamed and handed out in place
    of a CREATE DATABASE, which copies the template's few hundred files (and DROP DATABASE deletes them): ~0.1 s
    of CPU each, for each of the hundreds of tests of a run, against a few milliseconds to empty one."""
    name = f"pgcdc_test_{os.getpid()}_{next(_databases)}"
    with psycopg.connect(server.dsn, autocommit=True) as admin:
        while server.spare_databases:
            spare = server.spare_databases.pop()
            try:
                admin.execute(sql.SQL("ALTER DATABASE {} RENAME TO {}").format(sql.Identifier(spare),
                                                                               sql.Identifier(name)))
                break
            except psycopg.Error:  # a session got into it after all: not a spare
                drop_database(server, spare)
        else:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield TestDatabase(server, name)
    finally:
        try:
            recycle_database(server, name)
        except Exception:
            drop_database(server, name)
        else:
            server.spare_databases.append(name)


def switch_off_accelerators(monkeypatch: pytest.MonkeyPatch) -> None:
    """pgcdc's optional C modules off for one test: the pure-Python paths run, as where they are not built."""
    import sys

    from pgcdc.pgoutput import tuple_store
    from pgcdc.types import decoding

    decoder = sys.modules["pgcdc.pgoutput.decode"]
    monkeypatch.setattr(decoder, "_parse_change_c", None)
    monkeypatch.setattr(decoder, "_parse_raw_c", None)
    monkeypatch.setattr(tuple_store, "accelerator", None)
    monkeypatch.setattr(decoding, "accelerator", None)


@pytest.fixture(autouse=True)
def _pure_python_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.environ.get("PGCDC_TEST_PURE_PYTHON") == "1":
        switch_off_accelerators(monkeypatch)
        monkeypatch.setenv("PGCDC_NO_C_EXTENSIONS", "1")  # and in every pgcdc process a test starts


@pytest.fixture(params=["C", "python"])
def accelerators(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with pgcdc's C modules (where built) and with the pure-Python paths."""
    from pgcdc.pgoutput import tuple_store

    if request.param == "python":
        switch_off_accelerators(monkeypatch)
    elif tuple_store.accelerator is None:
        pytest.skip("the C modules are not built here")
    return request.param


@pytest.fixture
def pg(pg_server: TestServer) -> Iterator[TestDatabase]:
    """A fresh, empty database for one test, dropped afterwards with its slots."""
    with fresh_database(pg_server) as database:
        yield database


@pytest.fixture(scope="module")
def pg_module(pg_server: TestServer) -> Iterator[TestDatabase]:
    """One database for a test module whose tests each name their own tables, publications and slots."""
    with fresh_database(pg_server) as database:
        yield database


@pytest.fixture
def pg_factory(pg_server: TestServer) -> Iterator:
    """An empty database on demand (one per hypothesis example): one database for the test, emptied again for
    each example (its slots, publications and schemas dropped), and dropped when the test ends."""
    with contextlib.ExitStack() as stack:
        created: list[TestDatabase] = []

        def make() -> TestDatabase:
            if created:
                empty_database(pg_server, created[0].name)
            else:
                created.append(stack.enter_context(fresh_database(pg_server)))
            return created[0]

        yield make


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory):
    """One local Spark with Iceberg for the session (start-up costs seconds); with the object storage jars
    when they are installed, so that the S3 tests attach their catalogs to it instead of starting another."""
    from pgcdc.local_object_store import object_store_jars
    from pgcdc.spark.session import spark_session

    warehouse = tmp_path_factory.mktemp("warehouse")
    jars = object_store_jars()
    session = spark_session(Destination(warehouse=warehouse, conf={"spark.jars": ",".join(jars)} if jars else {}))
    yield session
    session.stop()


@pytest.fixture
def commit_steps_chosen(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Where each of the test's Iceberg commits ran its steps, in order: True in the calling thread, False on
    Iceberg's worker pool (pgcdc.spark.iceberg_java.steps_where_cheapest)."""
    from pgcdc.spark import iceberg_java as iceberg

    chosen: list[bool] = []
    decide = iceberg.steps_in_calling_thread

    def noting(table, snapshot, removes_files: bool, **known) -> bool:
        chosen.append(decide(table, snapshot, removes_files, **known))
        return chosen[-1]

    monkeypatch.setattr(iceberg, "steps_in_calling_thread", noting)
    return chosen


@pytest.fixture
def iceberg_namespace(spark) -> str:
    """A fresh Iceberg namespace (``pgcdc.t_<hex>``) in the session warehouse."""
    namespace = f"t_{uuid.uuid4().hex[:12]}"
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS pgcdc.{namespace}")
    return namespace


# The object storage tests' servers (tests/objectstore/), each started once in a test process, when a test first
# asks for it, and shared by every module that does: one local S3 server with one bucket, and each catalog on it
# (JDBC; REST, whose server is a JVM). A parallel run keeps each catalog's tests in one worker (the xdist_group
# s3-jdbc or s3-rest), so that each catalog starts once in the run.

@pytest.fixture(scope="session")
def s3():
    from objectstore_support import BUCKET, s3_server

    with s3_server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="session")
def jdbc_store(pg_server: TestServer, s3):
    """Iceberg's JDBC catalog in a database of the server under test, its tables in ``s3a://pgcdc-mirrors/jdbc``."""
    from objectstore_support import BUCKET, jdbc_catalog

    with jdbc_catalog(pg_server, s3, BUCKET) as setup:
        yield setup


@pytest.fixture(scope="session")
def rest_store(pg_server: TestServer, s3):
    """A REST catalog (over a JDBC catalog of its own), its tables in ``s3a://pgcdc-mirrors/rest``."""
    from objectstore_support import BUCKET, rest_catalog

    with rest_catalog(pg_server, s3, BUCKET) as setup:
        yield setup


@pytest.fixture
def warehouse_dir(tmp_path: Path) -> Path:
    path = tmp_path / "warehouse"
    path.mkdir()
    return path


def pytest_configure(config: pytest.Config) -> None:
    """Before any test (and, in parallel runs, in the controller, before its workers start and inherit the
    environment): the JVM class archive that the tests' JVMs map, made in the background when there is none
    yet (tests/jvm_class_archive.py)."""
    if hasattr(config, "workerinput"):
        config.pluginmanager.register(LongestFirst(), "pgcdc-longest-first")
        return
    if config.option.collectonly or os.environ.get("PGCDC_TEST_CLASS_ARCHIVE") == "0":
        return
    if "SharedArchiveFile" in os.environ["PGCDC_JAVA_OPTIONS"]:
        return
    from jvm_class_archive import java_options, start_making, suite_archive

    archive = suite_archive()
    config._pgcdc_archive = (start_making(archive), archive)  # type: ignore[attr-defined]
    os.environ["PGCDC_JAVA_OPTIONS"] = f"{os.environ['PGCDC_JAVA_OPTIONS']} {java_options(archive)}"


@pytest.hookimpl(tryfirst=True)  # before -m selects by these marks, and before xdist reads the xdist_group ones
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        # Mark by the fixtures a test uses, so that `-m "not spark and not postgres"` (make test-fast) selects the
        # tests that start neither; a test that starts one another way (a `pgcdc` command that copies or streams,
        # an EmbeddedPostgres of its own, a Spark in a subprocess) carries the mark itself.
        names = set(getattr(item, "fixturenames", ()))
        if names & {"spark", "iceberg_namespace"}:
            item.add_marker(pytest.mark.spark)
        if names & {"pg", "pg_module", "pg_server", "pg_factory"}:
            item.add_marker(pytest.mark.postgres)
        # A module's XDIST_GROUP_BY names a parametrized fixture that is costly to set up: the tests of each of its
        # values run in one worker of a parallel run, so that it is set up once there. The group is named
        # XDIST_GROUP-value (the module's name by default): modules whose servers are the same name the same group.
        module = getattr(item, "module", None)
        grouped_by = getattr(module, "XDIST_GROUP_BY", None)
        callspec = getattr(item, "callspec", None)
        if grouped_by and callspec is not None and grouped_by in callspec.params:
            group = getattr(module, "XDIST_GROUP", module.__name__)
            item.add_marker(pytest.mark.xdist_group(f"{group}-{callspec.params[grouped_by]}"))


class LongestFirst:
    """Parallel runs hand out tests in collection order (make test: ``--dist loadgroup --no-loadscope-reorder``;
    a group of tests goes where its first test is): the tests that take minutes go first, the longest of them
    (``long(minutes)``) before the others, so that none of them starts last and runs alone at the end, then the
    other slow ones. A run in one process keeps pytest's order, which sets each module's fixtures up once."""

    @staticmethod
    def minutes(item: pytest.Item) -> float:
        long = item.get_closest_marker("long")
        if long is not None:
            return float(long.args[0]) if long.args else 1.0
        return 0.5 if item.get_closest_marker("slow") else 0.0

    @pytest.hookimpl(trylast=True)  # after pytest has grouped the tests that share a module's fixtures
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        items.sort(key=lambda item: -self.minutes(item))  # stable: collection order among equals
        # xdist keeps a group's tests in one worker by the group's name it appends to their ids (--dist loadgroup);
        # where it cannot (pytest-xdist 3.8 writes an attribute pytest 9 no longer reads its ids from), every test
        # goes its own way and each worker starts the costly servers again: said, as the run goes on
        grouped = next((item for item in items if item.get_closest_marker("xdist_group")), None)
        if config.getoption("loadgroup", False) and grouped is not None and "@" not in grouped.nodeid:
            warnings.warn(pytest.PytestWarning(
                f"xdist_group marks are not applied (pytest {pytest.__version__}): the tests of a group run in "
                "several workers, each starting their servers; install the versions pyproject.toml names"),
                stacklevel=1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Workers for ``-n auto`` (make test): one more than the cores, as a test spends part of its time waiting
    (for a server, a JVM's start, a kill's aftermath), but no more than the memory holds: a worker's Spark and
    the `pgcdc` processes and clusters its tests start take up to ~3 GB."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    by_memory = int(psutil.virtual_memory().available / 3e9)
    return max(1, min(cores + 1, by_memory))


def pytest_unconfigure(config: pytest.Config) -> None:
    if hasattr(config, "_pgcdc_archive"):
        from jvm_class_archive import report

        said = report(*config._pgcdc_archive)
        if said:
            print(f"\n{said}")
    # A thread a failed test left running (a pipeline reconnecting to a proxy that is gone) would keep the
    # interpreter alive after the report: name it, show where it is, and end the run with pytest's status.
    import faulthandler
    import sys
    import threading
    from concurrent.futures import thread as pool_threads

    # an idle thread pool's workers (PyIceberg keeps one for the process) are told to end and joined at exit
    pooled = set(getattr(pool_threads, "_threads_queues", {}))
    leftovers = [t for t in threading.enumerate()
                 if t is not threading.main_thread() and not t.daemon and t not in pooled]
    if leftovers:
        print(f"\nthreads still running after the tests: {[t.name for t in leftovers]}", file=sys.stderr)
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(getattr(config, "_pgcdc_exit_status", 1))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config._pgcdc_exit_status = int(exitstatus)  # type: ignore[attr-defined]
