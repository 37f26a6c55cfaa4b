"""Why a mirror must be copied again: pure decisions over what the stream, the catalog and the mirror say.

Some changes give a table's existing rows values logical decoding never sends (a rewrite through a cast, a
column dropped and added again, an enum value renamed, a partition attached with rows...), or key its rows
otherwise. A mirror that missed such a change holds rows the stream can no longer correct: the table is copied
again at a fresh consistent point while the others stream. :func:`copy_reason` decides, from facts gathered
beforehand (:class:`SourceFacts`, :class:`MirrorFacts`); :func:`refreshed_shape` says what the mirror's record
of its source should say now. Neither reads nor writes anything: the pipeline (:mod:`.tables`) gathers the
facts, records the shape, and copies.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from pgcdc.mirrors.properties import SourceShape, describe_key, key_tokens
from pgcdc.pgoutput.messages import Relation
from pgcdc.replication.published import TableStorage
from pgcdc.types.kinds import type_change_keeps_values


class Why(enum.Enum):
    """The kinds of reason a mirror is copied again (:attr:`CopyReason.why`)."""

    IDENTITY = "its replica identity changed: the mirror is made again, keyed on the new one"
    RECREATED = "the table was dropped and created again under its name"
    REWRITTEN_TYPE = "the type of {columns} changed and the table was rewritten, which may have changed their values"
    CHANGED_TYPE = "the type of {columns} changed, which may have changed their values"
    PUBLICATION = ("the publication's column list or row filter for it changed, or it was taken out of the "
                   "publication and put back: the mirror lacks rows or values the stream never sent")
    READDED_COLUMNS = "{columns} were dropped and added again: their values are the new columns'"
    REPRINTED = ("{columns} changed how its values print (an enum value renamed, a composite's attributes "
                 "changed): the mirror holds the old text")
    DETACHED = "partitions were detached or dropped: their rows left the table with no change decoded"
    ATTACHED = "a partition holding rows was attached: its rows joined the table with no change decoded"
    RENAMED = "columns were renamed: their values are the old columns', under new names"
    REWRITTEN_DEFAULT = ("new columns hold values PostgreSQL wrote by rewriting the table, which logical decoding "
                         "does not send")
    NARROWED = "a column's type changed to one its mirror cannot change to in place"


@dataclass(frozen=True)
class CopyReason:
    why: Why
    text: str

    def __str__(self) -> str:
        return self.text


def _reason(why: Why, columns: str = "") -> CopyReason:
    return CopyReason(why, why.value.format(columns=columns))


@dataclass(frozen=True)
class SourceFacts:
    """What the source says of a table, for one relation version: ``key``, the columns the server sends as a row's
    identity; ``storage``, the catalog's word on its storage now (None: not read, or the table is gone);
    ``rewritten_defaults``, new columns that have a default but no value recorded in the catalog (the table was
    rewritten to give them one); ``attached_with_rows``, the new leaf partitions that hold rows written before
    they joined (asked of the server only for new leaves that hold rows)."""

    key: tuple[str, ...]
    storage: TableStorage | None
    rewritten_defaults: bool = False
    attached_with_rows: frozenset[int] = frozenset()


@dataclass(frozen=True)
class MirrorFacts:
    """What the mirror holds now, before it evolves to the relation version: the ``key`` it records (None:
    none recorded), the source ``shape`` its rows hold (None: unknown), its ``columns``, and whether one of them
    has a type Iceberg cannot change in place to the version's (``narrowed``)."""

    key: tuple[str, ...] | None
    shape: SourceShape | None
    columns: frozenset[str]
    narrowed: bool = False


def copy_reason(relation: Relation, source: SourceFacts, mirror: MirrorFacts | None) -> CopyReason | None:
    """Why ``mirror`` (None: there is none) must be copied again before ``relation``'s changes reach it; None when
    the stream alone keeps it right. The catalog may be ahead of the stream: then the copy comes early, which is
    as right (rule 2 skips what it holds). A plain ADD COLUMN (NULL) or a non-volatile default (the catalog's
    missing value, filled in place) needs no copy; nor do columns, enum values, types or empty partitions added."""
    if mirror is None:
        return None
    if mirror.key is not None and key_tokens(mirror.key) != key_tokens(source.key):
        return CopyReason(Why.IDENTITY, f"{relation.qualified_name}: its replica identity now identifies rows by "
                                        f"{describe_key(source.key)}, but its mirror is keyed on "
                                        f"{describe_key(mirror.key)}: the mirror is made again, keyed on the new one")
    if mirror.shape is not None:
        reason = _shape_reason(relation, source, mirror.shape)
        if reason is not None:
            return reason
    names = {c.name for c in relation.columns}
    if names - mirror.columns and mirror.columns - names:
        return _reason(Why.RENAMED)
    if source.rewritten_defaults:
        return _reason(Why.REWRITTEN_DEFAULT)
    if mirror.narrowed:
        return _reason(Why.NARROWED)
    return None


