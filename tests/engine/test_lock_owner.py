"""Who owns a FairLock's hold: the thread or greenlet itself, never a number the runtime
recycles (issue 41).

Python hands a thread's id to the next thread once it has exited, and under gevent a
greenlet's id is its address, reused once it is freed.  A hold keyed on such a number was
re-entered by an unrelated thread that happened to get the same id.  Each test here makes
that happen (a new thread or greenlet with the dead holder's id) against a real ZooKeeper.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest

from celery_zklock import FairLock
from tests.lockutil import children

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def path(request):
    return f"/t/{request.node.name.replace('[', '_').replace(']', '')}"


def _in_a_thread(fn):
    """Run ``fn`` in a new thread; returns (its result or exception, the thread's ident)."""
    out: dict = {}

    def run() -> None:
        out["ident"] = threading.get_ident()
        try:
            out["value"] = fn()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out["value"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["value"], out["ident"]


def _in_a_thread_with_ident(ident: int, fn, tries: int = 500):
    """Run ``fn`` in a new thread that has ``ident`` (threads are made until one does)."""
    for _ in range(tries):
        box: dict = {}

        def run(box: dict = box) -> None:  # bound now: each try has its own box
            if threading.get_ident() == ident:
                try:
                    box["value"] = fn()
                except Exception as exc:  # noqa: BLE001
                    box["value"] = exc

        t = threading.Thread(target=run)
        t.start()
        t.join()
        if box:
            return box["value"]
    pytest.skip(f"no new thread got the ident {ident} in {tries} tries (the OS did not reuse it)")


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "not-reentrant"])
def test_a_new_thread_with_a_dead_holders_ident_is_not_the_owner(zk_client, path, reentrant):
    """Thread A acquires and ends without releasing; thread B, another thread with A's id,
    queues like anyone else: its try-once gets False (not True, not LockReentered), and
    ZooKeeper holds A's node alone."""
    lock = FairLock(zk_client, path, reentrant=reentrant)
    got, ident = _in_a_thread(lambda: lock.acquire(blocking=False))
    assert got is True
    assert _in_a_thread_with_ident(ident, lambda: lock.acquire(blocking=False)) is False
    assert _in_a_thread_with_ident(ident, lambda: lock.acquire(timeout=0.2)) is False
    assert len(children(zk_client, path)) == 1
    assert lock.is_held()
    assert lock.release() is True  # any thread may end an ended owner's hold (see FairLock.release)
    assert children(zk_client, path) == []


def test_many_short_lived_threads_on_one_reentrant_instance_one_wins(zk_client, path):
    """kazoo's ``test_lock_many_threads_no_block`` with FairLock's default ``reentrant=True``:
    each thread tries once on one shared instance and never releases; one wins.  First one
    after the other (each new thread reuses the last one's id), then all at once."""
    lock = FairLock(zk_client, path)
    wins = [_in_a_thread(lambda: lock.acquire(blocking=False))[0] for _ in range(20)]
    assert wins.count(True) == 1 and wins.count(False) == 19, wins
    assert len(children(zk_client, path)) == 1
    assert lock.release() is True

    shared = FairLock(zk_client, path + "-2")
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(shared.acquire(blocking=False))) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1, results
    assert len(children(zk_client, path + "-2")) == 1
    shared.release()


