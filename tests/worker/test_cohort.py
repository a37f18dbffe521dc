"""Lock cohorting with real workers: ZooKeeper holds at most one contender per worker per key
(two while a node is handed on), the lock passes among a worker's own tasks locally, tokens
stay strictly increasing cluster-wide, and other contenders get their turn within the bound."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from celery_zklock import FairLock, LockLost
from support.workers import Worker
from tests.lockedapp import history, started
from tests.lockutil import children, overlapping
from tests.polling import wait_until


@pytest.fixture(autouse=True)
def clean(mod):
    mod._r.delete("history", "arrivals")
    yield


class Sampler:
    """Children of one lock path, read every few ms while a burst runs."""

    def __init__(self, zk, path: str) -> None:
        self.zk, self.path = zk, path
        self.most = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, len(children(self.zk, self.path)))
            self.samples += 1
            time.sleep(0.005)  # the sampling period

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _check_holds(rows) -> None:
    by_start = sorted(rows, key=lambda r: r["start"])
    assert overlapping([(r["start"], r["end"]) for r in rows]) is None
    tokens = [r["token"] for r in by_start]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), "tokens not strictly increasing"


def test_a_hot_key_keeps_one_node_per_worker(mod, env, zk_client):
    """Two workers x -c 3, 300 tasks on one key: every task ran once, never two at once, with
    strictly increasing tokens, while the key never had more than two nodes per worker."""
    ws = [Worker(env, f"coh{i}", concurrency=3).start(mod.app) for i in (1, 2)]
    try:
        key = f"coh-{uuid.uuid4().hex[:6]}"
        path = f"{env['TEST_ZK_ROOT']}/k:{key}"
        with Sampler(zk_client, path) as sampler:
            results = [mod.hold.delay(key, 2, i) for i in range(300)]
            for r in results:
                r.get(timeout=120)
        rows = history(mod, "hold")
        assert sorted(r["tag"] for r in rows) == list(range(300))
        _check_holds(rows)
        assert sampler.samples > 20 and sampler.most <= 4, f"{sampler.most} nodes for 2 workers"
        pids = {r["pid"] for r in rows}
        assert len(pids) >= 4  # both workers' pool processes took turns
    finally:
        for w in ws:
            w.stop()


def test_local_handoffs_pass_the_node_without_requeueing(mod, env, zk_client):
    """One worker, a backlog on one key and nobody else queueing: the node is created once and
    passed from task to task (its tokens are czxid << 8 | grant: one czxid for the run)."""
    w = Worker(env, "coh-local", concurrency=3).start(mod.app)
    try:
        key = f"coh-{uuid.uuid4().hex[:6]}"
        blocker = mod.hold.delay(key, 400, "first")
        wait_until(lambda: started(mod, "first"), 10, interval=0.005, what="the first to hold")
        results = [mod.hold.delay(key, 5, i) for i in range(40)]
        for r in [blocker, *results]:
            r.get(timeout=60)
        rows = history(mod, "hold")
        _check_holds(rows)
        nodes = {r["token"] >> 8 for r in rows}
        assert len(nodes) == 1, f"{len(nodes)} nodes for one worker's backlog: re-queued instead of handed on"
    finally:
        w.stop()


class _KazooPeer:
    """kazoo's own ``Lock``, configured to queue with Curator-named nodes (no token)."""

    def __init__(self, zk, path: str) -> None:
        from kazoo.recipe.lock import Lock

        self.lock = Lock(zk, path, extra_lock_patterns=["-lock-"])
        self.token = None

    def acquire(self, timeout: float) -> bool:
        return self.lock.acquire(timeout=timeout)

    def release(self) -> None:
        self.lock.release()


