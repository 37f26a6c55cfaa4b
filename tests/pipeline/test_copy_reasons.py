"""Why a mirror is copied again (pgcdc.pipeline.copy_reasons): each reason from the facts alone, no server, no
Spark. The integration tests (test_schema_rewrites.py, test_publication_shapes.py, test_replica_identity.py)
make each of these happen on a real server and check that pgcdc copies, and why."""

from __future__ import annotations

import dataclasses

import pytest

from pgcdc.mirrors.properties import SourceShape
from pgcdc.pgoutput.messages import Column, Relation
from pgcdc.pipeline.copy_reasons import (
    MirrorFacts,
    SourceFacts,
    Why,
    copy_reason,
    new_filled_partitions,
    refreshed_shape,
)
from pgcdc.replication.published import TableStorage

INT4, INT8, TEXT = 23, 20, 25
OID = 16_400


def relation(*columns: tuple[str, int, int], oid: int = OID, key: str = "id", identity: str = "d") -> Relation:
    return Relation(None, oid, "public", "t", identity,
                    tuple(Column(1 if name == key else 0, name, type_oid, typmod) for name, type_oid, typmod in columns))


BASE = relation(("id", INT4, -1), ("v", TEXT, -1))
STORAGE = TableStorage(filenodes=(500,), attnums=(("id", 1), ("v", 2)), definition=(None, None, "m1"),
                       printed_types=("enum 700 1 red",), partitions=())
SHAPE = SourceShape(OID, (("id", INT4, -1), ("v", TEXT, -1)), STORAGE.filenodes, STORAGE.attnums, STORAGE.definition,
                    STORAGE.printed_types, ())
MIRROR = MirrorFacts(("id",), SHAPE, frozenset({"id", "v"}))
SOURCE = SourceFacts(("id",), STORAGE)


def changed(**storage) -> SourceFacts:
    return dataclasses.replace(SOURCE, storage=dataclasses.replace(STORAGE, **storage))


@pytest.mark.parametrize(("version", "source", "mirror", "why"), [
    (BASE, SOURCE, MIRROR, None),  # nothing changed
    (BASE, SOURCE, None, None),  # no mirror: a copy of its own, not a copy again
    (BASE, dataclasses.replace(SOURCE, key=("v",)), MIRROR, Why.IDENTITY),  # REPLICA IDENTITY USING INDEX
    (BASE, dataclasses.replace(SOURCE, key=()), MIRROR, Why.IDENTITY),  # FULL without a key
    (relation(("id", INT4, -1), ("v", TEXT, -1), oid=OID + 1), SOURCE, MIRROR, Why.RECREATED),
    (relation(("id", INT8, -1), ("v", TEXT, -1)), changed(filenodes=(501,)), MIRROR, Why.REWRITTEN_TYPE),
    # a type change PostgreSQL makes in place (no rewrite): the values are the same, nothing to copy
    (relation(("id", INT8, -1), ("v", TEXT, -1)), SOURCE, MIRROR, None),
    # a mirror made before its storage was recorded: only a change that keeps every value is followed
    (relation(("id", INT4, -1), ("v", INT4, -1)), SOURCE,
     dataclasses.replace(MIRROR, shape=dataclasses.replace(SHAPE, filenodes=None)), Why.CHANGED_TYPE),
    (BASE, changed(definition=(("id",), None, "m1")), MIRROR, Why.PUBLICATION),  # a column list
    (BASE, changed(definition=(None, "(id > 5)", "m1")), MIRROR, Why.PUBLICATION),  # a row filter
    (BASE, changed(definition=(None, None, "m2")), MIRROR, Why.PUBLICATION),  # out of the publication and back
    (BASE, changed(attnums=(("id", 1), ("v", 3))), MIRROR, Why.READDED_COLUMNS),
    (BASE, changed(printed_types=("enum 700 1 crimson",)), MIRROR, Why.REPRINTED),  # RENAME VALUE
    (BASE, changed(printed_types=("enum 700 1 red", "enum 700 2 blue")), MIRROR, None),  # ADD VALUE
    (BASE, dataclasses.replace(changed(partitions=((901, True),))),
     dataclasses.replace(MIRROR, shape=dataclasses.replace(SHAPE, partitions=(900, 901))), Why.DETACHED),
    (BASE, dataclasses.replace(changed(partitions=((900, False), (901, True))), attached_with_rows=frozenset({901})),
     dataclasses.replace(MIRROR, shape=dataclasses.replace(SHAPE, partitions=(900,))), Why.ATTACHED),
    # a new partition filled by the stream since it joined changes nothing
    (BASE, changed(partitions=((900, False), (901, True))),
     dataclasses.replace(MIRROR, shape=dataclasses.replace(SHAPE, partitions=(900,))), None),
    (relation(("id", INT4, -1), ("w", TEXT, -1)), SOURCE, MIRROR, Why.RENAMED),
    (relation(("id", INT4, -1), ("v", TEXT, -1), ("n", INT4, -1)), dataclasses.replace(SOURCE, rewritten_defaults=True),
     MIRROR, Why.REWRITTEN_DEFAULT),
    (relation(("id", INT4, -1), ("v", TEXT, -1), ("n", INT4, -1)), SOURCE, MIRROR, None),  # a plain ADD COLUMN
    (BASE, SOURCE, dataclasses.replace(MIRROR, narrowed=True), Why.NARROWED),
])
def test_each_reason_to_copy_a_mirror_again(version, source, mirror, why):
    reason = copy_reason(version, source, mirror)
    assert (reason.why if reason is not None else None) is why, reason
    if reason is not None:
        assert str(reason) and "{" not in str(reason)


def test_a_changed_identity_names_both_keys():
    reason = copy_reason(BASE, dataclasses.replace(SOURCE, key=("code",)), MIRROR)
    assert reason is not None and "(code)" in reason.text and "(id)" in reason.text


def test_the_servers_word_on_new_partitions_is_asked_only_for_new_filled_ones():
    shape = dataclasses.replace(SHAPE, partitions=(900,))
    storage = dataclasses.replace(STORAGE, partitions=((900, True), (901, True), (902, False)))
    assert new_filled_partitions(shape, storage) == [901]
    assert new_filled_partitions(SHAPE, STORAGE) == []
    assert new_filled_partitions(dataclasses.replace(SHAPE, partitions=None), storage) == []


def test_what_the_catalog_added_is_recorded_and_what_is_the_same_is_not():
    assert refreshed_shape(SHAPE, STORAGE) is None
    grown = dataclasses.replace(STORAGE, attnums=(("id", 1), ("v", 2), ("n", 3)),
                                printed_types=("enum 700 1 red", "enum 700 2 blue"), partitions=((900, False),))
    refreshed = refreshed_shape(SHAPE, grown)
    assert refreshed is not None and refreshed.attnums == grown.attnums
    assert refreshed.printed_types == grown.printed_types and refreshed.partitions == (900,)
    assert refreshed.filenodes == SHAPE.filenodes  # the last copy's file numbers stay: a rewrite is told by them
    assert refreshed_shape(None, STORAGE) is None and refreshed_shape(SHAPE, None) is None