def _shape_reason(relation: Relation, source: SourceFacts, shape: SourceShape) -> CopyReason | None:
    """What the recorded source shape tells against the relation version and the catalog's storage now."""
    storage = source.storage
    if shape.relation_id != relation.relation_id:
        return _reason(Why.RECREATED)
    held = {name: (type_oid, typmod) for name, type_oid, typmod in shape.columns}
    changed = [c for c in relation.columns if c.name in held and held[c.name] != (c.type_oid, c.type_modifier)]
    listed = ", ".join(c.name for c in changed)
    if changed and shape.filenodes is not None and storage is not None and storage.filenodes != shape.filenodes:
        return _reason(Why.REWRITTEN_TYPE, listed)
    if changed and shape.filenodes is None and not all(
            type_change_keeps_values(held[c.name], (c.type_oid, c.type_modifier)) for c in changed):
        return _reason(Why.CHANGED_TYPE, listed)
    if storage is None:
        return None
    if shape.definition is not None and storage.definition is not None and storage.definition != shape.definition:
        return _reason(Why.PUBLICATION)
    if shape.attnums is not None:
        before = dict(shape.attnums)
        renumbered = [name for name, number in storage.attnums if before.get(name, number) != number]
        if renumbered:
            return _reason(Why.READDED_COLUMNS, ", ".join(renumbered))
    if shape.printed_types is not None:
        reprinted = _reprinted_types(shape.printed_types, storage.printed_types)
        if reprinted:
            return _reason(Why.REPRINTED, reprinted)
    if shape.partitions is not None:
        if set(shape.partitions) - {leaf for leaf, _ in storage.partitions}:
            return _reason(Why.DETACHED)
        if source.attached_with_rows:
            return _reason(Why.ATTACHED)
    return None


def new_filled_partitions(shape: SourceShape | None, storage: TableStorage | None) -> list[int]:
    """The leaves of ``storage`` the mirror's shape does not know that hold rows: the ones to ask the server about
    (:attr:`SourceFacts.attached_with_rows`)."""
    if shape is None or shape.partitions is None or storage is None:
        return []
    return sorted(leaf for leaf, filled in storage.partitions if filled and leaf not in shape.partitions)


def refreshed_shape(shape: SourceShape | None, storage: TableStorage | None) -> SourceShape | None:
    """The mirror's record of its source once what the catalog added since is known (columns, enum values, types,
    empty partitions; or what a mirror made before pgcdc recorded it did not know); None when it is unchanged."""
    if shape is None or storage is None:
        return None
    partitions = tuple(leaf for leaf, _ in storage.partitions)
    if (shape.attnums is None or set(storage.attnums) - set(shape.attnums)
            or (shape.definition is None and storage.definition is not None)
            or shape.printed_types != storage.printed_types or shape.partitions != partitions):
        return replace(shape, attnums=storage.attnums, printed_types=storage.printed_types, partitions=partitions,
                       definition=shape.definition if shape.definition is not None else storage.definition)
    return None


def _reprinted_types(before: tuple[str, ...], now: tuple[str, ...]) -> str | None:
    """The type (as "type <oid>") whose definition changed so that values the mirror holds print otherwise:
    an enum value of a type still used with another label, or an attribute of a composite used before that
    changed, appeared or went. A new enum value, or a type newly used or no longer used, changes no value."""
    def type_of(fact: str) -> str:
        return fact.split(" ", 2)[1]

    still_used, used_before = {type_of(f) for f in now}, {type_of(f) for f in before}
    changed = sorted({type_of(f) for f in set(before) - set(now) if type_of(f) in still_used}
                     | {type_of(f) for f in set(now) - set(before)
                        if f.startswith("composite ") and type_of(f) in used_before})
    return f"type {changed[0]}" if changed else None
