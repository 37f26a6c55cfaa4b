"""Connection strings fit to show: passwords removed from any text that may hold a DSN, well-formed or not.

Every path that can print a DSN (error messages, exception chains, tracebacks, logs) passes through
:func:`redact`; :func:`parse_dsn` is the one place a DSN is checked, so a malformed one gets the same error,
without its password, from every command and from the Python API.
"""

from __future__ import annotations

import re

import psycopg

from pgcdc.errors import ConfigError

_PASSWORD_PATTERNS = (
    # keyword form and URI query parameters: password=secret, password = 'it''s \' quoted', password=a&b
    re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'?|\"(?:[^\"\\]|\\.)*\"?|[^\s'\"]+)", re.IGNORECASE),
    # URI user info, up to the last @ of the word: a malformed URI may hold a raw @ or / in its password
    re.compile(r"(postgres(?:ql)?://[^:/@\s]*:)(\S*)(@)", re.IGNORECASE),
)


def redact(text: str) -> str:
    """``text`` with every password of a DSN in it (keyword form or URI) replaced by ***."""
    text = _PASSWORD_PATTERNS[0].sub(r"\1***", text)
    return _PASSWORD_PATTERNS[1].sub(r"\1***\3", text)


def parse_dsn(dsn: str) -> dict[str, str]:
    """The DSN's parameters; a DSN libpq cannot read is a ConfigError naming what libpq said, password removed."""
    if not dsn or not isinstance(dsn, str):
        raise ConfigError("--dsn is empty: give a connection string such as 'host=db.example dbname=shop user=cdc' "
                          "or postgresql://cdc@db.example/shop")
    try:
        return psycopg.conninfo.conninfo_to_dict(dsn)  # type: ignore[return-value]
    except psycopg.ProgrammingError as exc:
        reason = redact(" ".join(str(exc).split()))
        raise ConfigError(f"--dsn is not a valid connection string (libpq: {reason}); write it as 'host=db "
                          "dbname=shop user=cdc' or postgresql://cdc@db/shop, with special characters of a URI "
                          "percent-encoded") from None


def redact_dsn(dsn: str) -> str:
    """A DSN fit to print: its password replaced by ***."""
    try:
        params = parse_dsn(dsn)
    except ConfigError:
        return redact(dsn)
    if "password" in params:
        params["password"] = "***"
    return " ".join(f"{k}={v}" for k, v in params.items())
