"""Avro object container files read in Python: the manifest lists and manifests of an Iceberg table.

Iceberg writes a snapshot's file listing as Avro container files (the Avro 1.11 specification, "Object Container
Files"): a header (the magic ``Obj\\x01``, a map of metadata holding the writer's schema and codec, a 16-byte sync
marker), then blocks of records, each block's count and size first and the sync marker after it. The records are
decoded with the writer's schema, which every file carries; each record becomes a dict of its fields by name.

Codecs ``null`` and ``deflate`` (Iceberg's default, ``write.avro.compression-codec=gzip``) are read; a file in any
other codec, or one that is not a well-formed container, is :class:`MetadataUnreadable`, and the caller reads the
table through the JVM instead, never a guess.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from pgcdc.errors import MetadataUnreadable

MAGIC = b"Obj\x01"
SYNC_SIZE = 16
CODECS = ("null", "deflate")

_Decode = Callable[["_Reader"], Any]


class _Reader:
    """A cursor over one buffer of Avro binary encoding; reading past its end is :class:`MetadataUnreadable`."""

    __slots__ = ("data", "location", "offset")

    def __init__(self, data: bytes, location: str, offset: int = 0) -> None:
        self.data = data
        self.location = location
        self.offset = offset

    def take(self, size: int) -> bytes:
        end = self.offset + size
        if size < 0 or end > len(self.data):
            raise MetadataUnreadable(f"{self.location}: an Avro value runs past the end of its block")
        value = self.data[self.offset:end]
        self.offset = end
        return value

    def long(self) -> int:
        """A zig-zag variable-length integer (Avro's int and long)."""
        data, offset, shift, accumulated = self.data, self.offset, 0, 0
        while True:
            if offset >= len(data):
                raise MetadataUnreadable(f"{self.location}: an Avro integer runs past the end of its block")
            byte = data[offset]
            offset += 1
            accumulated |= (byte & 0x7F) << shift
            if not byte & 0x80:
                break
            shift += 7
            if shift > 63:
                raise MetadataUnreadable(f"{self.location}: an Avro integer is longer than 64 bits")
        self.offset = offset
        return (accumulated >> 1) ^ -(accumulated & 1)

    def counts(self) -> Iterator[int]:
        """The item counts of an array's or map's blocks, up to the empty block that ends it (a negative count is
        followed by the block's size in bytes, which a reader of every item does not need)."""
        while True:
            count = self.long()
            if count == 0:
                return
            if count < 0:
                count = -count
                self.long()
            if count > len(self.data) - self.offset:  # each item of the schemas read here takes a byte or more
                raise MetadataUnreadable(f"{self.location}: an Avro block claims more items than it has bytes")
            yield count


def read_container(data: bytes, location: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the header's metadata, with the writer's schema parsed under ``avro.schema``; every record, a dict of its
    fields) of the Avro container file whose bytes are ``data``; ``location`` names it in errors."""
    if not data.startswith(MAGIC):
        raise MetadataUnreadable(f"{location} is not an Avro container file")
    reader = _Reader(data, location, len(MAGIC))
    metadata: dict[str, Any] = {}
    for count in reader.counts():
        for _ in range(count):
            key = reader.take(reader.long()).decode("utf-8", "replace")
            metadata[key] = reader.take(reader.long())
    codec = metadata.get("avro.codec", b"null").decode("ascii", "replace") or "null"
    if codec not in CODECS:
        raise MetadataUnreadable(f"{location}: Avro codec {codec!r} (pgcdc reads {', '.join(CODECS)})")
    try:
        schema = json.loads(metadata["avro.schema"])
    except (KeyError, ValueError) as exc:
        raise MetadataUnreadable(f"{location}: its Avro schema cannot be read ({exc!r})") from None
    metadata["avro.schema"] = schema
    try:
        decode = _decoder(schema, {}, None, location)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise MetadataUnreadable(f"{location}: its Avro schema is malformed ({exc!r})") from None
    sync = reader.take(SYNC_SIZE)
    records: list[dict[str, Any]] = []
    while reader.offset < len(data):
        count = reader.long()
        block = reader.take(reader.long())
        if codec == "deflate":
            try:
                block = zlib.decompress(block, -zlib.MAX_WBITS)
            except zlib.error as exc:
                raise MetadataUnreadable(f"{location}: a block cannot be inflated ({exc})") from None
        if not 0 <= count <= len(block):  # a record of the schemas read here takes a byte or more
            raise MetadataUnreadable(f"{location}: a block claims {count} records in {len(block)} bytes")
        values = _Reader(block, location)
        records.extend(decode(values) for _ in range(count))
        if values.offset != len(block):
            raise MetadataUnreadable(f"{location}: a block holds more than its {count} records")
        if reader.take(SYNC_SIZE) != sync:
            raise MetadataUnreadable(f"{location}: a block does not end with the file's sync marker")
    return metadata, records


def _full_name(name: str, namespace: str | None) -> str:
    return name if "." in name or not namespace else f"{namespace}.{name}"


def _define(schema: dict[str, Any], namespace: str | None, named: dict[str, _Decode], decode: _Decode) -> str:
    """Names the type ``schema`` defines (a record, enum or fixed), by full and by short name; its full name."""
    full = _full_name(schema["name"], schema.get("namespace", namespace))
    named[full] = named[full.rsplit(".", 1)[-1]] = decode
    return full


def _decoder(schema: Any, named: dict[str, _Decode], namespace: str | None, location: str) -> _Decode:
    """A function decoding one value of ``schema`` from a reader; ``named``: the named types (records, enums,
    fixed) defined so far, by full and by short name."""
    if isinstance(schema, list):  # a union: the branch's index, then its value
        branches = [_decoder(branch, named, namespace, location) for branch in schema]

        def union(reader: _Reader) -> Any:
            index = reader.long()
            if not 0 <= index < len(branches):
                raise MetadataUnreadable(f"{location}: a union's branch {index} is not in its schema")
            return branches[index](reader)
        return union
    if isinstance(schema, str):
        primitive = _PRIMITIVES.get(schema)
        if primitive is not None:
            return primitive
        found = named.get(_full_name(schema, namespace)) or named.get(schema)
        if found is None:
            raise MetadataUnreadable(f"{location}: Avro type {schema!r} is not defined")
        return found
    if not isinstance(schema, dict):
        raise MetadataUnreadable(f"{location}: {schema!r} is not an Avro schema")
    kind = schema.get("type")
    if kind in ("record", "error"):
        fields: list[tuple[str, _Decode]] = []

        def record(reader: _Reader) -> dict[str, Any]:
            return {name: decode(reader) for name, decode in fields}
        full = _define(schema, namespace, named, record)  # before the fields: a record may hold itself
        inner = full.rsplit(".", 1)[0] if "." in full else None
        fields.extend((field["name"], _decoder(field["type"], named, inner, location)) for field in schema["fields"])
        return record
    if kind == "enum":
        symbols = list(schema["symbols"])

        def enum(reader: _Reader) -> str:
            index = reader.long()
            if not 0 <= index < len(symbols):
                raise MetadataUnreadable(f"{location}: enum index {index} is not one of its {len(symbols)} symbols")
            return symbols[index]
        _define(schema, namespace, named, enum)
        return enum
    if kind == "fixed":
        size = int(schema["size"])

        def fixed(reader: _Reader) -> bytes:
            return reader.take(size)
        _define(schema, namespace, named, fixed)
        return fixed
    if kind == "array":
        item = _decoder(schema["items"], named, namespace, location)

        def array(reader: _Reader) -> list[Any]:
            return [item(reader) for count in reader.counts() for _ in range(count)]
        return array
    if kind == "map":
        value = _decoder(schema["values"], named, namespace, location)

        def mapping(reader: _Reader) -> dict[str, Any]:
            return {_string(reader): value(reader) for count in reader.counts() for _ in range(count)}
        return mapping
    if isinstance(kind, str | list | dict):  # a primitive, a union or a named type written as {"type": ...}
        return _decoder(kind, named, namespace, location)
    raise MetadataUnreadable(f"{location}: {schema!r} is not an Avro schema")


def _string(reader: _Reader) -> str:
    raw = reader.take(reader.long())
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MetadataUnreadable(f"{reader.location}: an Avro string is not UTF-8") from None


def _boolean(reader: _Reader) -> bool:
    return reader.take(1) != b"\x00"


_FLOAT = struct.Struct("<f")
_DOUBLE = struct.Struct("<d")
_PRIMITIVES: dict[str, _Decode] = {
    "null": lambda reader: None,
    "boolean": _boolean,
    "int": _Reader.long,
    "long": _Reader.long,
    "float": lambda reader: _FLOAT.unpack(reader.take(4))[0],
    "double": lambda reader: _DOUBLE.unpack(reader.take(8))[0],
    "bytes": lambda reader: reader.take(reader.long()),
    "string": _string,
}
