"""What a lock wait decided, and the one place a locked call acts on it.

Why one place: a locked call gets its lock in one of two ways — claimed from the worker's
lock agent, which waited for it before the pool got the request, or waited for in this
process (:mod:`celery_zklock.acquisition`) — and both must end the same way: prerun sent
once, STARTED stored again after LOCK_WAITING, a grant checked before its body (confirmed,
not a copy whose first delivery finished), or the outcome's policy applied
(:mod:`celery_zklock.outcomes`), and the enqueue guard started or ended.  So each way
returns a :class:`LockDecision` and applies nothing; :func:`act` does the rest, in that order.
Which outcome follows which verdict or condition are pure functions (tests/test_decision.py).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

from celery.exceptions import Retry
from celery.states import STARTED

from . import enqueue, outcomes, prerun
from .config import ZkSettings
from .errors import LockTimeout, LockUnavailable
from .logs import task_logger
from .states import stores_waiting
from .worker.agent_protocol import Verdict

logger = task_logger()


class Outcome(str, enum.Enum):
    """How a locked call's lock was decided (the values name it in enqueue guard records)."""

    GRANTED = "granted"  # held: the body runs
    TIMED_OUT = "timeout"  # not within lock_timeout: on_lock_timeout
    UNAVAILABLE = "unavailable"  # ZooKeeper could not decide it: on_lock_unavailable
    REVOKED = "revoked"  # revoked while next in line in the pool: not run
    SHUTDOWN = "shutdown"  # warm shutdown while next in line: back to the broker
    GIVEN_BACK = "given back"  # busy, and the agent does not queue this delivery: back to the broker
    DUPLICATE = "duplicate"  # a redelivered copy whose first delivery finished: not run again


class GuardOwner(enum.Enum):
    """Whose the call's enqueue guard (``lock_enqueue``) is, and so who ends it."""

    NONE = "none"  # none here: a direct call, a nested one (the outer's), or no wait began
    RUN = "run"  # waited for here: started before the body and ended after it, or ended unrun
    VERDICT = "verdict"  # claimed: the agent's, which leaves it here with a timeout/unavailable verdict


@dataclass(frozen=True)
class LockDecision:
    """What a wait decided, with what acting on it needs."""

    outcome: Outcome
    waited: float = 0.0
    lock: Any = None  # GRANTED: the lock to hold
    holders: list | None = None  # TIMED_OUT: who held it (None: unknown)
    error: LockUnavailable | None = None  # UNAVAILABLE: why
    #: GRANTED after this process stored LOCK_WAITING over the tracer's STARTED: STARTED again.
    said_waiting: bool = False
    #: GRANTED to a possible copy (a :class:`~celery_zklock.redelivery.Redelivery`): it runs only if
    #: its first delivery left no final state (``finished_elsewhere``).
    copies: Any = None
    #: GRANTED by the agent: how long a grant not safe at the start waits for ZooKeeper to confirm it.
    confirm_within: float | None = None
    #: The lock's nodes are this process's (waited for here): an error before the body deletes
    #: them.  A claimed grant is the agent's, let go when its request ends.
    own_node: bool = False


class Taken(NamedTuple):
    """The call's lock, acted on: held (``lock``: the body runs), or not (``result``: the
    policy's value is the call's); ``guard``: whose enqueue guard the run ends."""

    lock: Any
    waited: float
    result: Any = None
    guard: GuardOwner = GuardOwner.NONE


# ------------------------------------------------------------------ the pure rules
#: The agent's verdict on a claimed request, as an outcome.
OF_VERDICT = {
    Verdict.GRANTED: Outcome.GRANTED,
    Verdict.TIMEOUT: Outcome.TIMED_OUT,
    Verdict.UNAVAILABLE: Outcome.UNAVAILABLE,
    Verdict.REVOKED: Outcome.REVOKED,
    Verdict.SHUTDOWN: Outcome.SHUTDOWN,
}


def in_process(acquired: bool, give_back: bool, connected: bool) -> Outcome:
    """The outcome of a wait in this process: held; or, not held, given back to the broker
    (a pool process beside an agent, the key busy), unavailable (the connection lost), or
    timed out."""
    if acquired:
        return Outcome.GRANTED
    if give_back and connected:
        return Outcome.GIVEN_BACK
    if not connected:
        return Outcome.UNAVAILABLE
    return Outcome.TIMED_OUT


def guard_end(guard: GuardOwner, decided: Outcome | None, raised: BaseException | None) -> str | None:
    """Why this process ends the call's enqueue guard, the run ending unrun (``decided``:
    the wait's outcome, None when the wait failed; ``raised``: what ends it, None when a
    policy returned); None when the guard is not ended here.  A retry or a request given
    back carries it on to the new message, where publishes dedupe into it."""
    if isinstance(raised, (Retry, outcomes.GivenBack)):
        return None
    ending = "skipped" if raised is None else type(raised).__name__
    if guard is GuardOwner.RUN:
        return "not run" if raised is None else ending
    if guard is GuardOwner.VERDICT and decided in (Outcome.TIMED_OUT, Outcome.UNAVAILABLE):
        return f"{decided.value}: {ending}"
    return None


class Reentry(enum.Enum):
    """A locked call inside a locked body of this thread, on keys that body holds."""

    UPGRADE_REFUSED = "upgrade refused"  # the outer reads a key this call writes: it would wait for itself
    REFUSED = "refused"  # lock_reentrant is off
    TAKES_THE_REST = "takes the rest"  # under the outer hold, taking the keys the outer lacks
    UNDER_OUTER = "under the outer hold"  # every key held by the outer: runs at once


