"""A Celery app configured the way a Django project is: from a settings object under
``namespace="CELERY"`` (``CELERY_BROKER_URL``, ``CELERY_ZKLOCK_HOSTS``...), without Django.

``TEST_NS_SETTINGS`` (JSON) adds or overrides attributes of that settings object, so a test
can start a worker whose settings.py holds a typo such as ``CELERY_ZKLOCK_HOST``."""

from __future__ import annotations

import json
import os
import types

from celery import Celery, shared_task

from celery_zklock import ZkLockedTask

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

settings = types.SimpleNamespace(  # stands in for django.conf:settings
    CELERY_BROKER_URL=REDIS_URL,
    CELERY_RESULT_BACKEND=REDIS_URL.rsplit("/", 1)[0] + "/1",
    CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP=True,
    CELERY_ZKLOCK_HOSTS=os.environ.get("TEST_ZK_HOSTS", "127.0.0.1:2181"),
    CELERY_ZKLOCK_ROOT=os.environ.get("TEST_ZK_ROOT", "/celery-zklock"),
    CELERY_ZKLOCK_SESSION_TIMEOUT=float(os.environ.get("TEST_ZK_SESSION", "4")),
    CELERY_ZKLOCK_CONNECT_TIMEOUT=3.0,
)
for _key, _value in json.loads(os.environ.get("TEST_NS_SETTINGS") or "{}").items():
    setattr(settings, _key, _value)

app = Celery("namespaced")
app.config_from_object(settings, namespace="CELERY")


@shared_task(base=ZkLockedTask, lock_key="order:{order_id}")
def place_order(order_id):
    return order_id
