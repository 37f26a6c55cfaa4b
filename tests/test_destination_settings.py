"""How a destination is told: catalog types and their addresses, extra jars, and secret settings that never show,
neither in output nor on a command line. None of these start Spark; one reads a file in the session's JVM."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from cli_support import run_pgcdc
from pgcdc import ConfigError
from pgcdc.secrets import holds_secret, is_secret_setting, redact, register_conf_secrets
from pgcdc.spark.destination import Destination
from pgcdc.spark.session import _private_properties, jars_on_the_class_path
from pgcdc.spark.settings import catalog_settings, iceberg_runtime_jar, spark_settings

PREFIX = "spark.sql.catalog.pgcdc"


def test_each_catalog_type_gets_its_settings():
    hadoop = catalog_settings("s3a://bucket/mirrors")
    assert hadoop[f"{PREFIX}.type"] == "hadoop" and hadoop[f"{PREFIX}.warehouse"] == "s3a://bucket/mirrors"

    jdbc = catalog_settings("s3a://bucket/mirrors", catalog_type="jdbc", catalog_uri="jdbc:postgresql://db/iceberg")
    assert jdbc[f"{PREFIX}.type"] == "jdbc" and jdbc[f"{PREFIX}.uri"] == "jdbc:postgresql://db/iceberg"
    assert jdbc[f"{PREFIX}.io-impl"] == "org.apache.iceberg.hadoop.HadoopFileIO"  # no AWS SDK v2 for S3FileIO
    assert jdbc[f"{PREFIX}.jdbc.schema-version"] == "V1"

    rest = catalog_settings(None, catalog_type="rest", catalog_uri="https://catalog.example/api")
    assert rest[f"{PREFIX}.type"] == "rest" and f"{PREFIX}.warehouse" not in rest  # the catalog knows its own
    assert rest[f"{PREFIX}.io-impl"] == "org.apache.iceberg.hadoop.HadoopFileIO"

    # the --conf route names the type itself; a catalog-impl (Glue, Nessie) is left to choose its own
    by_conf = catalog_settings("s3a://b/m", conf={f"{PREFIX}.type": "rest", f"{PREFIX}.uri": "http://c:8181"})
    assert by_conf[f"{PREFIX}.type"] == "rest" and by_conf[f"{PREFIX}.uri"] == "http://c:8181"
    custom = catalog_settings("s3a://b/m", conf={f"{PREFIX}.catalog-impl": "org.example.Catalog"})
    assert f"{PREFIX}.type" not in custom

    local = catalog_settings("relative/dir")
    assert local[f"{PREFIX}.warehouse"] == f"file://{os.path.abspath('relative/dir')}"


@pytest.mark.parametrize(("kind", "uri", "said"), [
    ("jdbc", None, "needs its address: --catalog-uri jdbc:postgresql://"),
    ("rest", None, "needs its address: --catalog-uri https://"),
    ("jdbc", "http://db/iceberg", "is not the address of a jdbc catalog"),
    ("rest", "jdbc:postgresql://db/x", "is not the address of a rest catalog"),
    ("glue", None, "must be one of hadoop, jdbc, rest; other catalogs"),
])
def test_a_catalog_without_a_usable_address_is_refused_before_anything_starts(kind, uri, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        Destination(warehouse="s3a://b/m", catalog_type=kind, catalog_uri=uri)


def test_extra_jars_join_the_iceberg_runtime():
    settings = spark_settings("s3a://b/m", conf={"spark.jars": "/jars/hadoop-aws.jar, /jars/sdk.jar"})
    assert settings["spark.jars"].split(",") == [str(iceberg_runtime_jar()), "/jars/hadoop-aws.jar", "/jars/sdk.jar"]


def test_a_local_jvms_jars_go_on_its_class_path_all_of_them_or_none(tmp_path, monkeypatch):
    """A local session whose JVM pgcdc starts has its jars on the class path from the start; when any jar is not
    a file here, or jars may come from elsewhere, every jar stays in spark.jars (one class loader for all)."""
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    aws, driver = tmp_path / "hadoop-aws.jar", tmp_path / "postgresql.jar"
    aws.write_bytes(b"PK")
    driver.write_bytes(b"PK")

    def moved(jars: str, **extra: str) -> list[str] | None:
        settings = spark_settings("/w", conf={"spark.jars": jars, **extra})
        rest, class_path = jars_on_the_class_path(settings)
        if not class_path:
            assert rest == settings
            return None
        assert "spark.jars" not in rest and rest == {k: v for k, v in settings.items() if k != "spark.jars"}
        return class_path

    iceberg = str(iceberg_runtime_jar())
    assert moved(f"{aws}, file://{driver}") == [iceberg, str(aws), str(driver)]
    assert moved(f"file:{driver}") == [iceberg, str(driver)]
    assert moved("") == [iceberg]
    # a jar that is not a file here: Spark fetches it, and every jar stays with it
    assert moved(f"{aws},https://repo.example/postgresql.jar") is None
    assert moved(f"{aws},s3a://jars/postgresql.jar") is None
    assert moved(f"{aws},{tmp_path / 'missing.jar'}") is None  # Spark says what is missing, as before
    assert moved(f"{aws}", **{"spark.jars.packages": "org.postgresql:postgresql:42.7.4"}) is None
    # jars named to spark-submit another way
    for arguments in ("--packages org.postgresql:postgresql:42.7.4 pyspark-shell", f"--jars {aws} pyspark-shell",
                      f"--conf spark.jars={aws} pyspark-shell"):
        monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", arguments)
        assert moved(str(aws)) is None, arguments
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", "--driver-memory 3g pyspark-shell")
    assert moved(str(aws)) == [iceberg, str(aws)]
    (conf_dir / "spark-defaults.conf").write_text("spark.driver.memory 3g\n# spark.jars /old.jar\n")
    assert moved(str(aws)) == [iceberg, str(aws)]
    (conf_dir / "spark-defaults.conf").write_text("spark.driver.memory 3g\n  spark.jars.packages=a:b:1\n")
    assert moved(str(aws)) is None
    named = tmp_path / "mine.properties"
    named.write_text("spark.jars\t/opt/x.jar\n")
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", f"--properties-file {named} pyspark-shell")
    assert moved(str(aws)) is None
    named.write_text("spark.executor.memory=1g\n")
    assert moved(str(aws)) == [iceberg, str(aws)]  # the named file is read instead of spark-defaults.conf


def test_jvm_options_come_from_the_environment_and_short_lived_commands(monkeypatch):
    from pgcdc.spark.settings import SHORT_LIVED_JVM

    monkeypatch.delenv("PGCDC_JAVA_OPTIONS", raising=False)
    monkeypatch.setattr("pgcdc.spark.settings.machine_cores", lambda: 8)
    plain = spark_settings("/w")
    assert "-Dlog4j.configurationFile=" in plain["spark.driver.extraJavaOptions"]
    assert SHORT_LIVED_JVM not in plain["spark.driver.extraJavaOptions"]
    quick = spark_settings("/w", short_lived=True)
    assert SHORT_LIVED_JVM in quick["spark.driver.extraJavaOptions"]
    monkeypatch.setenv("PGCDC_JAVA_OPTIONS", " -Xss4m -Dhttps.proxyHost=proxy ")
    both = spark_settings("/w")
    for key in ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions"):
        assert both[key].split()[1:] == ["-Xss4m", "-Dhttps.proxyHost=proxy"], both[key]
    # options given as Spark settings are the user's whole say
    mine = spark_settings("/w", conf={"spark.driver.extraJavaOptions": "-Xmx3g"})
    assert mine["spark.driver.extraJavaOptions"] == "-Xmx3g"


def test_a_small_machine_s_driver_collects_its_garbage_serially_unless_the_options_choose(monkeypatch):
    from pgcdc.spark.settings import SMALL_MACHINE_COLLECTOR

    monkeypatch.delenv("PGCDC_JAVA_OPTIONS", raising=False)
    monkeypatch.setattr("pgcdc.spark.settings.machine_cores", lambda: 2)
    small = spark_settings("/w")
    assert small["spark.driver.extraJavaOptions"].split()[-1] == SMALL_MACHINE_COLLECTOR
    assert SMALL_MACHINE_COLLECTOR not in small["spark.executor.extraJavaOptions"]  # a cluster's are not this machine
    for chosen in ("-XX:+UseG1GC", "-XX:+UseZGC -XX:+ZGenerational", "-XX:+UseParallelGC"):
        theirs = spark_settings("/w", java_options=chosen)
        assert SMALL_MACHINE_COLLECTOR not in theirs["spark.driver.extraJavaOptions"]
        assert theirs["spark.driver.extraJavaOptions"].endswith(chosen)
    monkeypatch.setattr("pgcdc.spark.settings.machine_cores", lambda: 3)
    assert SMALL_MACHINE_COLLECTOR not in spark_settings("/w")["spark.driver.extraJavaOptions"]


def test_secret_settings_are_recognised_by_name_and_removed_from_any_text():
    assert all(is_secret_setting(key) for key in (
        "spark.hadoop.fs.s3a.secret.key", "spark.hadoop.fs.s3a.session.token", "spark.sql.catalog.c.jdbc.password",
        "spark.sql.catalog.c.token", "spark.sql.catalog.c.credential", "spark.hadoop.fs.s3a.encryption.key"))
    assert not any(is_secret_setting(key) for key in (
        "spark.hadoop.fs.s3a.access.key", "spark.hadoop.fs.s3a.aws.credentials.provider", "spark.sql.catalog.c.uri"))
    text = ("--conf spark.hadoop.fs.s3a.secret.key=abc/def+123 {'spark.sql.catalog.c.jdbc.password': 'p w', "
            "'spark.sql.catalog.c.token': \"t0k\"} AWS_SECRET_ACCESS_KEY=zz9")
    shown = redact(text)
    assert not any(secret in shown for secret in ("abc/def+123", "p w", "t0k", "zz9")), shown
    assert "spark.hadoop.fs.s3a.secret.key=***" in shown

    register_conf_secrets({"spark.sql.catalog.c.jdbc.password": "registered-secret-42"})
    assert redact("FATAL: password authentication failed (registered-secret-42)") == \
        "FATAL: password authentication failed (***)"


def test_secrets_never_shown_through_the_command_line_even_with_debug(tmp_path):
    secret, password = "s3-secret-never-shown-1", "catalog-password-never-shown-2"
    # refused before Spark starts (no catalog address): the error and --debug's traceback hold no secret
    result = run_pgcdc(
        "--debug", "--log-level", "debug", "run", "--dsn", "dbname=x", "-p", "pub", "--warehouse", "s3a://bucket/m",
        "--catalog-type", "jdbc", "--conf", f"spark.hadoop.fs.s3a.secret.key={secret}",
        "--conf", f"spark.sql.catalog.pgcdc.jdbc.password={password}", timeout=120, env={"COLUMNS": "200"})
    text = result.stdout + result.stderr
    assert result.returncode == 2 and "needs its address: --catalog-uri" in text, text
    assert secret not in text and password not in text

    # the same through a config file's [spark] table and the environment
    config = tmp_path / "pgcdc.toml"
    config.write_text(f'warehouse = "s3a://bucket/m"\ncatalog_type = "rest"\n[spark]\n'
                      f'"spark.sql.catalog.pgcdc.token" = "{secret}"\n')
    result = run_pgcdc("--debug", "--config", str(config), "snapshot", "--dsn", "dbname=x", "-p", "pub", timeout=120,
                       env={"COLUMNS": "200", "PGCDC_CATALOG_URI": "jdbc:postgresql://h/iceberg"})
    text = result.stdout + result.stderr
    assert result.returncode == 2 and "is not the address of a rest catalog" in text, text
    assert secret not in text


def test_a_setting_carries_a_secret_by_its_name_or_in_its_value():
    assert holds_secret("spark.hadoop.fs.s3a.secret.key", "anything")
    assert holds_secret("spark.sql.catalog.c.uri", "jdbc:postgresql://h/db?user=u&password=pw")
    assert holds_secret("spark.sql.catalog.c.uri", "postgresql://u:pw@h/db")
    assert holds_secret("spark.driver.extraJavaOptions", "-Xmx2g -Dcatalog.token=t0k3n")
    assert not holds_secret("spark.sql.catalog.c.uri", "jdbc:postgresql://h/db?user=u")
    assert not holds_secret("spark.jars", "/jars/hadoop-aws.jar,/jars/postgresql.jar")


@pytest.fixture
def private_temporary(tmp_path, monkeypatch) -> Path:
    """tempfile's directory, for this test only; no PYSPARK_SUBMIT_ARGS and no spark-defaults.conf."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    monkeypatch.delenv("PYSPARK_SUBMIT_ARGS", raising=False)
    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path / "no-spark-conf"))
    return directory


