"""The Celery app under test: locked tasks that do fenced read-modify-writes.

Why this shape: every run of a task reads its key's counter through the fence ("begin"),
works for ``ms`` milliseconds, writes counter+1 through the fence ("end"), optionally
lingers in a tail (``tail_ms``, where the freeze fault strikes) and logs that the body
returned ("return").  Those events are the history the checker judges.  The body does not
stop when the store rejects a write: it behaves like a naive client, so that what the
*library* reports for the run is what is being tested.

Configured from ``FAULTS_*`` environment variables, so the worker subprocesses and the test
process (which calls :func:`configure` with the same values) agree on everything.
"""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from celery_zklock import LockLost, ZkLockedTask, current_lock
from celery_zklock.config import reset_settings
from tests.faults.store import Store

app = Celery("faults")
STORE: Store | None = None


def configure(env: dict[str, str]) -> None:
    """Point the app at the services named in ``env`` (the ``FAULTS_*`` variables)."""
    global STORE
    broker = env.get("FAULTS_BROKER", "redis://127.0.0.1:1/0")
    app.conf.update(
        broker_url=broker,
        task_default_queue=env.get("FAULTS_QUEUE", "celery"),
        result_backend=env.get("FAULTS_BACKEND") or broker.rsplit("/", 1)[0] + "/1",
        zklock_hosts=env.get("FAULTS_ZK_HOSTS", "127.0.0.1:1"),
        zklock_root=env.get("FAULTS_ZK_ROOT", "/faults"),
        zklock_session_timeout=float(env.get("FAULTS_SESSION", "3")),
        zklock_connect_timeout=3.0,
        zklock_timeout=60.0,
        zklock_retry_countdown=0.2,
        zklock_retry_backoff=1.5,
        zklock_retry_backoff_max=1.0,
        zklock_max_retries=60,
        worker_prefetch_multiplier=1,
        task_track_started=True,
        result_expires=3600,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_transport_options={
            # acks_late copies come back this long after delivery if not acknowledged; the
            # sweep that brings them back runs every second instead of every 100 s.
            "visibility_timeout": float(env.get("FAULTS_VISIBILITY", "3600")),
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
        result_backend_transport_options={"retry_policy": {"max_retries": 60, "interval_start": 0.1,
                                                           "interval_step": 0.2, "interval_max": 1}},
    )
    # Any further settings, as JSON: how the bad-input tests hand a worker a bad setting.
    app.conf.update(json.loads(env.get("FAULTS_CONF") or "{}"))
    reset_settings(app)
    STORE = Store(env.get("FAULTS_STORE", "redis://127.0.0.1:1/0"))


def nap(ms: float) -> None:
    """Sleep in 10 ms steps: an ``interrupt`` LockLost lands at the next bytecode, and a
    single long C-level sleep would not give it one."""
    deadline = time.monotonic() + ms / 1000
    while time.monotonic() < deadline:
        time.sleep(min(0.01, max(0.0, deadline - time.monotonic())))


def fenced_run(task, key: str, ms: float, tail_ms: float) -> int:
    """The body shared by the locked tasks (see the module docstring)."""
    token = current_lock().token
    who = dict(key=key, task=task.request.id, token=token, worker=task.request.hostname or "?", pid=os.getpid())
    STORE.redis.hset("faults:running", task.request.id, os.getpid())
    try:
        _ok, value, _t = STORE.op("begin", **who)
        nap(ms)
        STORE.op("end", value=value + 1, **who)
        if tail_ms:
            STORE.redis.set(f"faults:tail:{task.request.id}", os.getpid())
            nap(tail_ms)
    except LockLost:
        STORE.op("interrupted", **who)  # on_lock_lost="interrupt" stopped the body here
        raise
    STORE.op("return", **who)
    return token


@app.task(base=ZkLockedTask, bind=True, lock_key="{key}", on_lock_lost="fail")
def step(self, key, ms=50, tail_ms=0):
    """Lock lost mid-run: the run is reported as LockLost even if the body returns."""
    return fenced_run(self, key, ms, tail_ms)


@app.task(base=ZkLockedTask, bind=True, lock_key="{key}", on_lock_lost="interrupt")
def step_interrupt(self, key, ms=50, tail_ms=0):
    """Lock lost mid-run: LockLost is raised inside the body, which stops writing."""
    return fenced_run(self, key, ms, tail_ms)


@app.task(base=ZkLockedTask, bind=True, lock_key="{key}", acks_late=True)
def step_late(self, key, ms=50, tail_ms=0):
    """acks_late: the message is acknowledged after the run, so a lost worker's tasks
    (and unacknowledged ones after a broker restart) are delivered again."""
    return fenced_run(self, key, ms, tail_ms)


@app.task(base=ZkLockedTask, bind=True, lock_key="{key}")
def step_retry_now(self, key, ms=50, tail_ms=0):
    """Retried once, at once (countdown 0), from inside its lock: the same task id comes back
    to the worker while its first delivery lets go, or just after."""
    if not self.request.retries:
        raise self.retry(countdown=0)
    return fenced_run(self, key, ms, tail_ms)


# ----------------------------------------------------------------------- bad input
class _NoText:
    """An object whose only text would be its memory address."""


#: What the ``bad_key`` task's callable lock_key returns for each ``kind``.
BAD_KEYS = {
    "none": None,
    "object": _NoText(),
    "nested-list": [["a", "b"]],
    "dict": {"a": 1},
    "lone-surrogate": "order:\ud800",
    "empty-str": "",
    "empty-list": [],
}


def _bad_key(kind):
    return BAD_KEYS[kind]


@app.task(base=ZkLockedTask, bind=True, lock_key=_bad_key)
def bad_key(self, kind):
    """Never supposed to run: its key is not text.  Records it if it does."""
    STORE.op("mark", key=f"bad:{kind}", task=self.request.id, token=None, worker=self.request.hostname or "?",
             pid=os.getpid())
    return "ran"


configure(dict(os.environ))
