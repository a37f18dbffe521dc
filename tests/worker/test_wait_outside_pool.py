"""Waiting outside the pool: the worker's lock agent queues locked requests before the pool
runs them (zklock_wait_in="worker", the default), with real workers, Redis and ZooKeeper."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid

import pytest

from celery_zklock import LockLost
from celery_zklock.testing import four_letter_word
from support.workers import Worker
from tests.lockedapp import active_ids, handed_over, history, in_broker, learn_short_holds, started, started_pid
from tests.lockutil import children, overlapping
from tests.polling import holds_for, wait_until
from tests.tcpproxy import TcpProxy


@pytest.fixture(autouse=True)
def clean(mod):
    mod._r.delete("history", "arrivals", "retry-runs")
    yield


def _sessions(zk_server) -> int:
    """Client connections the ZooKeeper server has (``cons``), ours included."""
    out = four_letter_word("127.0.0.1", zk_server.client_port, "cons")
    return sum(1 for line in out.splitlines() if line.strip().startswith("/"))


def _hot_and_cold(mod, hot_key: str, hot: int, cold: int, hold_ms: int, queued):
    """Seconds the ``cold`` tasks take, sent once the ``hot`` chain runs and is ``queued(ids)``
    for its lock (its task ids) at the worker."""
    blockers = [mod.hold.delay(hot_key, hold_ms, f"hot{i}") for i in range(hot)]
    ids = {b.id for b in blockers}
    wait_until(lambda: started(mod, "hot0") and queued(ids), 10, what="the hot chain queued at the worker")
    sent = time.time()
    cold_results = [mod.hold.delay(f"cold-{uuid.uuid4().hex[:6]}", 20, f"cold{i}") for i in range(cold)]
    for r in cold_results:
        r.get(timeout=60)
    cold_done = time.time() - sent
    for r in blockers:
        r.get(timeout=120)
    return cold_done


def test_a_hot_key_takes_no_pool_slot(mod, env):
    """-c 2 prefork, 12 tasks queued on one hot key (600 ms each): tasks on other keys run
    at once instead of waiting behind the hot chain (in the pool they would have no slot)."""
    w = Worker(env, "hot1", concurrency=2).start(mod.app)
    try:
        cold_done = _hot_and_cold(mod, "hot-" + uuid.uuid4().hex[:6], hot=12, cold=10, hold_ms=600,
                                  queued=lambda ids: in_broker(mod) == 0)  # all taken: they wait in the worker
        rows = history(mod, "hold")
        hot_rows = [r for r in rows if r["tag"].startswith("hot")]
        assert overlapping([(r["start"], r["end"]) for r in hot_rows]) is None
        assert [r["token"] for r in sorted(hot_rows, key=lambda r: r["start"])] == sorted(r["token"] for r in hot_rows)
        # The hot chain takes 12 x 0.6 s; the ten cold tasks finish long before it ends.
        assert cold_done < 3.0, f"cold tasks waited {cold_done:.1f}s behind the hot key"
    finally:
        w.stop()


def test_in_pool_waiting_stays_available_for_comparison(mod, env):
    """zklock_wait_in="pool": the old behaviour, where the same workload blocks the slots."""
    w = Worker({**env, "TEST_ZK_WAIT_IN": "pool"}, "hot2", concurrency=2).start(mod.app)
    try:
        cold_done = _hot_and_cold(mod, "hotp-" + uuid.uuid4().hex[:6], hot=6, cold=4, hold_ms=600,
                                  queued=lambda ids: len(active_ids(mod, "hot2") & ids) == 2)  # in both processes
        assert cold_done > 1.5, "in-pool waiting should have held both slots behind the hot key"
    finally:
        w.stop()


def test_one_zookeeper_session_per_worker(mod, env, zk_server):
    base = _sessions(zk_server)
    w = Worker(env, "sess", concurrency=4).start(mod.app)
    try:
        results = [mod.hold.delay(f"s{i}-{uuid.uuid4().hex[:4]}", 50, i) for i in range(16)]
        for r in results:
            r.get(timeout=30)
        pids = {r["pid"] for r in history(mod, "hold")}
        assert len(pids) >= 2  # several pool processes ran locked tasks...
        assert _sessions(zk_server) - base == 1  # ...through the worker's one session
    finally:
        w.stop()


def test_revoked_waiting_task_never_reaches_the_pool(mod, env, zk_client):
    w = Worker(env, "rev", concurrency=2).start(mod.app)
    try:
        key = f"rev-{uuid.uuid4().hex[:6]}"
        holder = mod.hold.delay(key, 1500, "holder")
        wait_until(lambda: started(mod, "holder"), 10, what="the holder runs")
        waiting = mod.hold_tracked.delay(key, 10, "revoked")
        path = f"{env['TEST_ZK_ROOT']}/k:{key}"
        wait_until(lambda: waiting.state == "LOCK_WAITING", 5, "the second task waits")
        # Lock cohorting: it waits in the agent's memory behind the holder, not in ZooKeeper.
        assert len(children(zk_client, path)) == 1
        waiting.revoke()
        wait_until(lambda: waiting.state == "REVOKED", 2, "the revoked task is REVOKED while the holder runs")
        assert not holder.ready() and len(children(zk_client, path)) == 1
        holder.get(timeout=30)
        holds_for(lambda: waiting.state == "REVOKED" and [r["tag"] for r in history(mod, "hold")] == ["holder"], 0.3,
                  what="the revoked task's body never running")
    finally:
        w.stop()


def test_lock_waiting_is_stored_only_for_tasks_that_track_their_start(mod, env):
    """LOCK_WAITING is a result-backend write per waiting task: stored, like Celery's
    STARTED, only with ``track_started``.  Both waiters wait behind the same holder."""
    w = Worker(env, "trk", concurrency=2).start(mod.app)
    try:
        key = f"trk-{uuid.uuid4().hex[:6]}"
        holder = mod.hold.delay(key, 1500, "holder")
        wait_until(lambda: started(mod, "holder"), 10, "the holder runs")
        quiet = mod.hold.delay(key, 10, "quiet")
        tracked = mod.hold_tracked.delay(key, 10, "tracked")
        wait_until(lambda: tracked.state == "LOCK_WAITING", 5, "the tracked task waits")
        # Queued before the tracked one, so its wait was decided first: nothing was stored.
        assert quiet.state == "PENDING" and not holder.ready()
        assert tracked.get(timeout=30) and quiet.get(timeout=30)
        assert [r["tag"] for r in history(mod, "hold")] == ["holder", "quiet", "tracked"]
    finally:
        w.stop()


def test_warm_shutdown_returns_waiting_tasks_to_the_broker(mod, env, zk_client):
    key = f"shut-{uuid.uuid4().hex[:6]}"
    w = Worker(env, "shut1", concurrency=2).start(mod.app)
    holder = mod.hold.delay(key, 1000, "holder")
    wait_until(lambda: started(mod, "holder"), 10, what="the holder runs")
    waiting = [mod.hold.delay(key, 10, f"w{i}") for i in range(3)]
    path = f"{env['TEST_ZK_ROOT']}/k:{key}"
    wait_until(lambda: in_broker(mod) == 0, 5, what="the three waiting taken by the worker")
    w.stop()  # warm shutdown: the holder finishes, the waiting ones go back to the broker
    assert holder.get(timeout=5) is not None
    assert children(zk_client, path) == []  # their nodes were deleted
    w2 = Worker(env, "shut2", concurrency=2).start(mod.app)
    try:
        for r in waiting:
            r.get(timeout=30)  # ...and run on the next worker
        tags = [r["tag"] for r in history(mod, "hold")]
        assert sorted(tags) == ["holder", "w0", "w1", "w2"]
    finally:
        w2.stop()


def test_a_grant_claimed_while_zookeeper_is_unreachable_waits_for_it(mod, env, zk_client):
    """The agent grants a request, but no pool process is free to run it until after the
    connection to ZooKeeper has dropped: the body must wait until the agent's session is
    confirmed again (here: the network comes back within the session), never start on the
    old grant alone.  It used to start at once (zookeeper_down_mid_run, tests/faults)."""
    proxy = TcpProxy.to(env["TEST_ZK_HOSTS"])
    w = Worker({**env, "TEST_ZK_HOSTS": proxy.hosts, "TEST_ZK_SESSION": "8"}, "susp", concurrency=1).start(mod.app)
    try:
        tag = uuid.uuid4().hex[:6]
        busy = mod.plain_hold.delay(f"busy-{tag}", 1500, "busy")  # unlocked: takes the only pool process
        wait_until(lambda: busy.id in active_ids(mod, "susp"), 10, what="the busy task in the pool process")
        later = mod.hold.delay(f"later-{tag}", 10, "later")  # uncontended: granted at once
        path = f"{env['TEST_ZK_ROOT']}/k:later-{tag}"
        wait_until(lambda: children(zk_client, path), 10, "the agent to take the later task's lock")
        wait_until(lambda: handed_over(w, mod.app, later.id), 10, "the later task's grant handed to Celery")
        proxy.hold()  # the agent's connection drops; reconnections are parked
        cut = time.monotonic()
        # The busy task ends meanwhile, and the later one goes to the freed process, where it
        # claims its grant while the agent is suspended (within the 8 s session).
        wait_until(lambda: f"lock k:later-{tag} not confirmed at start" in w.log() or later.ready(), 6,
                   what="the later task to claim its grant while the agent is suspended")
        time.sleep(max(0.0, cut + 2.5 - time.monotonic()))  # the cut's length: 2.5 s at least
        healed = time.time()
        proxy.release_held()
        assert later.get(timeout=30) is not None
        busy.get(timeout=30)
        (row,) = [r for r in history(mod, "hold") if r["tag"] == "later"]
        assert row["start"] >= healed, f"the body started {healed - row['start']:.2f}s before ZooKeeper was back"
    finally:
        w.stop()
        proxy.close()


def test_killed_agent_is_restarted_and_running_task_follows_on_lock_lost(mod, env):
    w = Worker(env, "agentkill", concurrency=2).start(mod.app)
    try:
        key = f"ak-{uuid.uuid4().hex[:6]}"
        running = mod.lose_fail.delay(key, 1500)
        started_pid(mod, key)
        agent = w.agent_pid()
        os.kill(agent, signal.SIGKILL)
        with pytest.raises(LockLost):
            running.get(timeout=30)
        wait_until(lambda: w.agent_pid() not in (None, agent), 10, interval=0.05, what="the agent restarted")
        assert mod.hold.delay(key, 10, "after").get(timeout=30) is not None  # locking works again
    finally:
        w.stop()


def test_retry_published_while_holding_waits_for_the_running_attempt(mod, env):
    """The same task id arrives again (its retry) while its first attempt still holds the
    lock through the agent: the first keeps its lock, the retry runs after it."""
    w = Worker(env, "retryhold", concurrency=2).start(mod.app)
    try:
        key = f"rh-{uuid.uuid4().hex[:6]}"
        mod.retry_while_holding.delay(key)
        wait_until(lambda: len(history(mod, "hold")) >= 2, 30, interval=0.05, what="both attempts run")
        rows = sorted(history(mod, "hold"), key=lambda r: r["start"])
        assert [r["tag"] for r in rows] == ["attempt0", "attempt1"], rows
        assert overlapping([(r["start"], r["end"]) for r in rows]) is None
        assert rows[0]["token"] < rows[1]["token"]
    finally:
        w.stop()


# --------------------------------------------------------------- next in line, in the pool
def test_next_in_line_waits_in_one_pool_process_and_revoke_still_stops_it(mod, env, zk_client):
    """-c 3 (one handoff slot): behind a holder, the next in line is handed to the pool and
    waits there for the release; the one after it stays in the worker.  Revoking the one in
    the pool deletes its node at once and its body never runs."""
    name = "next1"
    w = Worker(env, name, concurrency=3).start(mod.app)
    try:
        key = f"nx-{uuid.uuid4().hex[:6]}"
        learn_short_holds(mod, key)
        holder = mod.hold.delay(key, 2500, "holder")
        wait_until(lambda: any(r["tag"] == "holder" for r in map(json.loads, mod._r.lrange("arrivals", 0, -1))), 10,
                  "the holder runs")
        nxt = mod.hold.delay(key, 10, "next")
        third = mod.hold.delay(key, 10, "third")
        path = f"{env['TEST_ZK_ROOT']}/k:{key}"
        wait_until(lambda: nxt.id in active_ids(mod, name), 5, "the next in line is in a pool process")
        assert third.id not in active_ids(mod, name)  # only one handoff slot: it waits in the worker
        assert len(children(zk_client, path)) == 1  # one node of this worker's for all three
        nxt.revoke()
        wait_until(lambda: nxt.state == "REVOKED", 2, "the revoked next in line is REVOKED at once")
        assert not holder.ready()
        assert holder.get(timeout=30) is not None
        assert third.get(timeout=30) is not None
        wait_until(lambda: nxt.state == "REVOKED", 5, "the revoked task is REVOKED")
        tags = [r["tag"] for r in sorted(history(mod, "hold"), key=lambda r: r["start"])]
        assert tags[-2:] == ["holder", "third"] and "next" not in tags  # its body never ran
    finally:
        w.stop()


def test_long_holds_never_park_a_pool_process(mod, env, zk_client):
    """Locks on this key are held for long: the next in line stays in the worker, and the
    pool's other processes serve other keys."""
    name = "next2"
    w = Worker(env, name, concurrency=3).start(mod.app)
    try:
        key = f"nl-{uuid.uuid4().hex[:6]}"
        mod.hold.delay(key, 800, "warm0").get(timeout=30)  # the agent learns: long holds here
        holder = mod.hold.delay(key, 1500, "holder")
        nxt = mod.hold_tracked.delay(key, 10, "next")
        wait_until(lambda: nxt.state == "LOCK_WAITING", 5, "the next task waits")
        wait_until(lambda: holder.id in active_ids(mod, name), 5, "the holder runs")
        holds_for(lambda: nxt.id not in active_ids(mod, name), 0.3, what="the next in line kept in the worker")
        others = [mod.hold.delay(f"o-{uuid.uuid4().hex[:6]}", 10, f"o{i}") for i in range(4)]
        for r in others:
            r.get(timeout=5)  # two free processes serve other keys while the holder runs
        assert not holder.ready()
        assert nxt.get(timeout=30) is not None
    finally:
        w.stop()


