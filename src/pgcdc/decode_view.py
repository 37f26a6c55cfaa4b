"""`pgcdc decode`: pgoutput messages from a slot (SQL interface) or from a file, printed for people or tools."""

from __future__ import annotations

import binascii
import dataclasses
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pgcdc.errors import ConfigError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput import (
    AnyMessage,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    MessageDecoder,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamCommit,
    StreamPrepare,
    Truncate,
    TupleData,
    Update,
    pg_timestamp,
)


def decode_slot(dsn: str, slot: str, *, publication: str, proto_version: int, binary: bool, streaming: bool,
                limit: int | None) -> Iterator[tuple[Lsn, AnyMessage]]:
    """The messages ``slot`` holds, through the SQL interface, peeked: the slot stays where it is (see
    :func:`transaction_end` and ``advance_slot`` for consuming exactly what was shown)."""
    from pgcdc.replication import ReplicationOptions, SqlInterfaceReader

    options = ReplicationOptions(publication=publication, proto_version=proto_version,
                                 streaming="on" if streaming else "off", binary=binary, messages=True)
    _require_slot_and_publication(dsn, slot, publication)
    reader = SqlInterfaceReader(dsn, slot=slot, options=options)
    yield from reader.messages(consume=False, limit=limit)


def _require_slot_and_publication(dsn: str, slot: str, publication: str) -> None:
    """pgoutput names a missing publication only once a change arrives: a quiet slot would print nothing and
    look empty. Check both up front."""
    from pgcdc.replication import source_connection

    with source_connection(dsn) as conn:
        row = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = %s), "
                           "EXISTS (SELECT 1 FROM pg_publication WHERE pubname = %s), current_database()",
                           (slot, publication)).fetchone()
    assert row is not None
    if not row[0]:
        raise ConfigError(f"replication slot {slot!r} does not exist; list the slots with pgcdc slot list, or create "
                          f"it with pgcdc slot create {slot}")
    if not row[1]:
        raise ConfigError(f"publication {publication!r} does not exist in database {row[2]!r}; check --publication "
                          "(psql: \\dRp lists them)")


def transaction_end(message: AnyMessage) -> Lsn | None:
    """The end of the WAL record that finishes a transaction (or its decoded PREPARE), for messages that
    finish one: a slot confirmed at that position sends nothing of the transaction again and everything after
    it. None for every other message: the server sends a transaction whole, so a slot cannot stop inside one,
    and consuming through ``pg_logical_slot_get_binary_changes(..., upto_nchanges)`` would move it past
    messages never shown."""
    if isinstance(message, Commit | StreamCommit | Prepare | StreamPrepare | CommitPrepared):
        return message.end_lsn
    if isinstance(message, RollbackPrepared):
        return message.rollback_end_lsn
    return None


def decode_file(path: Path, *, proto_version: int) -> Iterator[tuple[Lsn | None, AnyMessage]]:
    """Messages from a file: text with one hex payload per line (optionally ``LSN<TAB>hex``), or binary with
    each payload prefixed by its 4-byte big-endian length."""
    decoder = MessageDecoder(proto_version)
    for lsn, payload in _payloads(path.read_bytes()):
        yield lsn, decoder.decode(payload)


def _payloads(data: bytes) -> Iterator[tuple[Lsn | None, bytes]]:
    try:
        text = data.decode("ascii")
        lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
        parsed = []
        for line in lines:
            lsn_text, _, hex_text = line.rpartition("\t") if "\t" in line else ("", "", line)
            parsed.append((Lsn.parse(lsn_text) if lsn_text else None, binascii.unhexlify(hex_text)))
        yield from parsed
        return
    except (UnicodeDecodeError, binascii.Error, ValueError):
        pass
    offset = 0
    while offset < len(data):
        if offset + 4 > len(data):
            raise ConfigError(f"file ends inside a length prefix at byte {offset}")
        (size,) = struct.unpack_from(">I", data, offset)
        offset += 4
        if offset + size > len(data):
            raise ConfigError(f"message at byte {offset - 4} says {size} bytes, the file has {len(data) - offset}")
        yield None, data[offset:offset + size]
        offset += size