def _submitted_properties_file() -> Path:
    arguments = shlex.split(os.environ["PYSPARK_SUBMIT_ARGS"])
    assert arguments[0] == "--properties-file", arguments
    return Path(arguments[1])


def test_secret_settings_reach_spark_submit_in_a_file_only_the_user_reads_removed_afterwards(
        private_temporary, tmp_path, monkeypatch):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    (conf_dir / "spark-defaults.conf").write_text("spark.from.defaults  kept\nspark.hadoop.fs.s3a.secret.key old\n")
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    with _private_properties({"spark.hadoop.fs.s3a.secret.key": "s3-secret-1"}):
        path = _submitted_properties_file()
        assert shlex.split(os.environ["PYSPARK_SUBMIT_ARGS"])[2:] == ["pyspark-shell"]
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert path.parent.parent == private_temporary
        text = path.read_text()
        # spark-defaults.conf, which a properties file stands in for, first; the secret after it wins
        assert text.index("spark.from.defaults") < text.index("old") < text.index("s3-secret-1"), text
    assert "PYSPARK_SUBMIT_ARGS" not in os.environ and not path.parent.exists()

    # a properties file named in PYSPARK_SUBMIT_ARGS takes the place of spark-defaults.conf; the other
    # arguments stay, and so does the variable once the JVM is up
    mine = tmp_path / "mine.properties"
    mine.write_text("spark.driver.memory 3g\n")
    before = f"--properties-file {mine} --driver-java-options -Dx=1 pyspark-shell"
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", before)
    with _private_properties({"spark.sql.catalog.c.token": "t0k3n-2"}):
        path = _submitted_properties_file()
        assert shlex.split(os.environ["PYSPARK_SUBMIT_ARGS"])[2:] == ["--driver-java-options", "-Dx=1",
                                                                      "pyspark-shell"]
        assert "spark.driver.memory 3g" in path.read_text() and "spark.from.defaults" not in path.read_text()
    assert os.environ["PYSPARK_SUBMIT_ARGS"] == before and not path.exists()

    with _private_properties({}):  # nothing secret: spark-submit is started as it always was
        assert os.environ["PYSPARK_SUBMIT_ARGS"] == before
    monkeypatch.setenv("PYSPARK_SUBMIT_ARGS", f"--properties-file {tmp_path / 'missing'} pyspark-shell")
    with pytest.raises(ConfigError, match="is not a file"), _private_properties({"spark.a.password": "pw-3"}):
        pass
    assert list(private_temporary.iterdir()) == []


