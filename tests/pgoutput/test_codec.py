"""The codec against bytes PostgreSQL 18 really sent (fixtures/pg18.jsonl), round trips, and malformed input."""

from __future__ import annotations

import functools
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pgcdc.lsn import Lsn
from pgcdc.pgoutput import (
    MESSAGE_CLASSES,
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    DecodeError,
    Delete,
    Insert,
    Message,
    MessageDecoder,
    Origin,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
    decode,
    encode,
    pg_timestamp,
)

FIXTURES = Path(__file__).parent / "fixtures" / "pg18.jsonl"
DECODER = sys.modules["pgcdc.pgoutput.decode"]


@pytest.fixture(params=["C", "python"], autouse=True)
def tuple_parser(request, monkeypatch):
    """Every codec test runs with the C tuple parser (where built) and with the pure-Python one."""
    if request.param == "python":
        monkeypatch.setattr(DECODER, "_parse_change_c", None)
        monkeypatch.setattr(DECODER, "_parse_raw_c", None)
    elif DECODER._parse_change_c is None:
        pytest.skip("the C tuple parser is not built here")
    return request.param
RECORDS = [json.loads(line) for line in FIXTURES.read_text().splitlines()]


def decoded(record: dict) -> list[tuple[bytes, bool, object]]:
    """(bytes, in_stream, message) for every message of a record, tracking the stream state as a reader must."""
    in_stream = False
    out = []
    for entry in record["messages"]:
        data = bytes.fromhex(entry["hex"])
        message = decode(data, proto_version=record["proto_version"], in_stream=in_stream)
        out.append((data, in_stream, message))
        if isinstance(message, StreamStart):
            in_stream = True
        elif isinstance(message, StreamStop):
            in_stream = False
    return out


def records(scenario: str) -> list[dict]:
    found = [r for r in RECORDS if r["scenario"] == scenario]
    assert found, scenario
    return found


def test_fixtures_cover_every_message_type_and_every_protocol_version():
    seen = Counter(type(m).__name__ for r in RECORDS for _, _, m in decoded(r))
    assert set(seen) == {cls.__name__ for cls in MESSAGE_CLASSES}
    assert {r["proto_version"] for r in RECORDS} == {1, 2, 3, 4}


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r['scenario']}-v{r['proto_version']}")
def test_message_decoder_tracks_the_stream_state_itself(record):
    decoder = MessageDecoder(record["proto_version"])
    for data, in_stream, message in decoded(record):
        assert decoder.in_stream == in_stream
        assert decoder.decode(data) == message


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: f"{r['scenario']}-v{r['proto_version']}")
def test_encode_inverts_decode_on_captured_bytes(record):
    for data, in_stream, message in decoded(record):
        assert encode(message, proto_version=record["proto_version"], in_stream=in_stream) == data


@pytest.mark.parametrize("record", records("basic") + records("basic_binary"),
                         ids=lambda r: f"{r['scenario']}-v{r['proto_version']}")
