"""Celery app used by the real-worker tests; configured from environment variables so the
worker subprocesses and the test process agree on the broker, backend and ZooKeeper."""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery, shared_task

from celery_zklock import ZkLockedTask, current_lock

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("locked")
app.conf.update(
    broker_url=os.environ.get("TEST_BROKER_URL") or REDIS_URL,
    result_backend=REDIS_URL.rsplit("/", 1)[0] + "/1",
    zklock_hosts=os.environ.get("TEST_ZK_HOSTS", "127.0.0.1:2181"),
    zklock_root=os.environ.get("TEST_ZK_ROOT", "/celery-zklock"),
    zklock_session_timeout=float(os.environ.get("TEST_ZK_SESSION", "4")),
    zklock_connect_timeout=3.0,
    zklock_retry_countdown=0.2,
    zklock_retry_backoff=1.5,
    worker_prefetch_multiplier=1,
    task_acks_late=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
if os.environ.get("TEST_ZK_WAIT_IN"):
    app.conf.zklock_wait_in = os.environ["TEST_ZK_WAIT_IN"]
# Security settings for tests/test_security.py, as JSON (the worker gets them through its env).
for _name in ("use_ssl", "auth_secret", "sasl_options", "tasks"):
    if os.environ.get(f"TEST_ZK_{_name.upper()}"):
        app.conf[f"zklock_{_name}"] = json.loads(os.environ[f"TEST_ZK_{_name.upper()}"])
if os.environ.get("TEST_ZK_METRICS_PORT"):
    app.conf.zklock_metrics_port = int(os.environ["TEST_ZK_METRICS_PORT"])
if os.environ.get("TEST_ZK_HANDOFF_SLOTS"):
    app.conf.zklock_handoff_slots = int(os.environ["TEST_ZK_HANDOFF_SLOTS"])
if os.environ.get("TEST_ZK_COHORT_HANDOFFS"):
    app.conf.zklock_cohort_handoffs = int(os.environ["TEST_ZK_COHORT_HANDOFFS"])
if os.environ.get("TEST_ETA_TASK_LIMIT"):
    app.conf.worker_eta_task_limit = int(os.environ["TEST_ETA_TASK_LIMIT"])
if os.environ.get("TEST_VISIBILITY"):
    # Redis's visibility timeout, and kombu's sweep every second (its default: every 100 s).
    app.conf.broker_transport_options = {"visibility_timeout": float(os.environ["TEST_VISIBILITY"]),
                                         "unacked_restore_interval": 1, "unacked_restore_throttle": 1}
if os.environ.get("TEST_KEYPREFIX"):  # kombu's global_keyprefix: every broker key under a prefix
    app.conf.broker_transport_options = {**(app.conf.broker_transport_options or {}),
                                         "global_keyprefix": os.environ["TEST_KEYPREFIX"]}
if os.environ.get("TEST_POOL_START_METHOD"):
    app.conf.worker_pool_start_method = os.environ["TEST_POOL_START_METHOD"]
_r = redis.Redis.from_url(REDIS_URL)


def _record(kind: str, key, tag, start: float, end: float, token=None, carried=None) -> None:
    _r.rpush(
        "history",
        json.dumps({"kind": kind, "key": key, "tag": tag, "start": start, "end": end, "pid": os.getpid(), "token": token,
                    "carried": carried}),
    )


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=60)
def hold(key, ms=20, tag=None):
    return _hold(key, ms, tag)


def _hold(key, ms, tag):
    lk = current_lock()
    start = time.time()
    _r.rpush("arrivals", json.dumps({"tag": tag, "start": start}))
    time.sleep(ms / 1000)
    _record("hold", key, tag, start, time.time(), lk.token, getattr(lk._lock, "carried", None))
    return lk.token


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=60, lock_mode="read")
def read_hold(key, ms=20, tag=None):
    """``hold``'s reader: shares ``k:{key}`` with other readers, never with ``hold``."""
    lk = current_lock()
    start = time.time()
    time.sleep(ms / 1000)
    _record("read", key, tag, start, time.time(), lk.token)
    return lk.mode


