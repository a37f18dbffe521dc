"""Three ``celery beat`` processes, one elected to send: a plain task scheduled every second.

``beat_scheduler = "celery_zklock.beat:ZkScheduler"`` is the whole change.  The task is a
plain Celery task, not a ``ZkLockedTask``: the election alone keeps its ticks single.

Counters kept in Redis by this module, so a run can be checked:

* ``sent``: one record per tick a beat published (pid, tick number, due time, when), written
  by ``before_task_publish`` in the beat that sends;
* ``runs``: one record per body run (the tick number from the message's ``zklock_beat``
  header, the worker).
"""

from __future__ import annotations

import json
import os
import time

from celery import signals

from examples.common import Store, make_app

app = make_app("beat_elected")
store = Store("beat_elected")

TASK = "examples.beat_elected.app.refresh_exchange_rates"
PERIOD = float(os.environ.get("BEAT_ELECTED_PERIOD", "1.0"))

app.conf.update(
    beat_scheduler="celery_zklock.beat:ZkScheduler",
    beat_schedule={"refresh-exchange-rates": {"task": TASK, "schedule": PERIOD}},
    beat_max_loop_interval=1.0,
    zklock_beat_group=os.environ.get("BEAT_ELECTED_GROUP") or "beat_elected",
    zklock_session_timeout=float(os.environ.get("BEAT_ELECTED_SESSION_TIMEOUT", "4.0")),
)


@app.task(bind=True)
def refresh_exchange_rates(self) -> int:
    tick = (self.request.headers or {}).get("zklock_beat") if isinstance(self.request.headers, dict) else None
    tick = tick or getattr(self.request, "zklock_beat", None) or {}
    store.r.rpush(store.key("runs"), json.dumps({"id": self.request.id, "seq": tick.get("seq"), "at": time.time(),
                                                  "worker": self.request.hostname}))
    return tick.get("seq") or 0


@signals.before_task_publish.connect
def _count_tick(sender=None, headers=None, **_):
    if sender == TASK:  # fires in the process that publishes: here, a beat
        tick = (headers or {}).get("zklock_beat") or {}
        store.r.rpush(store.key("sent"), json.dumps({"pid": os.getpid(), "seq": tick.get("seq"), "due": tick.get("due"),
                                                      "token": tick.get("token"), "at": time.time()}))
