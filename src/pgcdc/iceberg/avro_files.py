"""Avro object container files read in Python: the manifest lists and manifests of an Iceberg table.

Iceberg writes a snapshot's file listing as Avro container files (the Avro 1.11 specification, "Object Container
Files"): a header (the magic ``Obj\\x01``, a map of metadata holding the writer's schema and codec, a 16-byte sync
marker), then blocks of records, each block's count and size first and the sync marker after it. fastavro reads
them: its compiled reader is 1.2-1.5 times as fast as the pure-Python one pgcdc had (bench/manifests.py), and it
reads every codec Iceberg writes (``write.avro.compression-codec``): ``deflate`` (gzip, the default), ``snappy``,
``zstandard`` (zstd) and ``null``; bzip2 and xz too. Its header, blocks, codecs and sync markers are fastavro's;
the records are decoded with the writer's schema, which every file carries, less its logical types, so each value
comes back as written (a date as its int of days, a decimal as its unscaled bytes, as Iceberg's own readers take a
partition), each record a dict of its fields by name.

A file that is not a well-formed container is :class:`MetadataUnreadable`, never a guess, and never another error:
whatever fastavro raises on damaged bytes, a block whose record count is absurd, a block holding more bytes than
its records (a damaged count, which would otherwise drop records unseen), a snappy block whose CRC-32 does not
match (fastavro skips it); the caller then reads the table through the JVM instead.
"""

from __future__ import annotations

import io
import json
import zlib
from typing import Any

import fastavro

from pgcdc.errors import MetadataUnreadable

MAGIC = b"Obj\x01"
SYNC_SIZE = 16


def read_container(data: bytes, location: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the header's metadata, text by key, with the writer's schema parsed under ``avro.schema``; every record, a
    dict of its fields) of the Avro container file whose bytes are ``data``; ``location`` names it in errors."""
    if not data.startswith(MAGIC):
        raise MetadataUnreadable(f"{location} is not an Avro container file")
    try:
        blocks = fastavro.block_reader(io.BytesIO(data))
        metadata: dict[str, Any] = dict(blocks.metadata)
        codec = metadata.get("avro.codec", "null")
        if codec not in fastavro.read.BLOCK_READERS:
            raise MetadataUnreadable(f"{location}: Avro codec {codec!r} (fastavro reads "
                                     f"{', '.join(sorted(fastavro.read.BLOCK_READERS))})")
        metadata["avro.schema"] = json.loads(metadata["avro.schema"])
        schema = fastavro.parse_schema(_plain(metadata["avro.schema"]))
    except MetadataUnreadable:
        raise
    except Exception as exc:  # fastavro's own and whatever its parsing met in damaged bytes: unreadable
        raise MetadataUnreadable(f"{location}: its Avro header or schema cannot be read ({exc!r})") from None
    records: list[Any] = []  # dicts, for a schema of records
    try:
        for block in blocks:
            values = getattr(block, "bytes_", None)  # the block's records, inflated: fastavro's Block holds them
            if not isinstance(values, io.BytesIO):
                raise MetadataUnreadable(f"{location}: fastavro {fastavro.__version__} keeps no block bytes")
            count, size = block.num_records, len(values.getbuffer())
            if not 0 <= count <= size:  # a record of the schemas read here takes a byte or more
                raise MetadataUnreadable(f"{location}: a block claims {count} records in {size} bytes")
            if codec == "snappy":  # its checksum, which fastavro skips: 4 bytes before the sync marker
                end = block.offset + block.size - SYNC_SIZE
                if zlib.crc32(values.getbuffer()) != int.from_bytes(data[end - 4:end], "big"):
                    raise MetadataUnreadable(f"{location}: a snappy block does not match its checksum")
            records.extend(fastavro.schemaless_reader(values, schema) for _ in range(count))
            if values.tell() != size:
                raise MetadataUnreadable(f"{location}: a block holds more than its {count} records")
    except MetadataUnreadable:
        raise
    except Exception as exc:  # a short block, a bad sync marker, a value past its block's end, a bad union index...
        raise MetadataUnreadable(f"{location}: a block cannot be read ({exc!r})") from None
    return metadata, records


def _plain(schema: Any) -> Any:
    """``schema`` without its logical types, whose values fastavro would convert (dates, decimals, timestamps:
    failing on those out of Python's range) where pgcdc takes them as written."""
    if isinstance(schema, list):  # a union
        return [_plain(branch) for branch in schema]
    if not isinstance(schema, dict):
        return schema
    plain = {key: value for key, value in schema.items() if key != "logicalType"}
    kind = plain.get("type")
    if kind in ("record", "error"):
        plain["fields"] = [{**field, "type": _plain(field["type"])} for field in plain["fields"]]
    elif kind == "array":
        plain["items"] = _plain(plain["items"])
    elif kind == "map":
        plain["values"] = _plain(plain["values"])
    elif isinstance(kind, list | dict):  # a union or a type written as {"type": {...}}
        plain["type"] = _plain(kind)
    return plain