@app.task(base=ZkLockedTask, lock_key=["k:{read}", "k:{write}"], lock_timeout=60, lock_mode={"k:{read}": "read"})
def read_one_write_other(read, write, ms=20, tag=None):
    """Reads ``k:{read}`` and writes ``k:{write}``: mixed modes, taken in canonical order."""
    start = time.time()
    time.sleep(ms / 1000)
    end = time.time()
    _record("read", read, tag, start, end)
    _record("hold", write, tag, start, end)
    return current_lock().modes


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=60, track_started=True)
def hold_tracked(key, ms=20, tag=None):
    """``hold`` with ``track_started``: it stores LOCK_WAITING while it waits."""
    return _hold(key, ms, tag)


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=0.3, on_lock_timeout="fail")
def hold_fail(key, ms=0):
    time.sleep(ms / 1000)
    return "ran"


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=0.3, on_lock_timeout="skip")
def hold_skip(key, ms=0):
    time.sleep(ms / 1000)
    return "ran"


@app.task
def gather(results):
    """A chord's callback: what its header returned."""
    return results


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=0, on_lock_timeout="skip", lock_retry_countdown=0.5,
          lock_max_retries=40)
def try_once(key):
    """A try-once singleton (the nightly job's options): skipped when busy, retried when the
    lock cannot be decided (``on_lock_unavailable``'s default)."""
    _record("try_once", key, None, time.time(), time.time())
    return "ran"


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=0.2, on_lock_timeout="retry",
          lock_retry_countdown=0.3, lock_max_retries=20, bind=True)
def hold_retry(self, key, ms=0):
    _r.rpush("retry-runs", json.dumps({"retries": self.request.retries, "at": time.time()}))
    time.sleep(ms / 1000)
    return self.request.retries


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_max_holders=2)
def hold_two(key, ms=50, tag=None, until=None):
    """Hold for ``ms``, or (with ``until``, a Redis key) until the test sets that key: checks
    that must run while two hold then do not race the clock of a loaded machine."""
    start = time.time()
    if until is None:
        time.sleep(ms / 1000)
    else:
        _hold_until(until, start)
    _record("two", key, tag, start, time.time())


def _hold_until(until, start: float) -> None:
    """Hold until the test sets the Redis key ``until`` (a check that must run while the task
    holds then does not race a loaded machine's clock), 120 s at most."""
    while until is not None and not _r.exists(until) and time.time() < start + 120:
        time.sleep(0.01)


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=60, ignore_result=True)
def hold_unrecorded(key, tag=None, until=None):
    """``hold`` keeping no result (``ignore_result``): nothing tells a second delivery of its
    message that the first ran, so a message the broker gives back runs twice.  With
    ``until`` (a Redis key) it holds until the test sets that key, as ``hold_two`` does."""
    start = time.time()
    _r.rpush("arrivals", json.dumps({"tag": tag, "start": start}))
    _hold_until(until, start)
    _record("unrecorded", key, tag, start, time.time())


@app.task(base=ZkLockedTask, lock_key=["m:{a}", "m:{b}"])
def hold_multi(a, b, ms=5, tag=None):
    start = time.time()
    time.sleep(ms / 1000)
    _record("multi", sorted([a, b]), tag, start, time.time())


@app.task(base=ZkLockedTask)
def singleton(ms=50, tag=None):
    start = time.time()
    time.sleep(ms / 1000)
    _record("singleton", "singleton", tag, start, time.time())


@app.task(base=ZkLockedTask, lock_key="k:{key}")
def report_pid(key, ms=5000):
    _r.set(f"pid:{key}", os.getpid())
    time.sleep(ms / 1000)
    return "finished"


@app.task(base=ZkLockedTask, lock_key="k:{key}", on_lock_lost="fail")
def lose_fail(key, ms=3000):
    _r.set(f"pid:{key}", os.getpid())
    time.sleep(ms / 1000)
    return "body returned"


@app.task(base=ZkLockedTask, lock_key="k:{key}", on_lock_lost="interrupt")
def lose_interrupt(key, ms=3000):
    _r.set(f"pid:{key}", os.getpid())
    deadline = time.time() + ms / 1000
    while time.time() < deadline:
        time.sleep(0.01)
    _r.set(f"finished:{key}", 1)
    return "body returned"


@app.task(base=ZkLockedTask, lock_key="k:{key}", on_lock_lost="interrupt")
def hold_interrupt(key, ms=3000, tag=None):
    """A hold that records its token on arrival, and when its body ends or is interrupted."""
    token, start = current_lock().token, time.time()
    _r.rpush("arrivals", json.dumps({"tag": tag, "start": start, "token": token}))
    deadline = start + ms / 1000
    try:
        while time.time() < deadline:
            time.sleep(0.01)
    except BaseException:
        _record("interrupted", key, tag, start, time.time(), token)
        raise
    _record("hold", key, tag, start, time.time(), token)
    return token


