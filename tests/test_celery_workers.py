"""ZkLockedTask with real `celery worker` processes, a real Redis broker and real ZooKeeper."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from celery_zklock import LockLost, LockTimeout
from tests.lockedapp import history, in_broker, started, started_pid
from tests.lockutil import children, overlapping
from tests.polling import wait_until


@pytest.fixture(autouse=True)
def clean(mod):
    mod._r.delete("history", "arrivals", "retry-runs")
    yield


def test_many_tasks_one_key_never_overlap_and_run_fifo(mod, workers):
    results = [mod.hold.delay("hot", 15, i) for i in range(24)]
    tokens = [r.get(timeout=60) for r in results]
    rows = history(mod, "hold")
    assert len(rows) == 24
    assert overlapping([(r["start"], r["end"]) for r in rows]) is None
    # fencing tokens grow in the order the holds happened
    by_start = sorted(rows, key=lambda r: r["start"])
    assert [r["token"] for r in by_start] == sorted(tokens)
    assert len({r["pid"] for r in rows}) >= 2  # really spread over processes


def test_different_keys_run_in_parallel(mod, workers):
    results = [mod.hold.delay(f"p{i}", 300, i) for i in range(4)]
    for r in results:
        r.get(timeout=30)
    rows = history(mod, "hold")
    # How the broker spreads 4 messages over 4 slots is up to prefetch; that different keys
    # do not serialize is shown by any two of them running at once.
    assert overlapping([(r["start"], r["end"]) for r in rows], max_holders=1) is not None


def test_fifo_order_of_arrival_at_the_lock(mod, workers, zk_client, env):
    """Tasks run in the order they reached the lock, as cohorting defines it: in arrival order
    among one worker's waiters (its agent's queue), and so among another worker's, whose
    node queues behind the holder's.  Across workers arrival order is not the promise: the
    holder's worker may pass the node to its own waiters first, within the streak bound
    (``zklock_cohort_handoffs``; the bound itself is tests/worker/test_cohort.py's)."""
    blocker = mod.hold.delay("fifo", 1500, "blocker")
    wait_until(lambda: children(zk_client, f"{env['TEST_ZK_ROOT']}/k:fifo"), 10,
               what="the blocker to hold before anyone else arrives")
    rs = []
    for i in range(4):
        r = mod.hold_tracked.delay("fifo", 10, i)
        wait_until(lambda r=r: r.state == "LOCK_WAITING", 10, interval=0.01, what=f"waiter {i} at the lock")
        rs.append(r)
    for r in [blocker, *rs]:
        r.get(timeout=30)
    rows = sorted(history(mod, "hold"), key=lambda r: r["start"])
    assert rows[0]["tag"] == "blocker"
    worker_of = {pid: w.name for w in workers for pid in w.child_pids()}
    by_worker: dict[str, list] = {}
    for r in rows[1:]:
        by_worker.setdefault(worker_of[r["pid"]], []).append(r["tag"])
    for name, tags in by_worker.items():
        assert tags == sorted(tags), f"{name} ran its waiters out of arrival order: {tags}"
    assert sorted(t for tags in by_worker.values() for t in tags) == [0, 1, 2, 3]


def test_timeout_policy_fail_raises_lock_timeout_with_holder(mod, workers):
    blocker = mod.report_pid.delay("tf", 1500)
    started_pid(mod, "tf")  # the blocker holds the key
    r = mod.hold_fail.delay("tf")
    with pytest.raises(LockTimeout) as info:
        r.get(timeout=30)
    assert info.value.key == "k:tf"
    assert info.value.holders and json.loads(info.value.holders[0])["task"] == "tests.apps.locked.report_pid"
    blocker.get(timeout=30)


def test_a_skipped_run_is_finished_for_every_celery_api_that_waits(mod, workers):
    """on_lock_timeout="skip": the run ends SUCCESS with the result None (what a direct call
    returns), so ``get()``, ``ready()``, ``join()``, a group and a chord holding it finish at
    once.  It says it was skipped in its WARNING line, its ``task-lock-timeout`` event and
    ``zklock_timeouts_total`` (before: a state of ours, SKIPPED, which Celery never counts as
    ready: ``get()`` and ``join()`` waited until their timeouts)."""
    from celery import chord, group

    blocker = mod.report_pid.delay("ts", 3000)
    started_pid(mod, "ts")  # the blocker holds the key
    r = mod.hold_skip.delay("ts")
    assert r.get(timeout=10) is None
    assert r.ready() and r.successful()
    assert group(mod.hold_skip.s("ts"), mod.hold_skip.s("ts")).apply_async().join(timeout=10) == [None, None]
    assert chord([mod.hold_skip.s("ts"), mod.plain_hold.s("ts-free", 0)])(mod.gather.s()).get(timeout=10)[0] is None
    blocker.get(timeout=30)


def test_timeout_policy_retry_keeps_no_lock_and_eventually_runs(mod, workers, zk_client, env):
    blocker = mod.report_pid.delay("tr", 1500)
    started_pid(mod, "tr")  # the blocker holds the key
    r = mod.hold_retry.delay("tr")
    path = f"{env['TEST_ZK_ROOT']}/k:tr"
    seen_max = 0
    while not r.ready():
        seen_max = max(seen_max, len(children(zk_client, path)))
        time.sleep(0.02)  # the sampling period
    assert r.get(timeout=30) >= 1  # it ran after at least one retry
    blocker.get(timeout=30)
    # between retries the retrying task held no node: only blocker + one waiting attempt at once
    assert seen_max <= 2


def test_max_holders_two(mod, workers):
    rs = [mod.hold_two.delay("two", 150, i) for i in range(6)]
    for r in rs:
        r.get(timeout=30)
    iv = [(r["start"], r["end"]) for r in history(mod, "two")]
    assert overlapping(iv, 2) is None
    assert overlapping(iv, 1) is not None


def test_multi_key_opposite_orders_do_not_deadlock(mod, workers):
    rs = [mod.hold_multi.delay(*(("x", "y") if i % 2 else ("y", "x")), 10, i) for i in range(16)]
    for r in rs:
        r.get(timeout=60)
    iv = [(r["start"], r["end"]) for r in history(mod, "multi")]
    assert len(iv) == 16 and overlapping(iv) is None


def test_singleton_and_send_task(mod, workers):
    rs = [mod.singleton.delay(30, i) for i in range(3)]
    rs += [mod.app.send_task("tests.apps.locked.singleton", args=(30, f"s{i}")) for i in range(3)]
    for r in rs:
        r.get(timeout=30)
    iv = [(r["start"], r["end"]) for r in history(mod, "singleton")]
    assert len(iv) == 6 and overlapping(iv) is None


def test_sigkill_of_child_frees_lock_fast(mod, workers):
    """Five kills in a row: Celery's own notice of a dead child can lag by its 5-second
    maintenance period when the child is not yet reapable at the first look, so one lucky
    kill would prove nothing."""
    delays = []
    for round_ in range(5):
        key = f"kill-{round_}-{uuid.uuid4().hex[:6]}"
        victim = mod.report_pid.delay(key, 30000)
        pid = started_pid(mod, key)
        waiter = mod.hold.delay(key, 1, f"after-kill-{round_}")
        wait_until(lambda: in_broker(mod) == 0, 10, what="the waiter at a worker, behind the victim")
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        waiter.get(timeout=30)
        started = min(r["start"] for r in history(mod, "hold") if r["tag"] == f"after-kill-{round_}")
        delays.append(round(started - killed_at, 3))
        # The lock is freed as soon as the kernel closes the dead child's socket to the
        # agent, which can be before Celery has recorded the child's loss.
        with pytest.raises(Exception, match="WorkerLostError|Worker exited"):
            victim.get(timeout=30)
        assert victim.state == "FAILURE"
    assert max(delays) < 1.0, f"next task started after the kill by {delays} s"


def test_lock_lost_mid_run_fails_even_if_body_returns(mod, workers, zk_client, env):
    key = f"lost-{uuid.uuid4().hex[:6]}"
    r = mod.lose_fail.delay(key, 1500)
    started_pid(mod, key)
    path = f"{env['TEST_ZK_ROOT']}/k:{key}"
    for name in zk_client.get_children(path):  # an operator force-releases the lock
        zk_client.delete(f"{path}/{name}")
    with pytest.raises(LockLost):
        r.get(timeout=30)


def test_lock_lost_interrupt_stops_the_body(mod, workers, zk_client, env):
    key = f"int-{uuid.uuid4().hex[:6]}"
    r = mod.lose_interrupt.delay(key, 4000)
    started_pid(mod, key)
    path = f"{env['TEST_ZK_ROOT']}/k:{key}"
    for name in zk_client.get_children(path):
        zk_client.delete(f"{path}/{name}")
    with pytest.raises(LockLost):
        r.get(timeout=30)
    assert mod._r.get(f"finished:{key}") is None  # the body did not run to its end


def test_celery_autoretry_with_backoff_retries_through_the_lock(mod, workers):
    """Celery's own ``autoretry_for`` + ``retry_backoff`` on a locked task (they used to be
    refused as lock-option typos): every attempt holds the lock, the retries are Celery's."""
    key = f"auto-{uuid.uuid4().hex[:6]}"
    blocker = mod.hold.delay(key, 400, f"blocker-{key}")
    # Its body runs, so it holds the lock: the first attempt must queue behind it.  (Published
    # one after the other, the two could reach ZooKeeper in either order from two workers.)
    wait_until(lambda: started(mod, f"blocker-{key}"), 20, interval=0.01, what="the blocker to start")
    r = mod.autoretry_backoff.delay(key, fail_times=2)
    out = r.get(timeout=60)
    blocker.get(timeout=30)
    assert out["retries"] == 2
    attempts = sorted(history(mod, "autoretry"), key=lambda row: row["start"])
    assert [a["tag"] for a in attempts] == ["attempt0", "attempt1", "attempt2"]
    holds = history(mod, "hold")
    assert overlapping([(x["start"], x["end"]) for x in holds + attempts]) is None
    tokens = [x["token"] for x in attempts]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3  # a fresh lock per attempt
    assert holds[0]["token"] < tokens[0]  # the attempt waited behind the blocker


def test_no_lock_nodes_left_behind(mod, workers, zk_client, env):
    mod.hold.delay("left", 1).get(timeout=30)
    root = env["TEST_ZK_ROOT"]

    def leftovers() -> list:  # a released node goes a moment after the task's result is in
        found = [(k, children(zk_client, f"{root}/{k}")) for k in children(zk_client, root)]
        return [x for x in found if x[1] and not x[0].startswith("k:kill")]

    wait_until(lambda: leftovers() == [], 5, what=lambda: f"no lock nodes left: {leftovers()}")