def test_the_private_properties_file_reads_back_in_java_exactly(spark, private_temporary, tmp_path, monkeypatch):
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    # a last line continued (a trailing backslash) and no final newline: it must not swallow pgcdc's first line
    (conf_dir / "spark-defaults.conf").write_text("spark.from.defaults = one \\\n  two\nspark.open.end = x\\")
    monkeypatch.setenv("SPARK_CONF_DIR", str(conf_dir))
    settings = {"spark.a.password": " leading = : # ! \\ trailing \t", "spark.b.token": "ü 😀\nsecond=line\r",
                "spark.key with spaces=and:colon.secret": "!#value", "spark.c.credential": ""}
    jvm = spark.sparkContext._jvm
    with _private_properties(settings):
        properties = jvm.java.util.Properties()
        stream = jvm.java.io.FileInputStream(str(_submitted_properties_file()))
        try:
            properties.load(jvm.java.io.InputStreamReader(stream, "UTF-8"))  # as Spark reads it
        finally:
            stream.close()
        loaded = {key: properties.getProperty(key) for key in properties.stringPropertyNames()}
    assert loaded == {"spark.from.defaults": "one two", "spark.open.end": "x", **settings}


def test_secrets_typed_as_flags_are_named_in_one_warning_and_flags_join_the_config_files_table(tmp_path):
    secret, password = "s3-secret-typed-as-a-flag-1", "catalog-password-in-a-uri-2"
    config = tmp_path / "pgcdc.toml"
    config.write_text('[spark]\n"spark.sql.catalog.pgcdc.type" = "rest"\n')

    def run(*flags: str) -> tuple[subprocess.CompletedProcess, str]:
        result = run_pgcdc("--config", str(config), "run", "--dsn", "dbname=x", "-p", "pub", "--warehouse",
                           "s3a://bucket/m", *flags, timeout=120, env={"COLUMNS": "200"})
        return result, result.stdout + result.stderr

    result, text = run("--conf", f"spark.hadoop.fs.s3a.secret.key={secret}", "--conf", "spark.ui.enabled=false",
                       "-c", f"spark.sql.catalog.pgcdc.uri=jdbc:postgresql://cdc:{password}@db/iceberg",
                       "--conf", f"spark.hadoop.fs.s3a.secret.key={secret}")
    # the table's catalog type stays beside the flags: the flag's address is checked against it
    assert result.returncode == 2 and "is not the address of a rest catalog" in text, text
    warnings = [line for line in result.stderr.splitlines() if "can be read by every user of this machine" in line]
    assert len(warnings) == 1, text
    assert "--conf spark.hadoop.fs.s3a.secret.key, spark.sql.catalog.pgcdc.uri on pgcdc's command line" in \
        warnings[0], warnings
    assert "[spark] table" in warnings[0] and "AWS_SECRET_ACCESS_KEY" in warnings[0]
    assert secret not in text and password not in text

    # the same settings from the config file: nothing on the command line, nothing to warn of
    config.write_text(f'[spark]\n"spark.sql.catalog.pgcdc.type" = "rest"\n"spark.hadoop.fs.s3a.secret.key" = '
                      f'"{secret}"\n"spark.sql.catalog.pgcdc.uri" = "jdbc:postgresql://cdc:{password}@db/iceberg"\n')
    result, text = run()
    assert result.returncode == 2 and "is not the address of a rest catalog" in text, text
    assert "can be read by every user" not in text and secret not in text and password not in text


@pytest.mark.parametrize(("message", "said"), [
    # the probe file's random name holds "403": the connection that never opened is what went wrong
    ("getFileStatus on s3a://b/w/.pgcdc-check-082a83403a2a41379e0856f3aeb5d76d: com.amazonaws.SdkClientException: "
     "Unable to execute HTTP request: Connect to 127.0.0.1:47145 failed: Connection refused", "nothing answers"),
    ("com.amazonaws.services.s3.model.AmazonS3Exception: Forbidden (Service: Amazon S3; Status Code: 403)",
     "refused pgcdc's credentials"),
    ("java.net.UnknownHostException: s3.nowhere.example", "nothing answers"),
    ("com.amazonaws.services.s3.model.AmazonS3Exception: The specified bucket does not exist", "does not exist"),
])
def test_a_storage_failure_is_named_by_what_went_wrong(message, said):
    from pgcdc.spark.destination import _storage_problem

    problem = _storage_problem("s3a://b/w", {"fs.s3a.endpoint": "http://127.0.0.1:47145"}, message)
    assert said in problem.what, problem
