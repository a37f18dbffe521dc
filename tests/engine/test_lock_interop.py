"""FairLock sharing one lock path with kazoo's ``Lock`` and Apache Curator's ``InterProcessMutex``.

Our children are named like Curator's protected nodes (``_c_<uuid>-lock-<seq>``) and we
order kazoo's ``<uuid>__lock__<seq>`` nodes too, so all three must form one FIFO queue
with one holder.  Everything runs against a real ZooKeeper; Curator runs in a real JVM
(``tests/java/CuratorHolder.java``, compiled per test session with ``javac``; tests/curator.py).
"""

from __future__ import annotations

import threading
import time
from itertools import pairwise

import pytest
from kazoo.client import KazooClient
from kazoo.recipe.lock import Lock as KazooLock

from celery_zklock import FairLock, contenders
from tests.lockutil import children, overlapping
from tests.polling import holds_for, wait_until


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def _wait_children(client, path, n, timeout=10.0):
    wait_until(lambda: len(children(client, path)) >= n, timeout, interval=0.005,
               what=lambda: f"{n} children of {path}: {children(client, path)}")


def _clients(hosts, n):
    out = []
    for _ in range(n):
        c = KazooClient(hosts=hosts, timeout=4.0)
        c.start(timeout=15)
        out.append(c)
    return out


def _stop(clients):
    for c in clients:
        try:
            c.stop()
            c.close()
        except Exception:
            pass


def _kazoo_lock(client, path):
    return KazooLock(client, path, identifier="kazoo", extra_lock_patterns=["-lock-"])


def _make(kind, client, path):
    return _kazoo_lock(client, path) if kind == "kazoo" else FairLock(client, path, identifier="fair")


@pytest.fixture
def path(request):
    name = request.node.name.replace("[", "_").replace("]", "")
    return f"/t/interop/{name}"


# --------------------------------------------------------------------------------------
# kazoo Lock(extra_lock_patterns=["-lock-"])
# --------------------------------------------------------------------------------------
def test_control_kazoo_lock_without_pattern_ignores_fairlock(zk_client, path):
    """Control: proves the checks below can fail.  A kazoo Lock that is *not* told about
    '-lock-' nodes does not see our holder and acquires alongside it."""
    zk_client.ensure_path(path)
    ours = FairLock(zk_client, path)
    assert ours.acquire(timeout=5)
    try:
        blind = KazooLock(zk_client, path)
        assert blind.acquire(blocking=False) is True
        blind.release()
        aware = _kazoo_lock(zk_client, path)
        assert aware.acquire(blocking=False) is False
    finally:
        ours.release()


def test_kazoo_lock_and_fairlock_mutual_exclusion(zk_server, zk_client, path):
    # Persistent parent: kazoo's Lock only ensure_path()s once per instance and would hit
    # NoNodeError if a *container* parent were reaped between its ensure_path and create.
    zk_client.ensure_path(path)
    clients = _clients(zk_server.hosts, 6)
    intervals, guard, errors = [], threading.Lock(), []
    max_queue = [0]

    def worker(i):
        kind = "kazoo" if i % 2 else "fair"
        try:
            for _ in range(12):
                lk = _make(kind, clients[i], path)
                assert lk.acquire(timeout=30)
                start = time.monotonic()
                time.sleep(0.002)  # the hold
                end = time.monotonic()
                lk.release()
                with guard:
                    intervals.append((start, end, kind))
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)

    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            try:
                max_queue[0] = max(max_queue[0], len(zk_client.get_children(path)))
            except Exception:
                pass
            time.sleep(0.003)  # the sampling period

    s = threading.Thread(target=sampler, daemon=True)
    s.start()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    stop.set()
    s.join(5)
    _stop(clients)
    assert not errors, errors
    assert len(intervals) == 72
    assert overlapping([(s_, e_) for s_, e_, _ in intervals]) is None
    # Real contention between the two kinds: the queue was deep and holders alternated.
    assert max_queue[0] >= 3, max_queue[0]
    kinds = [k for _, _, k in sorted(intervals)]
    switches = sum(1 for a, b in pairwise(kinds) if a != b)
    assert switches >= 10, kinds


@pytest.mark.parametrize("holder_kind", ["fair", "kazoo"])
def test_fifo_across_kazoo_lock_and_fairlock(zk_server, zk_client, path, holder_kind):
    zk_client.ensure_path(path)
    holder = _make(holder_kind, zk_client, path)
    assert holder.acquire(timeout=5)
    kinds = ["kazoo", "fair"] * 4
    clients = _clients(zk_server.hosts, len(kinds))
    order, errors, threads = [], [], []
    guard = threading.Lock()
    for i, kind in enumerate(kinds):
        lk = _make(kind, clients[i], path)

        def run(i=i, lk=lk):
            try:
                assert lk.acquire(timeout=30)
                with guard:
                    order.append(i)
                time.sleep(0.003)  # the hold
                lk.release()
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=run)
        t.start()
        threads.append(t)
        _wait_children(zk_client, path, i + 2)  # the i-th waiter is queued before the next starts
    # Everybody is queued behind the holder, in enqueue order, and nobody jumped it.
    queued = contenders(zk_client, path)
    assert [c.identifier for c in queued] == [holder_kind] + kinds
    assert [c.holder for c in queued] == [True] + [False] * len(kinds)
    holds_for(lambda: order == [], 0.2, what="nobody jumping the holder")
    holder.release()
    for t in threads:
        t.join(30)
    _stop(clients)
    assert not errors, errors
    assert order == list(range(len(kinds)))


# --------------------------------------------------------------------------------------
# Apache Curator InterProcessMutex (a real JVM)
# --------------------------------------------------------------------------------------
@pytest.fixture
def curator(curators, path):
    """A Curator InterProcessMutex on the test's path (tests/curator.py)."""
    return curators(path)