@app.task(base=ZkLockedTask, lock_key="k:{key}", acks_late=True)
def hold_late(key, ms=20, tag=None):
    start = time.time()
    time.sleep(ms / 1000)
    _record("hold", key, tag, start, time.time(), current_lock().token)


@app.task(base=ZkLockedTask, lock_key="k:{key}", acks_late=True, track_started=True, lock_timeout=0.2, on_lock_timeout="skip")
def hold_late_skip(key, ms=20, tag=None):
    start = time.time()
    time.sleep(ms / 1000)
    _record("hold", key, tag, start, time.time(), current_lock().token)


@app.task(base=ZkLockedTask, lock_key="k:{key}", acks_late=True, track_started=True, lock_timeout=0, on_lock_timeout="fail")
def hold_late_nowait(key, ms=20, tag=None):
    start = time.time()
    time.sleep(ms / 1000)
    _record("hold", key, tag, start, time.time(), current_lock().token)


@app.task(base=ZkLockedTask, lock_key="k:{key}", acks_late=True, bind=True)
def late_retry_while_holding(self, key):
    """Publishes its retry while it still holds the lock (``throw=False``), then finishes."""
    start = time.time()
    if self.request.retries == 0:
        self.retry(countdown=0, throw=False)
        time.sleep(0.5)
    _record("hold", key, f"attempt{self.request.retries}", start, time.time(), current_lock().token)


class Flaky(Exception):
    """Raised by ``autoretry_backoff`` on its first attempts."""


@app.task(base=ZkLockedTask, lock_key="k:{key}", bind=True, autoretry_for=(Flaky,), retry_backoff=0.2,
          retry_backoff_max=1, retry_jitter=False, max_retries=5)
def autoretry_backoff(self, key, fail_times=2):
    """Celery's own autoretry with backoff, through the lock: each attempt holds it."""
    start = time.time()
    token = current_lock().token
    _record("autoretry", key, f"attempt{self.request.retries}", start, time.time(), token)
    if self.request.retries < fail_times:
        raise Flaky(f"attempt {self.request.retries}")
    return {"retries": self.request.retries, "token": token}


@app.task(base=ZkLockedTask, lock_key="k:{key}", bind=True)
def retry_while_holding(self, key):
    """Publishes its retry while it still holds the lock (``throw=False``), then goes on:
    the retry (same task id) must wait for this attempt's lock, not take it over."""
    start = time.time()
    if self.request.retries == 0:
        self.retry(countdown=0, throw=False)
        time.sleep(0.5)
    _record("hold", key, f"attempt{self.request.retries}", start, time.time(), current_lock().token)


# Not a ZkLockedTask: locked only through zklock_tasks (TEST_ZK_TASKS), code unchanged.
@shared_task(name="tests.apps.shared.plain_hold")
def plain_hold(key, ms=20, tag=None):
    start = time.time()
    time.sleep(ms / 1000)
    _record("plain", key, tag, start, time.time())
    return os.getpid()


# ---- task_prerun / task_postrun around a lock wait (tests/test_prerun.py) -----------------
from celery import signals as _signals  # noqa: E402

_TIMED = ("tests.apps.locked.timed_hold", "tests.apps.locked.timed_skip", "tests.apps.locked.timed_late")


def _note_signal(kind: str, task_id, task) -> None:
    if task is not None and task.name in _TIMED:
        _r.rpush("signals", json.dumps({"sig": kind, "id": task_id, "at": time.time(), "pid": os.getpid()}))


_signals.task_prerun.connect(lambda task_id=None, task=None, **_: _note_signal("prerun", task_id, task), weak=False,
                            dispatch_uid="tests-timed-prerun")  # once, however often reloaded
_signals.task_postrun.connect(lambda task_id=None, task=None, **_: _note_signal("postrun", task_id, task), weak=False,
                             dispatch_uid="tests-timed-postrun")


def _timed_body(request_id, key, ms) -> int:
    lk = current_lock()
    start = time.time()
    time.sleep(ms / 1000)
    _r.rpush("signals", json.dumps({"sig": "body", "id": request_id, "start": start, "end": time.time(),
                                    "wait": lk.wait, "acquired_at": lk.acquired_at}))
    return lk.token


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=60, bind=True)
def timed_hold(self, key, ms=10):
    return _timed_body(self.request.id, key, ms)


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=0.3, on_lock_timeout="skip")
def timed_skip(key):
    return "ran"


