"""Batching: whole transactions collected per source table and turned into Arrow change tables.

A batch holds, per table, runs of changes under one schema version (segments). A segment is converted
to Arrow chunk by chunk while the batch fills, so a batch holding a million-row transaction costs its
Arrow size, not a million Python objects. A transaction's changes to a table come as runs
(:class:`~pgcdc.transactions.ChangeRun`): a segment takes a run whole, and its conversion gathers the runs'
values column by column from the bytes the server sent.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa

from pgcdc.change_table import (
    Pending,
    build_change_table,
    build_change_table_setting_aside,
    describe_row,
    first_unconvertible,
)
from pgcdc.checkpoint import Span, held_whole
from pgcdc.errors import ConversionError, TextValuesRequired
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Relation
from pgcdc.pipeline.tables import SourceTables, schema_signature
from pgcdc.transactions import Change, ChangeRun, Transaction
from pgcdc.types import TableConverter

log = logging.getLogger("pgcdc.pipeline")

_CHUNK_ROWS = 20_000


@dataclass
class Segment:
    """A run of one table's changes under one schema version: changes waiting for conversion, and chunks."""

    relation: Relation
    pending: list[Pending] = field(default_factory=list)
    pending_rows: int = 0
    chunks: list[pa.Table] = field(default_factory=list)
    span: Span = field(default_factory=Span)
    rejects: list[pa.Table] = field(default_factory=list)  # changes set aside (REJECTS_SCHEMA)


@dataclass
class Batch:
    """Whole transactions waiting to be applied, per source table (relation id)."""

    tables: dict[int, list[Segment]] = field(default_factory=dict)
    rows: int = 0
    bytes: int = 0  # of the changes converted so far (Arrow), set aside ones included
    transactions: int = 0
    last_commit_lsn: Lsn | None = None
    last_end_lsn: Lsn | None = None
    started: float = field(default_factory=time.monotonic)
    # tables sent an inserted row with a value left out as unchanged TOAST: an UPDATE that moved a row into a
    # publication's row filter comes as an INSERT that only the source itself can complete
    incomplete_inserts: set[tuple[str, str]] = field(default_factory=set)

    def __bool__(self) -> bool:
        return self.transactions > 0

    def full(self, max_rows: int, max_bytes: int) -> bool:
        """Whether the batch holds ``max_rows`` changes, or its converted changes take ``max_bytes``."""
        return self.rows >= max_rows or self.bytes >= max_bytes

    def relations(self) -> list[Relation]:
        """The first schema version of each table the batch touches."""
        return [segments[0].relation for segments in self.tables.values()]

    def versions(self, held: Callable[[Relation], Lsn | None]) -> list[Relation]:
        """Every schema version of every table the batch touches, in order, but those whose every change the
        mirror already holds (``held``: its position; a replay after a crash, passed over by the apply too)."""
        return [segment.relation for segments in self.tables.values() for segment in segments
                if not held_whole(segment.span, held(segment.relation))]


