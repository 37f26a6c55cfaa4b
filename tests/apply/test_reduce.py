"""A batch reduced to what its mirror must become (pgcdc.apply.reduce): pure Arrow, no Spark. The writers that
make the reduction durable, and what they leave in real mirrors, are tested in test_apply.py."""

from __future__ import annotations

import pyarrow as pa

from change_tables import ARROW, changes
from pgcdc.apply.reduce import APPEND_ONLY, COPIES_GONE, KEYED, KEYLESS, ordered, reduce_changes
from pgcdc.change_table import ChangeColumns as C
from pgcdc.lsn import Lsn

NAMES = list(ARROW.names)


def rows(table: pa.Table) -> list[dict]:
    return table.select([n for n in NAMES if n in table.column_names]).to_pylist()


def keyed(batch: pa.Table, position: Lsn | None = None):
    return reduce_changes(ordered(batch), NAMES, ("id",), append_only=False, position=position)


def test_the_last_change_per_key_wins_and_a_key_change_removes_the_old_key():
    reduction = keyed(changes(
        ("I", 10, 0, {"id": 1, "name": "one"}),
        ("U", 10, 1, {"id": 1, "name": "uno"}),
        ("I", 11, 0, {"id": 2, "name": "two"}),
        ("U", 12, 0, {"id": 20, "name": "two"}, {"old_key": {"id": 2}}),  # the key changed
        ("I", 12, 1, {"id": 3, "name": "three"}),
        ("D", 13, 0, {"id": 3}),
    ))
    assert reduction is not None and reduction.kind == KEYED and not reduction.truncated
    assert reduction.changes == 6 and reduction.commit_lsns == {10, 11, 12, 13}
    assert rows(reduction.rows) == [{"id": 1, "name": "uno", "big": None, "tags": None},
                                    {"id": 20, "name": "two", "big": None, "tags": None}]
    assert reduction.removed is not None and sorted(reduction.removed.column("id").to_pylist()) == [2, 3]


def test_changes_the_mirror_holds_are_passed_over():
    batch = changes(("I", 10, 0, {"id": 1}), ("U", 11, 0, {"id": 1, "name": "b"}), ("I", 12, 0, {"id": 2}))
    assert keyed(batch, Lsn(12)) is None  # rule 2: all held
    reduction = keyed(batch, Lsn(10))
    assert reduction is not None and reduction.changes == 2 and reduction.commit_lsns == {11, 12}


def test_the_order_is_the_commit_order_whatever_the_table_s():
    reduction = keyed(changes(("U", 11, 0, {"id": 1, "name": "later"}), ("I", 10, 0, {"id": 1, "name": "first"})))
    assert reduction is not None and rows(reduction.rows)[0]["name"] == "later"


def test_a_truncate_empties_the_mirror_and_only_what_follows_it_is_written():
    reduction = keyed(changes(("I", 10, 0, {"id": 1}), ("T", 11, 0, None), ("I", 11, 1, {"id": 2}),
                              ("I", 12, 0, {"id": 3})))
    assert reduction is not None and reduction.truncated and reduction.removed is None
    assert [r["id"] for r in rows(reduction.rows)] == [2, 3]


def test_unchanged_toast_values_come_from_earlier_changes_or_are_left_for_the_mirror():
    reduction = keyed(changes(
        ("I", 10, 0, {"id": 1, "name": "a", "big": "B1"}),
        ("U", 11, 0, {"id": 1, "name": "b"}, {"unchanged": ["big"]}),  # known from the insert
        ("U", 11, 1, {"id": 2, "name": "c"}, {"unchanged": ["big"]}),  # only the mirror knows
        ("U", 12, 0, {"id": 30, "name": "d"}, {"unchanged": ["big"], "old_key": {"id": 3}}),  # under the old key
    ))
    assert reduction is not None
    by_id = {row["id"]: row for row in reduction.rows.to_pylist()}
    assert by_id[1]["big"] == "B1" and by_id[1][C.UNCHANGED] == []
    assert by_id[2][C.UNCHANGED] == ["big"] and by_id[2][C.FILL_KEY] is None
    assert by_id[30][C.UNCHANGED] == ["big"] and by_id[30][C.FILL_KEY] == {"id": 3}


def test_a_keyless_delete_cancels_an_identical_insert_first_then_counts_the_copies_it_removes():
    before = {"id": 5, "name": "x", "big": None, "tags": None}
    reduction = reduce_changes(ordered(changes(
        ("I", 10, 0, {"id": 1, "name": "a"}),
        ("D", 10, 1, {"id": 1, "name": "a"}, {"before": {"id": 1, "name": "a", "big": None, "tags": None}}),
        ("D", 11, 0, before, {"before": before}),
        ("D", 11, 1, before, {"before": before}),
        ("I", 12, 0, {"id": 7, "name": "new"}),
    )), NAMES, (), append_only=False, position=None)
    assert reduction is not None and reduction.kind == KEYLESS
    assert rows(reduction.rows) == [{"id": 7, "name": "new", "big": None, "tags": None}]
    assert reduction.removed is not None
    assert reduction.removed.to_pylist() == [{**before, COPIES_GONE: 2}]


def test_an_append_only_mirror_takes_the_inserts_and_counts_what_it_cannot_match():
    reduction = reduce_changes(ordered(changes(("I", 10, 0, {"id": 1}), ("U", 11, 0, {"id": 1, "name": "b"}),
                                               ("D", 12, 0, {"id": 1}))), NAMES, (), append_only=True, position=None)
    assert reduction is not None and reduction.kind == APPEND_ONLY
    assert [r["id"] for r in rows(reduction.rows)] == [1] and reduction.unmatched == 2 and reduction.removed is None
