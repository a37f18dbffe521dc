"""The elected beat's fence where a tick runs: each tick's body at most once, and never after
a later tick of its entry.

Why at the worker: the beat proves its leadership in ZooKeeper before it publishes, but the
broker is past that proof.  A publish whose reply was lost is retried by kombu and redis-py
(the message is queued twice); a leader stalled in its publish, or cut off and deposed,
delivers its tick late, after the next leader's.  Only the place where the message is
consumed sees every copy, so each tick carries ``zklock_beat`` {entry, seq, token, fence}
and the worker's lock agent records, per entry, the last tick that ran (one znode, written
with a version check): a tick whose seq is not above it already ran or was overtaken.

The rule is :func:`decide`; :func:`consume` is its one read and one conditional write (two
ZooKeeper requests per tick, a few more under a race).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from .kazoo_compat import acl_for


class Fenced(str, enum.Enum):
    """What the fence says of a tick message (the wire value: JSON strings)."""

    RUN = "run"  # the first of its entry's ticks at or above its seq: it runs
    DUPLICATE = "duplicate"  # this tick already ran (a publish sent twice)
    STALE = "stale"  # a later tick of its entry ran first (a deposed or stalled leader's)


@dataclass(frozen=True)
class Tick:
    """A tick as the fence knows it: its entry's fence znode, its seq and its term's token."""

    path: str
    seq: int
    token: int | None

    @classmethod
    def of(cls, header) -> "Tick | None":
        """From a message's ``zklock_beat`` header; None without one, or without a fence
        (sent by a beat that does not fence, or with ``zklock_beat_fence`` off)."""
        if not isinstance(header, dict) or not header.get("fence"):
            return None
        try:
            return cls(str(header["fence"]), int(header["seq"]), header.get("token"))
        except (KeyError, TypeError, ValueError):
            return None


def decide(last: tuple[int, int | None] | None, seq: int, token: int | None) -> Fenced:
    """The fence's rule: ``last`` is (seq, token) of the tick of this entry that ran last.

    A tick runs if its seq is above the last one's: seqs grow across terms (each new leader
    continues from the group's records), so a tick of an older term that arrives late has a
    lower seq than the one that ran.  Equal seqs are the same tick (two copies of a publish).
    A higher seq from an older term than the last run's cannot come from a working election;
    it is not run either (stale)."""
    if last is None:
        return Fenced.RUN
    last_seq, last_token = last
    if seq == last_seq:
        return Fenced.DUPLICATE
    if seq < last_seq:
        return Fenced.STALE
    if token is not None and last_token is not None and token < last_token:
        return Fenced.STALE
    return Fenced.RUN


def consume(client, tick: Tick) -> Fenced:
    """Decide ``tick`` against its entry's record and, if it runs, record it: a read and a
    write at the version read (a create for an entry's first tick); a race with another
    worker is read again.  Blocking: run it off any event loop."""
    data = json.dumps({"seq": tick.seq, "token": tick.token}).encode()
    while True:
        try:
            raw, stat = client.get(tick.path)
        except NoNodeError:
            try:
                client.create(tick.path, data, acl=acl_for(client, tick.path), makepath=True)
                return Fenced.RUN
            except NodeExistsError:
                continue
        try:
            last = json.loads(raw.decode() or "null")
            last = (int(last["seq"]), last.get("token")) if last else None
        except (ValueError, KeyError, TypeError):
            last = None  # unreadable: a tick runs rather than none ever again
        verdict = decide(last, tick.seq, tick.token)
        if verdict is not Fenced.RUN:
            return verdict
        try:
            client.set(tick.path, data, version=stat.version)
            return Fenced.RUN
        except (BadVersionError, NoNodeError):
            continue
