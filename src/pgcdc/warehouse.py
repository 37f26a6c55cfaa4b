"""A local ``--warehouse`` checked before Spark starts: a file in its way or a directory pgcdc cannot write is
one sentence here, not a Java stack trace from Hadoop's ``mkdirs`` after the slot exists."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

from pgcdc.errors import ConfigError


def local_warehouse(warehouse: str) -> Path | None:
    """The directory of a warehouse on the local file system (a path or a ``file:`` URI), None for other
    storage (s3a://, hdfs://, ...), which only Spark can check."""
    parsed = urlparse(warehouse)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme and len(parsed.scheme) > 1:  # one letter: a Windows drive, still a path
        return None
    return Path(warehouse)


def require_writable_warehouse(warehouse: str) -> None:
    """Refuse a local warehouse that is a file, lies under a file, or sits where pgcdc cannot write."""
    path = local_warehouse(warehouse)
    if path is None:
        return
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == path.absolute() else f"lies under {existing}, which is a file"
        raise ConfigError(f"--warehouse {warehouse} {where}: give a directory (it is created if missing)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--warehouse {warehouse}: pgcdc cannot write in {existing}; give a directory it can write, "
                          "or grant it write access there")


def require_existing_warehouse(warehouse: str) -> None:
    """Refuse a local warehouse that does not exist: reading one (``pgcdc status``) never creates it, and a
    misspelt path must not look like a warehouse without mirrors."""
    path = local_warehouse(warehouse)
    if path is not None and not path.is_dir():
        raise ConfigError(f"--warehouse {warehouse} {'is not a directory' if path.exists() else 'does not exist'}: "
                          "give the directory pgcdc run wrote its mirrors to")
