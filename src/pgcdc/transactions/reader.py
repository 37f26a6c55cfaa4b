"""Committed transactions from a slot's events: the one loop from a replication stream to transactions.

The events come from :meth:`pgcdc.replication.LogicalReplicationStream.events` (or anything shaped like
them): a decoded message, an idle tick, or a reconnection. After a reconnection the server sends again
everything after the confirmed position, so what the assembler held (open, streamed and prepared
transactions, their spill files) is dropped and assembly starts afresh. Type messages go to a callback
(the type registry), non-transactional logical messages to another.

>>> reader = TransactionReader(stream.events())                           # doctest: +SKIP
>>> for txn in reader.transactions():                                     # doctest: +SKIP
...     apply(txn); stream.confirm(txn.end_lsn)
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Protocol, cast

from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import AnyMessage, Message, RawChange, Type
from pgcdc.transactions.assembler import Transaction, TransactionAssembler


class SlotEvent(Protocol):
    @property
    def message(self) -> AnyMessage | None: ...

    @property
    def reconnected(self) -> bool: ...


class Tick(enum.Enum):
    """What an event that completed no transaction was, for a loop that acts on every event."""

    RECEIVED = "received"  # a message, assembled
    IDLE = "idle"  # no message for the stream's idle timeout
    RECONNECTED = "reconnected"  # the connection was re-established: what was not confirmed comes again


class TransactionReader:
    """Iterate for every committed transaction (in commit order) and a :class:`Tick` after each event.

    A transaction is closed (its spill file removed) when the iteration moves past it: read its changes
    before asking for the next item. ``reconnections`` counts the connections re-established.
    """

    def __init__(self, events: Iterable[SlotEvent], *, memory_limit_bytes: int = 256 << 20,
                 spill_dir: str | os.PathLike[str] | None = None, on_type: Callable[[Type], None] | None = None,
                 on_message: Callable[[Message], None] | None = None) -> None:
        self._events = events
        self._memory_limit_bytes = memory_limit_bytes
        self._spill_dir = spill_dir
        self._on_type = on_type
        self._on_message = on_message
        self.assembler = self._new_assembler()
        self.reconnections = 0

    def oldest_pending_lsn(self) -> Lsn | None:
        """See :meth:`TransactionAssembler.oldest_pending_lsn`: the position the slot must not pass."""
        return self.assembler.oldest_pending_lsn()

    def __iter__(self) -> Generator[Transaction | Tick, None, None]:
        return self._items(ticks=True)

    def transactions(self) -> Iterator[Transaction]:
        """Only the committed transactions (no ticks: the fastest way through a slot)."""
        return cast(Iterator[Transaction], self._items(ticks=False))

    def _items(self, *, ticks: bool) -> Generator[Transaction | Tick, None, None]:
        try:
            for event in self._events:
                if event.reconnected:
                    self.reconnections += 1
                    self.assembler.close()
                    self.assembler = self._new_assembler()
                    if ticks:
                        yield Tick.RECONNECTED
                    continue
                message = event.message
                if type(message) is RawChange:  # most messages: a row change, which completes nothing
                    self.assembler.add_change(message)
                    if ticks:
                        yield Tick.RECEIVED
                    continue
                if message is None:
                    if ticks:
                        yield Tick.IDLE
                    continue
                for item in self.assembler.feed(message):
                    if isinstance(item, Transaction):
                        try:
                            yield item
                        finally:
                            item.close()
                    elif isinstance(item, Type):
                        if self._on_type is not None:
                            self._on_type(item)
                    elif self._on_message is not None:
                        self._on_message(item)
                if ticks:
                    yield Tick.RECEIVED
        finally:
            self.assembler.close()

    def _new_assembler(self) -> TransactionAssembler:
        return TransactionAssembler(memory_limit_bytes=self._memory_limit_bytes, spill_dir=self._spill_dir)
