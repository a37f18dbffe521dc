"""A Celery app whose task's lock_key names a field the task has no parameter for
(``{order}``, the parameter is ``order_id``): the worker must refuse to start, with one
clear message and no traceback (issue 36 item 5)."""

from __future__ import annotations

import os

from celery import Celery

from celery_zklock import ZkLockedTask

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("bad_key")
app.conf.update(
    broker_url=REDIS_URL,
    zklock_hosts=os.environ.get("TEST_ZK_HOSTS", "127.0.0.1:2181"),
    zklock_root=os.environ.get("TEST_ZK_ROOT", "/celery-zklock"),
    zklock_connect_timeout=3.0,
    broker_connection_retry_on_startup=True,
)


@app.task(base=ZkLockedTask, lock_key="order:{order}")
def ship(order_id):
    return order_id
