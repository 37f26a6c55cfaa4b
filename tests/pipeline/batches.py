"""Batches made from pgoutput messages through the real assembler and batcher, for the pipeline's unit tests."""

from __future__ import annotations

from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Begin, Column, Commit, Relation, TupleData
from pgcdc.pipeline.batcher import Batch, Batcher
from pgcdc.pipeline.config import PipelineConfig
from pgcdc.pipeline.tables import SourceTables
from pgcdc.transactions import Transaction, TransactionAssembler

INT4, TEXT, TIMESTAMP = 23, 25, 1114
ITEMS = Relation(None, 1, "public", "items", "d",
                 (Column(1, "id", INT4, -1), Column(0, "at", TIMESTAMP, -1), Column(0, "note", TEXT, -1)))
WIDER = Relation(None, 1, "public", "items", "d", (*ITEMS.columns, Column(0, "extra", TEXT, -1)))
OTHER = Relation(None, 2, "public", "other", "d", (Column(1, "id", INT4, -1),))
FAR = b"294276-12-31 23:59:59"


def row(*values: bytes | None, unchanged: int | None = None) -> TupleData:
    return TupleData("".join("u" if i == unchanged else "n" if v is None else "t" for i, v in enumerate(values)),
                     tuple(None if i == unchanged else v for i, v in enumerate(values)))


def transactions(*bodies: list) -> list[Transaction]:
    """Each body a list of messages of one transaction, committed in order, read through the assembler."""
    assembler = TransactionAssembler()
    found: list[Transaction] = []
    for number, body in enumerate(bodies, start=1):
        lsn = Lsn(1000 * number)
        for message in [Begin(lsn, 0, 700 + number), *body, Commit(0, lsn, Lsn(int(lsn) + 8), 0)]:
            found += [item for item in assembler.feed(message) if isinstance(item, Transaction)]
    return found


def batcher(**config) -> Batcher:
    return Batcher(SourceTables(PipelineConfig(dsn="dbname=x", publication="p", **config), lambda: None))


def collected(batcher: Batcher, txns: list[Transaction]) -> Batch:
    batch = Batch()
    for txn in txns:
        batcher.add(batch, txn)
    batcher.finish(batch)
    return batch
