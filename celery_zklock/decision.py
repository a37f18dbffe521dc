"""How a locked call gets its lock decision, and what happens on it: read top to bottom.

Why one module: a locked call's lock is decided in one of two ways — waited for in this
process, or claimed from the worker's lock agent, which waited for it before the pool got
the request — and both must end the same way: prerun sent once, STARTED stored again after
LOCK_WAITING, a grant checked before its body (confirmed, not a copy whose first delivery
finished), or the outcome's policy applied and reported the same way wherever it was
decided, and the enqueue guard started or ended.  So each way returns a :class:`LockDecision`
and applies nothing; :func:`act` does the rest, in that order.  Which outcome follows which
verdict or condition are pure functions (tests/test_decision.py).  Functions of the running
:class:`celery_zklock.task.ZkLockedTask`.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

from celery.exceptions import Ignore, Retry
from celery.states import STARTED
from kazoo.exceptions import ConnectionClosedError

from . import enqueue, lock_waiting, metrics, signals
from .config import ZkSettings, retry_delay
from .engine.client import get_client
from .engine.identity import Identity
from .engine.lock import FairLock, MultiLock
from .engine.znodes import NodeKind, exclusive_kind
from .errors import LockLost, LockTimeout, LockUnavailable
from .held import RunState
from .logs import task_logger
from .redelivery import Redelivery, publish_again, redelivered
from .states import stores_waiting
from .worker import agent_client
from .worker.agent_protocol import Claimed, Verdict

logger = task_logger()


# ------------------------------------------------------------------ what a wait decides
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


class GivenBack(Ignore):
    """This run ended unrun because its request went back to the broker: like a retry, the
    new message carries on its enqueue guard (it is not ended here)."""


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
    if isinstance(raised, (Retry, GivenBack)):
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


# ------------------------------------------------------------------ getting a decision, either way
# Each way has its own hazards — a node left behind on any exception, a redelivered copy
# queued behind its original, a grant that is no longer safe by the time the pool process
# claims it — and each returns a LockDecision, applying no policy.
def lock_in_process(task, req, direct: bool, opts: ZkSettings, label, paths: list[str], on_lost,
                    started: float, give_back: bool = False, read_paths: frozenset[str] = frozenset()) -> LockDecision:
    """Wait for the lock in this process: held, or not (timed out, unavailable, given back).

    With ``give_back`` (a pool process of a worker whose lock agent queues for the same keys:
    the agent did not know this request, or another delivery of its id waits there) the lock
    is tried once and, if the key is busy, the request goes back to the broker instead of
    waiting: the nodes ahead may be the agent's, granted to requests that need this very pool
    process, and with every process waiting so, the worker ran nothing until ``lock_timeout``
    (found by the soak)."""
    try:
        client = get_client(opts)
    except LockUnavailable as exc:
        return LockDecision(Outcome.UNAVAILABLE, 0.0, error=exc)

    identity = Identity.of_this_process(
        task_id=req.id, retries=req.retries or 0, task=task.name, worker=req.hostname,
        holders=task.lock_max_holders if task.lock_max_holders > 1 else None,
    ).to_bytes()
    flagged = redelivered(req)
    copies = Redelivery(task, client, req.id, req.retries or 0, enabled=bool((task.acks_late or flagged) and not direct),
                        flagged=flagged)
    waiter = lock_waiting.Waiter.running(task, label, direct, functools.partial(send_event, task))
    said = [False]  # it said it waits (in the zklock_waiting gauge until the wait ends)

    def on_wait(fair: FairLock, position: int) -> None:
        # Monitoring only: nothing here may fail the task or escape into the lock.
        if copies.queued_behind_original(fair):
            logger.info("copy of task %s queued behind its original under lock %s; waiting", req.id, label)
            return  # never LOCK_WAITING: the original's state must not be overwritten
        logger.info("waiting for lock %s (position %s)", label, position)
        lock_waiting.record(waiter, position, first=not said[0])
        said[0] = True

    common = dict(max_holders=task.lock_max_holders, identifier=identity, on_lost=on_lost, on_wait=on_wait)
    exclusive = exclusive_kind(opts.curator_interop)
    lock: FairLock | MultiLock
    if len(paths) == 1:
        lock = FairLock(client, paths[0], kind=NodeKind.READ if paths[0] in read_paths else exclusive, **common)
    else:
        lock = MultiLock(client, paths, read_paths=read_paths, exclusive=exclusive, **common)

    # From the first acquire until the decision is returned (and, granted, until the body's
    # own try: act), any exception (a kazoo error, a signal) must not leave our node behind.
    try:
        try:
            acquired = (lock.acquire(timeout=0) if give_back
                        else copies.acquire(lock, opts.timeout, task.lock_max_holders > 1 or bool(read_paths)))
        except ConnectionClosedError as exc:  # the client closed for good (get_client replaces it next)
            lock.release()
            return LockDecision(Outcome.UNAVAILABLE, time.monotonic() - started,
                            error=LockUnavailable(f"could not wait for lock {label!r}: {exc}"))
        finally:
            if said[0]:
                lock_waiting.ended(task)
        waited = time.monotonic() - started
        outcome = in_process(acquired, give_back, client.connected)
        if outcome is Outcome.GRANTED:
            return LockDecision(outcome, waited, lock=lock, said_waiting=said[0], copies=copies, own_node=True)
        if outcome is Outcome.UNAVAILABLE:
            error = LockUnavailable(f"lost the ZooKeeper connection while waiting for lock {label!r}")
            decision = LockDecision(outcome, waited, error=error)
        else:
            decision = LockDecision(outcome, waited, holders=_holders(lock) if outcome is Outcome.TIMED_OUT else None)
        lock.release()  # nothing held: a failed acquire deleted its nodes (this lets go of the rest)
        return decision
    except BaseException:
        lock.release()
        raise


def claimed_lock(task, claimed: tuple[agent_client.AgentClient, Claimed], opts: ZkSettings,
                 on_lost: Callable[[agent_client.AgentLock], None]) -> LockDecision:
    """The lock the worker's agent took for this request, or its other verdict: the one
    reader of the claim's answer (``agent_client.claim``: the agent's link and its answer,
    which is a verdict: neither ``pending`` nor ``unknown``)."""
    link, answer = claimed
    outcome = OF_VERDICT[Verdict(answer.verdict)]
    waited = float(answer.waited or 0.0)
    if outcome is Outcome.TIMED_OUT:
        return LockDecision(outcome, waited, holders=answer.holders)
    if outcome is Outcome.UNAVAILABLE:
        return LockDecision(outcome, waited,
                        error=LockUnavailable(answer.error or "the lock agent could not reach ZooKeeper"))
    if outcome is not Outcome.GRANTED:
        return LockDecision(outcome, waited)
    req = task.request
    grace = agent_client.silence_grace(opts.session_timeout, answer.session_timeout)
    lock = agent_client.AgentLock(link, req.id, answer.tokens or {}, grace=grace,
                                  release_bound=opts.session_timeout + 1.0, on_lost=on_lost, state=answer)
    # Its first delivery may have been taken by a pool process (and acknowledged there, an
    # acknowledgement lost with a connection) and run: a redelivered copy must not run it again.
    flagged = redelivered(req)
    copies = Redelivery(task, None, req.id, req.retries or 0, enabled=flagged, flagged=flagged) if flagged else None
    return LockDecision(outcome, waited, lock=lock, copies=copies, confirm_within=opts.session_timeout + 1.0)


def _holders(lock) -> list[str | None] | None:
    """Who holds the lock, for the timeout message; None when they cannot be read."""
    try:
        return [c.identifier for lk in lock.locks for c in lk.contenders() if c.holder]
    except Exception:
        return None


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
            fire_prerun(task)  # decided (held or given up), or failed: prerun never goes unsent
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
        return timed_out(task, LockTimeout(label, opts.timeout, decision.holders), opts, decision.waited)
    if outcome is Outcome.UNAVAILABLE:
        assert decision.error is not None  # an unavailable decision always says why
        return unavailable(task, decision.error, opts, label, direct)
    unrun = {  # the outcomes that end a run unrun without a policy (each raises)
        Outcome.REVOKED: revoked,
        Outcome.SHUTDOWN: shut_down,
        Outcome.GIVEN_BACK: given_back,
        Outcome.DUPLICATE: duplicate,
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


# ------------------------------------------------------------------ prerun, once the lock is decided
# Celery's tracer sends task_prerun just before it calls the task, but a locked task waits
# in different places (the worker's lock agent, or inside the call): left alone, prerun would
# mean "before the wait" in some and "after it" in others (a prerun -> postrun timing would
# count the wait as run time, a DB session opened in prerun would idle through it).  So the
# tracer's prerun of a locked task is held back in the running thread (or greenlet) and sent
# by act once the lock is decided, granted or not (prerun and postrun stay paired).  This
# patches one module global of the tracer (celery.app.trace.send_prerun, looked up at each
# call); where there is none, prerun keeps Celery's own timing and nothing else changes.
_held: contextvars.ContextVar[tuple[Any, dict] | None] = contextvars.ContextVar("celery_zklock_prerun", default=None)
_send: Callable[..., Any] | None = None


def _defers(sender: Any) -> bool:
    return bool(getattr(sender, "_zklock_defers_prerun", False))


def _send_prerun(sender: Any = None, **named: Any) -> Any:
    if _send is None or not _defers(sender):
        return (_send or (lambda **_: []))(sender=sender, **named)
    _held.set((sender, named))
    return []


def install_prerun() -> bool:
    """Hold back the tracer's prerun for locked tasks (idempotent).  False where Celery's
    tracer has no ``send_prerun`` to wrap."""
    global _send
    try:
        from celery.app import trace
    except ImportError:  # pragma: no cover - Celery is a dependency
        return False
    current = getattr(trace, "send_prerun", None)
    if current is None:
        return False
    if current is not _send_prerun:
        _send = current
        trace.send_prerun = _send_prerun
    return True


def fire_prerun(task: Any) -> None:
    """Send ``task``'s held-back prerun now, if one is held for its current request (once)."""
    held = _held.get()
    if held is None:
        return
    sender, named = held
    if sender is not task or named.get("task_id") != getattr(task.request, "id", None):
        return
    _held.set(None)
    if _send is not None:
        _send(sender=sender, **named)


