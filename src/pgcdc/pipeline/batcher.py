"""Batching: whole transactions collected per source table and turned into Arrow change tables.

A batch holds, per table, runs of changes under one schema version (segments). A segment is converted
to Arrow chunk by chunk while the batch fills, so a batch holding a million-row transaction costs its
Arrow size, not a million Python objects.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pyarrow as pa

from pgcdc.change_table import build_change_table
from pgcdc.checkpoint import Span
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Relation
from pgcdc.pipeline.tables import SourceTables, schema_signature
from pgcdc.transactions import Change, Transaction

_CHUNK_ROWS = 20_000


@dataclass
class Segment:
    """A run of one table's changes under one schema version: changes waiting for conversion, and chunks."""

    relation: Relation
    pending: list[tuple[Transaction, Change]] = field(default_factory=list)
    chunks: list[pa.Table] = field(default_factory=list)
    span: Span = field(default_factory=Span)


@dataclass
class Batch:
    """Whole transactions waiting to be applied, per source table (relation id)."""

    tables: dict[int, list[Segment]] = field(default_factory=dict)
    rows: int = 0
    transactions: int = 0
    last_commit_lsn: Lsn | None = None
    last_end_lsn: Lsn | None = None
    started: float = field(default_factory=time.monotonic)

    def __bool__(self) -> bool:
        return self.transactions > 0

    def relations(self) -> list[Relation]:
        """The first schema version of each table the batch touches."""
        return [segments[0].relation for segments in self.tables.values()]

    def versions(self) -> list[Relation]:
        """Every schema version of every table the batch touches, in order."""
        return [segment.relation for segments in self.tables.values() for segment in segments]


class Batcher:
    """Adds transactions to batches and converts their changes to change tables."""

    def __init__(self, tables: SourceTables) -> None:
        self.tables = tables

    def add(self, batch: Batch, txn: Transaction) -> None:
        for change in txn.changes():
            targets: tuple[Relation, ...]
            if change.op == "T":
                targets = change.truncate_relations
            elif change.op in ("I", "U", "D") and change.relation is not None:
                targets = (change.relation,)
            else:  # transactional logical messages are not table data
                continue
            for relation in targets:
                segments = batch.tables.setdefault(relation.relation_id, [])
                if not segments or schema_signature(segments[-1].relation) != schema_signature(relation):
                    if segments:
                        self._convert_pending(segments[-1])
                    segments.append(Segment(relation))
                segment = segments[-1]
                segment.pending.append((txn, change))
                segment.span.note(txn.commit_lsn)
                if len(segment.pending) >= _CHUNK_ROWS:
                    self._convert_pending(segment)
            batch.rows += 1
        batch.transactions += 1
        batch.last_commit_lsn = txn.commit_lsn
        batch.last_end_lsn = txn.end_lsn

    def finish(self, batch: Batch) -> None:
        """Convert what is left, before the batch is applied."""
        for segments in batch.tables.values():
            for segment in segments:
                self._convert_pending(segment)

    def _convert_pending(self, segment: Segment) -> None:
        if segment.pending:
            relation = segment.relation
            segment.chunks.append(build_change_table(segment.pending, self.tables.converter_for(relation),
                                                     self.tables.key_for(relation)))
            segment.pending = []
