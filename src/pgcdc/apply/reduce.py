"""The first step of a batch's way into a mirror: its changes reduced to what the mirror must become. Pure Arrow.

Input is a change table (:mod:`pgcdc.change_table`) of one source table. The steps:

1. skip changes at or below the mirror's position (:mod:`pgcdc.checkpoint`'s rule 2) and order the rest by
   (commit LSN, ordinal); keep only what follows the last TRUNCATE, which empties the mirror;
2. by the mirror's kind of key (:class:`Reduction`):

   - **keyed**: unchanged TOAST values resolved from earlier changes of the batch (following key changes
     back); an UPDATE that changed the key becomes a DELETE of the old key and a write of the new one; the last
     change per key wins. The result: the new row images (what the batch cannot know of unchanged values is
     left marked, with the key to read it under) and every key the batch touches;
   - **keyless** (REPLICA IDENTITY FULL without a key): rows match on every column and a table may hold the same
     row several times. A delete first cancels an identical row inserted earlier in the batch; the result: the
     whole rows deleted, each with how many of its copies go, and the rows inserted;
   - **append-only** (no replica identity): the inserts.

What only the mirror knows (the values of unchanged TOAST columns the batch never saw, how many copies of a
keyless row it holds) is read next (:mod:`.mirror_reads`); a writer then makes it durable in one commit
(:mod:`.row_delta`, :mod:`.merge_writer`), orchestrated by :mod:`.batch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from pgcdc.change_table import ChangeColumns as C
from pgcdc.checkpoint import first_unapplied
from pgcdc.lsn import Lsn
from pgcdc.spark.arrow import from_plain_rows, from_plain_values, plain_rows, plain_values

KEYED, KEYLESS, APPEND_ONLY = "keyed", "keyless", "append-only"


@dataclass(frozen=True)
class Reduction:
    """A batch's changes to one mirror, reduced (see the module).

    ``changes``: the changes the mirror did not hold yet; ``commit_lsns``: their transactions. ``truncated``: the
    batch empties the mirror first. ``rows``: the rows to write — for a keyed mirror the last row image per key,
    with ``_pgcdc_unchanged`` (columns whose value the batch does not know) and ``_pgcdc_fill_key`` (the key to
    read them under, when it changed in the batch); the inserts otherwise. ``removed``: keyed, the keys whose last
    change deletes them (a key written is replaced as well: its older row goes too); keyless, every whole row
    deleted, with ``_pgcdc_copies_gone`` saying how many of its identical copies go; None for append-only mirrors
    and after a TRUNCATE."""

    kind: str
    changes: int
    commit_lsns: frozenset[int]
    truncated: bool
    rows: pa.Table
    removed: pa.Table | None
    keys: tuple[str, ...] = ()
    unmatched: int = 0  # updates and deletes an append-only mirror cannot match to a row


def ordered(changes: pa.Table) -> pa.Table:
    """``changes`` in (commit LSN, ordinal) order."""
    if changes.num_rows == 0:
        return changes
    return changes.take(pc.sort_indices(changes, sort_keys=[(C.LSN, "ascending"), (C.ORDINAL, "ascending")]))


def after_position(changes: pa.Table, position: Lsn | None) -> pa.Table:
    """The changes a mirror at ``position`` does not hold (rule 2)."""
    if position is None or changes.num_rows == 0:
        return changes
    return changes.filter(pc.greater_equal(changes.column(C.LSN), first_unapplied(position)))


def reduce_changes(changes: pa.Table, names: list[str], keys: tuple[str, ...], *, append_only: bool,
                   position: Lsn | None) -> Reduction | None:
    """``changes`` (ordered, see :func:`ordered`) reduced for a mirror at ``position`` with source columns ``names``,
    keyed on ``keys`` (none: keyless, or ``append_only``); None when the mirror holds them all already."""
    fresh = after_position(changes, position)
    if fresh.num_rows == 0:
        return None
    commit_lsns = frozenset(pc.unique(fresh.column(C.LSN)).to_pylist())
    truncates = pc.indices_nonzero(pc.equal(fresh.column(C.OP), "T")).to_pylist()
    truncated = bool(truncates)
    current = fresh.slice(truncates[-1] + 1) if truncated else fresh
    if keys:
        rows, touched = _reduce_keyed(current, list(keys), names)
        return Reduction(KEYED, fresh.num_rows, commit_lsns, truncated, rows, None if truncated else touched, keys)
    if append_only:
        inserts = current.filter(pc.equal(current.column(C.OP), "I")).select(names)
        return Reduction(APPEND_ONLY, fresh.num_rows, commit_lsns, truncated, inserts, None,
                         unmatched=current.num_rows - inserts.num_rows)
    deleted, inserts = _keyless_effect(current, names)
    return Reduction(KEYLESS, fresh.num_rows, commit_lsns, truncated, inserts, None if truncated else deleted)


def _reduce_keyed(changes: pa.Table, keys: list[str], names: list[str]) -> tuple[pa.Table, pa.Table]:
    """(the last row image per key written, the keys deleted) of a keyed mirror's changes."""
    resolved, fill_keys = resolve_unchanged(changes, keys, names)
    last = last_per_key(with_old_key_deletes(resolved, keys, fill_keys), keys)
    written = pc.not_equal(last.column(C.OP), "D")
    return (last.filter(written).select([*names, C.UNCHANGED, C.FILL_KEY]),
            last.filter(pc.invert(written)).select(keys))


