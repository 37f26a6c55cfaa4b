"""Which Java Spark runs: the version an installation states in its ``release`` file, asked of the JVM only when
there is none; a ``JAVA_HOME`` too old for Spark passed over for the Java on ``PATH``, which Spark then runs."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from pgcdc.spark.session import MIN_JAVA, _java_major, ensure_java


def java_home(root: Path, *, release: str | None, prints: str) -> tuple[Path, Path]:
    """A Java installation under ``root`` whose ``bin/java`` prints ``prints`` as ``java -version`` does (on stderr)
    and notes each run in ``runs``; ``release``: its release file's text (None: no such file)."""
    (root / "bin").mkdir(parents=True)
    runs = root / "runs"
    java = root / "bin" / "java"
    java.write_text(f"#!/bin/sh\necho \"$*\" >> '{runs}'\necho '{prints}' >&2\n")
    java.chmod(0o755)
    if release is not None:
        (root / "release").write_text(release)
    return java, runs


def runs_of(runs: Path) -> list[str]:
    return runs.read_text().splitlines() if runs.exists() else []


@pytest.mark.parametrize("release, major", [
    ('IMPLEMENTOR="Debian"\nJAVA_VERSION="17.0.15"\nJAVA_VERSION_DATE="2025-04-15"\n', 17),
    ('JAVA_VERSION="21"\n', 21),
    ('JAVA_VERSION="1.8.0_292"\nOS_NAME="Linux"\n', 8),
], ids=["17", "21-no-minor", "8-old-numbering"])
def test_the_release_file_tells_the_version_without_starting_the_jvm(tmp_path, release, major):
    java, runs = java_home(tmp_path / "jdk", release=release, prints='openjdk version "11.0.2" 2019-01-15')
    assert _java_major(str(java)) == major
    assert runs_of(runs) == []


@pytest.mark.parametrize("release", [None, 'IMPLEMENTOR="Someone"\n', 'JAVA_VERSION="unknown"\n'],
                         ids=["no-release-file", "no-version-in-it", "a-version-unreadable"])
def test_without_a_version_in_a_release_file_the_jvm_is_asked(tmp_path, release):
    java, runs = java_home(tmp_path / "jdk", release=release, prints='openjdk version "21.0.8" 2025-07-15')
    assert _java_major(str(java)) == 21
    assert runs_of(runs) == ["-version"]


def test_a_symlinked_java_is_read_where_it_is_installed(tmp_path):
    java, runs = java_home(tmp_path / "jdk", release='JAVA_VERSION="17.0.2"\n', prints="not asked")
    (tmp_path / "usr-bin").mkdir()
    (tmp_path / "usr-bin" / "java").symlink_to(java)
    assert _java_major(str(tmp_path / "usr-bin" / "java")) == 17
    assert runs_of(runs) == []


def test_a_java_home_too_old_for_spark_gives_way_to_the_java_on_path(tmp_path, monkeypatch, caplog):
    _, old_runs = java_home(tmp_path / "old-jdk", release='JAVA_VERSION="11.0.2"\n', prints="not asked")
    new, new_runs = java_home(tmp_path / "new-jdk", release=f'JAVA_VERSION="{MIN_JAVA}.0.9"\n', prints="not asked")
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "old-jdk"))
    monkeypatch.setenv("PATH", str(new.parent))
    with caplog.at_level(logging.WARNING, logger="pgcdc.spark.session"):
        assert ensure_java() == str(new)
    # Spark's launcher runs $JAVA_HOME/bin/java: the Java chosen
    assert Path(os.environ["JAVA_HOME"]) == tmp_path / "new-jdk"
    assert f"JAVA_HOME={tmp_path / 'old-jdk'} is not a Java {MIN_JAVA} or newer" in caplog.text
    assert runs_of(old_runs) == runs_of(new_runs) == []  # both told by their release files


def test_a_java_home_new_enough_is_kept_as_it_is_named(tmp_path, monkeypatch, caplog):
    _, runs = java_home(tmp_path / "jdk", release=f'JAVA_VERSION="{MIN_JAVA}.0.9"\n', prints="not asked")
    (tmp_path / "jdk-link").symlink_to(tmp_path / "jdk")
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "jdk-link"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with caplog.at_level(logging.WARNING, logger="pgcdc.spark.session"):
        assert ensure_java() == str(tmp_path / "jdk-link" / "bin" / "java")
    assert os.environ["JAVA_HOME"] == str(tmp_path / "jdk-link")
    assert caplog.text == ""
    assert runs_of(runs) == []
