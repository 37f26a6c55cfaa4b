"""Encode message objects into pgoutput bytes: the exact inverse of :func:`pgcdc.pgoutput.decode`.

Used by tests, fakes and tools (e.g. writing a file ``pgcdc decode --file`` reads). A message that
the given protocol version or stream state does not allow raises ``ValueError``, as does a field
out of its wire range.
"""

from __future__ import annotations

import struct

from pgcdc.pgoutput.decode import ALLOWED_VERSIONS, refusal
from pgcdc.pgoutput.messages import (
    AnyMessage,
    Begin,
    BeginPrepare,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    Prepare,
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


def _string(value: str) -> bytes:
    raw = value.encode("utf-8")
    if b"\0" in raw:
        raise ValueError(f"string {value!r} contains NUL, which the wire format cannot carry")
    return raw + b"\0"


def _tuple(data: TupleData) -> bytes:
    parts = [struct.pack(">h", len(data.kinds))]
    for kind, value in zip(data.kinds, data.values, strict=True):
        if kind in ("t", "b"):
            if value is None:
                raise ValueError(f"a {kind!r} column needs a value")
            raw = bytes(value)
            parts.append(kind.encode() + struct.pack(">i", len(raw)) + raw)
        elif kind in ("n", "u"):
            if value is not None:
                raise ValueError(f"a {kind!r} column carries no value")
            parts.append(kind.encode())
        else:
            raise ValueError(f"unknown tuple column kind {kind!r}")
    return b"".join(parts)


def _xid(xid: int | None, in_stream: bool) -> bytes:
    if in_stream:
        if xid is None:
            raise ValueError("inside a stream, data messages carry an xid")
        return struct.pack(">I", xid)
    if xid is not None:
        raise ValueError("outside a stream, data messages carry no xid")
    return b""


def encode(msg: AnyMessage, *, proto_version: int, in_stream: bool) -> bytes:
    """The bytes of ``msg`` as pgoutput sends them.

    >>> encode(StreamStop(), proto_version=2, in_stream=True)
    b'E'
    """
    tag = type(msg).TYPE
    if proto_version not in ALLOWED_VERSIONS.get((tag[0], in_stream), ()):
        # the same rules decode applies: what decode would refuse, encode does not write
        raise ValueError(str(refusal(tag[0], proto_version, in_stream)))
    try:
        body = _body(msg, in_stream, proto_version)
    except struct.error as exc:
        raise ValueError(f"{type(msg).__name__}: a field is out of its wire range ({exc})") from None
    return tag + body


def _body(msg: AnyMessage, in_stream: bool, proto: int) -> bytes:
    match msg:
        case Begin():
            return struct.pack(">QqI", msg.final_lsn, msg.commit_ts, msg.xid)
        case Message():
            return (_xid(msg.xid, in_stream) + struct.pack(">bQ", 1 if msg.transactional else 0, msg.lsn)
                    + _string(msg.prefix) + struct.pack(">i", len(msg.content)) + bytes(msg.content))
        case Commit():
            return struct.pack(">bQQq", msg.flags, msg.commit_lsn, msg.end_lsn, msg.commit_ts)
        case Origin():
            return struct.pack(">Q", msg.commit_lsn) + _string(msg.name)
        case Relation():
            columns = b"".join(struct.pack(">b", c.flags) + _string(c.name) + struct.pack(">Ii", c.type_oid,
                                                                                            c.type_modifier)
                               for c in msg.columns)
            return (_xid(msg.xid, in_stream) + struct.pack(">I", msg.relation_id) + _string(msg.namespace)
                    + _string(msg.name) + msg.replica_identity.encode("ascii")
                    + struct.pack(">h", len(msg.columns)) + columns)
        case Type():
            return (_xid(msg.xid, in_stream) + struct.pack(">I", msg.type_oid) + _string(msg.namespace)
                    + _string(msg.name))
        case Insert():
            return _xid(msg.xid, in_stream) + struct.pack(">I", msg.relation_id) + b"N" + _tuple(msg.new)
        case Update():
            if msg.key is not None and msg.old is not None:
                raise ValueError("an Update carries a key or an old tuple, never both")
            old = (b"K" + _tuple(msg.key) if msg.key is not None
                   else b"O" + _tuple(msg.old) if msg.old is not None else b"")
            return _xid(msg.xid, in_stream) + struct.pack(">I", msg.relation_id) + old + b"N" + _tuple(msg.new)
        case Delete():
            if (msg.key is None) == (msg.old is None):
                raise ValueError("a Delete carries exactly one of a key and an old tuple")
            old = b"K" + _tuple(msg.key) if msg.key is not None else b"O" + _tuple(msg.old)  # type: ignore[arg-type]
            return _xid(msg.xid, in_stream) + struct.pack(">I", msg.relation_id) + old
        case Truncate():
            return (_xid(msg.xid, in_stream) + struct.pack(">ib", len(msg.relation_ids), msg.options)
                    + struct.pack(f">{len(msg.relation_ids)}I", *msg.relation_ids))
        case StreamStart():
            return struct.pack(">Ib", msg.xid, 1 if msg.first_segment else 0)
        case StreamStop():
            return b""
        case StreamCommit():
            return struct.pack(">IbQQq", msg.xid, msg.flags, msg.commit_lsn, msg.end_lsn, msg.commit_ts)
        case StreamAbort():
            if (msg.abort_lsn is None) != (msg.abort_ts is None):
                raise ValueError("abort_lsn and abort_ts come together")
            if msg.abort_lsn is not None:
                if proto < 4:
                    raise ValueError("abort_lsn and abort_ts need protocol version 4")
                return struct.pack(">IIQq", msg.xid, msg.subxid, msg.abort_lsn, msg.abort_ts)
            return struct.pack(">II", msg.xid, msg.subxid)
        case BeginPrepare():
            return struct.pack(">QQqI", msg.prepare_lsn, msg.end_lsn, msg.prepare_ts, msg.xid) + _string(msg.gid)
        case Prepare() | CommitPrepared() | StreamPrepare():
            lsn = msg.commit_lsn if isinstance(msg, CommitPrepared) else msg.prepare_lsn
            ts = msg.commit_ts if isinstance(msg, CommitPrepared) else msg.prepare_ts
            return struct.pack(">bQQqI", msg.flags, lsn, msg.end_lsn, ts, msg.xid) + _string(msg.gid)
        case RollbackPrepared():
            return (struct.pack(">bQQqqI", msg.flags, msg.prepare_end_lsn, msg.rollback_end_lsn, msg.prepare_ts,
                                msg.rollback_ts, msg.xid) + _string(msg.gid))
    raise ValueError(f"not a pgoutput message: {msg!r}")
