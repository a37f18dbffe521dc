"""What a locked task does when it does not get, or loses, its lock; and how it says so.

Why one place: a timeout, an unreachable ZooKeeper and a lost lock are decided in several
spots of the call path (in process, in the worker's agent, after the body), but each must
follow its policy (``on_lock_timeout``, ``on_lock_unavailable``: retry, skip or fail) and
report the same event the same way wherever it was decided.  Functions of the running
:class:`celery_zklock.task.ZkLockedTask`.
"""

from __future__ import annotations

from typing import Any

from . import metrics, prerun, signals
from .config import ZkSettings, retry_delay
from .errors import LockLost, LockTimeout, LockUnavailable
from .interrupts import RunState
from .logs import task_logger

logger = task_logger()


def lost_error(task, label: Any, run_state: RunState) -> LockLost:
    reason = run_state.reason or "lock lost"
    logger.error("lock %s lost while running (%s): reporting failure", label, reason)
    lock_event(task, "task-lock-lost", key=label, reason=reason)
    return LockLost(label, reason)


def timed_out(task, exc: LockTimeout, opts: ZkSettings, waited: float) -> Any:
    prerun.fire(task)
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
    prerun.fire(task)
    lock_event(task, "task-lock-unavailable", key=label, error=str(exc))
    if opts.on_unavailable == "fail" or direct:
        logger.error("task not run (never unprotected): %s", exc)
        raise exc
    raise _retry(task, exc, opts)


def _retry(task, exc: Exception, opts: ZkSettings) -> Exception:
    """Celery's retry, which logs one line ("retry: Retry in 0.5s: LockUnavailable(...)"),
    naming the error: no line of ours beside it."""
    retries = task.request.retries or 0
    countdown = retry_delay(opts, retries)
    max_retries = task.max_retries if opts.max_retries is None else opts.max_retries
    return task.retry(exc=exc, countdown=countdown, max_retries=max_retries)


def lock_event(task, type_: str, **fields: Any) -> None:
    """Celery event for Flower/monitors, only when task events are on (``-E``); and the
    worker's Prometheus metrics when ``zklock_metrics_port`` is set."""
    metrics.record(type_[len("task-lock-"):], task, **fields)
    if not task.app.conf.worker_send_task_events or task.request.called_directly or not task.request.hostname:
        return
    try:
        task.send_event(type_, **fields)
    except Exception as exc:  # monitoring must never break the task
        logger.debug("could not send %s event: %r", type_, exc)
