"""Where a locked task's lock is decided: waited for in this process, or claimed from the
worker's lock agent, which waited for it before the pool got the request.

Why apart from the wrapper: both ways end the same (a lock to hold, or a policy that
gives up; prerun sent either way), but each has its own hazards — a node left behind on
any exception, a redelivered copy queued behind its original, a grant that is no longer
safe by the time the pool process claims it.  Functions of the running
:class:`celery_zklock.task.ZkLockedTask`; what it does when it does not get the lock is
:mod:`celery_zklock.outcomes`.
"""

from __future__ import annotations

import os
import time
from typing import Any, NamedTuple

from celery.states import STARTED
from celery.exceptions import Ignore, Retry
from kazoo.exceptions import ConnectionClosedError

from . import enqueue, metrics, outcomes, prerun
from .config import ZkSettings
from .engine.client import get_client
from .engine.identity import Identity
from .engine.lock import FairLock, MultiLock
from .engine.znodes import NodeKind, exclusive_kind
from .errors import LockTimeout, LockUnavailable
from .logs import task_logger
from .redelivery import Redelivery, publish_again, ran_before, redelivered
from .states import LOCK_WAITING, stores_waiting
from .worker import agent_client
from .worker.agent_protocol import Verdict

logger = task_logger()


class WaitResult(NamedTuple):
    """A lock waited for in process: held (``lock``), or not (``result``: what the policy returned)."""

    lock: Any
    waited: float
    result: Any = None


def lock_in_process(task, req, direct: bool, opts: ZkSettings, label, paths: list[str], on_lost,
                    started: float, give_back: bool = False, read_paths: frozenset[str] = frozenset()) -> WaitResult:
    """Wait for the lock in this process: held, or not (after a policy that returns
    instead of raising, its value is the call's result).

    With ``give_back`` (a pool process of a worker whose lock agent queues for the same keys:
    the agent did not know this request, or another delivery of its id waits there) the lock
    is tried once and, if the key is busy, the request goes back to the broker instead of
    waiting: the nodes ahead may be the agent's, granted to requests that need this very pool
    process, and with every process waiting so, the worker ran nothing until ``lock_timeout``
    (found by the soak)."""
    try:
        client = get_client(opts)
    except LockUnavailable as exc:
        return WaitResult(None, 0.0, outcomes.unavailable(task, exc, opts, label, direct))

    identity = Identity.of_this_process(
        task_id=req.id, retries=req.retries or 0, task=task.name, worker=req.hostname,
        holders=task.lock_max_holders if task.lock_max_holders > 1 else None,
    ).to_bytes()
    flagged = redelivered(req)
    copies = Redelivery(task, client, req.id, req.retries or 0, enabled=bool((task.acks_late or flagged) and not direct),
                        flagged=flagged)

    counted_waiting = [False]  # in the zklock_waiting gauge until the wait ends

    def on_wait(fair: FairLock, position: int) -> None:
        # Monitoring only: nothing here may fail the task or escape into the lock.
        if copies.queued_behind_original(fair):
            logger.info("copy of task %s queued behind its original under lock %s; waiting", req.id, label)
            return  # never LOCK_WAITING: the original's state must not be overwritten
        logger.info("waiting for lock %s (position %s)", label, position)
        outcomes.lock_event(task, "task-lock-waiting", key=label, position=position)
        counted_waiting[0] = True
        if req.id and not direct and stores_waiting(task):
            try:
                task.update_state(state=LOCK_WAITING, meta={"key": label, "position": position})
            except Exception as exc:
                logger.warning("could not store state %s for task %s (waiting anyway): %r", LOCK_WAITING, req.id, exc)

    common = dict(max_holders=task.lock_max_holders, identifier=identity, on_lost=on_lost, on_wait=on_wait)
    exclusive = exclusive_kind(opts.curator_interop)
    if len(paths) == 1:
        lock = FairLock(client, paths[0], kind=NodeKind.READ if paths[0] in read_paths else exclusive, **common)
    else:
        lock = MultiLock(client, paths, read_paths=read_paths, exclusive=exclusive, **common)

    # From the first acquire until the body's own try below, any exception (a kazoo
    # error, the backend read, a signal) must not leave our node behind.
    try:
        try:
            acquired = (lock.acquire(timeout=0) if give_back
                        else copies.acquire(lock, opts.timeout, task.lock_max_holders > 1 or bool(read_paths)))
        except ConnectionClosedError as exc:  # the client closed for good (get_client replaces it next)
            lock.release()
            return WaitResult(None, time.monotonic() - started, outcomes.unavailable(
                task, LockUnavailable(f"could not wait for lock {label!r}: {exc}"), opts, label, direct))
        finally:
            if counted_waiting[0]:
                metrics.record("waited", task)
        waited = time.monotonic() - started
        prerun.fire(task)  # the lock is decided: the run (or its policy) starts now
        if acquired and counted_waiting[0] and task.track_started and not task.ignore_result and not direct:
            # The wait overwrote the tracer's STARTED with LOCK_WAITING: started is now.
            _store_started(task)
        if acquired and copies.finished_elsewhere():
            lock.release()
            _not_again(task, label)
        if not acquired and give_back and client.connected:
            lock.release()
            return WaitResult(None, waited, _given_back(task, label))
        if not acquired:
            if not client.connected:
                return WaitResult(None, waited, outcomes.unavailable(task, 
                    LockUnavailable(f"lost the ZooKeeper connection while waiting for lock {label!r}"),
                    opts, label, direct,
                ))
            timed_out = LockTimeout(label, opts.timeout, _holders(lock))
            return WaitResult(None, waited, outcomes.timed_out(task, timed_out, opts, waited))
    except BaseException:
        lock.release()
        raise
    return WaitResult(lock, waited)