def test_basic_workload_fields(record):
    messages = [m for _, _, m in decoded(record)]
    done = record["workload"]
    binary = record["options"].get("binary") == "true"
    begins = [m for m in messages if isinstance(m, Begin)]
    commits = [m for m in messages if isinstance(m, Commit)]
    assert [b.final_lsn for b in begins] == [c.commit_lsn for c in commits]
    assert all(c.end_lsn > c.commit_lsn for c in commits)
    assert begins[0].xid == done["insert_xid"]
    assert pg_timestamp(begins[0].commit_ts).year >= 2024
    relations = {m.name: m for m in messages if isinstance(m, Relation)}
    assert set(relations) == set(done["relations"])
    assert all(m.xid is None for m in messages if isinstance(m, Relation | Insert | Update | Delete | Truncate))
    items = relations["items"]
    assert [c.name for c in items.columns] == ["id", "name", "feeling", "both_", "big"]
    assert [c.name for c in items.key_columns] == ["id"]
    assert items.replica_identity == "d" and relations["full_rows"].replica_identity == "f"
    assert relations["by_index"].replica_identity == "i"
    assert [c.name for c in relations["by_index"].key_columns] == ["a", "b"]
    assert {m.name for m in messages if isinstance(m, Type)} == {done["enum"], done["composite"]}

    inserts = [m for m in messages if isinstance(m, Insert) and m.relation_id == items.relation_id]
    first = inserts[0].new
    assert first.kinds == ("bbbbb" if binary else "ttttt")
    assert first.values[1] == b"one"
    updates = [m for m in messages if isinstance(m, Update)]
    toast = next(u for u in updates if u.relation_id == items.relation_id and u.key is None)
    assert toast.new.kinds[4] == "u" and toast.new.values[4] is None  # the unchanged TOAST value
    key_change = next(u for u in updates if u.relation_id == items.relation_id and u.key is not None)
    assert key_change.key.kinds[1:] == "nnnn"  # key tuples list every column, non-key ones as null
    full = next(u for u in updates if u.relation_id == relations["full_rows"].relation_id)
    assert full.old is not None and full.key is None
    deletes = [m for m in messages if isinstance(m, Delete)]
    assert {d.relation_id for d in deletes if d.old is not None} == {relations["full_rows"].relation_id}
    truncate = next(m for m in messages if isinstance(m, Truncate))
    assert truncate.cascade and truncate.restart_identity
    assert set(truncate.relation_ids) == {relations["parent"].relation_id, relations["child"].relation_id}
    logical = [m for m in messages if isinstance(m, Message)]
    assert [(m.transactional, m.prefix, m.content) for m in logical] == [
        (True, done["prefix"], b"in a transaction"), (False, done["prefix"], b"\x00\xff")]
    origin = next(m for m in messages if isinstance(m, Origin))
    assert origin.name == done["origin"] and origin.commit_lsn == Lsn("0/ABCDEF")


@pytest.mark.parametrize("record", records("streamed") + records("streamed_parallel"),
                         ids=lambda r: f"{r['scenario']}-v{r['proto_version']}")
def test_streamed_transaction_with_rolled_back_savepoint(record):
    items = decoded(record)
    done = record["workload"]
    starts = [m for _, _, m in items if isinstance(m, StreamStart)]
    assert starts[0].first_segment and not any(s.first_segment for s in starts[1:])
    assert {s.xid for s in starts} == {done["commit_xid"]}
    commit = next(m for _, _, m in items if isinstance(m, StreamCommit))
    assert commit.xid == done["commit_xid"]
    abort = next(m for _, _, m in items if isinstance(m, StreamAbort))
    assert abort.xid == done["commit_xid"] and abort.subxid != abort.xid  # the savepoint
    if record["options"]["streaming"] == "parallel":
        assert abort.abort_lsn is not None and abort.abort_lsn < commit.commit_lsn
    else:
        assert abort.abort_lsn is None and abort.abort_ts is None
    in_stream_xids = {m.xid for _, in_stream, m in items if in_stream and isinstance(m, Insert)}
    assert in_stream_xids == {done["commit_xid"], abort.subxid}  # changes carry the subtransaction's xid


@pytest.mark.parametrize("record", records("two_phase"), ids=lambda r: f"v{r['proto_version']}")
def test_two_phase_commit_rollback_and_streamed_prepare(record):
    messages = [m for _, _, m in decoded(record)]
    done = record["workload"]
    begin_prepares = [m for m in messages if isinstance(m, BeginPrepare)]
    prepares = [m for m in messages if isinstance(m, Prepare)]
    assert [m.gid for m in begin_prepares] == [done["committed_gid"], done["rolled_back_gid"]]
    assert [m.gid for m in prepares] == [done["committed_gid"], done["rolled_back_gid"]]
    assert begin_prepares[0].xid == done["committed_xid"]
    assert [b.prepare_lsn for b in begin_prepares] == [p.prepare_lsn for p in prepares]
    commits = [m for m in messages if isinstance(m, CommitPrepared)]
    assert [c.gid for c in commits] == [done["committed_gid"], done["streamed_gid"]]
    rollback = next(m for m in messages if isinstance(m, RollbackPrepared))
    assert rollback.gid == done["rolled_back_gid"] and rollback.prepare_end_lsn == prepares[1].end_lsn
    streamed = next(m for m in messages if isinstance(m, StreamPrepare))
    assert streamed.gid == done["streamed_gid"] and streamed.xid == done["streamed_xid"]