def reentry(outer_paths, outer_read_paths, paths, read_paths, reentrant: bool) -> Reentry:
    """How a call on ``paths`` (``read_paths`` of them read) re-enters an outer hold."""
    if any(p in outer_paths and p in outer_read_paths and p not in read_paths for p in paths):
        return Reentry.UPGRADE_REFUSED
    if not reentrant:
        return Reentry.REFUSED
    if any(p not in outer_paths for p in paths):
        return Reentry.TAKES_THE_REST
    return Reentry.UNDER_OUTER


# ------------------------------------------------------------------ acting on a decision
def act(task, opts: ZkSettings, label: Any, direct: bool, claim: Callable[[], LockDecision | None],
        wait_here: Callable[[], LockDecision], guard_here: GuardOwner) -> Taken:
    """Get the call's lock: the agent's verdict (``claim``, None when it has none for this
    request), else a wait here (``wait_here``, whose enqueue guard is ``guard_here``); then,
    in this order, prerun, STARTED again after LOCK_WAITING, a grant's checks, the outcome's
    policy and the enqueue guard's start or end."""
    guard, decided = GuardOwner.NONE, None
    try:
        try:
            claimed = claim()
            guard = GuardOwner.VERDICT if claimed is not None else guard_here
            decision = claimed if claimed is not None else wait_here()
            decided = decision.outcome
        except BaseException as exc:  # the wait failed: the run ends unrun
            _end_guard(task, opts, guard_end(guard, None, exc))
            raise
        finally:
            prerun.fire(task)  # decided (held or given up), or failed: prerun never goes unsent
        if decided is Outcome.GRANTED:
            decision = _before_run(task, decision, opts, label, direct, guard)
        result = _apply(task, decision, opts, label, direct)
    except BaseException as exc:
        if decided is None:
            raise  # its guard ended above
        if decision.outcome is Outcome.GRANTED and decision.own_node:
            decision.lock.release()  # until the body's own try, no node of ours is left behind
        _end_guard(task, opts, guard_end(guard, decided, exc))
        raise
    if decision.outcome is not Outcome.GRANTED:
        _end_guard(task, opts, guard_end(guard, decided, None))
        return Taken(None, decision.waited, result, guard)
    return Taken(decision.lock, decision.waited, None, guard)


def _before_run(task, decision: LockDecision, opts: ZkSettings, label: Any, direct: bool, guard: GuardOwner) -> LockDecision:
    """A grant, up to its body: GRANTED still, or not run after all (its lock let go)."""
    lock = decision.lock
    if decision.said_waiting and not direct and stores_waiting(task):
        _store_started(task)  # the wait overwrote the tracer's STARTED with LOCK_WAITING: started is now
    if decision.confirm_within is not None and (lock.suspended_reason is not None or lock.lost_reason is not None):
        # Granted, but the lock is not safe to hold now (the connection dropped between the
        # grant and this claim, or the lock is already lost): the body waits until the
        # agent's session is confirmed again, or the lock is declared lost; it never runs on
        # hope, and a lock lost before the body started is not a LockLost run.
        logger.warning("lock %s not confirmed at start (%s): waiting for ZooKeeper", label,
                       lock.lost_reason or lock.suspended_reason)
        if not lock.confirmed(decision.confirm_within):
            why = lock.lost_reason or lock.suspended_reason or "not confirmed"
            lock.abandon()
            return replace(decision, outcome=Outcome.UNAVAILABLE, lock=None,
                           error=LockUnavailable(f"lock {label!r} could not be confirmed before the run: {why}"))
    if decision.copies is not None and decision.copies.finished_elsewhere():
        lock.release()
        return replace(decision, outcome=Outcome.DUPLICATE, lock=None)
    if guard is GuardOwner.RUN:
        # Its enqueue guard ends (or moves) before the body runs; if ZooKeeper cannot, the
        # body does not run: that guard would swallow the work published during the run.
        try:
            enqueue.started(task, task.request, opts)
        except LockUnavailable as exc:
            lock.release()
            return replace(decision, outcome=Outcome.UNAVAILABLE, lock=None, error=exc)
    return decision


def _apply(task, decision: LockDecision, opts: ZkSettings, label: Any, direct: bool) -> Any:
    """The outcome's policy: nothing for a grant; the timeout and unavailable policies
    (retry, skip or fail); the others end the run unrun (they raise)."""
    outcome = decision.outcome
    if outcome is Outcome.GRANTED:
        return None
    if outcome is Outcome.TIMED_OUT:
        return outcomes.timed_out(task, LockTimeout(label, opts.timeout, decision.holders), opts, decision.waited)
    if outcome is Outcome.UNAVAILABLE:
        assert decision.error is not None  # an unavailable decision always says why
        return outcomes.unavailable(task, decision.error, opts, label, direct)
    unrun = {  # the outcomes that end a run unrun without a policy (each raises)
        Outcome.REVOKED: outcomes.revoked,
        Outcome.SHUTDOWN: outcomes.shut_down,
        Outcome.GIVEN_BACK: outcomes.given_back,
        Outcome.DUPLICATE: outcomes.duplicate,
    }
    return unrun[outcome](task, label)


def _end_guard(task, opts: ZkSettings, why: str | None) -> None:
    if why is not None:
        enqueue.finished(task, task.request, opts, ran=False, why=why)


def _store_started(task) -> None:
    try:
        task.update_state(state=STARTED, meta={"pid": os.getpid(), "hostname": task.request.hostname})
    except Exception as exc:  # monitoring only
        logger.warning("could not store state %s for task %s: %r", STARTED, task.request.id, exc)
