"""Every LSN decision on its own: no server, no Spark."""

from __future__ import annotations

import pytest

from pgcdc.checkpoint import (
    Checkpoint,
    Span,
    first_unapplied,
    held_whole,
    mirror_position,
    refuse_lost_slot,
    refuse_positions_ahead,
    resume_position,
)
from pgcdc.errors import ConfigError, PositionCorruptError
from pgcdc.lsn import ZERO, Lsn


def span(*commit_lsns: int) -> Span:
    noted = Span()
    for lsn in commit_lsns:
        noted.note(Lsn(lsn))
    return noted


def test_a_batch_confirms_its_end_when_nothing_is_held():
    assert Checkpoint.batch_flush(Lsn(500), held=None) == Lsn(500)


def test_a_batch_never_confirms_past_a_held_prepared_transaction():
    assert Checkpoint.batch_flush(Lsn(500), held=Lsn(300)) == Lsn(300)
    # held after the batch's end: the batch's end is below it, and that is what it may confirm
    assert Checkpoint.batch_flush(Lsn(500), held=Lsn(700)) == Lsn(500)
    assert Checkpoint.batch_flush(Lsn(500), held=Lsn(500)) == Lsn(500)


def test_the_confirmed_position_never_goes_backwards():
    checkpoint = Checkpoint(resume_from=Lsn(100))
    assert checkpoint.confirmed == Lsn(100)
    assert not checkpoint.advance(Lsn(100))
    assert not checkpoint.advance(Lsn(50))
    assert not checkpoint.advance(None)
    assert checkpoint.confirmed == Lsn(100)
    assert checkpoint.advance(Lsn(200))
    assert not checkpoint.advance(Lsn(150))  # a batch held back by a prepared transaction, after a quiet confirm
    assert checkpoint.confirmed == Lsn(200)


def test_a_quiet_slot_confirms_the_servers_position_only_when_nothing_waits():
    assert Checkpoint.quiet_flush(Lsn(900), unapplied=False, held=None) == Lsn(900)
    assert Checkpoint.quiet_flush(Lsn(900), unapplied=True, held=None) is None  # a batch collected or applying
    assert Checkpoint.quiet_flush(Lsn(900), unapplied=False, held=Lsn(400)) is None  # a prepared transaction
    assert Checkpoint.quiet_flush(None, unapplied=False, held=None) is None  # the server sent no position yet
    assert Checkpoint.quiet_flush(ZERO, unapplied=False, held=None) is None


def test_rule_2_skips_what_a_mirror_holds():
    assert first_unapplied(None) == 0  # a mirror without a position holds nothing
    assert first_unapplied(Lsn(700)) == 701  # the transaction committed at 700 is in the mirror


def test_a_run_records_its_last_transaction():
    assert mirror_position(span(10, 10, 20, 30), following=None, current=Lsn(5)) == Lsn(30)
    # the following run starts with a later transaction: nothing is split
    assert mirror_position(span(10, 20), following=span(30), current=None) == Lsn(20)


def test_a_transaction_split_by_a_schema_change_is_claimed_by_its_last_run():
    first, second = span(10, 20, 30), span(30, 40)
    # the first run claims the transaction before the split one: a crash between the two commits replays 30
    assert mirror_position(first, following=second, current=Lsn(5)) == Lsn(20)
    assert mirror_position(second, following=None, current=Lsn(20)) == Lsn(40)


def test_a_run_holding_only_a_split_transaction_never_moves_the_mirror_backwards():
    assert mirror_position(span(30), following=span(30, 40), current=Lsn(25)) == Lsn(25)
    assert mirror_position(span(30), following=span(30), current=None) == ZERO
    # three runs of one transaction (two schema changes inside it): only the last claims it
    runs = [span(30), span(30), span(30, 50)]
    positions = [mirror_position(run, runs[i + 1] if i + 1 < len(runs) else None, Lsn(25))
                 for i, run in enumerate(runs)]
    assert positions == [Lsn(25), Lsn(25), Lsn(50)]


def test_a_span_notes_first_last_and_the_transaction_before_the_last():
    noted = span(10, 10, 20, 20, 30)
    assert (noted.first, noted.last, noted.previous) == (Lsn(10), Lsn(30), Lsn(20))
    assert (Span().first, Span().last, Span().previous) == (ZERO, ZERO, ZERO)


def test_a_restart_resumes_from_the_slot_unless_it_lost_its_wal():
    assert resume_position("s", Lsn(123), invalidated=None) == Lsn(123)
    assert resume_position("s", None, invalidated=None) == ZERO
    with pytest.raises(ConfigError, match=r"'s' was invalidated \(wal_removed\).*--resnapshot"):
        resume_position("s", Lsn(123), invalidated="wal_removed")


def test_a_missing_slot_is_recreated_only_when_no_mirror_holds_a_position():
    refuse_lost_slot("s", "mirror", {})
    with pytest.raises(ConfigError, match=r"'s' does not exist, but 2 mirrors .*up to 0/200.*--resnapshot"):
        refuse_lost_slot("s", "mirror", {("a", "t"): Lsn(0x100), ("a", "u"): Lsn(0x200)})


def test_positions_beyond_the_servers_wal_are_never_trusted():
    refuse_positions_ahead({("a", "t"): Lsn(100)}, server_lsn=Lsn(100))
    with pytest.raises(PositionCorruptError, match=r"a\.u at 0/C8"):
        refuse_positions_ahead({("a", "t"): Lsn(100), ("a", "u"): Lsn(200)}, server_lsn=Lsn(150))


def test_a_run_the_mirror_holds_whole_is_passed_over():
    span = Span()
    for lsn in (Lsn(10), Lsn(20)):
        span.note(lsn)
    assert held_whole(span, Lsn(20)) and held_whole(span, Lsn(25))
    assert not held_whole(span, Lsn(19)) and not held_whole(span, None)

