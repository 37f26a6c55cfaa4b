"""Decode pgoutput bytes into message objects.

Every read is bounds-checked: malformed input of any kind raises
:class:`~pgcdc.errors.DecodeError` naming the message, the field and the byte
offset, and nothing is allocated ahead of the bytes that back it.

The tuple-data loop is the hot path of the whole capture side (one call per
column of every row), so it avoids per-column objects: it fills one list of
values and one string of kind characters (see :class:`TupleData`).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

from pgcdc.errors import DecodeError
from pgcdc.lsn import Lsn
from pgcdc.native import optional_extension
from pgcdc.pgoutput.messages import (
    MIN_PROTO_VERSION,
    AnyMessage,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    Prepare,
    RawChange,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)

SUPPORTED_PROTO_VERSIONS = (1, 2, 3, 4)
REPLICA_IDENTITIES = frozenset("dnfi")

_I8 = struct.Struct(">b").unpack_from
_I16 = struct.Struct(">h").unpack_from
_I32 = struct.Struct(">i").unpack_from
_U32 = struct.Struct(">I").unpack_from
_U64 = struct.Struct(">Q").unpack_from
_BEGIN = struct.Struct(">QqI")  # final_lsn, commit_ts, xid
_COMMIT = struct.Struct(">bQQq")  # flags, commit_lsn, end_lsn, commit_ts
_STREAM_COMMIT = struct.Struct(">IbQQq")  # xid, flags, commit_lsn, end_lsn, commit_ts
_STREAM_ABORT = struct.Struct(">II")
_STREAM_ABORT_V4 = struct.Struct(">IIQq")
_BEGIN_PREPARE = struct.Struct(">QQqI")  # prepare_lsn, end_lsn, prepare_ts, xid
_PREPARE = struct.Struct(">bQQqI")  # flags, lsn, end_lsn, ts, xid (Prepare, Commit Prepared, Stream Prepare)
_ROLLBACK_PREPARED = struct.Struct(">bQQqqI")
_COLUMN = struct.Struct(">Ii")  # type oid, typmod
_XID_RELATION = struct.Struct(">II").unpack_from

_NAMES = {
    b"B"[0]: "Begin", b"M"[0]: "Message", b"C"[0]: "Commit", b"O"[0]: "Origin", b"R"[0]: "Relation",
    b"Y"[0]: "Type", b"I"[0]: "Insert", b"U"[0]: "Update", b"D"[0]: "Delete", b"T"[0]: "Truncate",
    b"S"[0]: "Stream Start", b"E"[0]: "Stream Stop", b"c"[0]: "Stream Commit", b"A"[0]: "Stream Abort",
    b"b"[0]: "Begin Prepare", b"P"[0]: "Prepare", b"K"[0]: "Commit Prepared", b"r"[0]: "Rollback Prepared",
    b"p"[0]: "Stream Prepare",
}
# Messages that only ever appear between Stream Start and Stream Stop, or only outside that block.
_ONLY_IN_STREAM = frozenset(b"E")
_NEVER_IN_STREAM = frozenset(b"BCScAbPKrp")

_T, _B, _N, _U = b"t"[0], b"b"[0], b"n"[0], b"u"[0]


class _Reader:
    """Cursor over one message; every method checks the bytes it needs exist."""

    __slots__ = ("data", "end", "name", "pos")

    def __init__(self, data: bytes, name: str) -> None:
        self.data = data
        self.pos = 1
        self.end = len(data)
        self.name = name

    def error(self, problem: str, field: str, offset: int | None = None) -> DecodeError:
        return DecodeError(problem, msg_type=self.name, field=field, offset=self.pos if offset is None else offset)

    def need(self, size: int, field: str) -> int:
        pos = self.pos
        if pos + size > self.end:
            raise self.error(f"truncated: {size} bytes needed, {self.end - pos} left", field)
        self.pos = pos + size
        return pos

    def struct(self, fmt: struct.Struct, field: str) -> tuple:
        return fmt.unpack_from(self.data, self.need(fmt.size, field))

    def int8(self, field: str) -> int:
        return _I8(self.data, self.need(1, field))[0]

    def int16(self, field: str) -> int:
        return _I16(self.data, self.need(2, field))[0]

    def int32(self, field: str) -> int:
        return _I32(self.data, self.need(4, field))[0]

    def uint32(self, field: str) -> int:
        return _U32(self.data, self.need(4, field))[0]

    def lsn(self, field: str) -> Lsn:
        return Lsn(_U64(self.data, self.need(8, field))[0])

    def byte(self, field: str) -> int:
        return self.data[self.need(1, field)]

    def string(self, field: str) -> str:
        start = self.pos
        nul = self.data.find(b"\0", start)
        if nul < 0:
            raise self.error("string without its NUL terminator", field)
        self.pos = nul + 1
        try:
            return self.data[start:nul].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"invalid UTF-8 ({exc.reason})", field, start + exc.start) from None

    def xid_if(self, present: bool) -> int | None:
        return self.uint32("xid") if present else None

    def finish(self, message: AnyMessage) -> AnyMessage:
        if self.pos != self.end:
            raise self.error(f"{self.end - self.pos} trailing bytes after the message", "end")
        return message


# Hot-path construction: the messages are frozen dataclasses; the decoder, which owns the objects it
# builds, fills their slots directly instead of paying for the frozen __init__'s per-field checks.
_new = object.__new__
_lsn = int.__new__  # an LSN from an unsigned 64-bit field is always in range
_SET_TUPLE = (TupleData.__dict__["kinds"].__set__, TupleData.__dict__["values"].__set__)


def _error(problem: str, msg_type: str, field: str, offset: int) -> DecodeError:
    return DecodeError(problem, msg_type=msg_type, field=field, offset=offset)


def _tuple_data(data: bytes, pos: int, end: int, msg_type: str, field: str) -> tuple[TupleData, int]:
    if pos + 2 > end:
        raise _error(f"truncated: 2 bytes needed, {end - pos} left", msg_type, f"{field}.number_of_columns", pos)
    count = _I16(data, pos)[0]
    if count < 0:
        raise _error(f"negative number of columns {count}", msg_type, f"{field}.number_of_columns", pos)
    pos += 2
    if count > end - pos:  # every column takes at least one byte: refuse before allocating for them
        raise _error(f"{count} columns cannot fit in the {end - pos} bytes left", msg_type,
                     f"{field}.number_of_columns", pos - 2)
    kinds = bytearray(count)
    values: list[bytes | None] = [None] * count
    for index in range(count):
        if pos >= end:
            raise _error(f"truncated at column {index} of {count}", msg_type, f"{field}[{index}].kind", pos)
        kind = data[pos]
        if kind == _T or kind == _B:  # noqa: SIM109 - two compares beat building a tuple per column
            start = pos + 5
            if start > end:
                raise _error("truncated value length", msg_type, f"{field}[{index}].length", pos + 1)
            size = _I32(data, pos + 1)[0]
            stop = start + size
            if size < 0 or stop > end:
                problem = "negative" if size < 0 else f"{end - start} bytes left for"
                raise _error(f"{problem} value length {size}", msg_type, f"{field}[{index}].length", pos + 1)
            values[index] = data[start:stop]
            pos = stop
        elif kind == _N or kind == _U:  # noqa: SIM109
            pos += 1
        else:
            raise _error(f"unknown tuple column kind {kind!r}", msg_type, f"{field}[{index}].kind", pos)
        kinds[index] = kind
    tuple_data = _new(TupleData)
    _SET_TUPLE[0](tuple_data, kinds.decode("ascii"))
    _SET_TUPLE[1](tuple_data, tuple(values))
    return tuple_data, pos


def _head(data: bytes, in_stream: bool, msg_type: str) -> tuple[int | None, int, int]:
    """xid (inside a stream), relation id, and the position after them, for Insert/Update/Delete."""
    end = len(data)
    if in_stream:
        if end < 9:
            raise _error(f"truncated: 8 bytes needed, {end - 1} left", msg_type, "xid..relation_id", 1)
        xid, relation_id = _XID_RELATION(data, 1)
        return xid, relation_id, 9
    if end < 5:
        raise _error(f"truncated: 4 bytes needed, {end - 1} left", msg_type, "relation_id", 1)
    return None, _U32(data, 1)[0], 5


def _marker(data: bytes, pos: int, msg_type: str, field: str) -> int:
    if pos >= len(data):
        raise _error("truncated: 1 byte needed, 0 left", msg_type, field, pos)
    return data[pos]


def _trailing(data: bytes, pos: int, msg_type: str) -> None:
    if pos != len(data):
        raise _error(f"{len(data) - pos} trailing bytes after the message", msg_type, "end", pos)


def _setters(cls: type) -> tuple:
    return tuple(cls.__dict__[field.name].__set__ for field in dataclasses.fields(cls))


_SET_INSERT = _setters(Insert)
_SET_UPDATE = _setters(Update)
_SET_DELETE = _setters(Delete)
_SET_BEGIN = _setters(Begin)
_SET_COMMIT = _setters(Commit)


def _build(cls: type, setters: tuple, *values: object) -> Any:
    message: Any = _new(cls)
    for setter, value in zip(setters, values):  # noqa: B905 - both come from the same dataclass
        setter(message, value)
    return message


def _insert(data: bytes, in_stream: bool, proto: int) -> AnyMessage:
    xid, relation_id, pos = _head(data, in_stream, "Insert")
    marker = _marker(data, pos, "Insert", "tuple_marker")
    if marker != 0x4E:  # 'N'
        raise _error(f"expected 'N' before the new tuple, got {marker!r}", "Insert", "tuple_marker", pos)
    new, pos = _tuple_data(data, pos + 1, len(data), "Insert", "new")
    _trailing(data, pos, "Insert")
    message: Insert = _new(Insert)
    set_xid, set_relation, set_new = _SET_INSERT
    set_xid(message, xid)
    set_relation(message, relation_id)
    set_new(message, new)
    return message


def _update(data: bytes, in_stream: bool, proto: int) -> AnyMessage:
    xid, relation_id, pos = _head(data, in_stream, "Update")
    end = len(data)
    key = old = None
    marker = _marker(data, pos, "Update", "tuple_marker")
    if marker == 0x4B:  # 'K'
        key, pos = _tuple_data(data, pos + 1, end, "Update", "key")
        marker = _marker(data, pos, "Update", "new_tuple_marker")
    elif marker == 0x4F:  # 'O'
        old, pos = _tuple_data(data, pos + 1, end, "Update", "old")
        marker = _marker(data, pos, "Update", "new_tuple_marker")
    if marker != 0x4E:
        raise _error(f"expected 'N' before the new tuple, got {marker!r}", "Update", "new_tuple_marker", pos)
    new, pos = _tuple_data(data, pos + 1, end, "Update", "new")
    _trailing(data, pos, "Update")
    return _build(Update, _SET_UPDATE, xid, relation_id, key, old, new)


def _delete(data: bytes, in_stream: bool, proto: int) -> AnyMessage:
    xid, relation_id, pos = _head(data, in_stream, "Delete")
    marker = _marker(data, pos, "Delete", "tuple_marker")
    if marker not in (0x4B, 0x4F):
        raise _error(f"expected 'K' or 'O' before the old tuple, got {marker!r}", "Delete", "tuple_marker", pos)
    image, pos = _tuple_data(data, pos + 1, len(data), "Delete", "key" if marker == 0x4B else "old")
    _trailing(data, pos, "Delete")
    if marker == 0x4B:
        return _build(Delete, _SET_DELETE, xid, relation_id, image, None)
    return _build(Delete, _SET_DELETE, xid, relation_id, None, image)


def _begin(data: bytes, in_stream: bool, proto: int) -> AnyMessage:
    if len(data) != 21:
        problem = "truncated" if len(data) < 21 else f"{len(data) - 21} trailing bytes after the message"
        raise _error(problem, "Begin", "final_lsn..xid" if len(data) < 21 else "end", min(len(data), 21))
    final_lsn, commit_ts, xid = _BEGIN.unpack_from(data, 1)
    return _build(Begin, _SET_BEGIN, _lsn(Lsn, final_lsn), commit_ts, xid)


def _commit(data: bytes, in_stream: bool, proto: int) -> AnyMessage:
    if len(data) != 26:
        problem = "truncated" if len(data) < 26 else f"{len(data) - 26} trailing bytes after the message"
        raise _error(problem, "Commit", "flags..commit_ts" if len(data) < 26 else "end", min(len(data), 26))
    flags, commit_lsn, end_lsn, commit_ts = _COMMIT.unpack_from(data, 1)
    return _build(Commit, _SET_COMMIT, flags, _lsn(Lsn, commit_lsn), _lsn(Lsn, end_lsn), commit_ts)


def _message(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    xid = r.xid_if(in_stream)
    flags = r.int8("flags")
    if flags not in (0, 1):
        raise r.error(f"flags must be 0 or 1, got {flags}", "flags", r.pos - 1)
    lsn = r.lsn("lsn")
    prefix = r.string("prefix")
    size = r.int32("content_length")
    if size < 0:
        raise r.error(f"negative content length {size}", "content_length", r.pos - 4)
    start = r.need(size, "content")
    return r.finish(Message(xid, bool(flags), lsn, prefix, bytes(r.data[start : start + size])))


def _origin(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    commit_lsn = r.lsn("commit_lsn")
    return r.finish(Origin(commit_lsn, r.string("name")))


def _relation(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    xid = r.xid_if(in_stream)
    relation_id = r.uint32("relation_id")
    namespace = r.string("namespace")
    name = r.string("name")
    identity = chr(r.byte("replica_identity"))
    if identity not in REPLICA_IDENTITIES:
        raise r.error(f"unknown replica identity {identity!r}", "replica_identity", r.pos - 1)
    count = r.int16("number_of_columns")
    if count < 0:
        raise r.error(f"negative number of columns {count}", "number_of_columns", r.pos - 2)
    columns = []
    for index in range(count):
        flags = r.int8(f"columns[{index}].flags")
        column_name = r.string(f"columns[{index}].name")
        type_oid, typmod = r.struct(_COLUMN, f"columns[{index}].type_oid")
        columns.append(Column(flags, column_name, type_oid, typmod))
    return r.finish(Relation(xid, relation_id, namespace, name, identity, tuple(columns)))


def _type(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    xid = r.xid_if(in_stream)
    type_oid = r.uint32("type_oid")
    namespace = r.string("namespace")
    return r.finish(Type(xid, type_oid, namespace, r.string("name")))


def _truncate(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    xid = r.xid_if(in_stream)
    count = r.int32("number_of_relations")
    options = r.int8("options")
    if count < 0:
        raise r.error(f"negative number of relations {count}", "number_of_relations", r.pos - 5)
    start = r.need(4 * count, "relation_ids")  # checked before anything is allocated for them
    relation_ids = struct.unpack_from(f">{count}I", r.data, start)
    return r.finish(Truncate(xid, options, relation_ids))


def _stream_start(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    xid = r.uint32("xid")
    first = r.int8("first_segment")
    if first not in (0, 1):
        raise r.error(f"first_segment must be 0 or 1, got {first}", "first_segment", r.pos - 1)
    return r.finish(StreamStart(xid, bool(first)))


def _stream_stop(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    return r.finish(StreamStop())


def _stream_commit(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    xid, flags, commit_lsn, end_lsn, commit_ts = r.struct(_STREAM_COMMIT, "xid..commit_ts")
    return r.finish(StreamCommit(xid, flags, Lsn(commit_lsn), Lsn(end_lsn), commit_ts))


def _stream_abort(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    # abort_lsn/abort_ts are sent only with protocol 4 *and* streaming 'parallel':
    # what the message holds decides, within what the version allows.
    if proto >= 4 and r.end - r.pos == _STREAM_ABORT_V4.size:
        xid, subxid, abort_lsn, abort_ts = r.struct(_STREAM_ABORT_V4, "xid..abort_ts")
        return r.finish(StreamAbort(xid, subxid, Lsn(abort_lsn), abort_ts))
    xid, subxid = r.struct(_STREAM_ABORT, "xid..subxid")
    return r.finish(StreamAbort(xid, subxid))


def _begin_prepare(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    prepare_lsn, end_lsn, prepare_ts, xid = r.struct(_BEGIN_PREPARE, "prepare_lsn..xid")
    return r.finish(BeginPrepare(Lsn(prepare_lsn), Lsn(end_lsn), prepare_ts, xid, r.string("gid")))


def _prepare_like(cls):
    def decode_prepare_like(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
        flags, lsn, end_lsn, ts, xid = r.struct(_PREPARE, "flags..xid")
        return r.finish(cls(flags, Lsn(lsn), Lsn(end_lsn), ts, xid, r.string("gid")))

    return decode_prepare_like


def _rollback_prepared(r: _Reader, in_stream: bool, proto: int) -> AnyMessage:
    flags, prepare_end, rollback_end, prepare_ts, rollback_ts, xid = r.struct(_ROLLBACK_PREPARED, "flags..xid")
    return r.finish(RollbackPrepared(flags, Lsn(prepare_end), Lsn(rollback_end), prepare_ts, rollback_ts, xid,
                                     r.string("gid")))


def _accelerated(decoder):
    """Insert/Update/Delete through the C parser when it is built; malformed bytes (None) go to the Python
    decoder, which raises the DecodeError naming the field and offset."""
    if _parse_change_c is None:
        return decoder

    def decode_change(data: bytes, in_stream: bool, proto: int) -> AnyMessage:
        parse = _parse_change_c
        if parse is not None:  # tests switch the accelerator off at run time
            message = parse(data, in_stream)
            if message is not None:
                return message
        return decoder(data, in_stream, proto)

    return decode_change


# the C accelerator is optional: the Python decoders do the same, slower
_accelerator = optional_extension("pgcdc.pgoutput._tuple")
if _accelerator is None:
    _parse_change_c = _parse_raw_c = None
else:
    _accelerator.configure(
        TupleData, (TupleData.__dict__["kinds"], TupleData.__dict__["values"]),
        tuple((cls, *(getattr(cls, f.name) for f in dataclasses.fields(cls))) for cls in (Insert, Update, Delete)))
    _accelerator.configure_raw(RawChange, tuple(RawChange.__dict__[f.name] for f in dataclasses.fields(RawChange)))
    _parse_change_c = _accelerator.parse_change
    _parse_raw_c = _accelerator.parse_raw

_CHANGE_KINDS = frozenset(b"IUD")
_RAW_SETTERS = _setters(RawChange)


def decode_raw(data: bytes, *, in_stream: bool) -> RawChange:
    """An Insert, Update or Delete checked whole (a DecodeError as :func:`decode` raises it when malformed) and
    kept as its bytes: a :class:`RawChange`."""
    parse = _parse_raw_c
    if parse is not None and type(data) is bytes:
        raw = parse(data, in_stream)
        if raw is not None:
            return raw
    message = decode(data, proto_version=2 if in_stream else 1, in_stream=in_stream)
    if not isinstance(message, Insert | Update | Delete):
        raise DecodeError(f"{type(message).__name__} is not an Insert, Update or Delete", field="type", offset=0)
    return _build(RawChange, _RAW_SETTERS, chr(data[0]), message.xid, message.relation_id, bytes(data))


def _cold(decoder):
    """A decoder of a rare message, reading through the bounds-checked :class:`_Reader`."""

    def decode_cold(data: bytes, in_stream: bool, proto: int) -> AnyMessage:
        return decoder(_Reader(data, _NAMES[data[0]]), in_stream, proto)

    return decode_cold


_DECODERS = {
    b"I"[0]: _accelerated(_insert), b"U"[0]: _accelerated(_update), b"D"[0]: _accelerated(_delete),
    b"B"[0]: _begin, b"C"[0]: _commit,
    b"M"[0]: _cold(_message), b"O"[0]: _cold(_origin), b"R"[0]: _cold(_relation), b"Y"[0]: _cold(_type),
    b"T"[0]: _cold(_truncate), b"S"[0]: _cold(_stream_start), b"E"[0]: _cold(_stream_stop),
    b"c"[0]: _cold(_stream_commit), b"A"[0]: _cold(_stream_abort), b"b"[0]: _cold(_begin_prepare),
    b"P"[0]: _cold(_prepare_like(Prepare)), b"K"[0]: _cold(_prepare_like(CommitPrepared)),
    b"r"[0]: _cold(_rollback_prepared), b"p"[0]: _cold(_prepare_like(StreamPrepare)),
}
_MIN_VERSION = {key[0]: version for key, version in MIN_PROTO_VERSION.items()}


def decode(data: bytes | bytearray | memoryview, *, proto_version: int, in_stream: bool) -> AnyMessage:
    """Decode one pgoutput message.

    ``proto_version`` is the version negotiated in START_REPLICATION;
    ``in_stream`` is True between Stream Start and Stream Stop, where the
    data messages carry the (sub)transaction's xid.

    >>> decode(bytes.fromhex("45"), proto_version=2, in_stream=True)
    StreamStop()
    """
    if type(data) is not bytes:
        try:
            data = bytes(data)
        except (TypeError, ValueError, BufferError) as exc:
            raise DecodeError(f"cannot read {type(data).__name__} as bytes: {exc}") from None
    if not data:
        raise DecodeError("empty message", field="type", offset=0)
    kind = data[0]
    if proto_version in ALLOWED_VERSIONS.get((kind, in_stream), ()):
        return _DECODERS[kind](data, in_stream, proto_version)
    raise refusal(kind, proto_version, in_stream)


def refusal(kind: int, proto_version: int, in_stream: bool) -> DecodeError:
    """Why a message type cannot be decoded in this protocol version and stream state."""
    if proto_version not in SUPPORTED_PROTO_VERSIONS:
        return DecodeError(f"unsupported protocol version {proto_version!r}; pgoutput defines versions 1 to 4")
    name = _NAMES.get(kind)
    if name is None:
        return DecodeError(f"unknown message type {chr(kind)!r} (0x{kind:02x})", field="type", offset=0)
    if proto_version < _MIN_VERSION[kind]:
        return DecodeError(f"{name} needs protocol version {_MIN_VERSION[kind]}, the stream uses {proto_version}",
                           msg_type=name, field="type", offset=0)
    if in_stream and proto_version < 2:
        return DecodeError("streamed transactions need protocol version 2 or later", msg_type=name, offset=0)
    if in_stream:
        return DecodeError(f"{name} cannot appear between Stream Start and Stream Stop", msg_type=name,
                           field="type", offset=0)
    return DecodeError(f"{name} outside a streamed block", msg_type=name, field="type", offset=0)


class MessageDecoder:
    """Decodes a slot's messages in their order, knowing whether the next one is inside a streamed block
    (between Stream Start and Stream Stop, where data messages carry an xid).

    >>> decoder = MessageDecoder(proto_version=2)
    >>> decoder.decode(bytes.fromhex("530000030101")).xid
    769
    >>> decoder.in_stream
    True
    """

    __slots__ = ("in_stream", "proto_version", "raw_changes")

    def __init__(self, proto_version: int, *, raw_changes: bool = False) -> None:
        """``raw_changes``: Inserts, Updates and Deletes come as :class:`RawChange` (checked, their tuple data left
        as bytes), for a consumer that stores them column by column."""
        self.proto_version = proto_version
        self.in_stream = False
        self.raw_changes = raw_changes

    def decode(self, data: bytes | bytearray | memoryview) -> AnyMessage:
        if self.raw_changes and data and data[0] in _CHANGE_KINDS and type(data) is bytes:
            return decode_raw(data, in_stream=self.in_stream)
        message = decode(data, proto_version=self.proto_version, in_stream=self.in_stream)
        kind = type(message)
        if kind is StreamStart:
            self.in_stream = True
        elif kind is StreamStop:
            self.in_stream = False
        return message


# (message type, in_stream) -> the protocol versions in which it may appear there
ALLOWED_VERSIONS: dict[tuple[int, bool], frozenset[int]] = {
    (kind, in_stream): frozenset(
        v for v in SUPPORTED_PROTO_VERSIONS
        if v >= _MIN_VERSION[kind] and not (in_stream and (kind in _NEVER_IN_STREAM or v < 2))
        and not (not in_stream and kind in _ONLY_IN_STREAM))
    for kind in _DECODERS for in_stream in (False, True)
}

