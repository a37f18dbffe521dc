"""A hot key beside other keys (issue 39), with real workers, Redis and ZooKeeper: what a
worker takes from the broker while its agent decides, and which requests may idle in a pool
process next in line.

Why: in ``make bench`` scenario 6 (one hot key among distinct keys, 2 workers) the other
keys' p95 was 1.6x the ideal.  Two causes, one test each here: every locked request raised
the prefetch window on arrival, so a worker whose agent was slow to answer took a burst's
requests far past its window (they then queued for its processes, behind the hot streak);
and a request next in line behind *another* worker's node parked a pool process for that
worker's whole streak (up to ``zklock_cohort_hold``), not for one short hold.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid

from kazoo.client import KazooClient

from celery_zklock.engine.lock import FairLock
from support.workers import Worker
from tests.lockedapp import active_ids, held_aside, history, learn_short_holds
from tests.polling import holds_for, wait_until


def _queued_in_broker(mod, queue: str) -> int:
    return mod._r.llen(queue)


def test_requests_granted_at_once_count_against_the_prefetch_window(mod, env):
    """-c 1 with ``worker_prefetch_multiplier=1``: a window of one message.  While the agent
    answers nothing (stopped here; in a loaded run, slow), requests on keys nobody holds
    are not known to wait, so they stay in the broker beyond the window: another worker may
    take them.  Before issue 39 each one raised the window on arrival and the worker took
    all eight."""
    tag = uuid.uuid4().hex[:6]
    queue = f"window-{tag}"  # a queue of its own: only this worker reads it
    w = Worker(env, "window1", concurrency=1, extra=["-Q", queue]).start(mod.app)
    try:
        agent = w.agent_pid()
        os.kill(agent, signal.SIGSTOP)  # well within the silence the worker tolerates (2 s)
        try:
            results = [mod.hold.apply_async((f"cold-{tag}-{i}", 10, f"c{i}"), queue=queue) for i in range(8)]
            time.sleep(1.0)  # the agent silent for 1 s: what the worker takes from the broker meanwhile
            left = _queued_in_broker(mod, queue)
        finally:
            os.kill(agent, signal.SIGCONT)
        assert left >= 6, f"the worker took {8 - left} of 8 messages with a window of 1"
        for r in results:
            r.get(timeout=30)
        ran = sorted(r["tag"] for r in history(mod, "hold") if str(r["key"]).startswith(f"cold-{tag}-"))
        assert ran == [f"c{i}" for i in range(8)]
    finally:
        w.stop()


def test_requests_waiting_for_their_lock_leave_the_window_to_other_keys(mod, env, zk_server):
    """The same window of one: two requests wait for keys another client holds (each the
    first of its key in this worker, so only the agent's ``queued`` says it waits); tasks
    on other keys still come in and run meanwhile.  Were the waiting ones counted in the
    window, the worker would take nothing more until the other client let go."""
    client = KazooClient(hosts=zk_server.hosts, timeout=10.0)
    client.start(timeout=15)
    w = Worker(env, "window2", concurrency=1).start(mod.app)
    tag = uuid.uuid4().hex[:6]
    locks = [FairLock(client, f"{env['TEST_ZK_ROOT']}/k:held-{tag}-{i}", identifier="test holder") for i in (0, 1)]
    try:
        for lock in locks:
            assert lock.acquire(timeout=10)
        waiting = [mod.hold.delay(f"held-{tag}-{i}", 10, f"w{i}") for i in (0, 1)]
        wait_until(lambda: held_aside(w, mod) + len(active_ids(mod, "window2")) >= 2, 10,
                   what="both at the worker, queued behind the test's nodes")
        others = [mod.hold.delay(f"other-{tag}-{i}", 10, f"o{i}") for i in range(3)]
        for r in others:
            r.get(timeout=10)
        assert not any(r.ready() for r in waiting)
        for lock in locks:
            lock.release()
        for r in waiting:
            r.get(timeout=30)
    finally:
        for lock in locks:
            if lock.is_held():
                lock.release()
        w.stop()
        client.stop()
        client.close()


def test_next_in_line_behind_another_contender_parks_only_in_an_idle_pool(mod, env, zk_server):
    """-c 2 (one handoff slot), short holds learned on the key, another client holds it:
    the worker's request is next in line behind a holder that is not the worker's (as
    behind another worker's streak).  With a process busy, it does not park the other one,
    which stays for other keys; once the busy process is done (the pool idle), it parks.
    With the pool idle from the start it parks at once (nothing else wanted the process)."""
    name = "park1"
    client = KazooClient(hosts=zk_server.hosts, timeout=10.0)
    client.start(timeout=15)
    w = Worker(env, name, concurrency=2).start(mod.app)
    tag = uuid.uuid4().hex[:6]
    busy_key, idle_key = f"pk-{tag}", f"pi-{tag}"
    lock = FairLock(client, f"{env['TEST_ZK_ROOT']}/k:{busy_key}", identifier="other worker")
    lock2 = FairLock(client, f"{env['TEST_ZK_ROOT']}/k:{idle_key}", identifier="other worker")
    try:
        learn_short_holds(mod, busy_key)
        learn_short_holds(mod, idle_key)
        assert lock.acquire(timeout=10)
        busy = mod.plain_hold.delay(f"busy-{tag}", 2000, "busy")  # takes one of the two processes
        wait_until(lambda: busy.id in active_ids(mod, name), 5, "the busy task runs")
        nxt = mod.hold.delay(busy_key, 10, "next")
        wait_until(lambda: held_aside(w, mod) >= 1, 10, what="the next in line queued behind the client's node")
        holds_for(lambda: nxt.id not in active_ids(mod, name), 0.5,
                  what="not parked next in line behind another contender's hold")
        other = mod.hold.delay(f"o-{tag}", 10, "other")
        other.get(timeout=2)  # the free process runs it while the busy task still runs
        assert not busy.ready() and nxt.id not in active_ids(mod, name)
        busy.get(timeout=30)  # a process frees and nothing else waits for one: now it may park
        wait_until(lambda: nxt.id in active_ids(mod, name), 5, "the next in line waits in the now idle pool")
        lock.release()
        nxt.get(timeout=30)

        # The pool idle: behind the same kind of holder, the next in line waits in a process.
        assert lock2.acquire(timeout=10)
        parked = mod.hold.delay(idle_key, 10, "parked")
        wait_until(lambda: parked.id in active_ids(mod, name), 5, "the next in line waits in an idle pool")
        lock2.release()
        parked.get(timeout=30)
        rows = {r["tag"]: r for r in history(mod, "hold") if tag in str(r["key"])}
        assert rows["other"]["end"] < rows["next"]["start"]
    finally:
        for held in (lock, lock2):
            if held.is_held():
                held.release()
        w.stop()
        client.stop()
        client.close()


def test_eta_tasks_beside_held_requests_leave_the_window_as_it_was(mod, env):
    """-c 1, multiplier 4, ``worker_eta_task_limit`` 6: four requests wait aside on a held key
    while two ETA tasks come and go.  Celery raises its window by one per ETA task (a no-op at
    the limit) and lowers it by one as each is sent to the pool; our raise for the held
    requests had taken that room, so the window ended at 2 of 4 for good (a review found
    it).  It is kept apart from Celery's window now, which ends where it began."""
    tag = uuid.uuid4().hex[:6]
    queue = f"eta-{tag}"
    name = f"eta{tag}"
    w = Worker({**env, "TEST_ETA_TASK_LIMIT": "6"}, name, concurrency=1,
               extra=["-Q", queue, "--prefetch-multiplier", "4"]).start(mod.app)
    node = f"{name}@{socket.gethostname()}"
    try:
        assert _window(mod, node) == 4
        first = mod.hold.apply_async((f"eta-{tag}", 2500, "first"), queue=queue)
        wait_until(lambda: first.id in active_ids(mod, name), timeout=15)
        held = [mod.hold.apply_async((f"eta-{tag}", 20, f"h{i}"), queue=queue) for i in range(4)]
        wait_until(lambda: held_aside(w, mod) == 4, 10, what="the four held aside (the window raised for them)")
        later = [mod.hold.apply_async((f"eta-other-{tag}-{i}", 20, f"e{i}"), queue=queue, countdown=1)
                 for i in range(2)]
        for r in [first, *held, *later]:
            r.get(timeout=30)
        assert _window(mod, node) == 4
    finally:
        w.stop()


def _window(mod, node: str) -> int:
    """The prefetch window Celery's consumer reports (``inspect stats``)."""
    stats = mod.app.control.inspect(destination=[node], timeout=2.0).stats() or {}
    return stats[node]["prefetch_count"]
