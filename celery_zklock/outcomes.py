"""What a locked task does when it does not get, or loses, its lock; and how it says so.

Why one place: a timeout, an unreachable ZooKeeper and a lost lock are decided in several
spots of the call path (in process, in the worker's agent, after the body), but each must
follow its policy (``on_lock_timeout``, ``on_lock_unavailable``: retry, skip or fail) and
report the same event the same way wherever it was decided.  Functions of the running
:class:`celery_zklock.task.ZkLockedTask`; the policies are applied by
:func:`celery_zklock.decision.act`, after it sent the task's prerun.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import Ignore

from . import metrics, signals
from .config import ZkSettings, retry_delay
from .errors import LockLost, LockTimeout, LockUnavailable
from .interrupts import RunState
from .logs import task_logger
from .redelivery import publish_again

logger = task_logger()


def lost_error(task, label: Any, run_state: RunState) -> LockLost:
    reason = run_state.reason or "lock lost"
    logger.error("lock %s lost while running (%s): reporting failure", label, reason)
    lock_event(task, "task-lock-lost", key=label, reason=reason)
    return LockLost(label, reason)


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


class GivenBack(Ignore):
    """This run ended unrun because its request went back to the broker: like a retry, the
    new message carries on its enqueue guard (it is not ended here)."""


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
