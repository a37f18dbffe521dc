"""The project's Celery app (the Django way: settings under CELERY_), and a publish counter."""

import json
import os
import time

import redis
from celery import Celery, signals

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.beat.djproj.settings")
app = Celery("djproj")
app.config_from_object("django.conf:settings", namespace="CELERY")
sent = redis.Redis.from_url(os.environ["REDIS_URL"])
TASK = "djproj.ping"


@app.task(name=TASK)
def ping() -> int:
    return 1


@signals.before_task_publish.connect
def _count(sender=None, headers=None, **_):
    if sender == TASK:
        tick = (headers or {}).get("zklock_beat") or {}
        sent.rpush(os.environ["DJANGO_BEAT_SENT"], json.dumps({"pid": os.getpid(), "entry": tick.get("entry"),
                                                            "seq": tick.get("seq"), "at": time.time()}))
