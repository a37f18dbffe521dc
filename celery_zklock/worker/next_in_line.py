"""Requests the worker's main process hands to the pool while they are next in line for their
lock, before the grant (docs/waiting.md, "Next in line"), and those waiting for a slot to go.

Why a collaborator of its own: these requests are no longer held aside but not yet decided,
and have their own bookkeeping — how many pool processes they park (``zklock_handoff_slots``,
never the whole pool), the ones told "next" that wait for a slot or an idle pool, and the
revocations sent for them.  The rules are :mod:`celery_zklock.worker.pool_handoff`'s; the
consumer step (:mod:`celery_zklock.worker.wait_outside_pool`) holds the requests and hands them
over (:class:`Handing`).
"""

from __future__ import annotations

from typing import Protocol

from .pool_handoff import Early, hand_over_early, may_park, pool_size


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
        self.c = c  # Celery's consumer: its pool's size and books (pool_handoff)
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

