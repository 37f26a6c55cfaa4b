"""Committed transactions collected into batches of change tables (pgcdc.pipeline.batcher), fed by the real
assembler from pgoutput messages: no server, no Spark."""

from __future__ import annotations

import pytest
from batches import FAR, ITEMS, OTHER, WIDER, batcher, collected, row, transactions

from pgcdc.errors import ConversionError
from pgcdc.lsn import Lsn
from pgcdc.pgoutput.messages import Delete, Insert, Update

pytestmark = pytest.mark.usefixtures("accelerators")  # with the C modules and without


def test_changes_are_collected_per_table_and_schema_version():
    txns = transactions(
        [ITEMS, Insert(None, 1, row(b"1", b"2024-01-01 00:00:00", b"a")), OTHER, Insert(None, 2, row(b"9"))],
        [Update(None, 1, None, None, row(b"1", b"2024-01-02 00:00:00", b"b", unchanged=2))],
        [WIDER, Insert(None, 1, row(b"2", None, b"c", b"x")), Delete(None, 1, row(b"1", None, None, None), None)],
    )
    batch = collected(batcher(), txns)
    assert batch.rows == 5 and batch.transactions == 3
    assert batch.last_commit_lsn == Lsn(3000) and batch.last_end_lsn == Lsn(3008)
    items = batch.tables[1]
    assert [len(s.relation.columns) for s in items] == [3, 4]  # a new schema version starts a new run
    assert items[0].span.first == Lsn(1000) and items[0].span.last == Lsn(2000)
    first = items[0].chunks[0]
    assert first.column("_pgcdc_op").to_pylist() == ["I", "U"]
    assert first.column("_pgcdc_unchanged").to_pylist() == [[], ["note"]]
    assert items[1].chunks[0].column("_pgcdc_op").to_pylist() == ["I", "D"]
    assert [r.name for r in batch.relations()] == ["items", "other"]
    assert [len(r.columns) for r in batch.versions(lambda relation: None)] == [3, 4, 1]
    # a run the mirror holds whole is not a version to evolve it to (rule 2)
    assert [len(r.columns) for r in batch.versions(lambda relation: Lsn(2000))] == [4]


def test_an_insert_that_left_out_unchanged_toast_values_is_noted():
    txns = transactions([ITEMS, Insert(None, 1, row(b"1", None, b"x", unchanged=2))])
    assert collected(batcher(), txns).incomplete_inserts == {("public", "items")}


def test_a_value_the_mirror_cannot_hold_stops_naming_the_row_or_is_set_aside():
    txns = transactions([ITEMS, Insert(None, 1, row(b"1", b"2024-01-01 00:00:00", b"a")),
                         Insert(None, 1, row(b"2", FAR, b"far"))],
                        [Update(None, 1, None, None, row(b"2", FAR, b"still"))])
    with pytest.raises(ConversionError, match=r"in the insert of the row \(id=2\).*--on-conversion-error quarantine"):
        collected(batcher(), txns)
    batch = collected(batcher(on_conversion_error="quarantine"), txns)
    segment = batch.tables[1][0]
    assert [t.column("_pgcdc_op").to_pylist() for t in segment.chunks] == [["I"], ["D"]]  # the update's row goes
    rejects = segment.rejects[0]
    assert rejects.column("op").to_pylist() == ["I", "U"]
    assert dict(rejects.column("new_values")[0].as_py())["at"] == FAR.decode()
