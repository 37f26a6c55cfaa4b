"""The embedded server: a real PostgreSQL that starts, configures, reports failures and leaves nothing behind."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import psycopg
import pytest

from pgcdc.embedded import EmbeddedPostgres
from pgcdc.errors import EmbeddedPostgresError

pytestmark = pytest.mark.postgres


def _postgres_processes_of(data_dir: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.info.get("name") == "postgres" and data_dir in " ".join(cmdline):
            found.append(proc)
    return found


def test_logical_replication_settings_and_overrides():
    with EmbeddedPostgres(settings={"logical_decoding_work_mem": "64kB"}) as server:
        with psycopg.connect(server.dsn) as conn:
            settings = dict(conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('wal_level', 'logical_decoding_work_mem',"
                " 'max_prepared_transactions', 'max_replication_slots', 'listen_addresses')").fetchall())
            assert conn.execute("SELECT current_user").fetchone()[0] == "postgres"
        assert settings["wal_level"] == "logical"
        assert settings["logical_decoding_work_mem"] == "64"
        assert int(settings["max_prepared_transactions"]) >= 10
        assert int(settings["max_replication_slots"]) >= 10
        assert settings["listen_addresses"] == "127.0.0.1"
        if os.geteuid() == 0:
            server_process = psutil.Process(server.pid)
            assert server_process.username() != "root"


def test_stop_removes_process_and_data_dir():
    server = EmbeddedPostgres().start()
    data_dir = str(server.data_dir)
    pid = server.pid
    assert _postgres_processes_of(data_dir)
    server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not os.path.exists(data_dir)
    assert not _postgres_processes_of(data_dir)
    server.stop()  # idempotent


def test_bad_setting_raises_with_server_log():
    with pytest.raises(EmbeddedPostgresError, match="shared_buffers") as info:
        EmbeddedPostgres(settings={"shared_buffers": "not-a-size"}).start()
    assert "server log" in str(info.value)


def test_server_dies_with_a_killed_owner_and_its_dir_is_reclaimed(tmp_path):
    script = textwrap.dedent("""
        import sys
        from pgcdc.embedded import EmbeddedPostgres
        server = EmbeddedPostgres().start()
        print(server.data_dir, flush=True)
        sys.stdin.read()
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    data_dir = owner.stdout.readline().strip()
    assert _postgres_processes_of(data_dir)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    deadline = time.monotonic() + 20
    while _postgres_processes_of(data_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _postgres_processes_of(data_dir)
    # the next start sweeps the directory of the killed owner
    with EmbeddedPostgres():
        pass
    assert not os.path.exists(data_dir)


def test_restart_keeps_data():
    with EmbeddedPostgres() as server:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (id int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        server.restart(mode="immediate")
        with psycopg.connect(server.dsn) as conn:
            assert conn.execute("SELECT id FROM kept").fetchall() == [(42,)]


CREATE_SERVER_USER = """
import pwd, sys, time
from pgcdc.embedded import server_user
name, start = sys.argv[1], float(sys.argv[2])
while time.time() < start:  # every process reaches useradd at the same instant
    pass
print(server_user(name).pw_uid)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root process creates the server's account")
def test_processes_starting_at_once_all_run_the_server_as_the_one_account_they_created():
    """Test workers start their servers together: each must get the account that stays in /etc/passwd (two
    useradd runs at once can each write it in turn, and a server run as the uid the first wrote finds no user)."""
    import pwd

    name = f"pgcdc-t{os.getpid() % 100000}"
    start = time.time() + 2
    try:
        runs = [subprocess.Popen([sys.executable, "-c", CREATE_SERVER_USER, name, str(start)],
                                 stdout=subprocess.PIPE, text=True) for _ in range(4)]
        uids = {int(run.communicate(timeout=60)[0]) for run in runs}
        assert uids == {pwd.getpwnam(name).pw_uid}
    finally:
        subprocess.run(["userdel", name], capture_output=True)
        subprocess.run(["groupdel", name], capture_output=True)
