"""The pgoutput messages of logical replication protocol versions 1-4.

One frozen, slotted dataclass per message of the spec ("Logical Replication
Message Formats"), fields in the spec's order and named after it. LSNs are
:class:`~pgcdc.lsn.Lsn`; timestamps are the raw microseconds since the
PostgreSQL epoch (2000-01-01 UTC), as the server sends them, so that nothing
is lost before a consumer chooses a representation (:func:`pg_timestamp`).

``xid`` is ``None`` wherever the wire format has no xid: outside a streamed
transaction, or under protocol version 1.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import ClassVar, NamedTuple

from pgcdc.lsn import Lsn

PG_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
PG_EPOCH_UNIX_MICROS = 946_684_800_000_000


def pg_timestamp(micros: int) -> datetime:
    """Microseconds since 2000-01-01 UTC (a wire ``TimestampTz``) as an aware datetime.

    >>> pg_timestamp(0)
    datetime.datetime(2000, 1, 1, 0, 0, tzinfo=datetime.timezone.utc)
    """
    return PG_EPOCH + timedelta(microseconds=micros)


def pg_timestamp_from_datetime(value: datetime) -> int:
    """The inverse of :func:`pg_timestamp`; a naive datetime is taken as UTC."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    delta = value - PG_EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


# Column value kinds in TupleData.
NULL = "n"
UNCHANGED_TOAST = "u"
TEXT = "t"
BINARY = "b"


class TupleColumn(NamedTuple):
    """One column of a TupleData: ``kind`` is 'n', 'u', 't' or 'b'; ``value`` is None for 'n' and 'u'."""

    kind: str
    value: bytes | memoryview | None


@dataclass(frozen=True, slots=True)
class TupleData(Sequence[TupleColumn]):
    """A row image as sent on the wire, stored column-wise for cheap conversion.

    ``kinds`` holds one character per column ('n', 'u', 't', 'b'); ``values``
    the value bytes per column (None for 'n' and 'u'). Indexing and iteration
    give :class:`TupleColumn` objects.
    """

    kinds: str
    values: tuple[bytes | memoryview | None, ...]

    @classmethod
    def of(cls, columns: Sequence[TupleColumn | tuple[str, bytes | memoryview | None]]) -> TupleData:
        """Build from (kind, value) pairs, e.g. ``TupleData.of([("t", b"1"), ("n", None)])``."""
        return cls("".join(c[0] for c in columns), tuple(c[1] for c in columns))

    def __len__(self) -> int:
        return len(self.kinds)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [TupleColumn(k, v) for k, v in zip(self.kinds[index], self.values[index], strict=True)]
        return TupleColumn(self.kinds[index], self.values[index])

    def __iter__(self) -> Iterator[TupleColumn]:
        return map(TupleColumn, self.kinds, self.values)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TupleData):
            return NotImplemented
        return self.kinds == other.kinds and all(
            a == b for a, b in zip(self.values, other.values, strict=True)
        )

    def __hash__(self) -> int:
        return hash((self.kinds, tuple(None if v is None else bytes(v) for v in self.values)))

    @property
    def has_unchanged_toast(self) -> bool:
        return UNCHANGED_TOAST in self.kinds


class PgoutputMessage:
    """Base class of every pgoutput message."""

    __slots__ = ()
    TYPE: ClassVar[bytes]


