"""From the pgoutput message stream to committed transactions, in commit order.

Handles ordinary transactions (Begin ... Commit), streamed ones (protocol 2+: chunks between
Stream Start and Stream Stop, released by Stream Commit, dropped whole or per subtransaction by
Stream Abort, interleaved under ``streaming 'parallel'``), and two-phase ones (protocol 3+: held
from Prepare, or Stream Prepare, until Commit Prepared or Rollback Prepared).

A transaction holds its Inserts, Updates and Deletes column-wise: per table (schema version) a run of
changes in a :class:`~pgcdc.pgoutput.tuple_store.TupleStore`, their row images kept as the bytes the server
sent, with per change only its op, ordinal and subtransaction. :meth:`Transaction.runs` hands those runs on
as they are (a consumer turns a run into columns with no object per value); :meth:`Transaction.changes`
gives one :class:`Change` object per change.

Memory is bounded: a transaction whose changes outgrow ``memory_limit_bytes`` continues in a
spill file that is read back when it commits and removed when it ends; files left by a crashed
process are swept when the next assembler starts. A spill file holds the changes as pgoutput bytes
in checksummed frames, decoded by the same strict decoder as the wire: a corrupt or altered file
stops the pipeline with :class:`SpillCorruptError` (nothing was confirmed for that transaction, so
the server sends it again after a restart); it is never trusted, and never unpickled.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import os
import struct
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from pgcdc.errors import DecodeError, ProtocolError, SpillCorruptError
from pgcdc.faults import injection_point
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.decode import decode
from pgcdc.pgoutput.encode import encode
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
from pgcdc.pgoutput.tuple_store import new_store

log = logging.getLogger("pgcdc.transactions")

SPILL_PREFIX = "pgcdc-spill-"
_SPILL_CHUNK = 10_000
_CHANGE_OVERHEAD = 48  # bytes a buffered change costs beyond its values (its record, the image offsets)
_NONE = -1  # a change's subtransaction in a TupleStore when it has none


class Change:
    """One change of a committed transaction, ordered by ``(commit_lsn, ordinal)``.

    ``op`` is 'I', 'U', 'D', 'T' (truncate: ``truncate_relations``, ``truncate_options``) or 'M'
    (a transactional logical decoding message: ``message``). ``relation`` is the schema version in
    force when the change was written.
    """

    __slots__ = ("commit_lsn", "key", "message", "new", "old", "op", "ordinal", "relation", "truncate_options",
                 "truncate_relations")

    def __init__(self, commit_lsn: Lsn, ordinal: int, op: str, relation: Relation | None,
                 new: TupleData | None = None, old: TupleData | None = None, key: TupleData | None = None,
                 truncate_relations: tuple[Relation, ...] = (), truncate_options: int = 0,
                 message: Message | None = None) -> None:
        self.commit_lsn = commit_lsn
        self.ordinal = ordinal
        self.op = op
        self.relation = relation
        self.new = new
        self.old = old
        self.key = key
        self.truncate_relations = truncate_relations
        self.truncate_options = truncate_options
        self.message = message

    def __repr__(self) -> str:
        table = self.relation.qualified_name if self.relation else ",".join(
            r.qualified_name for r in self.truncate_relations)
        return f"Change({self.op} {table} at {self.commit_lsn}#{self.ordinal})"


# A buffered change other than a row change (a Truncate, a transactional Message): (subtransaction xid or None,
# the message, the truncated relations or None, its ordinal)
_Single = tuple[int | None, AnyMessage, Any, int]


class ChangeRun:
    """Row changes of one table (one schema version: ``relation``) in a transaction, in order: the changes of
    ``store`` (a :class:`~pgcdc.pgoutput.tuple_store.TupleStore`) at the int64 indices ``selection`` (None: all of
    them), with ``ordinals`` their positions in the transaction (None: the store's own)."""

    __slots__ = ("ordinals", "relation", "selection", "store")

    def __init__(self, relation: Relation, store: Any, selection: np.ndarray | None = None,
                 ordinals: np.ndarray | None = None) -> None:
        self.relation = relation
        self.store = store
        self.selection = selection
        self.ordinals = ordinals

    def __len__(self) -> int:
        return len(self.store) if self.selection is None else len(self.selection)

    def ordinal_array(self) -> np.ndarray:
        if self.ordinals is not None:
            return self.ordinals
        stored = np.frombuffer(self.store.ordinals(), dtype=np.int64)
        return stored if self.selection is None else stored[self.selection]

    def part(self, start: int, stop: int) -> ChangeRun:
        """The changes from ``start`` to ``stop`` (positions in this run)."""
        selection = self.selection if self.selection is not None else np.arange(len(self.store), dtype=np.int64)
        return ChangeRun(self.relation, self.store, selection[start:stop], self.ordinal_array()[start:stop])

    def __repr__(self) -> str:
        return f"ChangeRun({self.relation.qualified_name}, {len(self)} changes)"


class _Run:
    """The changes of a buffer to one relation version since it was last interrupted (by a Truncate of it)."""

    __slots__ = ("relation", "store")

    def __init__(self, relation: Relation) -> None:
        self.relation = relation
        self.store = new_store(len(relation.columns))


class _Pieces:
    """Changes in the order they came, as runs per relation version and single items: what a buffer holds in
    memory, and what a chunk of its spill file reads back as."""

    __slots__ = ("count", "items", "runs")

    def __init__(self, first_ordinal: int = 0) -> None:
        self.items: list[_Run | _Single] = []
        self.runs: dict[int, _Run] = {}  # the run each relation's next change joins
        self.count = first_ordinal

    def add_change(self, subxid: int | None, message: RawChange | Insert | Update | Delete, relation: Relation) -> int:
        """Adds a row change; its size in bytes (for the memory limit)."""
        run = self.runs.get(relation.relation_id)
        if run is None or run.relation is not relation:
            run = self.runs[relation.relation_id] = _Run(relation)
            self.items.append(run)
        try:
            if type(message) is RawChange:
                if not run.store.add_wire(message.data, message.xid is not None, self.count,
                                          _NONE if subxid is None else subxid):
                    message.message()  # raises the DecodeError that says what is wrong
                    raise DecodeError(f"{message.op} message could not be stored")
                size = len(message.data)
            else:
                assert isinstance(message, Insert | Update | Delete)
                op = "I" if isinstance(message, Insert) else "U" if isinstance(message, Update) else "D"
                run.store.add(op, getattr(message, "new", None), getattr(message, "old", None),
                              getattr(message, "key", None), self.count, _NONE if subxid is None else subxid)
                size = _tuple_size(message)
        except ValueError as exc:  # a row of another width
            raise ProtocolError(f"{exc} (table {relation.qualified_name}): the server sent a row that does not match "
                                "its table's description") from None
        self.count += 1
        return size

    def add_single(self, subxid: int | None, message: AnyMessage, relation: Any) -> None:
        if isinstance(relation, tuple):  # a Truncate: later changes of its tables come after it
            for version in relation:
                self.runs.pop(version.relation_id, None)
        self.items.append((subxid, message, relation, self.count))
        self.count += 1

    def changes(self) -> Iterator[tuple[int, int | None, AnyMessage, Any]]:
        """(ordinal, subxid, message, relation version or truncated relations) of every change, in order, one at a
        time (the runs of different tables interleave)."""
        return heapq.merge(*(self._run_changes(item) if isinstance(item, _Run) else iter([(item[3], *item[:3])])
                             for item in self.items), key=lambda entry: entry[0])

    @staticmethod
    def _run_changes(run: _Run) -> Iterator[tuple[int, int | None, AnyMessage, Any]]:
        store, relation = run.store, run.relation
        relation_id = relation.relation_id
        for index in range(len(store)):
            op, ordinal, subxid, new, old, key = store.change(index)
            message: AnyMessage = (Insert(subxid, relation_id, new) if op == "I" else
                                   Update(subxid, relation_id, key, old, new) if op == "U" else
                                   Delete(subxid, relation_id, key, old))
            yield ordinal, subxid, message, relation


@dataclass
class _Buffer:
    """Changes of one transaction not yet released; spills to disk past the memory limit."""

    xid: int
    start_lsn: Lsn | None = None
    commit_ts: int = 0
    origin: str | None = None
    pieces: _Pieces = field(default_factory=_Pieces)
    size: int = 0
    spill_path: Path | None = None
    spill_file: IO[bytes] | None = None
    aborted_subxids: set[int] = field(default_factory=set)
    relations: dict[int, Relation] = field(default_factory=dict)  # schema versions sent inside a stream
    # id(relation version) -> (its index in the spill file, the version itself, kept alive so ids stay unique)
    spilled_relations: dict[int, tuple[int, Relation]] = field(default_factory=dict)

    @property
    def count(self) -> int:
        return self.pieces.count

    def add_change(self, subxid: int | None, message: RawChange | Insert | Update | Delete, relation: Relation,
                   limit: int, spill_dir: str | None) -> None:
        self.size += self.pieces.add_change(subxid, message, relation) + _CHANGE_OVERHEAD
        if self.size > limit:
            self._spill(spill_dir)

    def add_single(self, subxid: int | None, message: AnyMessage, relation: Any, size: int, limit: int,
                   spill_dir: str | None) -> None:
        self.pieces.add_single(subxid, message, relation)
        self.size += size + _CHANGE_OVERHEAD
        if self.size > limit:
            self._spill(spill_dir)

    def _spill(self, spill_dir: str | None) -> None:
        if self.spill_file is None:
            try:
                handle, name = tempfile.mkstemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-{self.xid}-", dir=spill_dir)
            except OSError as exc:
                raise SpillCorruptError(self._cannot_spill(exc, spill_dir or tempfile.gettempdir())) from None
            self.spill_path = Path(name)
            self.spill_file = os.fdopen(handle, "wb")
            log.info("transaction %d exceeds the memory limit: spilling its changes to %s", self.xid, name)
            self._write(self.spill_file, _SPILL_MAGIC)
        frames = bytearray()
        for written, (_, subxid, message, relation) in enumerate(self.pieces.changes(), start=1):
            frames += self._spill_frames((subxid, message, relation))
            if written % _SPILL_CHUNK == 0:
                self._write(self.spill_file, frames)
                frames.clear()
        self._write(self.spill_file, frames)
        self.pieces = _Pieces(self.pieces.count)
        self.size = 0

    def _write(self, file: IO[bytes], data: bytes | bytearray) -> None:
        try:
            file.write(data)
            file.flush()  # a full disk must fail here, where the message can say what to do
        except OSError as exc:
            raise SpillCorruptError(self._cannot_spill(exc, self.spill_path)) from None

    def _cannot_spill(self, exc: OSError, where: object) -> str:
        return (f"cannot spill transaction {self.xid} to {where}: {exc.strerror or exc}. Free space in the spill "
                "directory (or point --spill-dir elsewhere), or raise --memory-limit; nothing of this transaction "
                "was confirmed, so the server sends it again after a restart")

    def _spill_frames(self, item: tuple[int | None, AnyMessage, Any]) -> bytes:
        subxid, message, relation = item
        relations = relation if isinstance(relation, tuple) else () if relation is None else (relation,)
        head = bytearray()
        refs = []
        for version in relations:
            known = self.spilled_relations.get(id(version))
            if known is None:
                known = self.spilled_relations[id(version)] = (len(self.spilled_relations), version)
                head += _frame(b"R", struct.pack(">I", known[0]) + _encode_any(version))
            refs.append(known[0])
        kind = b"T" if isinstance(relation, tuple) else b"C"
        payload = struct.pack(f">qH{len(refs)}I", -1 if subxid is None else subxid, len(refs), *refs)
        return bytes(head + _frame(kind, payload + _encode_any(message)))

    def chunks(self) -> Iterator[_Pieces]:
        """The changes in order: the spill file's read back a chunk at a time, then those held in memory."""
        if self.spill_file is not None and self.spill_path is not None:
            with open(self.spill_path, "rb") as spilled:
                chunk = _Pieces()
                for subxid, message, relation in _read_spill(spilled, self.spill_path):
                    if isinstance(message, Insert | Update | Delete):
                        chunk.add_change(subxid, message, relation)
                    else:
                        chunk.add_single(subxid, message, relation)
                    if chunk.count % _SPILL_CHUNK == 0:
                        yield chunk
                        chunk = _Pieces(chunk.count)
                if chunk.items:
                    yield chunk
        yield self.pieces

    def close(self) -> None:
        if self.spill_file is not None:
            self.spill_file.close()
            self.spill_file = None
        if self.spill_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.spill_path.unlink()
            self.spill_path = None
        self.pieces = _Pieces()


class Transaction:
    """A committed transaction; iterate its changes once with :meth:`changes`, then :meth:`close`."""

    def __init__(self, buffer: _Buffer, commit_lsn: Lsn, end_lsn: Lsn, commit_ts: int, gid: str | None) -> None:
        self._buffer = buffer
        self.xid = buffer.xid
        self.commit_lsn = commit_lsn
        self.end_lsn = end_lsn
        self.commit_ts = commit_ts
        self.origin = buffer.origin
        self.gid = gid
        self.change_count = buffer.count

    @property
    def spilled(self) -> bool:
        return self._buffer.spill_path is not None

    def changes(self) -> Iterator[Change]:
        """One :class:`Change` per change, in order (:meth:`runs` is the columnar way)."""
        aborted = self._buffer.aborted_subxids
        ordinal = 0
        for chunk in self._buffer.chunks():
            for _, subxid, message, relation in chunk.changes():
                if subxid is not None and subxid in aborted:
                    continue
                if isinstance(message, Insert):
                    yield Change(self.commit_lsn, ordinal, "I", relation, new=message.new)
                elif isinstance(message, Update):
                    yield Change(self.commit_lsn, ordinal, "U", relation, new=message.new, old=message.old,
                                 key=message.key)
                elif isinstance(message, Delete):
                    yield Change(self.commit_lsn, ordinal, "D", relation, old=message.old, key=message.key)
                elif isinstance(message, Truncate):
                    yield Change(self.commit_lsn, ordinal, "T", None, truncate_relations=relation,
                                 truncate_options=message.options)
                elif isinstance(message, Message):
                    yield Change(self.commit_lsn, ordinal, "M", None, message=message)
                ordinal += 1

    def runs(self) -> Iterator[ChangeRun | Change]:
        """The changes as runs of row changes per table (:class:`ChangeRun`) and a :class:`Change` for each other one
        (a Truncate, a transactional Message). The changes of one table come in their order; those of different
        tables may not (their ordinals tell)."""
        aborted = self._buffer.aborted_subxids
        base = 0  # the ordinal of the next change that was not rolled back
        for chunk in self._buffer.chunks():
            if aborted:
                surviving = self._surviving(chunk, aborted, base)
                base += sum(len(item) if isinstance(item, ChangeRun) else 1 for item in surviving)
                yield from surviving
                continue
            for item in chunk.items:
                if isinstance(item, _Run):
                    yield ChangeRun(item.relation, item.store)
                else:
                    yield self._single(item, item[3])

    def _surviving(self, chunk: _Pieces, aborted: set[int], base: int) -> list[ChangeRun | Change]:
        """The runs of a chunk without the changes of rolled-back subtransactions, numbered again from ``base``."""
        rolled_back = np.fromiter(aborted, dtype=np.int64, count=len(aborted))
        kept: list[tuple[_Run | _Single, np.ndarray | None, np.ndarray]] = []
        for item in chunk.items:
            if isinstance(item, _Run):
                keep = ~np.isin(np.frombuffer(item.store.subxids(), dtype=np.int64), rolled_back)
                chosen = np.flatnonzero(keep).astype(np.int64)
                kept.append((item, chosen, np.frombuffer(item.store.ordinals(), dtype=np.int64)[chosen]))
            elif item[0] is None or item[0] not in aborted:
                kept.append((item, None, np.array([item[3]], dtype=np.int64)))
        stored = np.concatenate([ordinals for _, _, ordinals in kept]) if kept else np.empty(0, np.int64)
        renumbered = np.empty(len(stored), dtype=np.int64)
        renumbered[np.argsort(stored, kind="stable")] = np.arange(base, base + len(stored), dtype=np.int64)
        surviving: list[ChangeRun | Change] = []
        at = 0
        for item, selection, ordinals in kept:
            numbers = renumbered[at:at + len(ordinals)]
            at += len(ordinals)
            if isinstance(item, _Run):
                if len(ordinals):
                    surviving.append(ChangeRun(item.relation, item.store, selection, numbers))
            else:
                surviving.append(self._single(item, int(numbers[0])))
        return surviving

    def _single(self, item: _Single, ordinal: int) -> Change:
        _, message, relation, _ = item
        if isinstance(message, Truncate):
            return Change(self.commit_lsn, ordinal, "T", None, truncate_relations=relation,
                          truncate_options=message.options)
        assert isinstance(message, Message)
        return Change(self.commit_lsn, ordinal, "M", None, message=message)

    def close(self) -> None:
        self._buffer.close()

    def __repr__(self) -> str:
        return f"Transaction(xid={self.xid}, commit_lsn={self.commit_lsn}, changes={self.change_count})"


class TransactionAssembler:
    """Feed it every decoded message in stream order; it yields committed :class:`Transaction` objects (in
    commit order), non-transactional logical messages, and Type messages (for the type registry)."""

    def __init__(self, *, memory_limit_bytes: int = 256 << 20, spill_dir: str | os.PathLike[str] | None = None
                 ) -> None:
        self.memory_limit_bytes = memory_limit_bytes
        self.spill_dir = str(spill_dir) if spill_dir is not None else None
        self.relations: dict[int, Relation] = {}
        self._current: _Buffer | None = None  # between Begin/Begin Prepare and Commit/Prepare
        self._streams: dict[int, _Buffer] = {}  # streamed transactions by top-level xid
        self._stream_xid: int | None = None  # the stream block being received
        self._prepared: dict[str, tuple[_Buffer, Lsn]] = {}  # gid -> (changes, prepare LSN)
        sweep_spill_files(self.spill_dir)

    # -- state for the caller ------------------------------------------------------------------
    def relation(self, relation_id: int) -> Relation | None:
        return self.relations.get(relation_id)

    @property
    def in_stream(self) -> bool:
        """True between Stream Start and Stream Stop: decode the next message with ``in_stream=True``."""
        return self._stream_xid is not None

    def oldest_pending_lsn(self) -> Lsn | None:
        """The lowest LSN the slot must not be confirmed past: the prepare LSN of the oldest prepared
        transaction still held (the server resends a prepared transaction only when its PREPARE lies at or
        after the confirmed position). Transactions not yet committed need no hold: the server resends any
        transaction whose commit lies after the confirmed position."""
        held = [lsn for _, lsn in self._prepared.values()]
        return min(held) if held else None

    @property
    def prepared_gids(self) -> list[str]:
        return list(self._prepared)

    def close(self) -> None:
        """Drop everything held (its spill files too); the server resends it after a restart."""
        buffers = [b for b, _ in self._prepared.values()] + list(self._streams.values())
        if self._current is not None:
            buffers.append(self._current)
        for buffer in buffers:
            buffer.close()
        self._prepared.clear()
        self._streams.clear()
        self._current = None

    # -- the stream ------------------------------------------------------------------------------
    def feed(self, message: AnyMessage) -> Iterator[Transaction | Message | Type]:
        """Take one message; yield what it completes."""
        match message:
            case RawChange() | Insert() | Update() | Delete():
                self.add_change(message)
            case Begin():
                self._begin(_Buffer(message.xid, start_lsn=message.final_lsn, commit_ts=message.commit_ts))
            case Commit():
                buffer = self._end_current("Commit")
                yield Transaction(buffer, message.commit_lsn, message.end_lsn, message.commit_ts, None)
            case Relation():
                self._relation(message)
            case Type():
                yield message
            case Truncate():
                self._add_single(message, tuple(self._relation_for(oid) for oid in message.relation_ids), 16)
            case Message(transactional=True):
                self._add_single(message, None, len(message.content))
            case Message():
                yield message
            case Origin():
                target = self._stream_buffer() if self._stream_xid is not None else self._current
                if target is None:
                    raise ProtocolError("Origin outside a transaction")
                target.origin = message.name
            case StreamStart():
                self._stream_start(message)
            case StreamStop():
                if self._stream_xid is None:
                    raise ProtocolError("Stream Stop without Stream Start")
                self._stream_xid = None
            case StreamCommit():
                buffer = self._take_stream(message.xid)
                self.relations.update(buffer.relations)
                yield Transaction(buffer, message.commit_lsn, message.end_lsn, message.commit_ts, None)
            case StreamAbort():
                self._stream_abort(message)
            case BeginPrepare():
                self._begin(_Buffer(message.xid, start_lsn=message.prepare_lsn, commit_ts=message.prepare_ts))
            case Prepare():
                self._prepared[message.gid] = (self._end_current("Prepare"), message.prepare_lsn)
                injection_point("assembler.prepared")
            case StreamPrepare():
                buffer = self._take_stream(message.xid)
                self.relations.update(buffer.relations)
                self._prepared[message.gid] = (buffer, message.prepare_lsn)
                injection_point("assembler.prepared")
            case CommitPrepared():
                held = self._prepared.pop(message.gid, None)
                if held is None:
                    # Its PREPARE lies before where this stream started, so the server sends the commit alone.
                    # pgcdc confirms past a PREPARE only once the transaction's commit is in every mirror (a
                    # transaction prepared after another one that is still held commits first, then the slot
                    # waits at the older one's PREPARE): it was applied before this start.
                    log.info("Commit Prepared for %r at %s: applied before this start (its PREPARE lies before the "
                             "slot's confirmed position)", message.gid, message.commit_lsn)
                    held = (_Buffer(message.xid), message.commit_lsn)
                yield Transaction(held[0], message.commit_lsn, message.end_lsn, message.commit_ts, message.gid)
            case RollbackPrepared():
                held = self._prepared.pop(message.gid, None)
                if held is not None:
                    held[0].close()
            case _:
                raise ProtocolError(f"unexpected message {message!r}")

    # -- internals -------------------------------------------------------------------------------
    def _begin(self, buffer: _Buffer) -> None:
        if self._current is not None:
            raise ProtocolError(f"transaction {buffer.xid} began inside transaction {self._current.xid}")
        self._current = buffer

    def _end_current(self, what: str) -> _Buffer:
        if self._current is None:
            raise ProtocolError(f"{what} without a transaction in progress")
        buffer, self._current = self._current, None
        return buffer

    def _stream_buffer(self) -> _Buffer:
        assert self._stream_xid is not None
        return self._streams[self._stream_xid]

    def _stream_start(self, message: StreamStart) -> None:
        if self._stream_xid is not None:
            raise ProtocolError(f"Stream Start for {message.xid} inside the stream of {self._stream_xid}")
        if message.xid not in self._streams:
            self._streams[message.xid] = _Buffer(message.xid)
        self._stream_xid = message.xid

    def _take_stream(self, xid: int) -> _Buffer:
        buffer = self._streams.pop(xid, None)
        if buffer is None:
            # a transaction can be streamed with no change pgcdc was sent (all filtered): nothing to release
            return _Buffer(xid)
        return buffer

    def _stream_abort(self, message: StreamAbort) -> None:
        buffer = self._streams.get(message.xid)
        if buffer is None:
            return
        if message.subxid == message.xid:
            self._streams.pop(message.xid).close()
        else:
            buffer.aborted_subxids.add(message.subxid)

    def _relation(self, message: Relation) -> None:
        if self._stream_xid is not None:
            self._stream_buffer().relations[message.relation_id] = message
        else:
            self.relations[message.relation_id] = message

    def _relation_for(self, relation_id: int) -> Relation:
        if self._stream_xid is not None:
            relation = self._stream_buffer().relations.get(relation_id)
            if relation is not None:
                return relation
        relation = self.relations.get(relation_id)
        if relation is None:
            raise ProtocolError(f"a change for relation {relation_id} arrived before its Relation message")
        return relation

    def _target(self, message: AnyMessage) -> _Buffer:
        if self._stream_xid is not None:
            return self._streams[self._stream_xid]
        if self._current is not None:
            return self._current
        raise ProtocolError(f"{type(message).__name__} outside a transaction")

    def add_change(self, message: RawChange | Insert | Update | Delete) -> None:
        """:meth:`feed` for a row change, which completes nothing (no generator for the most common message)."""
        # inside a stream, data messages carry the subtransaction's xid (for Stream Abort of a savepoint)
        buffer = self._target(message)
        buffer.add_change(message.xid if self._stream_xid is not None else None, message,
                          self._relation_for(message.relation_id), self.memory_limit_bytes, self.spill_dir)

    def _add_single(self, message: Truncate | Message, relation: Any, size: int) -> None:
        buffer = self._target(message)
        buffer.add_single(message.xid if self._stream_xid is not None else None, message, relation, size,
                          self.memory_limit_bytes, self.spill_dir)


_SPILL_MAGIC = b"PGCDC-SPILL-1\n"
_FRAME = struct.Struct(">cII")  # kind, payload length, CRC-32 of the payload
_MAX_FRAME = 1 << 30  # pgoutput messages are smaller than PostgreSQL's 1 GB field limit


def _frame(kind: bytes, payload: bytes) -> bytes:
    return _FRAME.pack(kind, len(payload), zlib.crc32(payload)) + payload


def _encode_any(message: AnyMessage) -> bytes:
    # a flag byte records whether the message came inside a streamed block (its xid is then on the wire)
    in_stream = getattr(message, "xid", None) is not None
    return (b"\1" if in_stream else b"\0") + encode(message, proto_version=4, in_stream=in_stream)


def _decode_any(data: bytes) -> AnyMessage:
    return decode(data[1:], proto_version=4, in_stream=data[:1] == b"\1")


def _read_spill(file: IO[bytes], path: Path) -> Iterator[tuple[int | None, AnyMessage, Any]]:
    """The items of a spill file, each frame's checksum and bytes verified before use."""
    def corrupt(offset: int, problem: str) -> SpillCorruptError:
        return SpillCorruptError(
            f"spill file {path} is corrupt at byte {offset} ({problem}); it is not trusted. Stop pgcdc and "
            "start it again: nothing of this transaction was confirmed, so the server sends it again")

    if file.read(len(_SPILL_MAGIC)) != _SPILL_MAGIC:
        raise corrupt(0, "not a pgcdc spill file")
    relations: dict[int, Relation] = {}
    offset = len(_SPILL_MAGIC)
    while True:
        head = file.read(_FRAME.size)
        if not head:
            return
        if len(head) < _FRAME.size:
            raise corrupt(offset, "truncated frame header")
        kind, length, checksum = _FRAME.unpack(head)
        if kind not in (b"R", b"C", b"T") or length > _MAX_FRAME:
            raise corrupt(offset, f"bad frame header {head.hex()}")
        payload = file.read(length)
        if len(payload) < length:
            raise corrupt(offset, f"truncated frame: {len(payload)} of {length} bytes")
        if zlib.crc32(payload) != checksum:
            raise corrupt(offset, "checksum mismatch")
        try:
            if kind == b"R":
                (index,) = struct.unpack_from(">I", payload)
                relation = _decode_any(payload[4:])
                if not isinstance(relation, Relation):
                    raise corrupt(offset, f"expected a Relation, found {type(relation).__name__}")
                relations[index] = relation
            else:
                subxid, count = struct.unpack_from(">qH", payload)
                refs = struct.unpack_from(f">{count}I", payload, 10)
                message = _decode_any(payload[10 + 4 * count:])
                versions = tuple(relations[ref] for ref in refs)
                target: Any = versions if kind == b"T" else versions[0] if versions else None
                yield (None if subxid < 0 else subxid, message, target)
        except (DecodeError, struct.error, KeyError, IndexError) as exc:
            raise corrupt(offset, f"undecodable frame: {exc}") from None
        offset += _FRAME.size + length


def _tuple_size(message: Insert | Update | Delete) -> int:
    size = 0
    for tuple_data in (getattr(message, "new", None), getattr(message, "old", None), getattr(message, "key", None)):
        if tuple_data is not None:
            size += sum(len(v) for v in tuple_data.values if v is not None) + 8 * len(tuple_data.values)
    return size


def sweep_spill_files(spill_dir: str | None) -> None:
    """Remove spill files of processes that no longer exist (a crash cannot leave disk behind for long)."""
    directory = Path(spill_dir or tempfile.gettempdir())
    for path in directory.glob(f"{SPILL_PREFIX}*"):
        try:
            pid = int(path.name[len(SPILL_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        except PermissionError:
            pass
