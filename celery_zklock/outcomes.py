"""What a locked task does when it does not get, or loses, its lock; and how it says so.

Why one place: a timeout, an unreachable ZooKeeper and a lost lock are decided in several
spots of the call path (in process, in the worker's agent, after the body), but each must
follow its policy (``on_lock_timeout``, ``on_lock_unavailable``: retry, skip or fail) and
report the same event the same way wherever it was decided.  Mixed into
:class:`celery_zklock.task.ZkLockedTask`.
"""

from __future__ import annotations

from typing import Any

from celery.exceptions import Ignore
from celery.utils.log import get_task_logger

from . import metrics, prerun
from .config import ZkSettings
from .errors import LockLost, LockTimeout, LockUnavailable
from .interrupts import RunState
from .states import SKIPPED

logger = get_task_logger("celery_zklock")


class LockOutcomes:
    """The retry/skip/fail policies and the lock events of :class:`ZkLockedTask`."""

    def _lost_error(self, label: Any, run_state: RunState) -> LockLost:
        reason = run_state.reason or "lock lost"
        logger.error("lock %s lost while running (%s): reporting failure", label, reason)
        self._lock_event("task-lock-lost", key=label, reason=reason)
        return LockLost(label, reason)

    def _timed_out(self, exc: LockTimeout, opts: ZkSettings, waited: float, direct: bool) -> Any:
        prerun.fire(self)
        self._lock_event("task-lock-timeout", key=exc.key, wait=round(waited, 6), holders=exc.holders, policy=opts.on_timeout)
        if opts.on_timeout == "fail":
            logger.warning("%s; failing", exc)
            raise exc
        if opts.on_timeout == "skip":
            logger.warning("%s; skipped (on_lock_timeout='skip')", exc)
            if direct:
                return None
            if self.request.id and not self.ignore_result:
                self.update_state(state=SKIPPED, meta={"key": exc.key, "holders": exc.holders, "timeout": exc.timeout})
            raise Ignore()
        raise self._retry(exc, opts, f"lock timeout: {exc}")

    def _unavailable(self, exc: LockUnavailable, opts: ZkSettings, label: Any, direct: bool) -> Any:
        prerun.fire(self)
        logger.error("task not run (never unprotected): %s", exc)
        self._lock_event("task-lock-unavailable", key=label, error=str(exc))
        if opts.on_unavailable == "fail" or direct:
            raise exc
        raise self._retry(exc, opts, str(exc))

    def _retry(self, exc: Exception, opts: ZkSettings, why: str) -> Exception:
        retries = self.request.retries or 0
        countdown = min(opts.retry_backoff_max, opts.retry_countdown * (opts.retry_backoff ** retries))
        max_retries = self.max_retries if opts.max_retries is None else opts.max_retries
        logger.info("retry %s in %.2fs: %s", retries + 1, countdown, why)
        return self.retry(exc=exc, countdown=countdown, max_retries=max_retries)

    def _lock_event(self, type_: str, **fields: Any) -> None:
        """Celery event for Flower/monitors, only when task events are on (``-E``); and the
        worker's Prometheus metrics when ``zklock_metrics_port`` is set."""
        metrics.record(type_[len("task-lock-"):], self, **fields)
        if not self.app.conf.worker_send_task_events or self.request.called_directly or not self.request.hostname:
            return
        try:
            self.send_event(type_, **fields)
        except Exception as exc:  # monitoring must never break the task
            logger.debug("could not send %s event: %r", type_, exc)