@pytest.mark.parametrize("peer", ["FairLock", "kazoo Lock"])
def test_a_foreign_contender_gets_its_turn_within_the_streak_bound(mod, env, zk_client, peer):
    """zklock_cohort_handoffs=5: another client queues on a key a worker is busy with; at
    most 5 of the worker's holds (+ the one running) pass before it holds, no hold of the
    worker overlaps it, and (FairLock, which has one) its token exceeds every earlier
    holder's and every later holder's exceeds it."""
    w = Worker({**env, "TEST_ZK_COHORT_HANDOFFS": "5"}, "coh-fair", concurrency=3).start(mod.app)
    try:
        key = f"coh-{uuid.uuid4().hex[:6]}"
        path = f"{env['TEST_ZK_ROOT']}/k:{key}"
        results = [mod.hold.delay(key, 20, i) for i in range(60)]
        wait_until(lambda: mod._r.llen("arrivals") >= 3, 30, interval=0.005, what="the worker's streak under way")
        lock = FairLock(zk_client, path) if peer == "FairLock" else _KazooPeer(zk_client, path)
        queued = time.time()
        assert lock.acquire(timeout=30)
        granted, token = time.time(), lock.token
        time.sleep(0.05)  # its hold
        released = time.time()
        lock.release()
        for r in results:
            r.get(timeout=60)
        rows = sorted(history(mod, "hold"), key=lambda r: r["start"])
        _check_holds(rows)
        between = [r for r in rows if r["end"] > queued and r["start"] < granted]
        assert len(between) <= 5 + 1, f"{len(between)} worker holds passed the waiting {peer}"
        assert overlapping([(r["start"], r["end"]) for r in rows] + [(granted, released)]) is None
        if token is not None:
            assert all(r["token"] < token for r in rows if r["end"] <= granted)
            assert all(r["token"] > token for r in rows if r["start"] >= granted)
        assert any(r["start"] >= granted for r in rows)  # the worker went on after it
    finally:
        w.stop()


def test_a_force_delete_after_a_local_handoff_interrupts_the_holder(mod, env, zk_client):
    """Issue 35, finding 1: the lease's write to the node fires the holder's data watch
    (NodeDataChanged), which used to be the end of it.  One worker, three 3 s holds on one
    key (on_lock_lost="interrupt"); an operator deletes the node 0.8 s into the second hold,
    which the node was handed on to locally: that holder is told within about a second
    and interrupted, and the third hold takes a new node, with a larger token."""
    w = Worker(env, "coh-force", concurrency=2).start(mod.app)
    try:
        key = f"coh-{uuid.uuid4().hex[:6]}"
        path = f"{env['TEST_ZK_ROOT']}/k:{key}"
        results = [mod.hold_interrupt.delay(key, 3000, i) for i in range(3)]
        def arrived():
            return {row["tag"]: row for row in map(json.loads, mod._r.lrange("arrivals", 0, -1))}

        wait_until(lambda: 1 in arrived(), 30, interval=0.01, what="the second hold to start")
        second = arrived()[1]
        time.sleep(max(0.0, second["start"] + 0.8 - time.time()))  # the delete comes 0.8 s into the second hold
        assert second["token"] >> 8 == arrived()[0]["token"] >> 8, "not a local handoff: the test proves nothing"
        deleted_at = time.time()
        for name in children(zk_client, path):  # as `celery zklock release KEY --node N --yes` does
            zk_client.delete(f"{path}/{name}")
        assert results[0].get(timeout=30) == arrived()[0]["token"]
        with pytest.raises(LockLost):
            results[1].get(timeout=30)
        third = results[2].get(timeout=30)
        rows = {(r["kind"], r["tag"]): r for r in history(mod)}
        if ("hold", 1) in rows:
            ran_on = rows[("hold", 1)]["end"] - deleted_at
            raise AssertionError(f"not interrupted: the body ran to its end {ran_on:.2f} s after the delete")
        told = rows[("interrupted", 1)]["end"] - deleted_at
        assert told < 1.2, f"the holder learned of the delete {told:.2f} s after it"
        assert third > second["token"] and third >> 8 != second["token"] >> 8, "the third hold did not take a new node"
    finally:
        w.stop()
