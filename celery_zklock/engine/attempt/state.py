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


WAITING_STATES = (State.CREATING, State.WAITING)
HELD_STATES = (State.HELD, State.HELD_SUSPENDED)
