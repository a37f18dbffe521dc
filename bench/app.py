"""The Celery app under test: one trivial and one sleeping task per contender.

Why one app for every contender: all contenders then run in the same ``celery worker``
processes, against the same broker, ZooKeeper and Redis, in the same run, so the
comparison is between locking strategies and nothing else (a separate worker per
contender would also compare process start-up luck and page-cache state).  Each
contender is configured the way its own documentation says:

* ``plain``: a plain Celery task, the baseline (no lock, no exclusion);
* ``zklock``: ``base=ZkLockedTask, lock_key="k:{n}"`` (this project);
* ``naive``: a kazoo ``Lock`` taken in ``Task.__call__`` on a per-process client, what a
  user writes by hand before reaching for a library;
* ``once``: celery-once's ``QueueOnce`` with ``app.conf.ONCE`` pointing at Redis,
  ``once={"graceful": True, "keys": ["n"]}`` (duplicates are rejected at publish time);
* ``singleton``: celery-singleton's ``Singleton`` with ``singleton_backend_url`` and
  ``unique_on=["n"]`` (a duplicate gets the running task's result instead of running).

Measurements: every task leaves one JSON record in the Redis list ``bench:rec:<tag>`` from
the ``task_postrun`` signal, i.e. after the contender's own unlock (``on_success`` /
``after_return`` / ``__call__``'s ``finally``) has run.  The record holds ``time.time()``
stamps (one clock for all processes of this machine): ``joined`` (``task_prerun``, just
before the lock is requested), ``start``/``end`` (the body), ``done`` (postrun), plus the
pid and the lock's order token where the lock has one.  With ``announce=True`` the task
also pushes ``joined`` and ``start`` events to ``bench:events:<tag>`` at once, for the
worker-loss scenario, which must know when a task is waiting and when it began.

Configuration comes from environment variables (``BENCH_REDIS_URL``, ``BENCH_ZK_HOSTS``,
``BENCH_ZK_ROOT``, ``BENCH_ZK_WAIT_IN``, ``BENCH_ZK_HANDOFF_SLOTS``, ``BENCH_ZK_USE_SSL``) so the runner and the worker subprocesses agree.
"""

from __future__ import annotations

import json
import os
import threading
import time

import redis
from celery import Celery, Task, signals
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_zklock import ZkLockedTask, current_lock

REDIS_URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:0/0")
#: The broker: Redis unless BENCH_BROKER_URL names another (the burst also runs on RabbitMQ).
BROKER_URL = os.environ.get("BENCH_BROKER_URL") or REDIS_URL
ZK_HOSTS = os.environ.get("BENCH_ZK_HOSTS", "127.0.0.1:2181")
ZK_ROOT = os.environ.get("BENCH_ZK_ROOT", "/bench-celery")

#: Contender name -> label used in tables.  Order = table order.
CONTENDERS = {
    "plain": "plain Celery",
    "zklock": "ZkLockedTask",
    "naive": "naive kazoo Lock",
    "once": "celery-once",
    "singleton": "celery-singleton",
}

app = Celery("bench")
app.conf.update(
    broker_url=BROKER_URL,
    result_backend=None,
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
    worker_redirect_stdouts=False,
    worker_hijack_root_logger=False,
    zklock_hosts=ZK_HOSTS,
    zklock_root=ZK_ROOT,
    zklock_wait_in=os.environ.get("BENCH_ZK_WAIT_IN", "worker"),
    zklock_handoff_slots=int(os.environ["BENCH_ZK_HANDOFF_SLOTS"]) if os.environ.get("BENCH_ZK_HANDOFF_SLOTS") else None,
    zklock_use_ssl=json.loads(os.environ["BENCH_ZK_USE_SSL"]) if os.environ.get("BENCH_ZK_USE_SSL") else False,
    # celery-once, as its README configures it (1 h default lock TTL)
    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": REDIS_URL, "default_timeout": 60 * 60}},
    # celery-singleton, as its README configures it (no lock expiry by default)
    singleton_backend_url=REDIS_URL,
)

_redis = redis.Redis.from_url(REDIS_URL)
_stamps: dict[str, dict] = {}  # task id -> stamps of the task running in this process


# ------------------------------------------------------------------ the naive contender
_naive = threading.local()
_naive_guard = threading.Lock()
_naive_client: dict[int, object] = {}


def naive_client():
    """One started KazooClient per process (pid-checked: clients do not survive fork)."""
    pid = os.getpid()
    client = _naive_client.get(pid)
    if client is None:
        from kazoo.client import KazooClient

        with _naive_guard:
            client = _naive_client.get(pid)
            if client is None:
                client = KazooClient(hosts=ZK_HOSTS, timeout=10.0)
                client.start(timeout=20)
                _naive_client.clear()
                _naive_client[pid] = client
    return client