class Batcher:
    """Adds transactions to batches and converts their changes to change tables."""

    def __init__(self, tables: SourceTables) -> None:
        self.tables = tables
        self._without_columns: set[int] = set()

    def add(self, batch: Batch, txn: Transaction) -> None:
        for item in txn.runs():
            if isinstance(item, ChangeRun):
                relation = item.relation
                if relation.columns or not self._warn_without_columns(relation):
                    if item.store.unchanged_insert:
                        batch.incomplete_inserts.add((relation.namespace, relation.name))
                    self._pend(batch, txn, relation, item)
                batch.rows += len(item)
            elif item.op == "T":
                for relation in item.truncate_relations:
                    if relation.columns or not self._warn_without_columns(relation):
                        self._pend(batch, txn, relation, item)
                batch.rows += 1
            # transactional logical messages are not table data
        batch.transactions += 1
        batch.last_commit_lsn = txn.commit_lsn
        batch.last_end_lsn = txn.end_lsn

    def _pend(self, batch: Batch, txn: Transaction, relation: Relation, item: ChangeRun | Change) -> None:
        """A run (or a Truncate) into the table's segment of its schema version, converted every _CHUNK_ROWS."""
        segments = batch.tables.setdefault(relation.relation_id, [])
        if not segments or (segments[-1].relation is not relation
                            and schema_signature(segments[-1].relation) != schema_signature(relation)):
            if segments:
                self._convert_pending(batch, segments[-1])
            segments.append(Segment(relation))
        segment = segments[-1]
        segment.span.note(txn.commit_lsn)
        for part in _parts(item, _CHUNK_ROWS - segment.pending_rows):
            segment.pending.append((txn, part))
            segment.pending_rows += len(part) if isinstance(part, ChangeRun) else 1
            if segment.pending_rows >= _CHUNK_ROWS:
                self._convert_pending(batch, segment)

    def finish(self, batch: Batch) -> None:
        """Convert what is left, before the batch is applied."""
        for segments in batch.tables.values():
            for segment in segments:
                self._convert_pending(batch, segment)

    def _warn_without_columns(self, relation: Relation) -> bool:
        """A table without columns (``CREATE TABLE z ()``) has nothing a mirror could hold: its changes are
        passed over, with one warning per table."""
        if relation.relation_id not in self._without_columns:
            self._without_columns.add(relation.relation_id)
            log.warning("%s has no published columns: its changes are not mirrored until it has one",
                        relation.qualified_name)
        return True

    def _convert_pending(self, batch: Batch, segment: Segment) -> None:
        if not segment.pending:
            return
        converted, set_aside = len(segment.chunks), len(segment.rejects)  # before this conversion
        relation = segment.relation
        converter, key = self.tables.converter_for(relation), self.tables.key_for(relation)
        try:
            segment.chunks.append(build_change_table(segment.pending, converter, key))
        except TextValuesRequired:  # no value is wrong: the stream must carry text (the pipeline restarts it)
            raise
        except ConversionError as exc:
            if self.tables.config.on_conversion_error != "quarantine":
                raise _stop_error(exc, segment.pending, converter, key) from None
            chunks, rejected = build_change_table_setting_aside(segment.pending, converter, key)
            segment.chunks.extend(chunks)
            if rejected is not None:
                segment.rejects.append(rejected)
                log.warning("%s: %d changes set aside in its __rejects table (first: %s at commit LSN %s)",
                            relation.qualified_name, rejected.num_rows, rejected.column("error")[0].as_py(),
                            rejected.column("commit_lsn")[0].as_py())
        segment.pending = []
        segment.pending_rows = 0
        batch.bytes += sum(chunk.nbytes for chunk in segment.chunks[converted:])
        batch.bytes += sum(table.nbytes for table in segment.rejects[set_aside:])


def _parts(item: ChangeRun | Change, room: int) -> list[ChangeRun | Change]:
    """A run cut so that the first part fills the ``room`` left in a chunk and the others a chunk each."""
    if not isinstance(item, ChangeRun) or len(item) <= max(room, 1):
        return [item]
    bounds = [0, *range(max(room, 1), len(item), _CHUNK_ROWS), len(item)]
    return [item.part(start, stop) for start, stop in itertools.pairwise(bounds)]


def _stop_error(error: ConversionError, changes: list[Pending], converter: TableConverter,
                key: tuple[str, ...]) -> ConversionError:
    """The error that stops pgcdc at a value it cannot mirror: which row, which change, and the way past."""
    found = first_unconvertible(changes, converter, key)
    where = ""
    if found is not None:
        txn, change, error = found
        action = {"I": "insert", "U": "update", "D": "delete"}.get(change.op, change.op)
        where = (f" in the {action} of the row {describe_row(change, converter, key)} committed at LSN "
                 f"{txn.commit_lsn} (xid {txn.xid})")
    return ConversionError(
        f"{error}{where}. pgcdc stops rather than write a wrong value, and stops here again at every start (the "
        "change is in the slot): run with --on-conversion-error quarantine to set such changes aside, whole and "
        f"raw, in {converter.relation.name}__rejects beside the mirror while everything else goes on (docs/types.md "
        "says what each type can hold)")
