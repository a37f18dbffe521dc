"""Celery app for the enqueue-time singleton tests (``lock_enqueue``), configured from the
environment like tests.apps.locked so workers and the test process agree."""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_zklock import ZkLockedTask, current_lock

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("enqueued")
app.conf.update(
    broker_url=REDIS_URL,
    result_backend=REDIS_URL.rsplit("/", 1)[0] + "/1",
    zklock_hosts=os.environ.get("TEST_ZK_HOSTS", "127.0.0.1:2181"),
    zklock_root=os.environ.get("TEST_ZK_ROOT", "/celery-zklock"),
    zklock_session_timeout=float(os.environ.get("TEST_ZK_SESSION", "4")),
    zklock_connect_timeout=3.0,
    zklock_retry_countdown=0.2,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
if os.environ.get("TEST_ZK_WAIT_IN"):
    app.conf.zklock_wait_in = os.environ["TEST_ZK_WAIT_IN"]
_r = redis.Redis.from_url(REDIS_URL)


def _record(kind: str, key: str, ms: float) -> None:
    from celery import current_task

    start = time.time()
    granted = current_lock().acquired_at  # after its enqueue guard ended (lock_enqueue_until="start")
    _r.rpush("enq:runs", json.dumps({"kind": kind, "key": key, "id": current_task.request.id, "start": start,
                                     "granted": granted, "pid": os.getpid()}))
    time.sleep(ms / 1000.0)


@app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe")
def refresh(user, ms=0):
    _record("refresh", str(user), ms)
    return user


@app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="reject")
def rejecting(user, ms=0):
    _record("rejecting", str(user), ms)
    return user


@app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe", lock_enqueue_until="finish")
def in_flight(user, ms=0):
    _record("in_flight", str(user), ms)
    return user


@app.task(bind=True, base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="reject", lock_enqueue_until="finish",
          max_retries=3)
def retrying(self, user, ms=0):
    _record("retrying", str(user), ms)
    if self.request.retries < 2:
        raise self.retry(countdown=0.1)
    return self.request.retries


@app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe", lock_timeout=1.0, on_lock_timeout="skip",
          lock_enqueue_unrun="report")
def skipping(user, ms=0):
    _record("skipping", str(user), ms)
    return user


@app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe", lock_timeout=2.0, on_lock_timeout="skip")
def republishing(user, ms=0):
    _record("republishing", str(user), ms)
    return user


def _die_the_first_time(self, task_id, args, kwargs):
    """Before ``__call__`` (so before the pool process claims its lock from the agent)."""
    if _r.set(f"enq:died:{args[0]}", 1, nx=True, ex=600):
        os._exit(1)


@app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe", lock_enqueue_until="finish",
          before_start=_die_the_first_time)
def dying(user, ms=0):
    _record("dying", str(user), ms)
    return user


@app.task
def echo(value):
    """A plain task: a chain's rest, a link, a chord's body."""
    return value


@app.task(base=ZkLockedTask, lock_key="user:{user}")
def holding(user, flag):
    """Holds the execution lock of user:<user> until the test sets ``flag`` in Redis (30 s at most)."""
    _record("holding", str(user), 0)
    deadline = time.monotonic() + 30
    while not _r.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.05)
    return user


@app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe", lock_timeout=1.0, on_lock_timeout="retry",
          lock_max_retries=1)
def timing_out(user, ms=0):
    _record("timing_out", str(user), ms)
    return user


def _first_argument(*args, **kwargs):
    """A key callable that takes any call: Celery's argument check is the one that refuses."""
    return f"user:{args[0] if args else kwargs.get('user')}"


@app.task(base=ZkLockedTask, lock_key=_first_argument, lock_enqueue="dedupe")
def keyed_by_callable(user, ms=0):
    _record("keyed_by_callable", str(user), ms)
    return user


@app.task(base=ZkLockedTask, lock_key=None, lock_enqueue="dedupe")
def one_at_a_time(user, ms=0):
    _record("one_at_a_time", str(user), ms)
    return user
