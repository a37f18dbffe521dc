"""The states an :class:`~celery_zklock.engine.attempt.machine.Attempt` moves between, and
what its collaborators may read of it (:class:`AttemptView`)."""

from __future__ import annotations

import enum
from typing import Protocol

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


class AttemptView(Protocol):
    """What a collaborator (:mod:`.ghosts`, :mod:`.holding`) may read of the
    :class:`~.machine.Attempt` it serves, under the attempt's ``mutex``, and never write:
    whether a reply is still wanted (``finished``, ``look``) and which hold it is
    (``state``, ``node``, ``session``).  What they find they tell the attempt, which
    applies it itself."""

    @property
    def state(self) -> State: ...

    @property
    def node(self) -> str | None: ...

    @property
    def session(self) -> int | None: ...

    @property
    def finished(self) -> bool: ...

    @property
    def look(self) -> int: ...
