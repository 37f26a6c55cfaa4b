"""The pgoutput codec: bytes <-> message objects, protocol versions 1 to 4. No I/O."""

from pgcdc.errors import DecodeError
from pgcdc.pgoutput.decode import SUPPORTED_PROTO_VERSIONS, MessageDecoder, decode
from pgcdc.pgoutput.encode import encode
from pgcdc.pgoutput.messages import (
    MESSAGE_CLASSES,
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
    PgoutputMessage,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleColumn,
    TupleData,
    Type,
    Update,
    pg_timestamp,
    pg_timestamp_from_datetime,
)

__all__ = [
    "MESSAGE_CLASSES", "SUPPORTED_PROTO_VERSIONS", "AnyMessage", "Begin", "BeginPrepare", "Column", "Commit",
    "CommitPrepared", "DecodeError", "Delete", "Insert", "Message", "MessageDecoder", "Origin", "PgoutputMessage", "Prepare",
    "Relation", "RollbackPrepared", "StreamAbort", "StreamCommit", "StreamPrepare", "StreamStart", "StreamStop",
    "Truncate", "TupleColumn", "TupleData", "Type", "Update", "decode", "encode", "pg_timestamp",
    "pg_timestamp_from_datetime",
]
