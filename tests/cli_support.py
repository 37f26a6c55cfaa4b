"""``pgcdc`` commands as a user runs them, each in a process of its own, without paying each time for Python's
start and pgcdc's imports (about half a second of CPU per command, most of a short command's cost: the suite runs
well over a hundred of them).

A server process imports the command line's modules once; each command runs in a child forked from it, which
takes the command's arguments, environment, working directory and standard streams, then runs ``pgcdc.cli`` as
``python -m pgcdc.cli`` does (a fresh ``__main__``, whose consoles read the command's environment) and exits as
that would, exit handlers included. What pgcdc reads from the environment as it is imported is read again in the
child (:mod:`pgcdc.faults`' injection points; tempfile's directory). A test that signals a command or reads it
while it runs starts ``python -m pgcdc.cli`` itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

_SERVER = r"""
import atexit, gc, importlib, json, os, runpy, sys, tempfile, threading

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


for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:  # the command's own process
        try:
            command(request)
        finally:
            os._exit(255)
    sys.stdout.write(json.dumps({"pid": pid}) + "\n")
    sys.stdout.flush()
    _, status = os.waitpid(pid, 0)
    sys.stdout.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    sys.stdout.flush()
"""


class _ForkServer:
    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=dict(os.environ))
        self.command_pid = 0

    def run(self, args: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
        try:
            return self._run(args, env, cwd, timeout)
        except BaseException:  # cut off between a request and its reply (a test's time limit): a new server next
            with contextlib.suppress(ProcessLookupError):
                if self.command_pid:
                    os.kill(self.command_pid, signal.SIGKILL)
            self.process.kill()
            self.process.wait()
            raise

    def _run(self, args: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
        assert self.process.stdin is not None and self.process.stdout is not None
        command = ["pgcdc", *args]
        with tempfile.TemporaryDirectory(prefix="pgcdc-cli-") as streams:
            out, err = Path(streams) / "stdout", Path(streams) / "stderr"
            out.touch()
            err.touch()
            self.process.stdin.write(json.dumps({"args": args, "env": env, "cwd": cwd, "stdout": str(out),
                                                 "stderr": str(err)}) + "\n")
            self.process.stdin.flush()
            self.command_pid = pid = json.loads(self.process.stdout.readline())["pid"]
            expired = threading.Event()

            def expire() -> None:  # as subprocess.run's timeout: the command is killed
                expired.set()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(timeout, expire)
            timer.start()
            try:
                reply = self.process.stdout.readline()
            finally:
                timer.cancel()
            if not reply:
                raise RuntimeError("the pgcdc fork server ended")
            self.command_pid = 0
            result = subprocess.CompletedProcess(command, json.loads(reply)["returncode"], out.read_text(),
                                                 err.read_text())
        if expired.is_set():
            raise subprocess.TimeoutExpired(command, timeout, result.stdout, result.stderr)
        return result


_server: _ForkServer | None = None
_server_lock = threading.Lock()


def run_pgcdc(*args: str, env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``pgcdc ARGS`` run to its end in a process of its own (as ``subprocess.run(..., capture_output=True,
    text=True)`` would), with the test process's environment and ``env`` on top; its exit code, stdout, stderr."""
    global _server
    with _server_lock:
        if _server is None or _server.process.poll() is not None:
            _server = _ForkServer()
        return _server.run(list(args), {**os.environ, **(env or {})}, str(cwd or os.getcwd()), timeout)
