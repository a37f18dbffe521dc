"""The enqueue guard's pure rules: what a guard node holds, where it lives, and what a publisher
does about one it finds (:func:`verdict`, table-tested).

Why apart from :mod:`celery_zklock.engine.guards`: that module is the protocol (kazoo calls,
in order, top to bottom); these are the decisions it takes, with no I/O and no clock of
their own, as Curator keeps ``getsTheLock`` out of its lock loop.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass
from typing import Any

from ..keys import encode_key

#: The guards' folder under ``zklock_root``.  A leading dot: no key encodes to it
#: (:func:`celery_zklock.keys.encode_key` escapes one), so it never meets a lock path.
FOLDER = ".enqueue"

#: The message header (and so the request attribute) that carries a guarded task's guard.
HEADER = "zklock_guard"

UNTIL = ("start", "finish")
MODES = ("dedupe", "reject")

#: How long a guard may stay unconfirmed (created, its message not yet known to be with the
#: broker).  Publishers that find it wait that long at most; past it the guard is stale and
#: the key is taken over (a duplicate if that publish did reach the broker: never a loss).
PUBLISH_WINDOW = 10.0


class GuardVerdict(enum.Enum):
    """What a publisher does about a guard found in place (:func:`verdict`)."""

    OWN = "own"  # it names this very task: a retry or a republish of it takes it over
    STALE = "stale"  # past its bound (or never confirmed in time): nobody will run it
    HELD = "held"  # another task of the key is queued (or running): dedupe or refuse
    UNCONFIRMED = "unconfirmed"  # its publish is under way: wait for it, then decide


OWN, STALE, HELD, UNCONFIRMED = GuardVerdict.OWN, GuardVerdict.STALE, GuardVerdict.HELD, GuardVerdict.UNCONFIRMED


def folder(root: str) -> str:
    return f"{root.rstrip('/')}/{FOLDER}"


def guard_path(root: str, task: str, key: str) -> str:
    """One guard per task name and key: ``refresh`` for user 42 does not dedupe into
    ``bill`` for user 42, even where both serialize on the same lock key."""
    return f"{folder(root)}/{encode_key(task)}/{encode_key(key)}"


@dataclass(frozen=True)
class Guard:
    """What a guard node holds: whose it is, until when it can matter, and how much work
    was deduped into it."""

    id: str
    task: str
    until: str
    expires_at: float  # the guard's bound (time.time()): past it, a queued guard is stale
    retries: int = 0
    at: float = 0.0  # when it was published
    confirmed: bool = True  # its message is with the broker (guards of older versions: yes)
    publish_by: float = 0.0  # unconfirmed past this: its publisher never got through
    #: The czxid of the node its publisher created, written by the confirm (0: not stated,
    #: as in guards of older versions and running guards, whose identity is their session).
    #: A confirm is a write conditional on version 0, and every new guard is at version 0:
    #: one that arrives after its task started and another publisher took the key lands on
    #: that publisher's node, and this field is then how a reader tells (:func:`misplaced`).
    node: int = 0
    #: Publishes deduped into it (a lower bound under contention), as :func:`~celery_zklock.
    #: engine.guards.release` read them off its counter node: never stored in the guard itself.
    deduped: int = 0

    def dumps(self) -> bytes:
        fields = asdict(self)
        del fields["deduped"]
        return json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes) -> "Guard | None":
        try:
            raw = json.loads(data.decode())
            return cls(id=str(raw["id"]), task=str(raw.get("task") or ""), until=str(raw.get("until") or "start"),
                       expires_at=float(raw["expires_at"]), retries=int(raw.get("retries") or 0),
                       at=float(raw.get("at") or 0.0), confirmed=bool(raw.get("confirmed", True)),
                       publish_by=float(raw.get("publish_by") or 0.0), node=int(raw.get("node") or 0))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def names(self, task_id: str, retries: int) -> bool:
        return self.id == task_id and self.retries == retries

    def ended_by(self, task_id: str, retries: int) -> bool:
        """A run ends the guard of its own try or of an earlier one of its id (a retry whose
        takeover failed left that one); never a later try's, which a retry just published."""
        return self.id == task_id and self.retries <= retries


def bound(now: float, eta: float | None, expires: float | None, staleness: float) -> float:
    """A queued guard's bound (pure): the message's own ``expires`` when it has one (the worker
    discards it then), else its ETA (or now) plus ``staleness``, so that neither a countdown
    nor a backlog shorter than ``staleness`` makes it stale."""
    if expires is not None:
        return expires
    return max(now, eta or now) + staleness


def misplaced(found: "Guard | None", czxid: int) -> bool:
    """A confirm that landed on another node than the one its publisher created (pure): the
    guard names a task that already started (its own node ended then), on a node another
    publisher created since, whose task id the confirm overwrote.  It names nobody: nobody
    may dedupe into it (the work would be lost) and any run or publish may clear it (its
    real publisher's task is queued all the same: a duplicate at worst)."""
    return found is not None and found.confirmed and bool(found.node) and bool(czxid) and found.node != czxid


def verdict(found: "Guard | None", task_id: str, now: float, running: bool = False, czxid: int = 0) -> GuardVerdict:
    """What a publisher of ``task_id`` does about a guard it found in place (pure).

    ``running``: the guard is an ephemeral node (``lock_enqueue_until="finish"``, its task
    running): its bound is the running worker's session, not ``expires_at``, which bounds
    only a queued guard whose message the broker may have lost.  ``czxid``: the node's
    (0: unknown), against which a confirmed guard's ``node`` is checked.  A node we cannot
    read as a guard is somebody else's: held, never deleted."""
    if found is None:
        return HELD
    if running:
        return OWN if found.id == task_id else HELD
    if misplaced(found, czxid):
        return STALE
    if found.id == task_id:
        return OWN
    if not found.confirmed:
        return STALE if now >= found.publish_by else UNCONFIRMED
    if now >= found.expires_at:
        return STALE
    return HELD


def guarded(request_or_headers: Any) -> dict | None:
    """The guard header of a request (a Celery Request, a task's request Context, or a
    message's headers dict), if its task was published under a guard."""
    if isinstance(request_or_headers, dict):
        value = request_or_headers.get(HEADER)
    else:
        value = getattr(request_or_headers, HEADER, None)
        if value is None:
            headers = getattr(request_or_headers, "request_dict", None) or getattr(request_or_headers, "headers", None)
            value = headers.get(HEADER) if isinstance(headers, dict) else None
    if isinstance(value, dict) and isinstance(value.get("paths"), list) and value.get("until") in UNTIL:
        return value
    return None
