"""A cluster job scheduled by beat that takes longer than its period.

The classic misconfiguration: two ``celery beat`` processes run (say one per deployment
replica), so every tick is sent twice, and the job (2.2 s) outlasts its period (1 s).
Without a lock the runs pile up and overlap.  With ``lock_key=None`` the task is a
cluster-wide singleton; ``lock_timeout=0`` tries the lock once and ``on_lock_timeout="skip"``
drops a tick that finds the job already running: the task ends without running its body
(SUCCESS, with the result None).

Counters kept in Redis by this module, so a run can be checked:

* ``sent``: ticks published, per beat process (``before_task_publish`` in the beat);
* ``runs``: one record per body run (start, end, token, worker, concurrent runs seen);
* ``skipped``: ticks skipped (celery_zklock's ``lock_timed_out`` signal, policy ``"skip"``).
"""

from __future__ import annotations

import json
import os
import socket
import time

from celery import signals

from celery_zklock import ZkLockedTask, current_lock
from celery_zklock.signals import lock_timed_out
from examples.common import Store, make_app

app = make_app("beat_singleton")
store = Store("beat")

TASK = "examples.beat_singleton.app.rebuild_search_index"
PERIOD = float(os.environ.get("BEAT_SINGLETON_PERIOD", "1.0"))
DURATION = float(os.environ.get("BEAT_SINGLETON_DURATION", "2.2"))

app.conf.beat_schedule = {
    "rebuild-search-index": {"task": TASK, "schedule": PERIOD, "kwargs": {"seconds": DURATION}},
}
app.conf.beat_max_loop_interval = 1.0


@app.task(base=ZkLockedTask, bind=True, lock_timeout=0, on_lock_timeout="skip")
def rebuild_search_index(self, seconds: float = DURATION) -> int:
    token = current_lock().token
    r = store.r
    concurrent = r.incr(store.key("running"))  # > 1 would mean two runs at once
    start = time.time()
    time.sleep(seconds)
    end = time.time()
    r.decr(store.key("running"))
    r.rpush(store.key("runs"), json.dumps({"id": self.request.id, "start": start, "end": end, "token": token,
                                            "concurrent": concurrent, "worker": self.request.hostname}))
    return token


@signals.before_task_publish.connect
def _count_tick(sender=None, headers=None, **_):
    if sender == TASK:  # fires in the process that publishes: here, a beat
        pipe = store.r.pipeline()
        pipe.hincrby(store.key("sent"), f"{socket.gethostname()}:{os.getpid()}", 1)
        pipe.rpush(store.key("sent_ids"), (headers or {}).get("id", ""))
        pipe.execute()


@lock_timed_out.connect
def _count_skip(sender=None, policy=None, **_):
    if sender is not None and sender.name == TASK and policy == "skip":
        store.r.incr(store.key("skipped"))
