"""Security: TLS to PostgreSQL with certificate and host verification, passwords that never leak into
logs, errors, metrics or status, nor onto any process's command line, and a least-privilege role (REPLICATION +
SELECT on the published tables).

One dedicated server for the module, reached only through TLS (a proxy terminating TLS in front of it,
as the embedded build has no OpenSSL; see tests/tls_proxy.py), where the ``cdc`` role must authenticate
with SCRAM, and so must the ``iceberg`` role of a JDBC catalog in a database of the same server."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest

from cli_support import run_pgcdc
from pgcdc.embedded import EmbeddedPostgres, free_port
from pgcdc.local_object_store import postgres_jdbc_jar
from pgcdc.pipeline import Pipeline, PipelineConfig
from pgcdc.spark.destination import Destination
from pipeline_support import (
    FLOOD_PAUSE,
    SHOP_TABLES,
    Workload,
    assert_mirrors_equal,
    prepare_source,
    wait_for_transactions,
)
from tls_proxy import TlsTerminatingProxy

pytestmark = [pytest.mark.slow, pytest.mark.postgres]  # the module's own server (tls_server)

PASSWORD = "S3cr3t-Pa55-do-not-leak"
# the exact grants pgcdc needs (docs/usage.md: "Security"); the publication is made by the tables' owner
LEAST_PRIVILEGE = f"""
CREATE ROLE cdc LOGIN REPLICATION PASSWORD '{PASSWORD}';
GRANT USAGE ON SCHEMA shop TO cdc;
GRANT SELECT ON ALL TABLES IN SCHEMA shop TO cdc;
"""


def _certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate it signs for 127.0.0.1/localhost, and an unrelated CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def authority(common: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(name(common)).issuer_name(name(common))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    ca_key, ca_cert = authority("pgcdc test CA")
    _, other_cert = authority("some other CA")
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (x509.CertificateBuilder().subject_name(name("localhost")).issuer_name(ca_cert.subject)
                   .public_key(server_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(hours=1))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([
                       x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                   .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    paths = {"ca": directory / "ca.pem", "other_ca": directory / "other-ca.pem"}
    paths["ca"].write_bytes(ca_cert.public_bytes(pem))
    paths["other_ca"].write_bytes(other_cert.public_bytes(pem))
    paths["server_cert"] = directory / "server.pem"
    paths["server_cert"].write_bytes(server_cert.public_bytes(pem))
    paths["server_key"] = directory / "server.key"
    paths["server_key"].write_bytes(server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))
    return paths


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """(TLS endpoint, admin DSN (direct), certificate paths)."""
    certs = _certificates(tmp_path_factory.mktemp("certs"))
    hba = ["host all cdc 127.0.0.1/32 scram-sha-256", "host replication cdc 127.0.0.1/32 scram-sha-256",
           "host all iceberg 127.0.0.1/32 scram-sha-256"]
    with EmbeddedPostgres(hba=hba) as server, \
            TlsTerminatingProxy(server.port, certs["server_cert"], certs["server_key"]) as proxy:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE shopdb")
        admin = server.dsn_for("shopdb")

        class Database:  # what prepare_source takes
            def connect(self):
                return psycopg.connect(admin, autocommit=True)

        prepare_source(Database(), rows=200)
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(LEAST_PRIVILEGE)
        yield proxy, admin, certs


def _cdc_dsn(proxy: TlsTerminatingProxy, **extra: str) -> str:
    params = {"host": "127.0.0.1", "port": str(proxy.port), "dbname": "shopdb", "user": "cdc", **extra}
    return psycopg.conninfo.make_conninfo("", **params)


def _config(dsn: str, spark, **overrides) -> PipelineConfig:
    return PipelineConfig(dsn=dsn, publication="shop", slot=f"sec_{random.randrange(10**6)}",
                          destination=Destination(warehouse=spark.conf.get("spark.sql.catalog.pgcdc.warehouse"),
                                                  namespace=f"sec_{os.getpid()}_{random.randrange(10**9)}"),
                          batch_max_seconds=0.5, **overrides)


def test_plain_connections_are_refused_by_the_tls_endpoint(tls_server):
    proxy, _, _ = tls_server
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(_cdc_dsn(proxy, password=PASSWORD, sslmode="disable"))
    assert proxy.refused_plain >= 1


def test_least_privilege_role_over_verified_tls_mirrors_everything(tls_server, spark):
    """``cdc`` has REPLICATION and SELECT on the published tables, nothing else; the server certificate and
    host name are verified (verify-full)."""
    proxy, admin, certs = tls_server
    handshakes = proxy.handshakes
    dsn = _cdc_dsn(proxy, password=PASSWORD, sslmode="verify-full", sslrootcert=str(certs["ca"]))
    config = _config(dsn, spark, heartbeat_seconds=0.5)
    pipeline = Pipeline(config, spark=spark)
    pipeline.check()  # no problem reported for the least-privilege role
    pipeline.snapshot()
    with Workload(admin, seed=5, pause=FLOOD_PAUSE) as workload:
        wait_for_transactions(workload, 75)  # what four seconds wrote here, as a count that a slow machine also reaches
    pipeline.run(until_caught_up=True, handle_signals=False)
    assert_mirrors_equal(config, spark, admin, SHOP_TABLES)
    assert proxy.handshakes > handshakes  # the only way in for cdc is TLS


def test_a_wrong_certificate_authority_fails_clearly(tls_server):
    proxy, _, certs = tls_server
    dsn = _cdc_dsn(proxy, password=PASSWORD, sslmode="verify-full", sslrootcert=str(certs["other_ca"]))
    result = _cli("check", "--dsn", dsn, "--publication", "shop")
    assert result.returncode != 0
    assert "certificate verify failed" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert PASSWORD not in result.stdout + result.stderr


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_pgcdc(*args, timeout=timeout, env=env)


@pytest.mark.long
def test_passwords_never_appear_in_logs_errors_metrics_or_status(tls_server, spark, tmp_path):
    proxy, _, certs = tls_server
    tls = {"sslmode": "verify-full", "sslrootcert": str(certs["ca"])}
    warehouse = spark.conf.get("spark.sql.catalog.pgcdc.warehouse")
    seen: list[str] = []

    # the password in the DSN (keyword form and URI form), at DEBUG level, as text and JSON logs
    keyword_dsn = _cdc_dsn(proxy, password=PASSWORD, **tls)
    uri_dsn = (f"postgresql://cdc:{PASSWORD}@127.0.0.1:{proxy.port}/shopdb?sslmode=verify-full"
               f"&sslrootcert={certs['ca']}")
    port = free_port()
    namespace = f"sec_{os.getpid()}_{random.randrange(10**9)}"
    run = subprocess.Popen(
        [sys.executable, "-m", "pgcdc.cli", "--log-format", "json", "--log-level", "DEBUG", "run", "--dsn",
         uri_dsn, "--publication", "shop", "--slot", "secrets", "--warehouse", warehouse, "--namespace", namespace,
         "--metrics-port", str(port), "--batch-seconds", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    metrics = ""
    while time.monotonic() < deadline:
        try:
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            if 'pgcdc_phase{phase="streaming"} 1.0' in metrics:
                break
        except OSError:
            pass
        time.sleep(1)
    run.send_signal(signal.SIGTERM)
    output, _ = run.communicate(timeout=120)
    seen += [output, metrics]
    assert 'pgcdc_phase{phase="streaming"} 1.0' in metrics, (metrics, output[-3000:])

    for args in (("status", "--dsn", keyword_dsn, "--json"),
                 ("status", "--dsn", keyword_dsn, "--warehouse", warehouse, "--namespace", namespace),
                 ("check", "--dsn", keyword_dsn, "--publication", "no_such_publication"),
                 ("--log-level", "DEBUG", "run", "--dsn", uri_dsn, "--publication", "no_such_publication",
                  "--warehouse", str(tmp_path)),
                 ("check", "--dsn", uri_dsn.replace(PASSWORD, PASSWORD + "-wrong"), "--publication", "shop")):
        result = _cli(*args)
        seen += [result.stdout, result.stderr]
    assert "password authentication failed" in seen[-1] + seen[-2]

    # the password from PGPASSWORD and from ~/.pgpass: pgcdc works and still prints nothing of it
    plain = _cdc_dsn(proxy, **tls)
    with_env = _cli("status", "--dsn", plain, env={"PGPASSWORD": PASSWORD})
    assert with_env.returncode == 0, with_env.stdout + with_env.stderr
    home = tmp_path / "home"
    home.mkdir()
    pgpass = home / ".pgpass"
    pgpass.write_text(f"127.0.0.1:{proxy.port}:*:cdc:{PASSWORD}\n")
    pgpass.chmod(0o600)
    with_file = _cli("check", "--dsn", plain, "--publication", "shop", env={"HOME": str(home)})
    assert with_file.returncode == 0, with_file.stdout + with_file.stderr
    seen += [with_env.stdout, with_env.stderr, with_file.stdout, with_file.stderr]

    leaks = [text for text in seen if PASSWORD in text]
    assert not leaks, leaks[0][-2000:]
    assert len("".join(seen)) > 1000  # the commands did speak


class CommandLineScan:
    """Every process's command line (``/proc/<pid>/cmdline``, which every local user may read), read over and
    over in a thread of its own while commands run: which of this process's descendants (the commands under test
    and everything they start) hold one of ``secrets`` — other tests running beside this one may put a secret
    on a command line on purpose — and which mention ``marker`` (a string only the commands under test put on
    command lines)."""

    def __init__(self, secrets: list[str], marker: str, interval: float = 0.05) -> None:
        self.secrets = [secret.encode() for secret in secrets]
        self.marker = marker.encode()
        self.interval = interval
        self.leaks: dict[int, str] = {}  # pid: its command line, secrets removed
        self.marked: dict[int, set[str]] = {}  # pid: the programs it ran (bash, java), as seen
        self.scans = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._scan, name="cmdline-scan", daemon=True)

    def __enter__(self) -> CommandLineScan:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _scan(self) -> None:
        while not self._stop.is_set():
            for entry in os.listdir("/proc"):
                if not entry.isdigit():
                    continue
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as file:
                        command = file.read()
                except OSError:  # ended meanwhile
                    continue
                if any(secret in command for secret in self.secrets) and descends_from(int(entry), os.getpid()):
                    shown = command
                    for secret in self.secrets:
                        shown = shown.replace(secret, b"<secret>")
                    self.leaks[int(entry)] = shown.replace(b"\0", b" ").decode(errors="replace")
                if self.marker in command:
                    self.marked.setdefault(int(entry), set()).add(os.path.basename(command.split(b"\0")[0]).decode())
            self.scans += 1
            self._stop.wait(self.interval)


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (False once it has ended)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as file:
                pid = int(file.read().rsplit(")", 1)[1].split()[1])  # the parent's pid, after the command's name
        except (OSError, ValueError, IndexError):
            return False
    return False


@pytest.mark.long
@pytest.mark.spark  # the commands' own JVMs
def test_no_command_line_holds_a_secret_while_commands_run(tls_server, tmp_path):
    """The DSN's password, a JDBC catalog's password and an S3 secret key in the config file: while ``run``,
    ``status``, ``check --warehouse`` and ``maintain`` run, no process's command line holds any of them: not
    Spark's JVM, not spark-submit's bash launchers and Spark's launcher JVM, not a Python worker. Each secret still
    takes effect: the catalog's database wants its role's password (SCRAM), and the source the DSN's."""
    jar = postgres_jdbc_jar()
    if jar is None:
        pytest.skip("a JDBC catalog needs the PostgreSQL JDBC driver (apt-get install libpostgresql-jdbc-java)")
    proxy, admin, certs = tls_server
    catalog_password, s3_secret = f"jdbc-secret-{uuid.uuid4().hex}", f"s3-secret-{uuid.uuid4().hex}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE iceberg LOGIN PASSWORD '{catalog_password}'")
        conn.execute("CREATE DATABASE iceberg_catalog OWNER iceberg")
        conn.execute("CREATE TABLE shop.on_the_process_table (id int PRIMARY KEY, note text)")
        conn.execute("INSERT INTO shop.on_the_process_table SELECT i, 'n' FROM generate_series(1, 50) i")
        conn.execute("GRANT SELECT ON shop.on_the_process_table TO cdc")
        conn.execute("CREATE PUBLICATION process_table FOR TABLE shop.on_the_process_table")
    catalog_port = psycopg.conninfo.conninfo_to_dict(admin)["port"]
    warehouse = tmp_path / "warehouse-of-the-process-table-test"  # on the commands' command lines: the marker
    settings = {
        "dsn": _cdc_dsn(proxy, password=PASSWORD, sslmode="verify-full", sslrootcert=str(certs["ca"])),
        "publication": "process_table", "slot": "process_table", "warehouse": str(warehouse),
        "catalog_type": "jdbc", "catalog_uri": f"jdbc:postgresql://127.0.0.1:{catalog_port}/iceberg_catalog",
        "namespace": "process_table"}
    spark = {"spark.jars": jar, "spark.sql.catalog.pgcdc.jdbc.user": "iceberg",
             "spark.sql.catalog.pgcdc.jdbc.password": catalog_password, "spark.hadoop.fs.s3a.secret.key": s3_secret}
    config = tmp_path / "pgcdc.toml"
    config.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in settings.items()) + "[spark]\n"
                      + "".join(f"{json.dumps(key)} = {json.dumps(value)}\n" for key, value in spark.items()))
    config.chmod(0o600)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {"TMPDIR": str(temporary)}

    def pgcdc(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "pgcdc.cli", "--config", str(config), *args],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env})

    started = time.monotonic()
    with CommandLineScan([PASSWORD, catalog_password, s3_secret], marker=warehouse.name) as scan:
        run = pgcdc("run", "--until-caught-up", "--batch-seconds", "0.5", "--no-maintenance")
        ran = run.communicate(timeout=600)[0]
        assert run.returncode == 0, ran[-3000:]
        # the other three at once: each starts its own JVM
        others = {name: pgcdc(*args) for name, args in {"status": ("status", "--json"), "check": ("check",),
                                                         "maintain": ("maintain", "--json")}.items()}
        said = {name: process.communicate(timeout=600)[0] for name, process in others.items()}
    elapsed = time.monotonic() - started
    for name, process in others.items():
        assert process.returncode == 0, (name, said[name][-3000:])
    assert "shop.on_the_process_table" in said["status"] and "ready" in said["check"], said
    assert "on_the_process_table" in said["maintain"], said["maintain"]

    assert not scan.leaks, scan.leaks
    # the scan saw what it was there for: each command's Spark JVM (the driver, and Spark's launcher) and
    # spark-submit's bash launchers, many times over
    programs = [name for names in scan.marked.values() for name in names]
    assert programs.count("java") >= 4 and "bash" in programs, (programs, scan.scans, elapsed)
    assert scan.scans > 100, (scan.scans, elapsed)
    # the settings spark-submit read from a private file: gone, as the launchers' temporary directories
    assert not list(temporary.glob("pgcdc-spark-*")), list(temporary.iterdir())
    # the catalog recorded the mirror, reached with the password it wants
    with psycopg.connect(psycopg.conninfo.make_conninfo(admin, dbname="iceberg_catalog")) as conn:
        tables = conn.execute("SELECT table_name FROM iceberg_tables").fetchall()
    assert any("on_the_process_table" in name for (name,) in tables), tables
    for text in [ran, *said.values()]:
        assert PASSWORD not in text and catalog_password not in text and s3_secret not in text
