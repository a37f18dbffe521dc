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

An acks-early task is acknowledged as its pool process takes it, so the broker delivers it
again only when that acknowledgement was lost with a connection: the first delivery may have
begun, and may have run already.  A delivery the broker flags ``redelivered`` is therefore a
possible copy too, and once granted its lock it runs only if its first delivery left no
final state (:func:`earlier_run`).
"""

from __future__ import annotations

import time
from enum import Enum

from celery import states
from celery.backends.base import DisabledBackend

from .engine import znodes
from .engine.identity import Identity
from .logs import task_logger
from .states import SKIPPED

logger = task_logger()

#: How long a redelivered copy waits for its original's final state to be stored.
RESULT_GRACE = 2.0


#: The header a request that may be a copy keeps when this library publishes it again (a
#: warm shutdown's request next in line, a request a pool process gives back): the broker's
#: flag does not travel with a new message, and without it a copy whose first run finished
#: ran again (found by the simulator).
COPY_HEADER = "zklock_copy"


def redelivered(request) -> bool:
    """Is this delivery a possible copy: flagged as a redelivery by the broker (RabbitMQ's
    requeue of an unacknowledged message, kombu's restore of a Redis one), or published again
    by us from one that was (:data:`COPY_HEADER`)?"""
    if (getattr(request, "delivery_info", None) or {}).get("redelivered"):
        return True
    if (getattr(request, "request_dict", None) or {}).get(COPY_HEADER):  # the worker's Request
        return True
    get = getattr(request, "get", None)
    return bool(get(COPY_HEADER) if callable(get) else getattr(request, COPY_HEADER, None))


def publish_again(task, countdown: float | None = None) -> None:
    """Publish the running request again as it is (same id, arguments and retry count), a
    possible copy keeping that mark (:data:`COPY_HEADER`)."""
    headers = {COPY_HEADER: True} if redelivered(task.request) else None
    task.signature_from_request(task.request).apply_async(countdown=countdown, headers=headers)


class Earlier(Enum):
    """What the result backend says of an earlier delivery of the same attempt."""

    FINISHED = "finished"  # it ran to a final state (or was skipped): a copy must not run
    RUNNING = "running"  # it began (STARTED), and its final state may be about to be stored
    UNKNOWN = "unknown"  # nothing says it began: it never did, or no state was kept


def earlier_run(state: str | None) -> Earlier:
    """Read a stored state as news of an earlier delivery.  ``RETRY`` says nothing: it is
    also what the previous attempt left, before this attempt first ran.  ``LOCK_WAITING``
    says nothing either: a request held aside and given back to the broker stored it."""
    if state in states.READY_STATES or state == SKIPPED:
        return Earlier.FINISHED
    if state == states.STARTED:
        return Earlier.RUNNING
    return Earlier.UNKNOWN


def ran_before(task, task_id: str, seen: bool = False) -> bool:
    """A copy holding its lock: did an earlier delivery of it already reach a final state?

    Celery stores a run's final state just *after* its ``__call__`` (and so its release)
    returns, so a copy granted at that moment waits up to :data:`RESULT_GRACE` for it when
    the original was ``seen`` ahead in the queue or is STARTED.  Without a result backend we
    cannot tell, and run the copy (at-least-once, as Celery promises): losing the work would
    be worse than repeating it."""
    if task.ignore_result or isinstance(task.backend, DisabledBackend):
        return False
    deadline = time.monotonic() + RESULT_GRACE
    while True:
        try:
            earlier = earlier_run(task.backend.get_state(task_id))
        except Exception as exc:
            logger.warning("cannot read the state of task %s (%r); running the redelivered copy", task_id, exc)
            return False
        if earlier is Earlier.FINISHED:
            return True
        if (earlier is Earlier.UNKNOWN and not seen) or time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def delivery_of(contender) -> tuple | None:
    """(task id, attempt) of a queued node; None for nodes not written by a task."""
    identity = Identity.parse(contender.identifier)
    return identity.delivery if identity is not None else None


class Redelivery:
    """The copy checks of one task run; inert unless the task is ``acks_late``."""

    def __init__(self, task, client, task_id: str | None, retries: int, enabled: bool, flagged: bool = False) -> None:
        self.task = task
        self.client = client
        self.delivery = (task_id, retries) if enabled and task_id else None
        self.seen = False  # a copy of ours was seen ahead of us
        self.flagged = flagged  # the broker flagged this delivery redelivered

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

    def acquire(self, lock, timeout: float | None, shared: bool) -> bool:
        """Take ``lock`` under ``timeout`` — except for a copy, which waits without a deadline
        until its original is gone (it must neither run beside it nor apply a timeout policy).
        ``shared``: others may hold beside us (a semaphore, a reader)."""
        while True:
            acquired = lock.acquire(timeout=timeout)
            if acquired:
                if self.delivery is None or not shared:
                    return True  # alone: nobody can be ahead of a holder
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
        delivery = self.delivery
        if delivery is None:  # not a copy that can have an original
            return False
        try:
            return any(delivery_of(c) == delivery for lk in lock.locks for c in lk.contenders())
        except Exception as exc:
            logger.warning("could not look for an earlier copy of task %s: %r", delivery[0], exc)
            return False

    def finished_elsewhere(self) -> bool:
        """Holding the lock: did our original already reach a final state (:func:`ran_before`)?
        Asked only of a copy: one seen behind its original, or flagged redelivered."""
        if self.delivery is None or not (self.seen or self.flagged):
            return False
        return ran_before(self.task, self.delivery[0], seen=self.seen)


def wait_nodes_gone(client, nodes: list[str]) -> None:
    """Block until every znode in ``nodes`` is deleted (a watch each, no polling)."""
    for node in nodes:
        while True:
            changed = client.handler.event_object()
            # Bound now: a watch left by an earlier turn (or node) sets its own event, not this one's.
            if client.exists(node, watch=lambda _event, changed=changed: changed.set()) is None:
                break
            # Re-checked every second too: a watch does not survive a session expiry.
            changed.wait(1.0)
