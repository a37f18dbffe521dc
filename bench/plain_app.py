"""Stock Celery, no celery-zklock anywhere: the "plain Celery" contender of
``bench.broker_faults`` (and a reference for ``bench.soak``).

Configured from the same environment variables as ``tests.apps.locked`` (TEST_REDIS_URL,
TEST_BROKER_URL, TEST_VISIBILITY), with the same settings (prefetch multiplier 1, acks
early), and its task body is the same as ``tests.apps.locked.hold``: it notes its arrival,
sleeps ``ms`` and records the run (kind ``plain``) in the Redis list ``history``.  The
worker imports nothing of celery_zklock, so no lock agent, no held-aside requests and no
lease sweep: what a Celery user without the library gets.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("plain")
app.conf.update(
    broker_url=os.environ.get("TEST_BROKER_URL") or REDIS_URL,
    result_backend=REDIS_URL.rsplit("/", 1)[0] + "/1",
    worker_prefetch_multiplier=1,
    task_acks_late=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
if os.environ.get("TEST_VISIBILITY"):
    app.conf.broker_transport_options = {"visibility_timeout": float(os.environ["TEST_VISIBILITY"]),
                                         "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
_r = redis.Redis.from_url(REDIS_URL)


@app.task(name="bench.plain_app.plain_hold")
def plain_hold(key, ms=20, tag=None):
    start = time.time()
    _r.rpush("arrivals", json.dumps({"tag": tag, "start": start}))
    time.sleep(ms / 1000)
    _r.rpush("history", json.dumps({"kind": "plain", "key": key, "tag": tag, "start": start, "end": time.time(),
                                    "pid": os.getpid()}))
    return os.getpid()
