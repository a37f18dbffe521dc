"""The elected beat's pure decisions, table by table (celery_zklock.beat.rules)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab, schedule

from celery_zklock.beat.rules import (
    Handover,
    TickRecord,
    TickState,
    TickVerdict,
    already_sent,
    handover,
    missed_due_times,
    on_own_clock,
    skew_to_say,
    verdict,
)

T0 = datetime(2026, 11, 26, 12, 0, 0, tzinfo=timezone.utc)


def record(last_run_at=T0, seq=7, state=TickState.SENT) -> TickRecord:
    return TickRecord(last_run_at=last_run_at, due=last_run_at, seq=seq, runs=seq, state=state, by="h:1", token=42,
                      nonce="n")


@pytest.mark.parametrize("age, session, leader, expected", [
    (0.0, 9.0, True, TickVerdict.PUBLISH),
    (2.999, 9.0, True, TickVerdict.PUBLISH),
    (3.001, 9.0, True, TickVerdict.STALE),  # a third of the session: the lock's lease rule
    (30.0, 9.0, True, TickVerdict.STALE),  # stopped between the write and the publish
    (0.0, 9.0, False, TickVerdict.NOT_LEADER),  # suspended or lost: doubt wins
    (30.0, 9.0, False, TickVerdict.NOT_LEADER),
])
def test_verdict(age, session, leader, expected):
    assert verdict(age, session, leader) is expected


@pytest.mark.parametrize("rec, ours, expected", [
    (None, T0, False),  # never sent by anyone: ours to send
    (record(T0), T0, False),  # the record is the base of our due time: send the next
    (record(T0 + timedelta(seconds=1)), T0, True),  # someone sent after our view: adopt, send nothing
    (record(T0 - timedelta(seconds=1)), T0, False),  # older record (entry reset locally): send
    (record(T0), None, True),  # we know nothing, the record does
])
def test_already_sent(rec, ours, expected):
    assert already_sent(rec, ours) is expected


@pytest.mark.parametrize("sched, elapsed, expected", [
    (schedule(timedelta(seconds=1)), 0.5, 0),
    (schedule(timedelta(seconds=1)), 1.0, 1),
    (schedule(timedelta(seconds=1)), 4.4, 4),
    (schedule(timedelta(seconds=10)), 86400.0, 8640),  # arithmetic, not a loop
    (crontab(minute="*"), 30.0, 0),
    (crontab(minute="*"), 60.0, 1),
    (crontab(minute="*"), 3 * 60 + 1, 3),
    (crontab(minute="0", hour="*"), 2 * 3600 + 5, 2),
])
def test_missed_due_times(sched, elapsed, expected):
    assert missed_due_times(sched, T0, T0 + timedelta(seconds=elapsed)) == expected


def test_missed_due_times_is_capped_for_stepped_schedules():
    assert missed_due_times(crontab(minute="*"), T0, T0 + timedelta(days=30), cap=50) == 50


@pytest.mark.parametrize("state, elapsed, expected", [
    (TickState.SENT, 0.5, Handover(0, 0, False)),
    (TickState.SENT, 1.2, Handover(1, 0, False)),  # one due time: sent now, none skipped
    (TickState.SENT, 4.4, Handover(4, 3, False)),  # one sent now, three skipped (reported)
    (TickState.SENDING, 1.2, Handover(1, 0, True)),  # its writer may have died before publishing
])
def test_handover(state, elapsed, expected):
    assert handover(record(state=state), schedule(timedelta(seconds=1)), T0 + timedelta(seconds=elapsed)) == expected


def test_record_round_trip_and_bad_data():
    r = record(state=TickState.SENDING)
    assert TickRecord.parse(r.to_bytes()) == r
    assert TickRecord.parse(r.sent().to_bytes()).state is TickState.SENT
    for bad in (None, b"", b"{}", b"[1]", b'{"seq": "x"}', b"\xff"):
        assert TickRecord.parse(bad) is None


@pytest.mark.parametrize("written_ms, own_skew, expected", [
    (None, 0.0, T0),  # when the server applied the write is unknown: the writer's own time
    (int(T0.timestamp() * 1000) - 60_000, None, T0),  # this beat's skew unknown: likewise
    (int(T0.timestamp() * 1000) - 60_000, 0.0, T0 - timedelta(seconds=60)),  # writer 60 s ahead, ours true
    (int(T0.timestamp() * 1000), 5.0, T0 + timedelta(seconds=5)),  # writer true, ours 5 s ahead
    (int(T0.timestamp() * 1000) + 30_000, -2.0, T0 + timedelta(seconds=28)),  # writer 30 s behind, ours 2 s behind
])
def test_on_own_clock(written_ms, own_skew, expected):
    assert on_own_clock(T0, written_ms, own_skew) == expected


@pytest.mark.parametrize("skew, period, expected", [
    (None, 1.0, False),
    (0.5, 1.0, False),
    (1.5, 1.0, True),
    (-1.5, 1.0, True),
    (0.9, 0.2, False),  # at least a second: NTP's usual error is never news
    (45.0, 60.0, False),  # a crontab's minute
    (61.0, 60.0, True),
])
def test_skew_to_say(skew, period, expected):
    assert skew_to_say(skew, period) is expected
