"""A real Spark standalone cluster on loopback: a master and workers started from pip's pyspark
(``$SPARK_HOME/bin/spark-class``), each in a process group of its own so that it and every executor JVM and
Python worker under it are stopped by their ids, also when a test fails."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

EXECUTOR_MAIN = "org.apache.spark.executor.CoarseGrainedExecutorBackend"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children() -> dict[int, list[int]]:
    """{parent pid: child pids} of every process of this machine, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    children = _children()
    found, pending = [], [pid]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class StandaloneCluster:
    master_url: str
    web_url: str
    log_dir: Path
    master: subprocess.Popen
    workers: list[subprocess.Popen] = field(default_factory=list)

    def state(self) -> dict:
        with urllib.request.urlopen(f"{self.web_url}/json/", timeout=5) as response:
            return json.load(response)

    def executor_pids(self) -> list[int]:
        """The executor JVMs the workers of this cluster run now (found by their command line)."""
        return [pid for worker in self.workers for pid in _descendants(worker.pid)
                if EXECUTOR_MAIN in _command_line(pid)]

    def kill_executors(self) -> list[int]:
        """SIGKILL every executor JVM of this cluster (what a lost machine does to it); returns their ids."""
        killed = self.executor_pids()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return killed

    def logs(self) -> str:
        return "\n".join(f"== {path.name}\n{path.read_text(errors='replace')[-3000:]}"
                         for path in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        # PySpark's daemons make process groups of their own: every descendant is also stopped by its id
        descendants = [pid for process in [*self.workers, self.master] for pid in _descendants(process.pid)]
        for process in [*self.workers, self.master]:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in [*self.workers, self.master]:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            # the group holds the executors and their Python workers too; none of them may outlive the test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid in descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def standalone_cluster(tmp: Path, workers: int = 2, worker_memory: str = "1g",
                       cores: int = 1) -> Iterator[StandaloneCluster]:
    """A master and ``workers`` workers of ``cores`` cores each, on 127.0.0.1 only; everything stopped on exit.
    The master and workers run with the JVM options of ``PGCDC_JAVA_OPTIONS`` too (the suite's: the quick
    compiler, one collector thread), as the executors do through pgcdc's settings."""
    import pyspark

    from pgcdc.spark.session import ensure_java

    ensure_java()
    spark_home = Path(pyspark.__file__).parent
    env = {**os.environ, "SPARK_HOME": str(spark_home), "SPARK_LOCAL_IP": "127.0.0.1",
           "SPARK_MASTER_HOST": "127.0.0.1", "SPARK_NO_DAEMONIZE": "1",
           "SPARK_DAEMON_JAVA_OPTS": os.environ.get("PGCDC_JAVA_OPTIONS", "")}
    spark_class = str(spark_home / "bin" / "spark-class")
    port, web_port = free_port(), free_port()
    log_dir = tmp / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    def start(name: str, *args: str) -> subprocess.Popen:
        with open(log_dir / f"{name}.log", "wb") as log:
            return subprocess.Popen([spark_class, *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    master = start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                   "--webui-port", str(web_port))
    cluster = StandaloneCluster(f"spark://127.0.0.1:{port}", f"http://127.0.0.1:{web_port}", log_dir, master)
    try:
        for number in range(workers):
            work_dir = tmp / f"worker{number}"
            work_dir.mkdir(exist_ok=True)
            cluster.workers.append(start(
                f"worker{number}", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                "--cores", str(cores), "--memory", worker_memory, "--work-dir", str(work_dir),
                "--webui-port", str(free_port()), cluster.master_url))
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError, ValueError):
                if cluster.state().get("aliveworkers") == workers:
                    break
            if time.monotonic() > deadline or any(p.poll() is not None for p in [master, *cluster.workers]):
                raise AssertionError(f"the standalone cluster did not start:\n{cluster.logs()}")
            time.sleep(0.3)
        yield cluster
    finally:
        cluster.stop()
