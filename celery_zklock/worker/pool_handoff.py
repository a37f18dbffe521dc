"""Handing held requests to the pool: which may go before their grant, how many, and first.

Why apart from the consumer step (:mod:`celery_zklock.worker.wait_outside_pool`): these are the
rules and the pool internals of a handoff, not its bookkeeping — how many pool processes
may idle next in line (:func:`handoff_slots`, never all of them), whether one request may
(:func:`hand_over_early`), and putting a granted request at the head of the pool's queue
(:func:`run_next`), which touches Celery's and kombu's prefork internals defensively.
"""

from __future__ import annotations

import enum

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
