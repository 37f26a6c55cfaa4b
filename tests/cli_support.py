"""``pgcdc`` commands as a user runs them, each in a process of its own, without paying each time for Python's
start and the imports every command makes (about a second of CPU per command, most of a short command's cost: the
suite runs well over a hundred of them).

A server process imports the command line's modules once; each command runs in a child forked from it, which
takes the command's arguments, environment, working directory and standard streams, then runs ``pgcdc.cli`` as
``python -m pgcdc.cli`` does (a fresh ``__main__``, whose consoles read the command's environment) and exits as
that would, exit handlers included. What pgcdc reads from the environment as it is imported is read again in the
child (:mod:`pgcdc.faults`' injection points; tempfile's directory). Commands run at once as processes do: the
server forks each as it is asked and reports each exit. :func:`run_pgcdc` runs one to its end;
:func:`start_pgcdc` starts one to be signalled and read while it runs (a :class:`Command`, used as a
``subprocess.Popen``). A test that inspects the process itself (its command line, its process group) starts
``python -m pgcdc.cli`` itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

_SERVER = r"""
import atexit, gc, importlib, json, os, runpy, select, signal, sys, tempfile, threading

import pgcdc.cli  # noqa: F401  the imports every command pays for, paid once here
import pgcdc.faults

# and those most commands make once they run (a copy, a stream, a status): Arrow, pandas (which pyarrow imports
# when it is installed, the first time it is given Python objects), pyspark, and the distutils pyspark's type
# conversions import (setuptools' own, in a venv). Imported before the fork as pgcdc's Spark worker daemon does
# (spark/worker_daemon.py); measured on test_cli.py and test_operator_safety.py: the commands' Python 24 -> 17 s
# of CPU.
for name in ("pyarrow", "pyarrow.compute", "pandas", "distutils.version", "pyspark.sql", "pgcdc.pipeline",
             "pgcdc.spark.session"):
    try:
        importlib.import_module(name)
    except ImportError:  # not installed: the command imports what it needs, as before
        pass

del sys.modules["pgcdc.cli"]  # run afresh as __main__ by each command, as `python -m` runs it
gc.freeze()  # what is imported stays out of the children's collections (and unshared pages untouched)


