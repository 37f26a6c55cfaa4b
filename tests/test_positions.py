"""How a mirror's position is read back and recorded (pgcdc.positions), rule by rule, without Spark."""

from __future__ import annotations

import logging

import pytest

from pgcdc.errors import PositionCorruptError
from pgcdc.lsn import Lsn
from pgcdc.positions import (
    LSN_SUMMARY,
    ORDINAL_SUMMARY,
    RECORD_PROPERTY,
    PositionRecord,
    PositionRecording,
    carried_summary,
    commit_properties,
    mirror_position,
    record_to_write,
    rejects_position,
)

A, B, C = Lsn.parse("0/10"), Lsn.parse("0/20"), Lsn.parse("0/30")


@pytest.mark.parametrize(("lineage", "record", "keyed", "expected"), [
    ([], None, True, None),  # a mirror that holds nothing
    (["0/10"], None, True, A),  # the newest data commit carries it
    (["0/20", "0/30", "0/10"], None, False, C),  # the highest, not the newest: a maintain beside the stream
    (["0/20"], PositionRecord(A).encode(), False, B),  # the lineage wins over the property
    ([], PositionRecord(B).encode(), False, B),  # every snapshot carrying it expired: the property tells
    ([], PositionRecord(A, pending=B).encode(), True, A),  # keyed: a lower bound, replayed as upserts
])
def test_where_a_mirror_stands(lineage, record, keyed, expected):
    assert mirror_position("m", lineage, record, keyed=keyed) == expected


def test_a_keyed_mirror_resumes_from_the_lower_bound_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="pgcdc.positions"):
        mirror_position("m", [], PositionRecord(A, pending=B).encode(), keyed=True)
    assert "expired while a commit was in flight" in caplog.text


@pytest.mark.parametrize(("lineage", "record", "keyed", "refused"), [
    (["not an lsn"], None, True, "which is not an LSN"),
    ([], "{nonsense", True, "not a position record"),
    ([], '{"lsn": "0/10", "pending": "0/zz"}', True, "not a position record"),
    # keyless: replaying from the lower bound could double rows, skipping could lose them: never guessed
    ([], PositionRecord(A, pending=B).encode(), False, "Copy it again"),
])
def test_what_cannot_be_trusted_is_refused_with_the_way_out(lineage, record, keyed, refused):
    with pytest.raises(PositionCorruptError, match=refused) as raised:
        mirror_position("pgcdc.mirror.public.t", lineage, record, keyed=keyed)
    assert "pgcdc.mirror.public.t" in str(raised.value)


def test_position_records_round_trip_and_say_what_they_hold():
    for record in (PositionRecord(A), PositionRecord(A, pending=B)):
        assert PositionRecord.parse(record.encode()) == record
    assert PositionRecord(A).settled_behind(B) and not PositionRecord(B).settled_behind(A)
    assert not PositionRecord(A, pending=B).settled_behind(C)  # a commit in flight is not settled
    for value in ("", "[]", '{"pending": "0/10"}', "null"):
        with pytest.raises(ValueError):
            PositionRecord.parse(value)


def test_what_is_written_over_a_record():
    assert record_to_write(None, A) == PositionRecord(A).encode()
    assert record_to_write(PositionRecord(A).encode(), A) is None  # says so already
    assert record_to_write(PositionRecord(A).encode(), B) == PositionRecord(B).encode()
    assert record_to_write(None, A, pending=B) == PositionRecord(A, pending=B).encode()
    # a maintenance beside the stream only brings a settled record forward
    assert record_to_write(PositionRecord(A).encode(), B, advance_only=True) == PositionRecord(B).encode()
    assert record_to_write(PositionRecord(C).encode(), B, advance_only=True) is None
    assert record_to_write(PositionRecord(A, pending=C).encode(), B, advance_only=True) is None
    assert record_to_write("{nonsense", B, advance_only=True) is None


def test_what_commits_carry():
    assert carried_summary(None) == {}
    assert carried_summary(A) == {LSN_SUMMARY: "0/10"}
    assert carried_summary(A, 7) == {LSN_SUMMARY: "0/10", ORDINAL_SUMMARY: "7"}
    summary, properties = commit_properties(B)
    assert summary == {LSN_SUMMARY: "0/20"} and PositionRecord.parse(properties[RECORD_PROPERTY]) == PositionRecord(B)


def test_a_rejects_table_stands_at_its_last_change():
    assert rejects_position("r", [], None) is None
    assert rejects_position("r", [("0/10", "3"), ("0/20", "1"), ("0/20", "0")], None) == (int(B), 1)
    assert rejects_position("r", [], ("0/10", 4)) == (int(A), 4)  # the snapshots expired: its newest row tells
    with pytest.raises(PositionCorruptError, match="not a position"):
        rejects_position("r", [("x", "1")], None)


class _Store:
    """A table's ``pgcdc.position`` property kept in memory, written by the same rule the Spark store follows."""

    def __init__(self) -> None:
        self.value: str | None = None
        self.writes: list[str] = []

    def exists(self, identifier: str) -> bool:
        return True

    def record(self, identifier: str, position: Lsn | None, *, pending: Lsn | None = None,
               advance_only: bool = False) -> None:
        value = None if position is None else record_to_write(self.value, position, pending=pending,
                                                               advance_only=advance_only)
        if value is not None:
            self.value = value
            self.writes.append(value)


def test_a_keyless_commit_is_marked_pending_before_and_settled_after():
    store = _Store()
    store.record("t", A)
    with PositionRecording(store, "t", before=A, upto=B, held=lambda: B, whole=True):
        assert PositionRecord.parse(store.writes[-1]) == PositionRecord(A, pending=B)
    assert PositionRecord.parse(store.writes[-1]) == PositionRecord(B)

    # a crash between the commit and the record leaves the mark: the next read knows it for what it is
    crashed = _Store()
    with pytest.raises(RuntimeError), PositionRecording(crashed, "t", before=A, upto=B, held=lambda: B,
                                                       whole=True):
        raise RuntimeError("killed after the commit")
    assert PositionRecord.parse(crashed.writes[-1]).pending == B


def test_a_keyed_commit_or_one_that_records_itself_writes_no_mark():
    keyed = _Store()
    with PositionRecording(keyed, "t", before=A, upto=B, held=lambda: B, whole=False):
        assert keyed.writes == []
    assert [PositionRecord.parse(w) for w in keyed.writes] == [PositionRecord(B)]
    deferred = _Store()
    with PositionRecording(deferred, "t", before=A, upto=B, held=lambda: B, whole=True, deferred=True):
        pass  # the row-delta writer set the property in its own commit: no mark was asked for
    assert [PositionRecord.parse(w) for w in deferred.writes] == [PositionRecord(B)]