class NaiveKazooTask(Task):
    """``kazoo.recipe.lock.Lock`` around the body: acquire in ``__call__``, release in ``finally``."""

    abstract = True

    def __call__(self, n, *args, **kwargs):
        from kazoo.recipe.lock import Lock

        lock = Lock(naive_client(), f"{ZK_ROOT}/naive/k:{n}")
        lock.acquire(timeout=300)
        _naive.node = lock.node
        try:
            return self.run(n, *args, **kwargs)
        finally:
            _naive.node = None
            lock.release()


def _order_token(contender: str):
    """Where the lock has one, a number that grows in the order contenders joined its queue.

    ZkLockedTask: the fencing token (czxid of our lock node: assigned when the node is
    created, i.e. when the task joined the queue; still increasing if the container parent
    is deleted and recreated).  Naive kazoo Lock: the node's sequence number (its parent is
    persistent, so the sequence never resets during a run).
    """
    if contender == "zklock":
        return current_lock().token
    if contender == "naive" and getattr(_naive, "node", None):
        return int(_naive.node[-10:])
    return None


def _body(contender: str, n: str, ms: float, tag: str, announce: bool) -> None:
    stamps = _stamps.setdefault(_task_id(), {})
    stamps["start"] = time.time()
    stamps["token"] = _order_token(contender)
    if announce:
        _event(tag, "start", stamps["start"])
    if ms:
        time.sleep(ms / 1000.0)
    stamps["end"] = time.time()


def _task_id() -> str:
    return app.current_task.request.id


def _event(tag: str, kind: str, at: float) -> None:
    _redis.rpush(f"bench:events:{tag}", json.dumps({"kind": kind, "at": at, "pid": os.getpid(), "id": _task_id()}))


# ------------------------------------------------------------------ task registration
_BASES = {
    "plain": (Task, {}),
    "zklock": (ZkLockedTask, {"lock_key": "k:{n}", "lock_timeout": 300}),
    "naive": (NaiveKazooTask, {}),
    "once": (QueueOnce, {"once": {"graceful": True, "keys": ["n"]}}),
    "singleton": (Singleton, {"unique_on": ["n"]}),
}

TASKS: dict[tuple[str, str], Task] = {}


def _register(contender: str, kind: str):
    base, options = _BASES[contender]

    def body(n, ms=0, tag="", announce=False):
        _body(contender, n, ms, tag, announce)

    body.__name__ = f"{contender}_{kind}"
    body.__qualname__ = body.__name__
    return app.task(name=f"bench.{contender}.{kind}", base=base, **options)(body)


for _c in CONTENDERS:
    for _kind in ("trivial", "hold"):
        TASKS[(_c, _kind)] = _register(_c, _kind)

#: Contenders of one scenario only, outside :data:`CONTENDERS` (the tables' order): name -> label.
EXTRA: dict[str, str] = {}


def add_contender(name: str, label: str, base: type, options: dict) -> None:
    """Register a contender's trivial and hold tasks (``bench.<name>.<kind>``) for a scenario
    of its own; the module that calls this is the app the workers import."""
    EXTRA[name] = label
    _BASES[name] = (base, options)
    for kind in ("trivial", "hold"):
        TASKS[(name, kind)] = _register(name, kind)


#: Enqueue-time singletons (scenario 12 only): ours with celery-once's semantics, at most
#: one queued or running per key, next to the peers that lock at enqueue.
ENQUEUE = {"dedupe": 'ZkLockedTask lock_enqueue="dedupe"'}
add_contender("dedupe", ENQUEUE["dedupe"], ZkLockedTask, {"lock_key": "k:{n}", "lock_timeout": 300,
                                                          "lock_enqueue": "dedupe", "lock_enqueue_until": "finish"})


def task(contender: str, kind: str = "trivial") -> Task:
    return TASKS[(contender, kind)]


# ------------------------------------------------------------------ recording
@signals.task_prerun.connect
def _on_prerun(task_id=None, task=None, kwargs=None, **_):
    if not task.name.startswith("bench."):
        return
    at = time.time()
    _stamps[task_id] = {"joined": at}
    if kwargs and kwargs.get("announce"):
        _redis.rpush(f"bench:events:{kwargs['tag']}",
                     json.dumps({"kind": "joined", "at": at, "pid": os.getpid(), "id": task_id}))


@signals.task_postrun.connect
def _on_postrun(task_id=None, task=None, args=None, kwargs=None, state=None, **_):
    if not task.name.startswith("bench."):
        return
    rec = _stamps.pop(task_id, {})
    rec.update(done=time.time(), id=task_id, pid=os.getpid(), host=task.request.hostname, task=task.name, state=state,
               n=(args or [kwargs.get("n")])[0])
    _redis.rpush(f"bench:rec:{(kwargs or {}).get('tag', '')}", json.dumps(rec))