def command(request):
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    if request["stdout"] == request["stderr"]:  # one stream, as stderr=subprocess.STDOUT makes it
        output = os.open(request["stdout"], os.O_WRONLY | os.O_TRUNC)
        os.dup2(output, 1)
        os.dup2(output, 2)
    else:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    importlib.reload(pgcdc.faults)  # PGCDC_INJECT as this command has it
    tempfile.tempdir = None  # TMPDIR as this command has it
    sys.stdin = open(0, closefd=False)  # not the requests' stream, whatever it read ahead
    sys.argv = ["pgcdc", *request["args"]]
    try:
        runpy.run_module("pgcdc.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:  # what the interpreter makes of it at exit
        code = exc.code
        if code is None:
            code = 0
        elif not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # an interpreter's exit, without tearing down every module one by one: threads, exit handlers, streams
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def reply(message):  # on the pipe itself: no buffered stream whose lock a fork could copy held
    os.write(1, (json.dumps(message) + "\n").encode())


def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reply({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})


# one thread: requests and children's exits are waited for together (a child's exit wakes select)
woken, wake = os.pipe()
os.set_blocking(wake, False)
signal.signal(signal.SIGCHLD, lambda *_: None)
signal.set_wakeup_fd(wake)
pending = b""
while True:
    ready, _, _ = select.select([0, woken], [], [])
    if woken in ready:
        os.read(woken, 4096)
    reap()
    if 0 not in ready:
        continue
    data = os.read(0, 1 << 16)
    if not data:  # the tests ended: what still runs goes on, as a subprocess would
        break
    pending += data
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the command's own process
            try:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(woken)
                os.close(wake)
                command(request)
            finally:
                os._exit(255)
        reply({"pid": pid})
"""


class _ForkServer:
    """The server process, and the replies it sends: the pid of each command it forked, in the order asked, and
    each command's exit as it happens."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=dict(os.environ))
        self._asking = threading.Lock()  # one request at a time, until its pid comes back
        self._started: queue.Queue[int | None] = queue.Queue()
        self._exits: dict[int, int] = {}
        self._exited = threading.Condition()
        self._ended = False
        threading.Thread(target=self._read_replies, name="pgcdc-fork-server", daemon=True).start()

    def alive(self) -> bool:
        return self.process.poll() is None and not self._ended

    def _read_replies(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            if "pid" in message:
                with self._exited:  # a pid the system gave an earlier command: its exit is not this one's
                    self._exits.pop(message["pid"], None)
                self._started.put(message["pid"])
            else:
                with self._exited:
                    self._exits[message["exited"]] = message["returncode"]
                    self._exited.notify_all()
        with self._exited:
            self._ended = True
            self._exited.notify_all()
        self._started.put(None)

    def start(self, args: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> int:
        """Fork a command; its pid."""
        assert self.process.stdin is not None
        with self._asking:
            try:
                self.process.stdin.write((json.dumps({"args": args, "env": env, "cwd": cwd, "stdout": stdout,
                                                      "stderr": stderr}) + "\n").encode())
                self.process.stdin.flush()
                pid = self._started.get(timeout=120)
            except BaseException:  # cut off between a request and its reply: the next pid would be taken for it
                self.process.kill()
                raise
        if pid is None:
            raise RuntimeError("the pgcdc fork server ended")
        return pid

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The command's exit code once it exited, waiting up to ``timeout`` seconds (None: as long as it runs)."""
        with self._exited:
            self._exited.wait_for(lambda: pid in self._exits or self._ended, timeout)
            if pid in self._exits:
                return self._exits[pid]
            if self._ended:
                raise RuntimeError("the pgcdc fork server ended")
            return None


_server: _ForkServer | None = None
_server_lock = threading.Lock()


def _fork_server() -> _ForkServer:
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = _ForkServer()
        return _server


def run_pgcdc(*args: str, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``pgcdc ARGS`` run to its end in a process of its own (as ``subprocess.run(..., capture_output=True,
    text=True)`` would), with the test process's environment and ``env`` on top; its exit code, stdout, stderr."""
    command = ["pgcdc", *args]
    server = _fork_server()
    with tempfile.TemporaryDirectory(prefix="pgcdc-cli-") as streams:
        out, err = Path(streams) / "stdout", Path(streams) / "stderr"
        out.touch()
        err.touch()
        pid = server.start(list(args), {**os.environ, **(env or {})}, str(cwd or os.getcwd()), str(out), str(err))
        try:
            returncode = server.exit_code(pid, timeout)
        except BaseException:  # a test's time limit: the command goes with it
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise
        if returncode is None:  # as subprocess.run's timeout: the command is killed
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            server.exit_code(pid, None)
            raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(command, returncode, out.read_text(), err.read_text())


def start_pgcdc(*args: str, env: dict[str, str] | None = None) -> Command:
    """``pgcdc ARGS`` started in a process of its own, its stdout and stderr one text stream read as it comes (as
    ``subprocess.Popen(..., stdout=PIPE, stderr=STDOUT, text=True)``), with the test process's environment and
    ``env`` on top."""
    directory = tempfile.mkdtemp(prefix="pgcdc-cli-")
    output = Path(directory) / "output"
    output.touch()
    server = _fork_server()
    pid = server.start(list(args), {**os.environ, **(env or {})}, os.getcwd(), str(output), str(output))
    command = Command(server, pid, ["pgcdc", *args], output)
    weakref.finalize(command, shutil.rmtree, directory, True)
    return command


POLL_SECONDS = 0.02


class Command:
    """A forked command, used as the ``subprocess.Popen`` of :func:`start_pgcdc`: ``pid``, ``args``, ``stdout``,
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``, ``returncode``."""

    def __init__(self, server: _ForkServer, pid: int, args: list[str], output: Path) -> None:
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self.stdout = _Output(output, lambda: self.poll() is not None)
        self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self.stdout.read(), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not a pid the system may have given another process since
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Output:
    """A command's output file read as a pipe is: lines as they are written, the end once the command ended."""

    def __init__(self, path: Path, ended) -> None:
        self._file = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115  (closed with the command)
        self._ended = ended

    def readline(self) -> str:
        line = ""
        while True:
            ended = self._ended()  # asked first: what the command wrote before it ended is read below
            line += self._file.readline()
            if line.endswith("\n") or ended:
                return line
            time.sleep(POLL_SECONDS)

    def __iter__(self):
        while line := self.readline():
            yield line

    def read(self) -> str:
        parts = []
        while True:
            ended = self._ended()
            parts.append(self._file.read())
            if ended:
                return "".join(parts)
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        self._file.close()