@dataclass(frozen=True, slots=True)
class Begin(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"B"
    final_lsn: Lsn
    commit_ts: int
    xid: int


@dataclass(frozen=True, slots=True)
class Message(PgoutputMessage):
    """A logical decoding message (``pg_logical_emit_message``)."""

    TYPE: ClassVar[bytes] = b"M"
    xid: int | None
    transactional: bool
    lsn: Lsn
    prefix: str
    content: bytes


@dataclass(frozen=True, slots=True)
class Commit(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"C"
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_ts: int


@dataclass(frozen=True, slots=True)
class Origin(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"O"
    commit_lsn: Lsn
    name: str


@dataclass(frozen=True, slots=True)
class Column:
    """A column of a Relation message."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int

    KEY_FLAG: ClassVar[int] = 1

    @property
    def is_key(self) -> bool:
        return bool(self.flags & self.KEY_FLAG)


# relreplident values
REPLICA_IDENTITY_DEFAULT = "d"
REPLICA_IDENTITY_NOTHING = "n"
REPLICA_IDENTITY_FULL = "f"
REPLICA_IDENTITY_INDEX = "i"


@dataclass(frozen=True, slots=True)
class Relation(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"R"
    xid: int | None
    relation_id: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]

    @property
    def key_columns(self) -> tuple[Column, ...]:
        return tuple(c for c in self.columns if c.is_key)

    @property
    def qualified_name(self) -> str:
        """``schema.table`` as PostgreSQL would print it (empty namespace means pg_catalog)."""
        return f"{self.namespace or 'pg_catalog'}.{self.name}"


@dataclass(frozen=True, slots=True)
class Type(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"Y"
    xid: int | None
    type_oid: int
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class Insert(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"I"
    xid: int | None
    relation_id: int
    new: TupleData


@dataclass(frozen=True, slots=True)
class Update(PgoutputMessage):
    """``key`` is set when the replica identity key changed; ``old`` under REPLICA IDENTITY FULL."""

    TYPE: ClassVar[bytes] = b"U"
    xid: int | None
    relation_id: int
    key: TupleData | None
    old: TupleData | None
    new: TupleData


@dataclass(frozen=True, slots=True)
class Delete(PgoutputMessage):
    """Exactly one of ``key`` (index replica identity) and ``old`` (FULL) is set."""

    TYPE: ClassVar[bytes] = b"D"
    xid: int | None
    relation_id: int
    key: TupleData | None
    old: TupleData | None


@dataclass(frozen=True, slots=True)
class RawChange(PgoutputMessage):
    """An Insert, Update or Delete checked whole but with its tuple data left as the bytes the server sent
    (``data``, the message itself): what a columnar consumer appends to a
    :class:`~pgcdc.pgoutput.tuple_store.TupleStore` without an object per value. ``op`` is 'I', 'U' or 'D';
    :meth:`message` decodes it to the :class:`Insert`, :class:`Update` or :class:`Delete` it is."""

    op: str
    xid: int | None
    relation_id: int
    data: bytes

    def message(self) -> Insert | Update | Delete:
        from pgcdc.pgoutput.decode import decode

        message = decode(self.data, proto_version=2 if self.xid is not None else 1, in_stream=self.xid is not None)
        assert isinstance(message, Insert | Update | Delete)
        return message


TRUNCATE_CASCADE = 1
TRUNCATE_RESTART_IDENTITY = 2


@dataclass(frozen=True, slots=True)
class Truncate(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"T"
    xid: int | None
    options: int
    relation_ids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.options & TRUNCATE_CASCADE)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & TRUNCATE_RESTART_IDENTITY)


@dataclass(frozen=True, slots=True)
class StreamStart(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"S"
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"E"


@dataclass(frozen=True, slots=True)
class StreamCommit(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"c"
    xid: int
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_ts: int


@dataclass(frozen=True, slots=True)
class StreamAbort(PgoutputMessage):
    """``abort_lsn``/``abort_ts`` are present only under protocol 4 with ``streaming 'parallel'``."""

    TYPE: ClassVar[bytes] = b"A"
    xid: int
    subxid: int
    abort_lsn: Lsn | None = None
    abort_ts: int | None = None


@dataclass(frozen=True, slots=True)
class BeginPrepare(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"b"
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"P"
    flags: int
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"K"
    flags: int
    commit_lsn: Lsn
    end_lsn: Lsn
    commit_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"r"
    flags: int
    prepare_end_lsn: Lsn
    rollback_end_lsn: Lsn
    prepare_ts: int
    rollback_ts: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare(PgoutputMessage):
    TYPE: ClassVar[bytes] = b"p"
    flags: int
    prepare_lsn: Lsn
    end_lsn: Lsn
    prepare_ts: int
    xid: int
    gid: str


AnyMessage = (
    Begin | Message | Commit | Origin | Relation | Type | Insert | Update | Delete | RawChange | Truncate
    | StreamStart | StreamStop | StreamCommit | StreamAbort
    | BeginPrepare | Prepare | CommitPrepared | RollbackPrepared | StreamPrepare
)

MESSAGE_CLASSES: tuple[type[PgoutputMessage], ...] = (
    Begin, Message, Commit, Origin, Relation, Type, Insert, Update, Delete, Truncate,
    StreamStart, StreamStop, StreamCommit, StreamAbort,
    BeginPrepare, Prepare, CommitPrepared, RollbackPrepared, StreamPrepare,
)

# The lowest protocol version that defines each message type.
MIN_PROTO_VERSION: dict[bytes, int] = {
    **{cls.TYPE: 1 for cls in (Begin, Message, Commit, Origin, Relation, Type, Insert, Update, Delete, Truncate)},
    **{cls.TYPE: 2 for cls in (StreamStart, StreamStop, StreamCommit, StreamAbort)},
    **{cls.TYPE: 3 for cls in (BeginPrepare, Prepare, CommitPrepared, RollbackPrepared, StreamPrepare)},
}
