"""The two ways a locked call's lock is decided: waited for in this process, or claimed from
the worker's lock agent, which waited for it before the pool got the request.

Why apart from the wrapper: each way has its own hazards — a node left behind on any
exception, a redelivered copy queued behind its original, a grant that is no longer safe
by the time the pool process claims it.  Each returns a
:class:`~celery_zklock.decision.LockDecision` and applies no policy: that, and prerun, is
:func:`celery_zklock.decision.act`.  Functions of the running
:class:`celery_zklock.task.ZkLockedTask`.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

from kazoo.exceptions import ConnectionClosedError

from . import lock_waiting, outcomes
from .config import ZkSettings
from .decision import OF_VERDICT, LockDecision, Outcome, in_process
from .engine.client import get_client
from .engine.identity import Identity
from .engine.lock import FairLock, MultiLock
from .engine.znodes import NodeKind, exclusive_kind
from .errors import LockUnavailable
from .logs import task_logger
from .redelivery import Redelivery, redelivered
from .worker import agent_client
from .worker.agent_protocol import Claimed, Verdict

logger = task_logger()


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
    waiter = lock_waiting.Waiter.running(task, label, direct, functools.partial(outcomes.send_event, task))
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
    # own try: decision.act), any exception (a kazoo error, a signal) must not leave our node behind.
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