def test_warm_shutdown_sends_the_next_in_line_back_from_the_pool(mod, env, zk_client):
    """A warm shutdown while the next in line waits in a pool process: it does not run here;
    it goes back to the broker (same id) and runs once, after the holder, on another worker."""
    name = "next3"
    w = Worker(env, name, concurrency=3).start(mod.app)
    key = f"ns-{uuid.uuid4().hex[:6]}"
    learn_short_holds(mod, key)
    holder = mod.hold.delay(key, 1500, "holder")
    nxt = mod.hold.delay(key, 10, "next")
    wait_until(lambda: nxt.id in active_ids(mod, name), 5, "the next in line is in a pool process")
    first_pids = set(w.child_pids())
    w.stop()
    assert holder.get(timeout=5) is not None
    path = f"{env['TEST_ZK_ROOT']}/k:{key}"
    assert children(zk_client, path) == []
    w2 = Worker(env, "next3b", concurrency=3).start(mod.app)
    try:
        assert nxt.get(timeout=30) is not None
        rows = sorted(history(mod, "hold"), key=lambda r: r["start"])
        assert [r["tag"] for r in rows][-2:] == ["holder", "next"]
        assert [r["tag"] for r in rows].count("next") == 1
        assert rows[-1]["pid"] not in first_pids  # it ran on the second worker, not while shutting down
        assert rows[-2]["token"] < rows[-1]["token"]
    finally:
        w2.stop()


