"""The states an :class:`~celery_zklock.engine.attempt.machine.Attempt` moves between."""

from __future__ import annotations

import enum

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


WAITING_STATES = (State.CREATING, State.WAITING)
HELD_STATES = (State.HELD, State.HELD_SUSPENDED)
