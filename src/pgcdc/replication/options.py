"""pgoutput's START_REPLICATION options, negotiated from the server's version."""

from __future__ import annotations

import re
from dataclasses import dataclass

import psycopg

from pgcdc.errors import ConfigError
from pgcdc.types.registry import SESSION_SETTINGS


@dataclass(frozen=True)
class ReplicationOptions:
    """What to ask pgoutput for; ``None`` means the best the server supports.

    ``proto_version``: 4 on PostgreSQL 16+, 3 on 15, 2 on 14, 1 before. ``streaming``: in-progress
    transactions ('parallel' on protocol 4, 'on' on 2-3). ``two_phase``: decode at PREPARE (protocol
    3+). ``origin``: 'none' skips changes that were replicated into this server (PostgreSQL 16+).
    """

    publication: str
    proto_version: int | None = None
    streaming: str | None = None
    two_phase: bool | None = None
    binary: bool = False
    messages: bool = True
    origin: str | None = None

    def negotiate(self, server_version: int) -> dict[str, str]:
        """The option values for START_REPLICATION (or the SQL interface) on a server of this version."""
        highest = 4 if server_version >= 160000 else 3 if server_version >= 150000 else \
            2 if server_version >= 140000 else 1
        proto = self.proto_version or highest
        if proto > highest:
            raise ConfigError(f"protocol version {proto} needs a newer server: PostgreSQL "
                              f"{server_version // 10000} supports up to {highest}")
        options = {"proto_version": str(proto), "publication_names": quote_ident(self.publication)}
        streaming = self.streaming or ("parallel" if proto >= 4 else "on" if proto >= 2 else "off")
        if streaming == "parallel" and proto < 4:
            raise ConfigError("streaming 'parallel' needs protocol version 4 (PostgreSQL 16+)")
        if streaming != "off" and proto < 2:
            raise ConfigError("streaming in-progress transactions needs protocol version 2 (PostgreSQL 14+)")
        if streaming != "off":
            options["streaming"] = streaming if server_version >= 160000 else "true"
        two_phase = self.two_phase if self.two_phase is not None else proto >= 3
        if two_phase:
            if proto < 3:
                raise ConfigError("two-phase decoding needs protocol version 3 (PostgreSQL 15+)")
            options["two_phase"] = "true"
        if self.binary:
            options["binary"] = "true"
        if self.messages:
            options["messages"] = "true"
        if self.origin is not None:
            if server_version < 160000:
                raise ConfigError("the origin option needs PostgreSQL 16+")
            options["origin"] = self.origin
        return options


_PLAIN_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_$]*")


def quote_ident(name: str) -> str:
    """A PostgreSQL identifier as SQL text (and as ``publication_names`` reads it): plain lower-case names as they
    are, anything else double-quoted with quotes doubled."""
    return name if _PLAIN_IDENTIFIER.fullmatch(name) else '"' + name.replace('"', '""') + '"'


# Every connection pgcdc opens reads text as UTF-8, whatever the database's encoding: the server converts
# (LATIN1, WIN1252, ...) or passes bytes through (SQL_ASCII), and pgoutput's values arrive in it too.
CLIENT_ENCODING = "UTF8"


def with_session_settings(dsn: str, **extra: str) -> str:
    """The DSN with pgcdc's session settings (stable text output) added to its ``options``, in UTF-8."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    settings = " ".join(f"-c {key}={value.replace(' ', '')}" for key, value in SESSION_SETTINGS.items())
    params["options"] = " ".join(str(p) for p in (params.get("options"), settings) if p)
    params.setdefault("application_name", "pgcdc")
    params["client_encoding"] = CLIENT_ENCODING
    params.update(extra)
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})
