"""The states an :class:`~celery_zklock.engine.attempt.machine.Attempt` moves between."""

from __future__ import annotations

import enum
import threading
from typing import Any, Protocol

from .. import znodes

#: Lock paths whose parent this process saw lately (see znodes.RecentPaths).
RECENT = znodes.RecentPaths()


class State(enum.Enum):
    IDLE = "idle"  # not started, given up (timeout/cancel) or released
    CREATING = "creating"  # our node is being created, or a lost create is being resolved
    WAITING = "waiting"  # our node is queued behind holders
    HELD = "held"
    HELD_SUSPENDED = "held-suspended"  # held, but disconnected: unsafe until re-verified
    LOST = "lost"  # was held and is not any more; ``lost_reason`` says why


class Pending(enum.Enum):
    """What an attempt cut off from ZooKeeper does once connected again."""

    CREATE = "create"  # send our create (again)
    GHOST = "ghost"  # a create's reply was lost: adopt our node if it was made, else create
    READ = "read"  # read the queue again
    CLEANUP = "cleanup"  # given up with a create's reply lost: delete any node of ours


class Queue(enum.Enum):
    """What an attempt knows of its key's queue as its create is answered, besides a read."""

    # The key's container was made in the same multi as our node: ours is its first child.
    # Why not "sequence 0" alone: the sequence is the parent's cversion, which wraps
    # (znodes.SEQUENCE_WRAP), so an old parent names a node 0 again with others ahead.
    FRESH = "fresh"


WAITING_STATES = (State.CREATING, State.WAITING)
HELD_STATES = (State.HELD, State.HELD_SUSPENDED)


class AttemptPath(Protocol):
    """What the attempt's collaborators (:mod:`.parents`, :mod:`.ghosts`, :mod:`.holding`)
    may use of the :class:`~.machine.Attempt` they serve: its fields, and the steps of
    its path they hand back to.  Each collaborator runs its handlers under ``mutex``."""

    lk: Any  # the LockInternals: path, identifier, max_holders, grace(), on_lost
    client: Any  # the KazooClient
    monitor: Any  # the client's SessionMonitor: timers, epoch, new_keys
    prefix: str
    mutex: threading.RLock
    state: State
    node: str | None
    session: int | None
    finished: bool
    look: int
    pending: Pending | None
    create_in_flight: bool

    def next_look(self) -> int: ...
    def send_create(self, same_try: bool = False) -> None: ...
    def on_created(self, session, listed, result) -> None: ...
    def adopt(self, name: str, czxid: int, session) -> bool: ...
    def act_on_queue(self, children) -> None: ...
    def await_connection(self, kind: Pending | None) -> None: ...
    def give_up(self, value: bool | BaseException) -> None: ...
    def settle_cleanup(self) -> None: ...
    def delete(self, name: str, session) -> Any: ...
    def delete_given_up(self, name: str, session) -> None: ...
    def mark_lost(self, reason: str) -> None: ...
