"""Handing a request to Celery's pool: a granted one at the head of the pool's queue
(:func:`run_next`), and one next in line for its lock, before its grant (docs/waiting.md,
"Next in line"): whether it may go (:func:`hand_over_early`, a pure rule, and
:func:`may_park`), into how many processes (:func:`handoff_slots`, never the whole pool), and
the books of those handed over or waiting for a slot (:class:`NextInLine`).

Why one module: the rules and their books are one protocol, each read with the other, and
the prefork internals a handoff touches (the worker's semaphore, the pool's outbound buffer)
are read here only, defensively.  The consumer step
(:mod:`celery_zklock.worker.wait_outside_pool`) holds the requests and hands them over
(:class:`Handing`).
"""

from __future__ import annotations

import enum
from typing import Protocol

from ..config import ZkSettings
from .agent_protocol import HANDOFF_MAX_WAIT


class Early(enum.Enum):
    """When a next-in-line request goes to the pool before its grant."""

    NOW = "now"
    LATER = "later"  # when a handoff slot or a process frees, if still undecided
    NO = "no"  # it waits in the main process for its grant, like any other


def hand_over_early(expected_wait: float | None, early: int, slots: int, idle: bool,
                    max_wait: float = HANDOFF_MAX_WAIT) -> Early:
    """Hand a next-in-line request to the pool now, later (when a handoff slot or a process
    frees), or not at all (it waits here for its grant, like any other).

    Why these rules: a pool process given a next-in-line request idles until the holder
    releases, so it is worth it only when that wait is known to be short (a hot chain of
    short tasks, where it saves the dispatch and the wait for a free slot at every
    handoff), only in a bounded number of processes (a long holder, or a task not seen
    yet, never parks a pool process), and only while the pool is ``idle`` for it
    (:func:`may_park`): a process parked while other requests wait for one is a process
    the worker's other keys lack (issue 39: beside a hot chain, their p95 was 1.2-1.4x the
    ideal with parking regardless, 0.9-1.1x without, the chain as efficient).
    """
    if slots <= 0 or expected_wait is None or expected_wait > max_wait:
        return Early.NO
    if not idle:
        return Early.LATER
    return Early.NOW if early < slots else Early.LATER


def may_park(c, ours: bool) -> bool:
    """May a next-in-line request go to the pool before its grant?  Not while other requests
    wait for a process (they would wait behind a process that idles).  Behind another
    contender's holders (not ``ours``: another worker's node in ZooKeeper, whose whole
    streak, up to ``zklock_cohort_hold``, comes first) one process must also stay free
    besides the one it takes; behind our own holder none need be free now: one frees as
    that holder ends (parking on a free process only, it parked half as often, as the
    ending holder's process was often not yet counted free)."""
    free = idle_processes(c)
    return free is not None and (ours or free >= 2)


def handoff_slots(c, settings: ZkSettings) -> int:
    """How many pool processes may wait for a lock their task is next in line for: the
    setting, or half the pool (rounded down: a -c 1 pool never parks its one process).
    The solo pool's one process must never wait: none there."""
    if not (getattr(type(c.pool), "__module__", "") or "").endswith("prefork"):
        return 0
    if settings.handoff_slots is not None:
        return settings.handoff_slots
    return pool_size(c) // 2


def idle_processes(c) -> int | None:
    """Free pool processes when nothing waits for one; None while something does, or when
    the pool's books cannot be read (the worker's semaphore, one permit per process, and
    the prefork pool's outbound buffer)."""
    semaphore = getattr(c.controller, "semaphore", None)
    value = getattr(semaphore, "value", None)
    if not isinstance(value, int) or getattr(semaphore, "_waiting", True):
        return None
    buffer = getattr(getattr(c.pool, "_pool", None), "outbound_buffer", None)
    return None if buffer else value


def pool_size(c) -> int:
    """The pool's current size (it changes with --autoscale)."""
    pool = getattr(c.pool, "_pool", None)
    live = getattr(pool, "_processes", None)
    return int(live if isinstance(live, int) and live > 0 else getattr(c.pool, "limit", None) or 1)


