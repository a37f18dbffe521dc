"""The elected scheduler's decisions, as pure functions over plain values (table-tested).

Why apart from the I/O: whether a tick may be published, whether a record means "already
sent", and how many due times a handover missed are the rules that make ticks exactly-once;
they read best, and are tested best, with no ZooKeeper or Celery object in sight.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta, timezone
from enum import Enum

from ..engine.session import session_margin


class TickState(str, Enum):
    """What a tick record says of its publish (the wire encoding is the value)."""

    SENDING = "sending"  # recorded by the leader; its publish follows at once
    SENT = "sent"  # the broker took the message


class Written(Enum):
    """What became of a conditional write of a tick record."""

    RECORDED = "recorded"  # applied while our election node existed: we were the leader
    CONFLICT = "conflict"  # the record changed since we read it: someone else wrote it
    DEPOSED = "deposed"  # our election node is gone: we are not the leader
    UNKNOWN = "unknown"  # no reply (connection loss, timeout): it may or may not be applied


class TickVerdict(Enum):
    """Whether a recorded tick is published."""

    PUBLISH = "publish"
    STALE = "stale"  # the proof is older than session_margin() of the session: maybe deposed since
    NOT_LEADER = "not leader"  # the connection gives reason to doubt the session (suspended, lost)


@dataclass(frozen=True)
class TickRecord:
    """One schedule entry's last tick, kept in ZooKeeper and shared by every beat of a group.

    ``last_run_at`` is what Celery's entry holds after the send (the base of its next due
    time); ``due`` the scheduled time the tick was for; ``seq`` counts the entry's ticks
    across every leader, so a consumer (and the tests) can see each was sent once.
    """

    last_run_at: datetime
    due: datetime
    seq: int
    runs: int  # Celery's total_run_count after the send
    state: TickState
    by: str  # host:pid of the beat that wrote it
    token: int  # fencing token of its election node
    nonce: str  # tells our own write apart after an unanswered one

    def to_bytes(self) -> bytes:
        raw = asdict(self)
        raw.update(last_run_at=self.last_run_at.isoformat(), due=self.due.isoformat(), state=self.state.value)
        return json.dumps(raw, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes | None) -> "TickRecord | None":
        """The record in ``data``; None for data of another shape (so a bad node is rewritten,
        never trusted)."""
        try:
            raw = json.loads(data or b"")
            return cls(last_run_at=datetime.fromisoformat(raw["last_run_at"]), due=datetime.fromisoformat(raw["due"]),
                       seq=int(raw["seq"]), runs=int(raw["runs"]), state=TickState(raw["state"]), by=str(raw["by"]),
                       token=int(raw["token"]), nonce=str(raw["nonce"]))
        except (TypeError, ValueError, KeyError):
            return None

    def sent(self) -> "TickRecord":
        return replace(self, state=TickState.SENT)


def verdict(proof_age: float, session_timeout: float, connected_and_leader: bool) -> TickVerdict:
    """May a tick whose record was written ``proof_age`` seconds ago (counted from *sending*
    the write, so the server applied it no earlier) be published now?

    The write was applied while our election node existed; ZooKeeper cannot expire our session
    until a full session timeout after it last heard from us, so no other beat can lead
    within that time.  Publishing within a third of it leaves the rest for the broker.
    """
    if not connected_and_leader:
        return TickVerdict.NOT_LEADER
    if proof_age > session_margin(session_timeout):  # the lock's lease rule (worker.cohort), for a tick
        return TickVerdict.STALE
    return TickVerdict.PUBLISH


def already_sent(record: TickRecord | None, last_run_at: datetime | None) -> bool:
    """Does ``record`` show a tick sent after the entry's ``last_run_at`` (our view)?  Then
    another leader sent this due time: adopt its record, send nothing."""
    if record is None:
        return False
    if last_run_at is None:
        return True
    return _aware(record.last_run_at) > _aware(last_run_at)


def _aware(moment: datetime) -> datetime:
    """A naive time (an old schedule file's) is read as UTC, so comparing never raises."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def missed_due_times(schedule, last_run_at: datetime, now: datetime, cap: int = 10_000) -> int:
    """How many due times of ``schedule`` fell in (``last_run_at``, ``now``].

    Interval schedules by arithmetic; others (crontab, solar) by stepping from one due time
    to the next with Celery's own ``remaining_estimate`` on a copy whose clock reads ``now``,
    at most ``cap`` steps.
    """
    run_every = getattr(schedule, "run_every", None)
    if isinstance(run_every, timedelta) and type(schedule).__name__ == "schedule":
        seconds = run_every.total_seconds()
        if seconds <= 0:
            return 0
        return max(0, math.floor((_aware(now) - _aware(last_run_at)).total_seconds() / seconds + 1e-9))
    at_now = copy.copy(schedule)  # its own clock set to ``now``: the estimate is from then
    at_now.nowfun = lambda: now
    count, t = 0, last_run_at
    while count < cap:
        try:
            nxt = now + at_now.remaining_estimate(t)
        except Exception:
            return count
        if nxt > now or nxt <= t:
            return count
        count, t = count + 1, nxt
    return count


@dataclass(frozen=True)
class Handover:
    """What a new leader found for one entry: ``missed`` due times since the last tick (one
    is sent now, as Celery sends one tick for a beat that was down), ``skipped`` = the rest,
    and whether the last record may never have been published (its writer died between the
    record and the publish)."""

    missed: int
    skipped: int
    unconfirmed: bool


def on_own_clock(when: datetime, written_ms: int | None, own_skew: float | None) -> datetime:
    """A record's time, stamped on its writer's clock, moved to this beat's: the server's
    stamp of the write (``written_ms``, the node's mtime) plus ``own_skew`` (this beat's clock
    minus ZooKeeper's).  Unchanged when either is unknown.  Why: a new leader computed its
    first due time from the previous leader's clock, so a leader 60 s ahead left its successor
    sending nothing for 60 s, and one behind made clock error look like missed ticks."""
    if written_ms is None or own_skew is None:
        return when
    return datetime.fromtimestamp(written_ms / 1000.0 + own_skew, tz=when.tzinfo)


def skew_to_say(skew: float | None, period: float) -> bool:
    """Is a clock difference worth a warning: more than one period of the entry (at least 1 s)?"""
    return skew is not None and abs(skew) > max(1.0, period)


def handover(record: TickRecord, schedule, now: datetime) -> Handover:
    missed = missed_due_times(schedule, record.last_run_at, now)
    return Handover(missed=missed, skipped=max(0, missed - 1), unconfirmed=record.state is TickState.SENDING)