def message_as_dict(message: Any) -> dict[str, Any]:
    """A JSON-ready view: type name, fields, LSNs as text, timestamps as ISO, values as text or hex."""
    result: dict[str, Any] = {"type": type(message).__name__}
    for field in dataclasses.fields(message):
        result[field.name] = _jsonable(field.name, getattr(message, field.name))
    return result


def _jsonable(name: str, value: Any) -> Any:
    if isinstance(value, Lsn):
        return str(value)
    if isinstance(value, TupleData):
        return [_column(kind, raw) for kind, raw in zip(value.kinds, value.values, strict=True)]
    if name.endswith("_ts") and isinstance(value, int):
        return pg_timestamp(value).isoformat()
    if isinstance(value, bytes | memoryview):
        raw = bytes(value)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return {"hex": raw.hex()}
    if isinstance(value, tuple):
        return [message_as_dict(v) if dataclasses.is_dataclass(v) else v for v in value]
    return value


def _column(kind: str, raw: bytes | memoryview | None) -> Any:
    if kind == "n":
        return None
    if kind == "u":
        return {"unchanged_toast": True}
    if kind == "t":
        return bytes(raw or b"").decode("utf-8", errors="replace")
    return {"binary": bytes(raw or b"").hex()}


class MessagePrinter:
    """Messages as lines for people (or JSON lines for tools). Rows name their table and columns: the printer
    remembers each Relation message, as a subscriber does, and LSNs read as PostgreSQL writes them (``0/16F48E8``)."""

    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self._relations: dict[int, Relation] = {}

    def format(self, lsn: Lsn | None, message: AnyMessage) -> str:
        if isinstance(message, Relation):
            self._relations[message.relation_id] = message
        view = message_as_dict(message)
        relation_id = getattr(message, "relation_id", None)
        relation = self._relations.get(relation_id) if relation_id is not None else None
        if self.as_json:
            if relation is not None:
                view = {**view, "table": f"{relation.namespace}.{relation.name}"}
            if lsn is not None:
                view = {"lsn": str(lsn), **view}
            return json.dumps(view, ensure_ascii=False)
        kind = view.pop("type")
        if isinstance(message, Relation):
            columns = " ".join(c.name + ("(key)" if c.flags & 1 else "") for c in message.columns)
            fields = (f"{message.namespace}.{message.name} columns: {columns} replica_identity="
                      f"{message.replica_identity} relation_id={message.relation_id}")
        elif relation is not None and isinstance(message, Insert | Update | Delete):
            fields = self._row_fields(relation, message)
        elif isinstance(message, Truncate):
            fields = "tables=" + json.dumps([self._table_name(oid) for oid in message.relation_ids]) + \
                f" cascade={str(message.cascade).lower()} restart_identity={str(message.restart_identity).lower()}"
        else:
            fields = " ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in view.items())
        return f"{str(lsn) if lsn is not None else '-':>12} {kind:<16} {fields}"

    def _table_name(self, relation_id: int) -> str:
        relation = self._relations.get(relation_id)
        return f"{relation.namespace}.{relation.name}" if relation is not None else f"relation {relation_id}"

    @staticmethod
    def _row_fields(relation: Relation, message: Insert | Update | Delete) -> str:
        parts = [f"{relation.namespace}.{relation.name}"]
        for label in ("key", "old", "new"):
            row = getattr(message, label, None)
            if row is None:
                continue
            values = [_column(kind, raw) for kind, raw in zip(row.kinds, row.values, strict=True)]
            columns = " ".join(f"{column.name}={json.dumps(value, ensure_ascii=False)}"
                               for column, value, kind in zip(relation.columns, values, row.kinds, strict=False)
                               if not (label == "key" and kind == "n"))  # a key tuple lists non-key columns as null
            parts.append(f"{label}: {columns}")
        return " ".join(parts)


def format_message(lsn: Lsn | None, message: AnyMessage, *, as_json: bool) -> str:
    """One message alone (no Relation seen before it, so rows show relation ids)."""
    return MessagePrinter(as_json=as_json).format(lsn, message)
