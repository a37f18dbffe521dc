"""A short lock timeout with the retry policy: the task never blocks a worker slot for long.

``sync_account`` waits at most 0.5 s for ``account:{account_id}``.  When a long
``reconcile`` of the same account holds the lock, the attempt gives up, deletes its queue
node (the lock is never held across a retry) and is re-published with a countdown that
grows: ``lock_retry_countdown × lock_retry_backoff ** retries``, capped at
``lock_retry_backoff_max`` — 0.25, 0.5, 1, 2, 2... seconds here — up to
``lock_max_retries`` times.  Once the reconcile ends, the next attempt runs.

Recorded in Redis for the checks: every attempt's lock decision (``task_prerun``, which for a
locked task fires when its lock is decided, wherever it waited; with the retry number), every
retry with its countdown (``task_retry``: ``reason.when``), every body run.
"""

from __future__ import annotations

import json
import time

from celery import signals

from celery_zklock import ZkLockedTask, current_lock
from examples.common import Store, make_app

app = make_app("retry_on_timeout")
store = Store("retry")

LOCK_TIMEOUT = 0.5
COUNTDOWN, BACKOFF, BACKOFF_MAX, MAX_RETRIES = 0.25, 2.0, 2.0, 10


@app.task(base=ZkLockedTask, lock_key="account:{account_id}", lock_timeout=60)
def reconcile(account_id: int, seconds: float = 7.0) -> int:
    """The long holder: a nightly reconciliation of one account."""
    start = time.time()
    store.r.set(store.key("reconcile", account_id, "start"), start)
    time.sleep(seconds)
    store.r.set(store.key("reconcile", account_id, "end"), time.time())
    return current_lock().token


@app.task(base=ZkLockedTask, bind=True, lock_key="account:{account_id}", lock_timeout=LOCK_TIMEOUT,
          on_lock_timeout="retry", lock_retry_countdown=COUNTDOWN, lock_retry_backoff=BACKOFF,
          lock_retry_backoff_max=BACKOFF_MAX, lock_max_retries=MAX_RETRIES)
def sync_account(self, account_id: int) -> int:
    store.r.rpush(store.key("runs", account_id), json.dumps({"at": time.time(), "retries": self.request.retries,
                                                              "token": current_lock().token}))
    return self.request.retries


def expected_countdowns(n: int) -> list[float]:
    """The policy's first ``n`` countdowns."""
    return [min(BACKOFF_MAX, COUNTDOWN * BACKOFF ** i) for i in range(n)]


@signals.task_prerun.connect
def _note_attempt(task_id=None, task=None, **_):
    if task is not None and task.name == sync_account.name:
        account = task.request.kwargs.get("account_id", (task.request.args or [None])[0])
        store.r.rpush(store.key("attempts", account), json.dumps({"at": time.time(), "retries": task.request.retries or 0}))


@signals.task_retry.connect
def _note_retry(sender=None, request=None, reason=None, **_):
    if sender is not None and sender.name == sync_account.name:
        account = (request.kwargs or {}).get("account_id", (request.args or [None])[0])
        store.r.rpush(store.key("retries", account), json.dumps({"at": time.time(), "retries": request.retries or 0,
                                                                 "countdown": getattr(reason, "when", None)}))