def claimed_lock(task, claimed, opts: ZkSettings, label, on_lost) -> WaitResult:
    """The lock the worker's agent took for this request, or its timeout/unavailable verdict."""
    link, verdict = claimed
    decided = Verdict(verdict["verdict"])
    waited = float(verdict.get("waited") or 0.0)
    prerun.fire(task)  # decided by the agent: the run (or its policy) starts now
    if decided is Verdict.REVOKED:
        # Handed over while next in line, then revoked: the main process has recorded
        # REVOKED and deleted its node; the body never runs.
        logger.info("task %s revoked while waiting for lock %s: not run", task.request.id, label)
        raise Ignore()
    if decided is Verdict.SHUTDOWN:
        # Warm shutdown while next in line: its message was acknowledged when this
        # process took it, so it goes back to the broker as a new message with the same
        # id, arguments and retry count (what Celery's retry publishes), and queues anew.
        logger.info("worker shutting down: task %s goes back to the broker (lock %s)", task.request.id, label)
        publish_again(task)
        raise Ignore()
    if decided is not Verdict.GRANTED:
        # Skipped or failed on its lock: its enqueue guard (left to this process by the
        # agent) ends here, with the work deduped into it reported.
        try:
            if decided is Verdict.TIMEOUT:
                skipped = outcomes.timed_out(task, LockTimeout(label, opts.timeout, verdict.get("holders")), opts, waited)
                enqueue.finished(task, task.request, opts, ran=False, why=f"{decided.value}: skipped")
                return WaitResult(None, waited, skipped)
            outcomes.unavailable(task, LockUnavailable(verdict.get("error") or "the lock agent could not reach ZooKeeper"),
                                 opts, label, False)
        except Retry:
            raise  # the retry took its enqueue guard over: publishes dedupe into it
        except BaseException as exc:
            enqueue.finished(task, task.request, opts, ran=False, why=f"{decided.value}: {type(exc).__name__}")
            raise
    lock = agent_client.AgentLock(
        link, task.request.id, verdict["tokens"], grace=agent_client.silence_grace(opts.session_timeout, verdict),
        release_bound=opts.session_timeout + 1.0, on_lost=on_lost, state=verdict, carried=bool(verdict.get("carried")),
    )
    if lock.suspended_reason is not None or lock.lost_reason is not None:
        # Granted, but the lock is not safe to hold now (the connection dropped between
        # the grant and this claim, or the lock is already lost): the body waits until
        # the agent's session is confirmed again, or the lock is declared lost; it never
        # runs on hope, and a lock lost before the body started is not a LockLost run.
        logger.warning("lock %s not confirmed at start (%s): waiting for ZooKeeper", label,
                       lock.lost_reason or lock.suspended_reason)
        if not lock.confirmed(opts.session_timeout + 1.0):
            why = lock.lost_reason or lock.suspended_reason or "not confirmed"
            lock.abandon()
            outcomes.unavailable(task, LockUnavailable(f"lock {label!r} could not be confirmed before the run: {why}"),
                              opts, label, False)
    if redelivered(task.request) and ran_before(task, task.request.id):
        # Its first delivery was taken by a pool process (and acknowledged there, an
        # acknowledgement lost with a connection) and ran: this copy must not run it again.
        lock.release()
        _not_again(task, label)
    return WaitResult(lock, waited)


#: Seconds a request given back to the broker by a pool process waits there (its key was busy).
GIVE_BACK_COUNTDOWN = 0.5


class GivenBack(Ignore):
    """This run ended unrun because its request went back to the broker: like a retry, the
    new message carries on its enqueue guard (it is not ended here)."""


def _given_back(task, label) -> None:
    """Publish the request again, as it is (same id, arguments and retry count, what a
    warm shutdown does with one next in line), and end this run unrun: the next delivery
    waits for its lock in the worker, where no pool process waits."""
    logger.info("task %s: lock %s is busy and this worker's lock agent does not queue this delivery: back to the "
                "broker (in %.1fs), so that no pool process waits for a lock", task.request.id, label,
                GIVE_BACK_COUNTDOWN)
    outcomes.lock_event(task, "task-lock-given-back", key=label)
    publish_again(task, countdown=GIVE_BACK_COUNTDOWN)
    raise GivenBack()


def _not_again(task, label) -> None:
    logger.warning("task %s already finished under lock %s (this is a redelivered copy): not running it again",
                   task.request.id, label)
    outcomes.lock_event(task, "task-lock-duplicate", key=label)
    raise Ignore()


def _store_started(task) -> None:
    try:
        task.update_state(state=STARTED, meta={"pid": os.getpid(), "hostname": task.request.hostname})
    except Exception as exc:  # monitoring only
        logger.warning("could not store state %s for task %s: %r", STARTED, task.request.id, exc)


def _holders(lock) -> list[str | None] | None:
    """Who holds the lock, for the timeout message; None when they cannot be read."""
    try:
        return [c.identifier for lk in lock.locks for c in lk.contenders() if c.holder]
    except Exception:
        return None