@app.task(base=ZkLockedTask, lock_key="k:{key}", lock_timeout=60, acks_late=True, bind=True)
def timed_late(self, key, ms=10):
    return _timed_body(self.request.id, key, ms)


# ---- calling locked tasks from locked tasks (tests/test_reentrant.py) ----------------------
import threading as _threading  # noqa: E402


def _call(task, how: str, *args):
    """Call ``task`` the way a refactored body would: directly, eagerly, or (not the owner)
    from another thread of the same process."""
    if how == "direct":
        return task(*args)
    if how == "apply":
        return task.apply(args=args).get(disable_sync_subtasks=False)
    if how == "thread":
        box: dict = {}

        def run() -> None:
            try:
                box["value"] = task(*args)
            except Exception as exc:  # LockTimeout: it queued behind its own caller
                box["error"] = f"{type(exc).__name__}: {exc}"

        t = _threading.Thread(target=run)
        t.start()
        t.join()
        return box
    raise ValueError(how)


def _peer_gets(path: str) -> bool:
    """Can another FairLock (same process, another node) take ``path`` right now?"""
    from celery_zklock import FairLock
    from celery_zklock.engine.client import get_client

    peer = FairLock(get_client(re_outer.lock_options()), path)
    got = peer.acquire(timeout=0)
    if got:
        peer.release()
    return got


def _seen() -> dict:
    lk = current_lock()
    return {"token": lk.token, "tokens": sorted(lk.tokens.values()), "held": lk.is_held(), "task_id": lk.task_id}


@app.task(base=ZkLockedTask, lock_key="acct:{k}", lock_timeout=3, on_lock_timeout="fail")
def re_leaf(k):
    return _seen()


@app.task(base=ZkLockedTask, lock_key="acct:{k}", lock_timeout=3, on_lock_timeout="fail")
def re_mid(k, how):
    return {**_seen(), "inner": _call(re_leaf, how, k)}


@app.task(base=ZkLockedTask, lock_key="acct:{k}", lock_timeout=3, on_lock_timeout="fail", lock_reentrant=False)
def re_strict(k):
    return "ran"


@app.task(base=ZkLockedTask, lock_key=["acct:{a}", "acct:{b}"], lock_timeout=3, on_lock_timeout="fail")
def re_pair(a, b):
    return _seen()


def _outer_body(k, how="direct", inner="leaf", other=None):
    """Calls a locked task on its own key (and, for ``pair``, one more key ``other``)."""
    start = time.monotonic()
    if inner == "leaf":
        got = _call(re_leaf, how, k)
    elif inner == "mid":
        got = _call(re_mid, how, k, how)
    elif inner == "strict":
        try:
            got = _call(re_strict, how, k)
        except Exception as exc:
            got = {"error": f"{type(exc).__name__}: {exc}"}
    elif inner == "pair":
        got = _call(re_pair, how, k, other)
    else:
        raise ValueError(inner)
    took = time.monotonic() - start
    lk = current_lock()
    after = {"held": lk.is_held(), "peer_gets_own_key": _peer_gets(lk.path)}
    if other is not None:  # the superset's extra key was released by the inner call
        from celery_zklock.keys import key_path

        after["peer_gets_other_key"] = _peer_gets(key_path(re_outer.lock_options().root, f"acct:{other}"))
    return {**_seen(), "inner": got, "took": took, "after": after}


@app.task(base=ZkLockedTask, lock_key="acct:{k}", lock_timeout=3, on_lock_timeout="fail")
def re_outer(k, how="direct", inner="leaf", other=None):
    return _outer_body(k, how, inner, other)


@app.task(base=ZkLockedTask, lock_key="acct:{k}", lock_timeout=3, on_lock_timeout="fail", acks_late=True)
def re_outer_late(k, how="direct", inner="leaf", other=None):
    return _outer_body(k, how, inner, other)


@app.task(base=ZkLockedTask, lock_key=["acct:{a}", "acct:{b}"], lock_timeout=3, on_lock_timeout="fail")
def re_pair_outer(a, b, how="direct"):
    """Holds two keys and calls a task that needs one of them (a subset)."""
    start = time.monotonic()
    got = _call(re_leaf, how, a)
    return {**_seen(), "inner": got, "took": time.monotonic() - start,
            "after": {"held": current_lock().is_held(), "peer_gets_own_key": _peer_gets(current_lock().path)}}