def test_an_ended_owners_hold_waits_for_a_release_from_any_thread(zk_client, path):
    """What happens when the owner ends while holding: the hold stays (its node too, until a
    release or the session's end).  Another thread's acquire waits for it like anyone else's,
    up to its deadline; a release from any thread ends it, and the waiter gets the lock."""
    lock = FairLock(zk_client, path)
    assert _in_a_thread(lambda: lock.acquire())[0] is True
    first = lock.token
    assert _in_a_thread(lambda: lock.acquire(timeout=0.3))[0] is False
    got: list = []
    waiter = threading.Thread(target=lambda: (got.append(lock.acquire(timeout=10)), got.append(lock.token)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # still queued behind the ended owner's hold
    assert lock.release() is True  # from the main thread, not the (ended) owner
    waiter.join(10)
    assert got[0] is True and got[1] > first
    assert len(children(zk_client, path)) == 1
    assert lock.release() is True
    assert children(zk_client, path) == []


def test_a_release_from_another_thread_ends_one_level_of_the_hold(zk_client, path):
    """``release()`` from a thread that is not the owner is allowed (kazoo's ``Lock`` and
    ``threading.Lock`` do the same; Curator raises): it counts as one of the hold's releases,
    so a re-entered hold still needs one per acquire."""
    lock = FairLock(zk_client, path)
    assert lock.acquire() and lock.acquire()  # held, and re-entered once
    assert _in_a_thread(lock.release)[0] is True  # the re-entry's release
    assert lock.is_held() and len(children(zk_client, path)) == 1
    assert _in_a_thread(lock.release)[0] is True  # the hold's
    assert not lock.is_held() and children(zk_client, path) == []


def test_a_new_thread_does_not_inherit_a_dead_threads_task_hold():
    """Task-level re-entry (``celery_zklock.held``) is a context variable: a thread that set
    it and ended without resetting it leaves nothing to a new thread with its id."""
    from celery_zklock.held import CURRENT, HeldLock

    held = HeldLock(["k"], ["/k"], {"/k": 1}, object())
    _, ident = _in_a_thread(lambda: CURRENT.set(held) and None)
    assert _in_a_thread_with_ident(ident, CURRENT.get) is None


GREENLETS = r'''
from gevent import monkey
monkey.patch_all()

import json, sys, threading
import gevent
from kazoo.client import KazooClient
from kazoo.handlers.gevent import SequentialGeventHandler

from celery_zklock.engine.lock import FairLock
from celery_zklock.held import HeldLock, CURRENT

hosts, path, reentrant = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
client = KazooClient(hosts=hosts, handler=SequentialGeventHandler(), timeout=4.0)
client.start(timeout=15)
lock = FairLock(client, path, reentrant=reentrant)


def run(fn):
    """Run fn in a new greenlet; its result (or exception's name) and the greenlet's ident."""
    out = {}

    def body():
        out["ident"] = threading.get_ident()
        try:
            out["value"] = fn()
        except Exception as exc:
            out["value"] = type(exc).__name__

    g = gevent.spawn(body)
    g.join()
    del g  # freed at once: the next greenlet may get its address, hence its id
    return out["value"], out["ident"]


first, ident = run(lambda: lock.acquire(blocking=False))
held = HeldLock(["k"], ["/k"], {"/k": 1}, object())
_, task_ident = run(lambda: CURRENT.set(held) and None)
tries = same_id = 0
later, task_later = [], []
for tries in range(1, 301):
    value, other = run(lambda: lock.acquire(blocking=False))
    later.append(value)
    same_id += other == ident
    value, other = run(CURRENT.get)
    if other == task_ident:
        task_later.append(value is None)
print(json.dumps({"first": first, "later": later, "same_id": same_id, "tries": tries,
                  "task_checked": len(task_later), "task_clean": all(task_later),
                  "nodes": len(client.get_children(path))}))
lock.release()
client.stop()
'''


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "not-reentrant"])
def test_a_new_greenlet_with_a_dead_holders_ident_is_not_the_owner(zk_server, path, reentrant):
    """The same under gevent's monkey-patching (in a child process: patching is for good).
    Greenlet A acquires and ends without releasing; 300 greenlets after it, one at a time,
    each try once: all get False, and ZooKeeper holds one node.  Before the fix, greenlets
    reused A's id (its address) and re-entered its hold.  The last lines do the same for
    the task-level hold (a context variable): a new greenlet never sees a dead one's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", GREENLETS, zk_server.hosts, path, "1" if reentrant else "0"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["first"] is True, r
    assert set(r["later"]) == {False}, {k: v for k, v in r.items() if k != "later"} | {"later": sorted(set(map(str, r["later"])))}
    assert r["nodes"] == 1, r
    assert r["task_clean"], r
