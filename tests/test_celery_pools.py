"""Other pools, worker start-up checks, whole-worker loss, beat, redelivery and events."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

from support.workers import ROOT, Worker
from tests.celery_events import received_events
from tests.lockedapp import history, started, started_pid
from tests.lockutil import children, overlapping
from tests.polling import holds_for, wait_until


@pytest.fixture(autouse=True)
def clean(mod):
    mod._r.flushdb()
    yield


def _amqp_reachable() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "pool, conc, extra_env",
    [
        ("threads", 4, {}),
        ("solo", 1, {}),
        ("gevent", 8, {}),
        ("prefork", 2, {"TEST_POOL_START_METHOD": "spawn"}),
        pytest.param("prefork", 2, {"TEST_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672//"}, id="rabbitmq",
                     marks=pytest.mark.skipif(not _amqp_reachable(), reason="no RabbitMQ on 127.0.0.1:5672")),
    ],
)
def test_pool_keeps_exclusion(mod, env, pool, conc, extra_env):
    workers = [Worker({**env, **extra_env}, f"{pool}{i}", pool=pool, concurrency=conc) for i in (1, 2)]
    for w in workers:
        w.start()
    try:
        app = mod.app
        if extra_env.get("TEST_BROKER_URL"):
            app = type(mod.app)("sender", broker=extra_env["TEST_BROKER_URL"], backend=mod.app.conf.result_backend)
        for w in workers:
            w.wait_ready(app)
        rs = [app.send_task("tests.apps.locked.hold", args=(f"pool-{pool}", 10, i)) for i in range(16)]
        for r in rs:
            r.get(timeout=60)
        rows = history(mod, "hold")
        assert len(rows) == 16
        assert overlapping([(r["start"], r["end"]) for r in rows]) is None
    finally:
        for w in workers:
            w.stop()


def test_worker_refuses_to_start_with_bad_settings(env):
    w = Worker({**env, "TEST_ZK_ROOT": "no-slash"}, "badconf")
    w.start()
    assert w.proc.wait(60) != 0
    log = w.log()
    assert "celery-zklock: configuration error" in log and "zklock_root" in log and "absolute" in log


def test_worker_refuses_to_start_without_zookeeper(env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    w = Worker({**env, "TEST_ZK_HOSTS": dead}, "nozk")
    w.start()
    assert w.proc.wait(60) != 0
    assert "cannot reach ZooKeeper" in w.log() and "run unprotected" in w.log()


def test_whole_worker_sigkill_frees_lock_after_session_timeout(mod, env):
    victim = Worker(env, "victim").start(mod.app)
    other = Worker(env, "survivor", concurrency=1)
    try:
        key = f"wk-{uuid.uuid4().hex[:6]}"
        mod.report_pid.delay(key, 60000)
        pid = started_pid(mod, key)
        assert pid in victim.child_pids()  # the holder runs in the victim
        other.start(mod.app)
        killed = time.time()
        victim.kill()
        # Sent after the kill, so the survivor takes it: a request the victim had taken would
        # wait unacknowledged in it, and Redis returns those only after its visibility timeout.
        waiter = mod.hold.delay(key, 1, "after")
        waiter.get(timeout=30)
        started = [r["start"] for r in history(mod, "hold") if r["tag"] == "after"][0]
        # bounded by the session timeout (4 s here), with margin for detection
        assert started - killed < 4 + 2.5, started - killed
    finally:
        victim.kill()
        other.stop()


def test_redelivered_copy_with_same_task_id_does_not_run_twice(mod, env, zk_client):
    """acks_late redelivery looks like the same task id arriving again while it runs."""
    workers = [Worker(env, f"dup{i}", concurrency=1).start(mod.app) for i in (1, 2)]
    try:
        key = f"dup-{uuid.uuid4().hex[:6]}"
        tid = str(uuid.uuid4())
        sig = mod.hold_late.signature((key, 800, "orig"))
        sig.apply_async(task_id=tid)
        wait_until(lambda: children(zk_client, f"{env['TEST_ZK_ROOT']}/k:{key}"), 10, what="the first delivery holds")
        sig.apply_async(task_id=tid)
        def rows():
            return [r for r in history(mod, "hold") if r["key"] == key]
        wait_until(rows, 10, what="the first delivery's run")
        # The copy waits behind it, then sees its result and drops out (within the result grace).
        holds_for(lambda: len(rows()) == 1, 1.7, what=lambda: f"one run: {rows()}")
    finally:
        for w in workers:
            w.stop()


@pytest.mark.parametrize("task", ["hold_late_skip", "hold_late_nowait"])
def test_redelivered_copy_never_applies_its_timeout_policy_over_the_original(mod, env, task):
    """A copy of a running task (same id) whose lock_timeout is shorter than the original's
    run must not store SKIPPED/FAILURE over it, nor run again: it waits for the original
    without a deadline, then sees its final state and drops out."""
    workers = [Worker(env, f"dupt{i}", concurrency=1).start(mod.app) for i in (1, 2)]
    try:
        key = f"dupt-{uuid.uuid4().hex[:6]}"
        tid = str(uuid.uuid4())
        sig = getattr(mod, task).signature((key, 1500, "orig"))
        result = sig.apply_async(task_id=tid)
        wait_until(lambda: result.state == "STARTED", 15, interval=0.05, what="the original started")
        sig.apply_async(task_id=tid)
        # The original's run (1.5 s) and the copy's decision after it: only ever STARTED, then SUCCESS.
        holds_for(lambda: result.state in ("STARTED", "SUCCESS"), 6.0, interval=0.05,
                  what=lambda: f"the original's state STARTED or SUCCESS (is {result.state})")
        rows = [r for r in history(mod, "hold") if r["key"] == key]
        assert len(rows) == 1, rows
        assert result.state == "SUCCESS", result.state
    finally:
        for w in workers:
            w.stop()


def test_a_retry_published_while_holding_is_not_mistaken_for_a_copy(mod, env):
    """Same task id, next attempt: it queues behind the attempt that published it and then
    runs — it is new work, not a redelivered copy to drop."""
    worker = Worker(env, "retryhold", concurrency=2).start(mod.app)
    try:
        key = f"rh-{uuid.uuid4().hex[:6]}"
        mod.late_retry_while_holding.delay(key)
        def tags():
            return [r["tag"] for r in history(mod, "hold") if r["key"] == key]
        wait_until(lambda: "attempt1" in tags(), 20, interval=0.1, what="the retry's run")
        assert tags() == ["attempt0", "attempt1"], tags()
    finally:
        worker.stop()


def test_redelivered_copies_racing_for_the_lock_run_exactly_once(mod, env):
    """Two deliveries of one task id join the queue behind a holder at the same moment:
    the later one must wait behind the earlier and then see its result — exactly one runs
    (neither yielding to the other, nor both running)."""
    workers = [Worker(env, f"race{i}", concurrency=2).start(mod.app) for i in (1, 2)]
    try:
        key = f"race-{uuid.uuid4().hex[:6]}"
        blocker = mod.hold.delay(key, 700, "blocker")
        wait_until(lambda: started(mod, "blocker"), 10, what="the blocker holds")
        tid = str(uuid.uuid4())
        sig = mod.hold_late.signature((key, 50, "copy"))
        sig.apply_async(task_id=tid)
        sig.apply_async(task_id=tid)
        blocker.get(timeout=30)
        def rows():
            return [r for r in history(mod, "hold") if r["key"] == key and r["tag"] == "copy"]
        wait_until(rows, 15, interval=0.1, what="a copy's run")
        # The second copy's decision (result grace) is over within 3 s: it never runs.
        holds_for(lambda: len(rows()) == 1, 3.0, what=lambda: f"one run of the copies: {rows()}")
    finally:
        for w in workers:
            w.stop()


def test_beat_sent_tasks_are_locked(mod, env, tmp_path):
    """Two beat processes (the classic misconfiguration) send a job longer than its period."""
    worker = Worker(env, "beatw", concurrency=4).start(mod.app)
    beats = []
    try:
        for i in range(2):
            log = open(tmp_path / f"beat{i}.log", "wb")
            beats.append(subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "tests.apps.beat", "beat", "-s", str(tmp_path / f"sched{i}"),
                 "-l", "info"], env={**os.environ, **env, "PYTHONPATH": ROOT}, cwd=ROOT, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
        # Both beats send the job (longer than its period); runs never overlap.
        wait_until(lambda: len(history(mod, "singleton")) >= 3, 30, what="three runs of the job")
    finally:
        for b in beats:
            b.terminate()
            b.wait(10)
        worker.stop()
    rows = history(mod, "singleton")
    assert len(rows) >= 3, rows
    assert overlapping([(r["start"], r["end"]) for r in rows]) is None


def test_lock_events_are_sent(mod, env):
    worker = Worker(env, "events", concurrency=2, extra=["-E"]).start(mod.app)
    try:
        with received_events(mod.app) as seen:
            key = f"ev-{uuid.uuid4().hex[:6]}"
            r1, r2 = mod.hold.delay(key, 300, 1), mod.hold.delay(key, 300, 2)  # either may go first
            r1.get(timeout=30), r2.get(timeout=30)
            wait_until(lambda: any(e["type"] == "task-lock-acquired" and e.get("uuid") == r2.id for e in seen), 10,
                       interval=0.1, what="the second task's task-lock-acquired event")
    finally:
        worker.stop()
    types = {(e["type"], e.get("uuid")) for e in seen}
    assert ("task-lock-acquired", r1.id) in types and ("task-lock-acquired", r2.id) in types
    waiting = [e for e in seen if e["type"] == "task-lock-waiting"]
    assert waiting and waiting[0]["key"] == f"k:{key}"
    first, second = sorted((r1.id, r2.id), key=lambda tid: [e["uuid"] for e in seen if e["type"] == "task-lock-acquired"].index(tid))
    acquired = [e for e in seen if e["type"] == "task-lock-acquired" and e["uuid"] == second][0]
    assert acquired["token"] > 0 and acquired["wait"] > 0.1 and acquired["mode"] == "write"