# ------------------------------------------------------------------ the policies: not granted, or not run
def timed_out(task, exc: LockTimeout, opts: ZkSettings, waited: float) -> Any:
    lock_event(task, "task-lock-timeout", key=exc.key, wait=round(waited, 6), holders=exc.holders, policy=opts.on_timeout)
    signals.lock_timed_out.send(sender=task, task_id=task.request.id, key=exc.key, holders=exc.holders, wait=waited,
                                policy=opts.on_timeout)
    if opts.on_timeout == "fail":
        logger.warning("%s; failing", exc)
        raise exc
    if opts.on_timeout == "skip":
        # A skipped run returns None and ends SUCCESS, as a direct call does: Celery's ready
        # states are a closed set, so a state of our own (SKIPPED) was never "finished" for
        # get(), join(), groups or chords, which waited for it until their timeouts.
        logger.warning("%s; skipped (on_lock_timeout='skip')", exc)
        return None
    raise _retry(task, exc, opts)


def unavailable(task, exc: LockUnavailable, opts: ZkSettings, label: Any, direct: bool) -> Any:
    lock_event(task, "task-lock-unavailable", key=label, error=str(exc))
    if opts.on_unavailable == "fail" or direct:
        logger.error("task not run (never unprotected): %s", exc)
        raise exc
    raise _retry(task, exc, opts)