# -- hypothesis: generated messages round-trip ----------------------------------------------------

lsns = st.integers(0, 2**64 - 1).map(Lsn)
timestamps = st.integers(-(2**63), 2**63 - 1)
xids = st.integers(0, 2**32 - 1)
names = st.text(st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)), max_size=20)
values = st.binary(max_size=30)
tuples = st.lists(st.one_of(st.tuples(st.just("n"), st.none()), st.tuples(st.just("u"), st.none()),
                            st.tuples(st.sampled_from("tb"), values)), max_size=8).map(TupleData.of)
columns = st.builds(Column, st.integers(0, 1), names, st.integers(0, 2**32 - 1), st.integers(-(2**31), 2**31 - 1))


@functools.cache  # built once per state: building it for each example cost more than drawing from it
def messages_for(proto: int, in_stream: bool) -> st.SearchStrategy:
    xid = xids if in_stream else st.none()
    data = [
        st.builds(Message, xid, st.booleans(), lsns, names, st.binary(max_size=40)),
        st.builds(Origin, lsns, names),
        st.builds(Relation, xid, xids, names, names, st.sampled_from("dnfi"), st.lists(columns, max_size=5).map(tuple)),
        st.builds(Type, xid, xids, names, names),
        st.builds(Insert, xid, xids, tuples),
        st.builds(Update, xid, xids, st.none(), st.none(), tuples),
        st.builds(Update, xid, xids, tuples, st.none(), tuples),
        st.builds(Update, xid, xids, st.none(), tuples, tuples),
        st.builds(Delete, xid, xids, tuples, st.none()),
        st.builds(Delete, xid, xids, st.none(), tuples),
        st.builds(Truncate, xid, st.integers(0, 3), st.lists(xids, max_size=5).map(tuple)),
    ]
    if in_stream:
        return st.one_of(*data, st.just(StreamStop()))
    control = [st.builds(Begin, lsns, timestamps, xids), st.builds(Commit, st.integers(0, 127), lsns, lsns, timestamps)]
    if proto >= 2:
        control += [st.builds(StreamStart, xids, st.booleans()),
                    st.builds(StreamCommit, xids, st.integers(0, 127), lsns, lsns, timestamps),
                    st.builds(StreamAbort, xids, xids)]
    if proto >= 4:
        control.append(st.builds(StreamAbort, xids, xids, lsns, timestamps))
    if proto >= 3:
        control += [st.builds(BeginPrepare, lsns, lsns, timestamps, xids, names),
                    *(st.builds(cls, st.integers(0, 127), lsns, lsns, timestamps, xids, names)
                      for cls in (Prepare, CommitPrepared, StreamPrepare)),
                    st.builds(RollbackPrepared, st.integers(0, 127), lsns, lsns, timestamps, timestamps, xids, names)]
    return st.one_of(*data, *control)


STATES = [(p, s) for p in (1, 2, 3, 4) for s in (False, True) if not (s and p == 1)]


@pytest.mark.parametrize(("proto", "in_stream"), STATES)
@settings(max_examples=300)
@given(data=st.data())
def test_decode_inverts_encode_for_generated_messages(proto, in_stream, data):
    message = data.draw(messages_for(proto, in_stream))
    wire = encode(message, proto_version=proto, in_stream=in_stream)
    assert decode(wire, proto_version=proto, in_stream=in_stream) == message
    assert decode(memoryview(wire), proto_version=proto, in_stream=in_stream) == message
    assert decode(bytearray(wire), proto_version=proto, in_stream=in_stream) == message


# -- malformed input: DecodeError and nothing else ---------------------------------------------

SAMPLES = [(data, record["proto_version"], in_stream) for record in RECORDS
           for data, in_stream, _ in decoded(record)[:40]]


def _decode_or_decode_error(data: bytes, proto: int, in_stream: bool) -> None:
    try:
        decode(data, proto_version=proto, in_stream=in_stream)
    except DecodeError as exc:
        assert exc.offset is not None or exc.field is not None or "protocol" in str(exc)