def test_handoff_slots_never_take_every_process(mod, env):
    """zklock_handoff_slots larger than the pool: one process always stays for the holders.
    (Were every process parked with a next in line, the holders they wait for could never
    run: the chains would stall until their lock timeouts.)"""
    w = Worker({**env, "TEST_ZK_HANDOFF_SLOTS": "8"}, "next4", concurrency=2).start(mod.app)
    try:
        keys = [f"nd-{uuid.uuid4().hex[:6]}" for _ in range(3)]
        for key in keys:
            learn_short_holds(mod, key, n=2)
        results = [mod.hold.delay(key, 30, f"{key}-{i}") for i in range(8) for key in keys]
        for r in results:
            r.get(timeout=20)
        for key in keys:
            rows = [r for r in history(mod, "hold") if r["key"] == key]
            assert overlapping([(r["start"], r["end"]) for r in rows]) is None
    finally:
        w.stop()


@pytest.mark.parametrize("wait_in", ["worker", "pool"])
def test_a_zookeeper_outage_is_not_a_busy_lock(mod, env, wait_in):
    """A try-once singleton (``lock_timeout=0``, ``on_lock_timeout="skip"``) sent while the
    worker is cut off from ZooKeeper (6 s): it is not skipped as if the lock were busy.  It
    follows ``on_lock_unavailable`` (retry), is counted and reported as unavailable, and runs
    once ZooKeeper is back (before: it ended SKIPPED, ``held by: unknown``, and never ran)."""
    proxy = TcpProxy.to(env["TEST_ZK_HOSTS"])
    w = Worker({**env, "TEST_ZK_HOSTS": proxy.hosts, "TEST_ZK_WAIT_IN": wait_in}, f"outage{wait_in}",
               concurrency=1, extra=["-E"]).start(mod.app)
    try:
        key = f"outage-{uuid.uuid4().hex[:6]}"
        assert mod.try_once.delay(key).get(timeout=30) == "ran"  # the worker and its agent are up
        proxy.hold()  # every ZooKeeper connection drops; reconnections are parked
        time.sleep(1.0)  # the outage under test (6 s): the task is sent 1 s into it...
        sent = mod.try_once.delay(key)
        holds_for(lambda: sent.state != "SKIPPED", 5.0, what="not skipped as if the lock were busy")  # ...and 5 s more
        proxy.release_held()
        assert sent.get(timeout=60) == "ran"
        log = w.log()
        assert "not acquired within" not in log, "reported as a lock timeout"
        assert "???[???]" not in log, "a line of the main process formatted as a task's"
        # Each process says the outage once, and its end once (not kazoo's line per attempt).
        assert "ZooKeeper unreachable" in log and "ZooKeeper reachable again after" in log, log[-3000:]
        with open(w.log_path, errors="replace") as f:
            during = f.read().split("ZooKeeper unreachable")[1].split("ZooKeeper reachable again")[0]
        assert not re.search(r"\] (Connection dropped|Connecting to|Transition to CONNECTING)", during), during
        retried = [line for line in log.splitlines() if sent.id in line and "etry" in line]
        assert retried and all(" retry: Retry in " in line for line in retried), retried  # one line each: Celery's
        assert re.search(r"ZooKeeper was unreachable|lost the ZooKeeper connection", log), log[-3000:]
    finally:
        w.stop()
        proxy.close()


def test_a_whole_worker_stopped_and_resumed_keeps_its_agent(mod, env):
    """The whole worker (main process, pool and lock agent) SIGSTOPped for 5 s, then resumed:
    its agent was silent only because everything was stopped, so it is not killed, and tasks
    run on through it (before: the main process's liveness check, first to run after the stop,
    killed a healthy agent, and locks held through it were lost)."""
    w = Worker(env, "wholestop", concurrency=2).start(mod.app)
    try:
        key = f"ws-{uuid.uuid4().hex[:6]}"
        assert mod.hold.delay(key, 10, "before").get(timeout=30) is not None
        agent = w.agent_pid()
        os.killpg(w.proc.pid, signal.SIGSTOP)
        time.sleep(5.0)  # the stop under test
        os.killpg(w.proc.pid, signal.SIGCONT)
        assert mod.hold.delay(key, 10, "after").get(timeout=30) is not None
        holds_for(lambda: w.agent_pid() == agent, 1.0, what="the agent kept")
        assert "killing it" not in w.log(), w.log()[-2000:]
    finally:
        w.stop()