def run_next(c, req) -> None:
    """A request that holds its lock, or is next in line for it, goes to the head of the
    worker's queue for a pool process.

    Why: with every pool process busy, prefork queues requests in the main process in
    arrival order — in the worker's semaphore (``LaxBoundedSemaphore``, one permit per
    process) and then in the pool's outbound buffer; a granted request queued behind
    them would hold its key's lock while it waits for a slot, and every task queued on
    that key would wait with it.  Running it first keeps a hot key's chain moving.  This
    touches kombu's and Celery's prefork internals (``_waiting``,
    ``AsynPool.outbound_buffer``, ``Request._apply_result``) defensively: when they are
    not there, the request simply keeps its place.
    """
    waiting = getattr(getattr(c.controller, "semaphore", None), "_waiting", None)
    if waiting:
        entry = waiting[-1]
        if isinstance(entry, tuple) and len(entry) == 3 and entry[1][:1] == (req,):
            waiting.appendleft(waiting.pop())
            return
    buffer = getattr(getattr(c.pool, "_pool", None), "outbound_buffer", None)
    ref = getattr(req, "_apply_result", None)
    job = ref() if callable(ref) else None
    if job is not None and buffer and buffer[-1] is job:
        buffer.appendleft(buffer.pop())


class Handing(Protocol):
    """What :class:`NextInLine` asks of the consumer step."""

    def held(self, request_id: str):
        """The request held aside under ``request_id``, or None."""

    def hand_over(self, request_id: str, first: bool = False) -> None:
        """Give the request held aside to the pool (``first``: at the head of its queue)."""


class NextInLine:
    """Requests in the pool next in line (``early``, by id), next-in-line requests waiting for
    a handoff slot or an idle pool (``waiting``: id -> (expected wait, ours)), and the early
    ones whose revocation was sent to the agent."""

    def __init__(self, c, slots: int, step: Handing) -> None:
        self.c = c  # Celery's consumer: its pool's size and books (pool_size, may_park)
        self.handoff_slots = slots
        self.step = step
        self.early: dict[str, object] = {}
        self.waiting: dict[str, tuple] = {}
        self.revoking: set[str] = set()

    def slots(self) -> int:
        """Handoff slots, never all of the pool: a process must stay for the holders
        themselves, or next-in-line requests parked in every process would wait for
        grants that no free process can run (a deadlock until their lock timeouts)."""
        processes = pool_size(self.c)
        return max(0, min(self.handoff_slots, processes - 1))

    def told(self, request_id: str, hold: float | None, ours: bool = True) -> None:
        """The agent says only holders are ahead of this request: if its wait is expected
        to be short, a handoff slot is free and no other request waits for a process, hand
        it to the pool now (at the head of its queue), where it claims and waits for the
        release; the grant then reaches a process already running it.  Behind another
        contender's holders (not ``ours``), a process must also stay free besides."""
        req = self.step.held(request_id)
        if req is None:
            return
        when = hand_over_early(hold, len(self.early), self.slots(), may_park(self.c, ours))
        if when is Early.LATER:
            self.waiting[request_id] = (hold, ours)  # a slot (or a process) may free up before its grant
        elif when is Early.NOW:
            self.early[request_id] = req
            self.step.hand_over(request_id, first=True)

    def park(self) -> None:
        """A handoff slot or a pool process freed: next-in-line requests that waited for one
        go to the pool now, in the order they were told, while the pool is idle for them
        (:func:`may_park`).  Called as a locked request ends, and every 0.1 s (the
        pool also frees when other tasks end)."""
        for request_id, (hold, ours) in list(self.waiting.items()):
            if len(self.early) >= self.slots():
                return
            if not may_park(self.c, ours):
                continue
            del self.waiting[request_id]
            self.told(request_id, hold, ours)

    def get(self, request_id: str):
        """The request in the pool next in line under ``request_id``, or None."""
        return self.early.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.early

    def __len__(self) -> int:
        return len(self.early)

    def __iter__(self):
        return iter(list(self.early))

    def items(self) -> list[tuple[str, object]]:
        return list(self.early.items())

    def not_waiting(self, request_id: str) -> None:
        """It no longer waits for a slot (handed over, revoked, gone back to the broker)."""
        self.waiting.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        """Decided, finished or dropped: it no longer waits in the pool for its grant."""
        self.early.pop(request_id, None)
        self.revoking.discard(request_id)

    def to_revoke(self, revoked: list[str]) -> list[str]:
        """Those of the ``revoked`` early ids whose revocation is not sent yet (marked sent now)."""
        ids = [i for i in revoked if i not in self.revoking]
        self.revoking.update(ids)
        return ids

    def agent_lost(self) -> list[str]:
        """The agent died: requests in the pool next in line lost their nodes with it (their
        claims now find no verdict, and they lock in-process).  Their ids, now forgotten."""
        ids = list(self.early)
        self.early.clear()
        self.waiting.clear()
        return ids

    def stop_waiting(self) -> None:
        """The consumer stops: none waits for a slot any more (those in the pool stay)."""
        self.waiting.clear()