def with_old_key_deletes(changes: pa.Table, keys: list[str], fill_keys: pa.Array | None) -> pa.Table:
    """Each change is one event (``_pgcdc_seq`` orders them); an UPDATE that changed the key is preceded by a
    DELETE of the old key."""
    count = changes.num_rows
    seq = pa.array([2 * i + 1 for i in range(count)], pa.int64())
    events = changes.append_column(C.SEQ, seq)
    events = events.append_column(C.FILL_KEY, fill_keys if fill_keys is not None
                                  else pa.nulls(count, changes.schema.field(C.OLD_KEY).type))
    moved = pc.indices_nonzero(pc.is_valid(changes.column(C.OLD_KEY))).to_pylist()
    if not moved:
        return events
    deletes = events.take(moved)
    old_keys = deletes.column(C.OLD_KEY).combine_chunks()
    columns = []
    for field in deletes.schema:
        if field.name in keys:
            columns.append(old_keys.field(field.name))
        elif field.name == C.OP:
            columns.append(pa.array(["D"] * len(moved), pa.string()))
        elif field.name == C.SEQ:
            columns.append(pa.array([2 * i for i in moved], pa.int64()))
        elif field.name in (C.LSN, C.ORDINAL, C.XID, C.COMMIT_TS, C.ORIGIN):
            columns.append(deletes.column(field.name))
        elif field.name == C.UNCHANGED:
            columns.append(pa.array([[] for _ in moved], field.type))
        else:
            columns.append(pa.nulls(len(moved), field.type))
    return pa.concat_tables([events, pa.Table.from_arrays(columns, schema=deletes.schema)])


def last_per_key(events: pa.Table, keys: list[str]) -> pa.Table:
    """The last event (highest ``_pgcdc_seq``) of each key, in key order (tighter column bounds per file). Keys of
    nested types (an interval, an array), which Arrow cannot group or sort by, are grouped by their values' text."""
    if events.num_rows == 0:
        return events
    nested = any(pa.types.is_nested(events.schema.field(k).type) for k in keys)
    grouped = keys
    if nested:
        surrogate = pa.array([repr(key) for key in zip(*(plain_values(events.column(k)) for k in keys), strict=True)])
        events = events.append_column("_pgcdc_key", surrogate)
        grouped = ["_pgcdc_key"]
    last = events.select([*grouped, C.SEQ]).group_by(grouped, use_threads=False).aggregate([(C.SEQ, "max")])
    kept = events.filter(pc.is_in(events.column(C.SEQ), value_set=last.column(f"{C.SEQ}_max")))
    kept = kept.take(pc.sort_indices(kept, sort_keys=[(k, "ascending") for k in grouped]))
    return kept.drop_columns(["_pgcdc_key"]) if nested else kept


