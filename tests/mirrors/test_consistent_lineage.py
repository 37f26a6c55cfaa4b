"""Which moment of the source each snapshot of a mirror holds (pgcdc.mirrors.consistent.lineage), read from table
metadata alone, and so where a consistent tag may be put (no Spark needed; the tags on real mirrors:
tests/integration/test_consistent.py)."""

from __future__ import annotations

from pgcdc.iceberg.table_metadata import TableMetadata
from pgcdc.lsn import Lsn
from pgcdc.mirrors.consistent import lineage, snapshot_at

P1, P2, P3 = Lsn.parse("0/100"), Lsn.parse("0/200"), Lsn.parse("0/300")


def table(*snapshots: tuple[int, str, Lsn | None]) -> TableMetadata:
    """A table whose lineage is ``snapshots`` (id, operation, the pgcdc.lsn it carries), oldest first."""
    entries = []
    for index, (snapshot_id, operation, lsn) in enumerate(snapshots):
        summary = {"operation": operation, **({"pgcdc.lsn": str(lsn)} if lsn is not None else {})}
        entries.append({"snapshot-id": snapshot_id, "timestamp-ms": 1000 + index, "summary": summary,
                        **({"parent-snapshot-id": snapshots[index - 1][0]} if index else {})})
    return TableMetadata({"format-version": 2, "snapshots": entries, "current-snapshot-id": snapshots[-1][0],
                          "properties": {}}, "memory")


def test_a_rewrite_stamped_before_a_batch_beneath_it_holds_the_batch_s_moment():
    """pgcdc maintain read the position (P1) before its compaction; a batch (P2) committed meanwhile, and the
    compaction landed on top of it, stamped P1: its rows are the batch's, so no tag at P1 may be put on it."""
    mirror = table((1, "append", P1), (2, "overwrite", P2), (3, "replace", P1))
    assert lineage(mirror) == [(3, P2), (2, P2), (1, P1)]
    assert snapshot_at(mirror, P1) is None  # the mirror is ahead of P1: the tags stay, or move to a later LSN
    assert snapshot_at(mirror, P3) == 3


def test_rewrites_hold_their_parent_s_moment_and_another_writer_s_commit_none():
    mirror = table((1, "append", P1), (2, "replace", None), (3, "overwrite", None), (4, "replace", P2))
    assert lineage(mirror) == [(4, None), (3, None), (2, P1), (1, P1)]  # rows changed by another writer
    assert snapshot_at(mirror, P3) is None
    expired_parent = table((7, "replace", P2), (8, "replace", None))  # the rewrite's parent expired
    assert lineage(expired_parent) == [(8, P2), (7, P2)]  # its stamp is all there is
