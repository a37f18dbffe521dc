"""``acks_late`` redelivery: a copy of a task run that is still queued or running ahead of us.

Why: with ``acks_late`` a broker may deliver a message again while its first delivery
still waits for the lock or runs (Redis ``visibility_timeout``, a lost connection).  A
lock that let the copy queue like any task would run the same work twice, or apply the
copy's timeout policy over the original's state.  So a copy keeps its place behind its
original (the two never run at once), waits for it without a deadline, and once the
original is done runs only if the original left no final state.

A copy is recognised by its node's :class:`~celery_zklock.engine.identity.Identity`: the same
task id *and* attempt (``retries``).  A retry published by the body while it still holds
the lock has the same task id but is the next attempt: new work, not a copy.
"""

from __future__ import annotations

import time

from celery import states
from celery.backends.base import DisabledBackend
from celery.utils.log import get_task_logger

from .engine import znodes
from .engine.identity import Identity

logger = get_task_logger("celery_zklock")

#: How long a redelivered copy waits for its original's final state to be stored.
RESULT_GRACE = 2.0


def delivery_of(contender) -> tuple | None:
    """(task id, attempt) of a queued node; None for nodes not written by a task."""
    identity = Identity.parse(contender.identifier)
    return identity.delivery if identity is not None else None


class Redelivery:
    """The copy checks of one task run; inert unless the task is ``acks_late``."""

    def __init__(self, task, client, task_id: str | None, retries: int, enabled: bool) -> None:
        self.task = task
        self.client = client
        self.delivery = (task_id, retries) if enabled and task_id else None
        self.seen = False  # a copy of ours was seen ahead of us

    def queued_behind_original(self, lock) -> bool:
        """On having to wait: are we a copy queued behind our original?  (Monitoring only.)"""
        if self.delivery is None:
            return False
        try:
            if self.duplicates_ahead(lock):
                self.seen = True
                return True
        except Exception as exc:
            logger.warning("could not look for an earlier copy of task %s: %r", self.delivery[0], exc)
        return False

    def acquire(self, lock, timeout: float | None, max_holders: int) -> bool:
        """Take ``lock`` under ``timeout`` — except for a copy, which waits without a deadline
        until its original is gone (it must neither run beside it nor apply a timeout policy)."""
        while True:
            acquired = lock.acquire(timeout=timeout)
            if acquired:
                if self.delivery is None or max_holders == 1:
                    return True  # one slot: nobody can be ahead of a holder
                ahead = self.duplicates_ahead(lock)
                if not ahead:
                    return True
                # Several slots: the original may hold one beside us.  Wait for it with no
                # slot held, so a MultiLock copy can never block its own original.
                self.seen = True
                lock.release()
                wait_nodes_gone(self.client, ahead)
            elif self.delivery is None or not self.client.connected:
                return False
            elif not self.seen and not self._copies_queued(lock):
                return False  # an honest timeout: nobody with our task id is in the queue
            else:
                self.seen = True
                logger.info("task %s: its original still holds or awaits the lock; waiting without a deadline", self.delivery[0])
            timeout = None

    def duplicates_ahead(self, lock) -> list[str]:
        """Paths of nodes *ahead of ours* carrying our task id and attempt.

        Only nodes ahead count: when two copies race, each sees the other; the one that
        queued first is the original for our purposes.
        """
        found = []
        for lk in lock.locks:
            mine = znodes.sequence_of((lk.node or "").rsplit("/", 1)[-1])
            for c in lk.contenders():
                if mine is not None and znodes.queue_distance(c.sequence, mine) < 0 and delivery_of(c) == self.delivery:
                    found.append(f"{lk.path}/{c.node}")
        return found

    def _copies_queued(self, lock) -> bool:
        """After a timeout (our node deleted): is a node of our delivery in any queue?"""
        try:
            return any(delivery_of(c) == self.delivery for lk in lock.locks for c in lk.contenders())
        except Exception as exc:
            logger.warning("could not look for an earlier copy of task %s: %r", self.delivery[0], exc)
            return False

    def finished_elsewhere(self) -> bool:
        """Having waited behind our original: did it already reach a final state?

        Without a result backend we cannot tell, and run the copy (at-least-once, as
        Celery's acks_late promises): losing the work would be worse than repeating it.
        """
        task = self.task
        if not self.seen or task.ignore_result or isinstance(task.backend, DisabledBackend):
            return False
        task_id = self.delivery[0]
        # Celery stores the original's result just *after* its __call__ (and so its
        # release) returns: give that write a moment to land before deciding.
        deadline = time.monotonic() + RESULT_GRACE
        while True:
            try:
                if task.backend.get_state(task_id) in states.READY_STATES:
                    return True
            except Exception as exc:
                logger.warning("cannot read the state of task %s (%r); running the redelivered copy", task_id, exc)
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def wait_nodes_gone(client, nodes: list[str]) -> None:
    """Block until every znode in ``nodes`` is deleted (a watch each, no polling)."""
    for node in nodes:
        while True:
            changed = client.handler.event_object()
            if client.exists(node, watch=lambda _event: changed.set()) is None:
                break
            # Re-checked every second too: a watch does not survive a session expiry.
            changed.wait(1.0)