def resolve_unchanged(changes: pa.Table, keys: list[str], names: list[str]) -> tuple[pa.Table, pa.Array | None]:
    """Fill unchanged TOAST values from earlier changes of the same row in this batch.

    A row is followed back through key-changing updates. What the batch cannot tell is left unchanged for the
    mirror to keep — under the row's own key, or, when its key changed in this batch, under the key it had
    before the batch (returned as fill keys)."""
    unchanged = changes.column(C.UNCHANGED).to_pylist()
    wanted = [i for i, cols in enumerate(unchanged) if cols]
    if not wanted:
        return changes, None
    ops = changes.column(C.OP).to_pylist()
    key_rows = list(zip(*(plain_values(changes.column(k)) for k in keys), strict=True))
    old_keys: list[tuple[Any, ...] | None] = [None if k is None else tuple(k[name] for name in keys)
                                              for k in plain_values(changes.column(C.OLD_KEY))]
    by_key: dict[tuple, list[int]] = {}
    for index, key in enumerate(key_rows):
        by_key.setdefault(key, []).append(index)
    affected = sorted({c for i in wanted for c in unchanged[i]})
    values = {name: plain_values(changes.column(name)) for name in affected}
    fill: list[dict[str, Any] | None] = [None] * changes.num_rows
    for row in wanted:
        missing, search_key = _follow_back(row, list(unchanged[row]), old_keys[row] or key_rows[row], ops,
                                           unchanged, old_keys, by_key, values)
        unchanged[row] = missing
        if missing and search_key != key_rows[row]:
            fill[row] = dict(zip(keys, search_key, strict=True))
    columns = {name: from_plain_values(values[name], changes.schema.field(name).type) for name in affected}
    columns[C.UNCHANGED] = pa.array(unchanged, changes.schema.field(C.UNCHANGED).type)
    resolved = changes
    for name, array in columns.items():
        resolved = resolved.set_column(resolved.schema.get_field_index(name), name, array)
    fill_type = changes.schema.field(C.OLD_KEY).type
    fill_keys = from_plain_values(fill, fill_type) if any(f is not None for f in fill) else None
    return resolved, fill_keys


def _follow_back(row: int, missing: list[str], search_key: tuple, ops: list[str], unchanged: list[list[str]],
                 old_keys: list[tuple | None], by_key: dict[tuple, list[int]], values: dict[str, list[Any]]
                 ) -> tuple[list[str], tuple]:
    """The unchanged values of ``row`` taken from the earlier changes of the same row (``values`` updated in
    place); returns what is still missing and the key the row had before the batch."""
    limit = row
    while missing:
        earlier = [j for j in by_key.get(search_key, ()) if j < limit]
        if not earlier:
            break
        j = earlier[-1]
        if ops[j] == "D":
            return [], search_key  # the row did not exist before: nothing to keep
        for name in list(missing):
            if name not in unchanged[j]:
                values[name][row] = values[name][j]
                missing.remove(name)
        previous_key = old_keys[j]
        if previous_key is not None:
            search_key = previous_key
        limit = j
    return missing, search_key


COPIES_GONE = "_pgcdc_copies_gone"


def _keyless_effect(changes: pa.Table, names: list[str]) -> tuple[pa.Table, pa.Table]:
    """(whole rows deleted, each with how many of its identical copies go; rows inserted) of a table without a
    key: within the batch a delete first cancels an identical row inserted earlier in it."""
    after = plain_rows(changes.select(names))
    before = plain_values(changes.column(C.BEFORE))
    kept_columns = changes.column(C.UNCHANGED).to_pylist()
    pending: dict[str, list[dict]] = {}
    deletes: dict[str, tuple[dict, int]] = {}
    for op, new, old, kept in zip(changes.column(C.OP).to_pylist(), after, before, kept_columns, strict=True):
        if op in ("U", "D") and old is not None:
            image = repr(tuple(old[n] for n in names))
            if pending.get(image):
                pending[image].pop()
            else:
                deletes[image] = (old, deletes[image][1] + 1 if image in deletes else 1)
        if op in ("I", "U"):
            if kept and old is not None:  # the old image (FULL) carries the value an unchanged column kept
                new = {**new, **{n: old[n] for n in kept}}
            pending.setdefault(repr(tuple(new[n] for n in names)), []).append(new)
    schema = pa.schema([changes.schema.field(n) for n in names])
    deleted = from_plain_rows([row for row, _ in deletes.values()], schema)
    deleted = deleted.append_column(COPIES_GONE, pa.array([gone for _, gone in deletes.values()], pa.int64()))
    return deleted, from_plain_rows([row for rows in pending.values() for row in rows], schema)
