"""Connection strings and settings fit to show: passwords removed from any text that may hold a DSN, well-formed
or not, and the values of secret settings (``fs.s3a.secret.key``, a catalog's ``jdbc.password`` or ``token``).

Every path that can print a DSN or a setting (error messages, exception chains, tracebacks, logs, the JVM's
lines) passes through :func:`redact`. Secret settings are registered (:func:`register_conf_secrets`) where
pgcdc receives them, so that their values are removed wherever they show up, also inside another system's
message (a JDBC driver's, Hadoop's); :func:`parse_dsn` is the one place a DSN is checked, so a malformed one gets the same error,
without its password, from every command and from the Python API.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

import psycopg

from pgcdc.errors import ConfigError

_PASSWORD_PATTERNS = (
    # keyword form and URI query parameters: password=secret, password = 'it''s \' quoted', password=a&b
    re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'?|\"(?:[^\"\\]|\\.)*\"?|[^\s'\"]+)", re.IGNORECASE),
    # URI user info, up to the last @ of the word: a malformed URI may hold a raw @ or / in its password
    re.compile(r"(postgres(?:ql)?://[^:/@\s]*:)(\S*)(@)", re.IGNORECASE),
)


# a setting whose value is a secret, by its name: fs.s3a.secret.key, fs.s3a.session.token, jdbc.password,
# credential, token, fs.s3a.encryption.key, AWS_SECRET_ACCESS_KEY
_SECRET_KEY = re.compile(r"secret|password|passwd|token|credential(?!s?\.provider)|encryption\.key|signing\.key", re.IGNORECASE)
# KEY=VALUE and 'KEY': 'VALUE' forms of such settings in free text (command lines, a dict's repr)
_SECRET_SETTING = re.compile(
    r"([\w.-]*(?:secret|password|passwd|token|credential(?!s?\.provider)|encryption\.key|signing\.key)[\w.-]*['\"]?\s*[=:]\s*)"
    r"('[^']*'|\"[^\"]*\"|[^\s,;&}'\"]+)", re.IGNORECASE)
_SECRET_ENVIRONMENT = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")
_MIN_SECRET_LENGTH = 4  # shorter values would mask ordinary words
_registered: set[str] = set()


def is_secret_setting(key: str) -> bool:
    """Whether a setting's value is a secret, by the setting's name."""
    return _SECRET_KEY.search(key) is not None


def holds_secret(key: str, value: str) -> bool:
    """Whether a setting carries a secret: named like one (:func:`is_secret_setting`), or with a value that
    :func:`redact` would change (a password in a URI or as password=..., a registered secret's value)."""
    return is_secret_setting(key) or redact(str(value)) != str(value)


def register_conf_secrets(conf: Mapping[str, str]) -> None:
    """Remember the values of the secret settings in ``conf`` (and of the AWS secret variables of the
    environment): :func:`redact` removes them from any text from now on."""
    values = [value for key, value in conf.items() if is_secret_setting(key)]
    values += [os.environ[name] for name in _SECRET_ENVIRONMENT if os.environ.get(name)]
    _registered.update(str(v) for v in values if v and len(str(v)) >= _MIN_SECRET_LENGTH)


def redact(text: str) -> str:
    """``text`` with every password of a DSN in it (keyword form or URI), every value of a secret setting
    written as KEY=VALUE, and every registered secret value replaced by ***."""
    for value in sorted(_registered, key=len, reverse=True):  # a secret inside a longer one: the longer first
        text = text.replace(value, "***")
    text = _PASSWORD_PATTERNS[0].sub(r"\1***", text)
    text = _SECRET_SETTING.sub(r"\1***", text)
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