def _curator_node(client, path, ours=()):
    names = [c for c in client.get_children(path) if c not in ours]
    assert len(names) == 1, names
    return names[0]


def test_curator_holds_fairlock_times_out(curator, zk_client, path):
    curator.send("acquire")
    curator.expect("ACQUIRING")
    curator.expect("ACQUIRED")
    cnode = _curator_node(zk_client, path)
    assert cnode.startswith("_c_") and "-lock-" in cnode  # Curator's protected name, like ours

    lock = FairLock(zk_client, path)
    t0 = time.monotonic()
    assert lock.acquire(timeout=0.5) is False
    took = time.monotonic() - t0
    assert 0.5 <= took < 2.0, took
    assert zk_client.get_children(path) == [cnode]  # our node was removed on timeout
    assert [c.node for c in contenders(zk_client, path) if c.holder] == [cnode]

    curator.send("release")
    curator.expect("RELEASED")
    assert lock.acquire(timeout=5) is True
    lock.release()


def test_fairlock_queued_behind_curator_acquires_after_release(curator, zk_client, path):
    curator.send("acquire")
    curator.expect("ACQUIRING")
    curator.expect("ACQUIRED")
    lock = FairLock(zk_client, path)
    got = {}

    def run():
        got["ok"] = lock.acquire(timeout=30)
        got["at"] = time.monotonic()

    t = threading.Thread(target=run)
    t.start()
    _wait_children(zk_client, path, 2)
    holds_for(lambda: "ok" not in got and not lock.is_held(), 0.3, what="FairLock waiting while Curator holds the mutex")
    curator.send("release")
    released = curator.expect("RELEASED")
    t.join(10)
    assert got.get("ok") is True
    assert got["at"] > released
    lock.release()


def test_curator_blocks_while_fairlock_holds(curator, zk_client, path):
    lock = FairLock(zk_client, path)
    assert lock.acquire(timeout=5)
    curator.send("acquire")
    curator.expect("ACQUIRING")
    _wait_children(zk_client, path, 2)
    curator.assert_silent(0.6)
    released_at = time.monotonic()
    lock.release()
    acquired = curator.expect("ACQUIRED", timeout=10)
    assert acquired > released_at
    curator.send("release")
    curator.expect("RELEASED")


def test_fifo_between_fairlock_waiters_and_curator(curator, zk_server, zk_client, path):
    """Queue: our holder H, our waiter W1, Curator, our waiter W2.
    Expected grant order: W1, then Curator, then W2."""
    holder = FairLock(zk_client, path)
    assert holder.acquire(timeout=5)
    c1, c2 = _clients(zk_server.hosts, 2)
    w1, w2 = FairLock(c1, path), FairLock(c2, path)
    events, go = {}, {"w1": threading.Event(), "w2": threading.Event()}

    def run(name, lk):
        events[name + "_ok"] = lk.acquire(timeout=30)
        events[name + "_at"] = time.monotonic()
        go[name].wait(30)
        events[name + "_rel"] = time.monotonic()
        lk.release()

    t1 = threading.Thread(target=run, args=("w1", w1))
    t1.start()
    _wait_children(zk_client, path, 2)
    curator.send("acquire")
    curator.expect("ACQUIRING")
    _wait_children(zk_client, path, 3)
    t2 = threading.Thread(target=run, args=("w2", w2))
    t2.start()
    _wait_children(zk_client, path, 4)
    try:
        holder.release()
        wait_until(lambda: "w1_ok" in events, 10, interval=0.005, what="W1 (first in line) to get the lock")
        assert events["w1_ok"] is True, "W1 (first in line) did not get the lock"
        curator.assert_silent(0.4)  # Curator is behind W1
        assert "w2_ok" not in events  # and so is W2
        go["w1"].set()
        t1.join(10)
        acquired = curator.expect("ACQUIRED", timeout=10)
        assert acquired > events["w1_rel"]
        holds_for(lambda: "w2_ok" not in events, 0.4, what="W2 behind Curator")
        curator.send("release")
        released = curator.expect("RELEASED")
        wait_until(lambda: "w2_ok" in events, 10, interval=0.005, what="W2 to get the lock")
        assert events["w2_ok"] is True
        assert events["w2_at"] > released
    finally:
        go["w1"].set(), go["w2"].set()
        t1.join(10), t2.join(10)
        _stop([c1, c2])


def test_mutual_exclusion_with_curator_under_contention(curator, zk_server, path):
    """Curator takes the mutex 15 times back to back while three FairLock threads hammer
    the same path; hold intervals from both processes (same monotonic clock) never overlap."""
    clients = _clients(zk_server.hosts, 3)
    intervals, guard, errors = [], threading.Lock(), []

    def worker(c):
        try:
            for _ in range(10):
                lk = FairLock(c, path)
                assert lk.acquire(timeout=30)
                start = time.monotonic()
                time.sleep(0.003)  # the hold
                end = time.monotonic()
                lk.release()
                with guard:
                    intervals.append((start, end, "fair"))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for _ in range(15):
        curator.send("hold 3")
    for t in threads:
        t.start()
    for _ in range(15):
        curator.expect("ACQUIRING", timeout=30)
        start = curator.expect("ACQUIRED", timeout=30)
        end = curator.expect("RELEASED", timeout=30)
        intervals.append((start, end, "curator"))
    for t in threads:
        t.join(60)
    _stop(clients)
    assert not errors, errors
    assert len(intervals) == 45
    assert overlapping([(s, e) for s, e, _ in intervals]) is None
    kinds = [k for _, _, k in sorted(intervals)]
    assert sum(1 for a, b in pairwise(kinds) if a != b) >= 4, kinds
