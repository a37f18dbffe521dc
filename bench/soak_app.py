"""The Celery app of ``make soak`` (:mod:`bench.soak`): one locked task, recording each run.

Configured from the environment like ``tests.apps.locked`` (TEST_REDIS_URL, TEST_BROKER_URL,
TEST_ZK_HOSTS, TEST_ZK_ROOT, TEST_ZK_SESSION), with the same settings (prefetch multiplier
1, acks early).  ``hold`` notes its arrival (task id, tag, pid) in the Redis list
``soak:arrivals`` as its body starts, sleeps ``ms``, and records the run in ``soak:runs``
(task id, tag, key, pid, start, end, fencing token, and whether the lock was still held).
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_zklock import ZkLockedTask, current_lock

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("soak")
app.conf.update(
    broker_url=os.environ.get("TEST_BROKER_URL") or REDIS_URL,
    result_backend=REDIS_URL.rsplit("/", 1)[0] + "/1",
    zklock_hosts=os.environ.get("TEST_ZK_HOSTS", "127.0.0.1:2181"),
    zklock_root=os.environ.get("TEST_ZK_ROOT", "/celery-zklock-soak"),
    zklock_session_timeout=float(os.environ.get("TEST_ZK_SESSION", "6")),
    zklock_connect_timeout=3.0,
    zklock_retry_countdown=0.2,
    zklock_retry_backoff=1.5,
    worker_prefetch_multiplier=1,
    task_acks_late=False,
    broker_connection_retry_on_startup=True,
    result_expires=7200,
)
_r = redis.Redis.from_url(REDIS_URL)


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=300, bind=True, name="bench.soak_app.hold")
def hold(self, key, ms=40, tag=None):
    lk = current_lock()
    start = time.time()
    _r.rpush("soak:arrivals", json.dumps({"id": self.request.id, "tag": tag, "pid": os.getpid(), "start": start}))
    time.sleep(ms / 1000)
    _r.rpush("soak:runs", json.dumps({"id": self.request.id, "tag": tag, "key": key, "pid": os.getpid(), "start": start,
                                      "end": time.time(), "token": lk.token, "held": lk.is_held(),
                                      "retries": self.request.retries}))
    return lk.token