@settings(max_examples=500)
@given(sample=st.sampled_from(SAMPLES), cut=st.integers(0, 10_000))
def test_every_truncation_raises_decode_error(sample, cut):
    data, proto, in_stream = sample
    cut = cut % len(data)
    with pytest.raises(DecodeError) as info:
        decode(data[:cut], proto_version=proto, in_stream=in_stream)
    if cut:
        assert info.value.msg_type is not None and info.value.offset is not None


@settings(max_examples=1000)
@given(sample=st.sampled_from(SAMPLES), position=st.integers(0, 10_000), byte=st.integers(0, 255),
       extra=st.binary(max_size=8))
def test_mutations_and_appended_bytes_never_raise_anything_but_decode_error(sample, position, byte, extra):
    data, proto, in_stream = sample
    mutated = bytearray(data)
    mutated[position % len(mutated)] = byte
    _decode_or_decode_error(bytes(mutated) + extra, proto, in_stream)
    if extra:
        with pytest.raises(DecodeError, match="trailing"):
            decode(data + extra, proto_version=proto, in_stream=in_stream)


@settings(max_examples=1000)
@given(data=st.binary(max_size=64), proto=st.sampled_from([1, 2, 3, 4]), in_stream=st.booleans())
def test_random_bytes_never_raise_anything_but_decode_error(data, proto, in_stream):
    _decode_or_decode_error(data, proto, in_stream)


def test_encode_refuses_what_decode_would_refuse():
    with pytest.raises(ValueError, match="Stream Start needs protocol version 2"):
        encode(StreamStart(1, True), proto_version=1, in_stream=False)
    with pytest.raises(ValueError, match="cannot appear between Stream Start and Stream Stop"):
        encode(Begin(Lsn(1), 0, 1), proto_version=2, in_stream=True)
    with pytest.raises(ValueError, match="outside a streamed block"):
        encode(StreamStop(), proto_version=2, in_stream=False)


def test_decode_error_names_message_field_and_offset():
    insert = encode(Insert(None, 16384, TupleData.of([("t", b"42"), ("t", b"hello")])), proto_version=1,
                    in_stream=False)
    with pytest.raises(DecodeError) as info:
        decode(insert[:-2], proto_version=1, in_stream=False)
    assert "Insert" in str(info.value) and "new[1]" in str(info.value) and "offset" in str(info.value)
    with pytest.raises(DecodeError, match="Stream Start needs protocol version 2"):
        decode(encode(StreamStart(1, True), proto_version=2, in_stream=False), proto_version=1, in_stream=False)
    with pytest.raises(DecodeError, match="unknown message type"):
        decode(b"Z", proto_version=4, in_stream=False)
    with pytest.raises(DecodeError, match="UTF-8"):
        decode(b"O" + bytes(8) + b"\xff\xfe\0", proto_version=1, in_stream=False)


def test_huge_declared_counts_do_not_allocate():
    # a Truncate claiming 2^31-1 relations in 10 bytes is refused before anything is allocated for them
    with pytest.raises(DecodeError, match="relation_ids"):
        decode(b"T" + (2**31 - 1).to_bytes(4, "big") + b"\0", proto_version=1, in_stream=False)
    with pytest.raises(DecodeError, match=r"new\.number_of_columns"):
        decode(b"I" + bytes(4) + b"N" + (32767).to_bytes(2, "big"), proto_version=1, in_stream=False)


def test_live_server_still_sends_what_the_fixtures_hold(pg):
    """The capture path works against the running server, so the fixtures cannot silently rot."""
    sys.path.insert(0, str(Path(__file__).parent))
    from capture_fixtures import basic, capture

    live = capture(pg.dsn, "basic", basic, 4, {"binary": "true", "streaming": "parallel"})
    stored = next(r for r in RECORDS if r["scenario"] == "basic" and r["proto_version"] == 4)
    kinds = [[type(m).__name__ for _, _, m in decoded(r)] for r in (live, stored)]
    assert kinds[0] == kinds[1]