def revoked(task, label: Any) -> None:
    """Handed over while next in line, then revoked: the main process has recorded REVOKED
    and deleted its node; the body never runs."""
    logger.info("task %s revoked while waiting for lock %s: not run", task.request.id, label)
    raise Ignore()


def shut_down(task, label: Any) -> None:
    """Warm shutdown while next in line: its message was acknowledged when this process took
    it, so it goes back to the broker as a new message with the same id, arguments and retry
    count (what Celery's retry publishes), and queues anew."""
    logger.info("worker shutting down: task %s goes back to the broker (lock %s)", task.request.id, label)
    publish_again(task)
    raise Ignore()


#: Seconds a request given back to the broker by a pool process waits there (its key was busy).
GIVE_BACK_COUNTDOWN = 0.5


def given_back(task, label: Any) -> None:
    """Publish the request again, as it is (same id, arguments and retry count, what a
    warm shutdown does with one next in line), and end this run unrun: the next delivery
    waits for its lock in the worker, where no pool process waits."""
    logger.info("task %s: lock %s is busy and this worker's lock agent does not queue this delivery: back to the "
                "broker (in %.1fs), so that no pool process waits for a lock", task.request.id, label,
                GIVE_BACK_COUNTDOWN)
    lock_event(task, "task-lock-given-back", key=label)
    publish_again(task, countdown=GIVE_BACK_COUNTDOWN)
    raise GivenBack()


def duplicate(task, label: Any) -> None:
    """A redelivered copy holding its lock, whose first delivery already finished: not run again."""
    logger.warning("task %s already finished under lock %s (this is a redelivered copy): not running it again",
                   task.request.id, label)
    lock_event(task, "task-lock-duplicate", key=label)
    raise Ignore()


def _retry(task, exc: Exception, opts: ZkSettings) -> Exception:
    """Celery's retry, which logs one line ("retry: Retry in 0.5s: LockUnavailable(...)"),
    naming the error: no line of ours beside it."""
    retries = task.request.retries or 0
    countdown = retry_delay(opts, retries)
    max_retries = task.max_retries if opts.max_retries is None else opts.max_retries
    return task.retry(exc=exc, countdown=countdown, max_retries=max_retries)


# ------------------------------------------------------------------ saying so: events, and a lock lost in the body
def lock_event(task, type_: str, **fields: Any) -> None:
    """Celery event for Flower/monitors, only when task events are on (``-E``); and the
    worker's Prometheus metrics when ``zklock_metrics_port`` is set."""
    metrics.record(type_[len("task-lock-"):], task, **fields)
    send_event(task, type_, **fields)


def send_event(task, type_: str, **fields: Any) -> None:
    """The Celery event alone (:func:`lock_event` without the metrics)."""
    if not task.app.conf.worker_send_task_events or task.request.called_directly or not task.request.hostname:
        return
    try:
        task.send_event(type_, **fields)
    except Exception as exc:  # monitoring must never break the task
        logger.debug("could not send %s event: %r", type_, exc)


def lost_error(task, label: Any, run_state: RunState) -> LockLost:
    """The lock was lost while the body ran (or not held at its release): said, and the
    run's error."""
    reason = run_state.reason or "lock lost"
    logger.error("lock %s lost while running (%s): reporting failure", label, reason)
    lock_event(task, "task-lock-lost", key=label, reason=reason)
    return LockLost(label, reason)
