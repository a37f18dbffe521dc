"""The lock agent's enqueue guards (``lock_enqueue``): ended or moved as requests are decided.

A guard's updates are blocking ZooKeeper calls (:mod:`celery_zklock.engine.guards`): they run
in order on one thread of their own (a task's end must not overtake its start), and only
their completions come back to the event thread.  When a grant's guard starts is part of
its verdict (:meth:`Requests._tell_verdict <celery_zklock.worker.agent_requests.Requests._tell_verdict>`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

from ..engine import clock, guards
from .agent_protocol import Verdict
from .agent_requests import EventLoop, WaitRequest

logger = logging.getLogger("celery_zklock.worker.agent")

#: Run on the event thread once a guard's job is done: ``after(error)``, None when it succeeded.
After = Callable[[BaseException | None], None]


class GuardJobs:
    """Guard updates, in order, off the event thread; its own state is the job queue (and
    its thread, started with the first job)."""

    def __init__(self, loop: EventLoop) -> None:
        self.client, self.monitor, self.post = loop.client, loop.monitor, loop.post
        # (fn, its arguments after the client, after(error) or None, tries so far)
        self.jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], After | None, int]] = queue.SimpleQueue()
        self.started = False  # the jobs' thread, started with the first job

    def start(self, wait: WaitRequest, after: After) -> None:
        """A granted request's guard ends (or becomes ours) before its body may start."""
        guard = wait.guard
        assert guard is not None  # started only for a request that has one
        self.op(guards.start, guard["paths"], wait.id, int(guard.get("retries") or 0), guard["until"], after=after)

    def op(self, fn: Callable[..., Any], *args: Any, after: After | None = None) -> None:
        """A guard's blocking ZooKeeper calls, off the event thread and in order on one
        thread of their own (a task's end must not overtake its start); ``after(error)`` then
        runs on the event thread, whatever the outcome (``error`` is None when it was done)."""
        if not self.started:
            self.started = True
            threading.Thread(target=self._loop, name="zklock-agent-guards", daemon=True).start()
        self.jobs.put((fn, args, after, 0))

    def _loop(self) -> None:
        while True:
            fn, args, after, tries = self.jobs.get()
            error = None
            try:
                done = fn(self.client, *args)
            except Exception as exc:
                error = exc
                logger.warning("zklock agent: enqueue guard of %s not updated (%r)", args[1], exc)
                if fn is guards.release and after is None and tries < _RELEASE_TRIES:
                    # A guard left in place swallows every publish of its key: try again
                    # (each try is bounded by the client's timeout), until its bound would.
                    self.monitor.timers.call_at(clock.monotonic() + 1.0, self.jobs.put, (fn, args, None, tries + 1))
            else:
                if fn is guards.release:
                    for gone in done or ():
                        if gone.deduped:
                            logger.warning("zklock agent: task %s ended unrun; %d publish(es) deduped into it went with it",
                                           gone.id, gone.deduped)
            if after is not None:
                self.post(after, error)

    def decided(self, wait: WaitRequest, verdict: Verdict) -> None:
        """Its lock is decided: granted, the guard ends (``start``) or becomes an ephemeral
        node of our session (``finish``); revoked, it ends.  ``shutdown`` leaves it: the
        message goes back to the broker, still queued.  ``timeout`` and ``unavailable`` leave
        it to the pool process that follows the task's policy: its retry takes the guard
        over (no instant for a duplicate), or it ends it and reports the work deduped into
        it (:func:`celery_zklock.enqueue.unrun`); unclaimed, ``finished`` ends it here."""
        guard = wait.guard
        if guard is None or verdict in (Verdict.SHUTDOWN, Verdict.TIMEOUT, Verdict.UNAVAILABLE):
            return
        retries = int(guard.get("retries") or 0)
        if verdict is Verdict.GRANTED:  # started by start() already
            if guard["until"] != "finish":
                wait.guard = None
        else:
            wait.guard = None
            self.op(guards.release, guard["paths"], wait.id, retries)

    def finished(self, wait: WaitRequest) -> None:
        """A granted request ran (or its process died before it could claim it): its running
        guard goes; an undecided one's guard (never moved) goes too."""
        if wait.verdict is not None and wait.verdict.verdict is Verdict.SHUTDOWN:
            return  # its message goes back to the broker, still queued under it
        guard, wait.guard = wait.guard, None
        if guard is not None:
            self.op(guards.release, guard["paths"], wait.id, int(guard.get("retries") or 0))


#: How many times (about a second apart) the agent tries a guard's release again.
_RELEASE_TRIES = 600
