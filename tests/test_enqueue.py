"""Enqueue-time singletons (``lock_enqueue``) with a real ZooKeeper, Redis and ``celery worker``s.

Each test uses keys of its own; a task that holds the key's *execution* lock keeps the next
one queued (its guard in place) for as long as the test needs.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import time
import uuid

import pytest
from kazoo.client import KazooClient

from celery_zklock import AlreadyQueued
from celery_zklock.engine import guards
from support.workers import Worker
from tests.celery_events import received_events
from tests.enqueueutil import guard_of as _guard
from tests.enqueueutil import new_key as _key
from tests.enqueueutil import runs as _runs
from tests.lockutil import worker_env
from tests.polling import holds_for, wait_until


@pytest.fixture(scope="module")
def env(redis_server, zk_server):
    yield worker_env(redis_server, zk_server, "celery-zklock-enq")


@pytest.fixture(scope="module")
def mod(env):
    import tests.apps.enqueued as m

    return importlib.reload(m)


@pytest.fixture(scope="module")
def zk(env):
    client = KazooClient(hosts=env["TEST_ZK_HOSTS"])
    client.start(timeout=20)
    yield client
    client.stop()
    client.close()


@pytest.fixture(scope="module")
def worker(mod, env):
    w = Worker(env, "enq1", app="tests.apps.enqueued", concurrency=3)
    w.start(mod.app)
    yield w
    w.stop()


def test_dedupe_while_queued_returns_the_queued_task(worker, mod, zk):
    """While one runs (holding the key's lock) and one is queued behind it, every further
    publish returns the queued one's AsyncResult and sends nothing; the guard ends at its start."""
    key = _key()
    first = mod.refresh.delay(key, 1500)
    wait_until(lambda: _runs(mod, key), what="the first to start")
    queued = mod.refresh.delay(key, 0)
    dupes = [mod.refresh.delay(key, 0) for _ in range(20)]
    assert {d.id for d in dupes} == {queued.id} != {first.id}
    guard, stat = _guard(zk, mod, mod.refresh, key)
    assert guard.id == queued.id and stat.ephemeralOwner == 0  # a queued guard outlives its publisher
    assert first.get(timeout=20) == key and queued.get(timeout=20) == key
    assert sorted(r["id"] for r in _runs(mod, key)) == sorted([first.id, queued.id])
    wait_until(lambda: _guard(zk, mod, mod.refresh, key) is None, 5, "the guard to end at the start")
    again = mod.refresh.delay(key, 0)
    assert again.id not in (first.id, queued.id) and again.get(timeout=20) == key


def test_reject_raises_already_queued_with_the_queued_task(worker, mod):
    key = _key()
    mod.refresh.delay(key, 1500)  # holds the execution lock of user:<key>
    wait_until(lambda: _runs(mod, key), what="the holder to start")
    queued = mod.rejecting.delay(key, 0)
    with pytest.raises(AlreadyQueued) as refused:
        mod.rejecting.delay(key, 0)
    assert refused.value.task_id == queued.id and refused.value.key == f"user:{key}"
    assert queued.get(timeout=20) == key
    assert mod.rejecting.delay(key, 0).get(timeout=20) == key  # free again once it started


def test_until_finish_guards_the_running_task_and_ends_with_it(worker, mod, zk):
    key = _key()
    running = mod.in_flight.delay(key, 1200)
    wait_until(lambda: _runs(mod, key), what="it to start")
    guard, stat = wait_until(lambda: (g := _guard(zk, mod, mod.in_flight, key)) and g[1].ephemeralOwner and g,
                         5, "the guard to become the running session's")
    assert guard.id == running.id
    assert mod.in_flight.delay(key, 0).id == running.id  # deduped while it runs
    assert running.get(timeout=20) == key
    wait_until(lambda: _guard(zk, mod, mod.in_flight, key) is None, 5, "the guard to end with the run")
    after = mod.in_flight.delay(key, 0)
    assert after.id != running.id and after.get(timeout=20) == key


def test_a_retry_is_never_refused_by_its_own_guard(worker, mod, zk):
    key = _key()
    result = mod.retrying.delay(key, 0)
    assert result.get(timeout=30) == 2
    assert [r["id"] for r in _runs(mod, key)] == [result.id] * 3
    wait_until(lambda: _guard(zk, mod, mod.retrying, key) is None, 5, "the guard to end after the last try")


def test_revoking_a_queued_task_ends_its_guard(worker, mod, zk):
    key = _key()
    mod.refresh.delay(key, 2500)
    wait_until(lambda: _runs(mod, key), what="the holder to start")
    queued = mod.refresh.delay(key, 0)
    assert _guard(zk, mod, mod.refresh, key)[0].id == queued.id
    mod.app.control.revoke(queued.id)
    wait_until(lambda: _guard(zk, mod, mod.refresh, key) is None, 5, "the revoked task's guard to end")
    fresh = mod.refresh.delay(key, 0)
    assert fresh.id != queued.id and fresh.get(timeout=20) == key
    assert queued.id not in [r["id"] for r in _runs(mod, key)]


def test_a_guard_whose_message_is_lost_ends_at_its_expires(worker, mod, zk):
    """The broker lost the message (here: a queue no worker reads).  Its guard names the
    message's expires; once past, the next publish deletes it and is queued."""
    key = _key()
    lost = mod.refresh.apply_async((key, 0), queue=f"nobody-{key}", expires=1.0)
    assert mod.refresh.delay(key, 0).id == lost.id  # still guarded
    time.sleep(1.1)  # past the lost message's expires
    taken = mod.refresh.delay(key, 0)
    assert taken.id != lost.id and taken.get(timeout=20) == key


def test_sigkill_of_the_running_worker_frees_a_finish_guard_within_the_session(mod, env, zk):
    """celery-once and celery-singleton refuse the key for their TTL (1 h) after this; the
    running guard is an ephemeral node of the worker's session: gone within its timeout."""
    # A queue of its own: the module's worker (enq1), still up, must not be the one that runs it.
    w = Worker(env, "enq-victim", app="tests.apps.enqueued", concurrency=1, extra=["-Q", "enq-victim"])
    w.start(mod.app)
    try:
        key = _key()
        running = mod.in_flight.apply_async((key, 30_000), queue="enq-victim")
        wait_until(lambda: (g := _guard(zk, mod, mod.in_flight, key)) and g[1].ephemeralOwner, 10,
               "the running guard")
        w.kill()
        killed = time.monotonic()
        free = wait_until(lambda: (r := mod.in_flight.apply_async((key, 0), queue="nobody")) and r.id != running.id and r,
                      10, "the key to accept a new publish")
        assert time.monotonic() - killed <= 4.0 + 2.0  # session timeout 4 s (+ tick rounding)
        assert free.id != running.id
    finally:
        w.stop()


def _storm(args) -> list:
    root, hosts, redis_url, keys, n, seed = args
    os.environ.update({"TEST_ZK_ROOT": root, "TEST_ZK_HOSTS": hosts, "TEST_REDIS_URL": redis_url})
    import random

    import tests.apps.enqueued as m

    rnd = random.Random(seed)
    rows = []
    for _ in range(n):
        key, mine = rnd.choice(keys), str(uuid.uuid4())
        before = time.time()
        r = m.refresh.apply_async((key, 2), task_id=mine)
        rows.append((key, mine, r.id, before))
    return rows


def test_a_publish_storm_queues_at_most_one_per_key(worker, mod, env):
    """10,000 publishes from 8 processes on 10 keys while a worker runs them.  ZooKeeper's
    create decides, so each key has at most one task queued; every queued task runs exactly
    once; and no publish is deduped into a task whose run had begun (lock granted, guard
    gone) before the publish was made: work arriving after a start is never lost."""
    keys = [f"s{i}-{_key()}" for i in range(10)]
    jobs = [(env["TEST_ZK_ROOT"], env["TEST_ZK_HOSTS"], env["TEST_REDIS_URL"], keys, 1250, i) for i in range(8)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(8) as pool:
        rows = [row for part in pool.map(_storm, jobs) for row in part]
    assert len(rows) == 10_000
    queued = {mine for _k, mine, got, _b in rows if got == mine}
    wait_until(lambda: len({r["id"] for r in _runs(mod) if r["key"] in keys}) >= len(queued), 120,
           "every queued task to run")
    runs = [r for r in _runs(mod) if r["key"] in keys]
    assert sorted(r["id"] for r in runs) == sorted(queued)  # each queued task ran exactly once
    granted = {r["id"]: r["granted"] for r in runs}
    late = [(k, got, before) for k, mine, got, before in rows if got != mine and before > granted[got]]
    assert not late, f"{len(late)} publishes deduped into runs already under way, e.g. {late[:3]}"
    key_of = {mine: k for k, mine, _g, _b in rows}
    assert all(key_of[got] == k for k, _m, got, _b in rows)  # deduped into a task of the same key
    assert len(queued) < 10_000 / 5  # deduping did happen


def test_waiting_in_the_pool_the_pool_process_ends_and_moves_guards(mod, env, zk):
    """With zklock_wait_in="pool" no agent exists: the pool process that locks in process
    ends a ``start`` guard at its grant and holds a ``finish`` guard in its own session."""
    w = Worker({**env, "TEST_ZK_WAIT_IN": "pool"}, "enq-pool", app="tests.apps.enqueued", concurrency=2,
               extra=["-Q", "enq-pool"])  # not the module's worker (enq1), which waits in its agent
    w.start(mod.app)
    try:
        key = _key()
        running = mod.in_flight.apply_async((key, 1000), queue="enq-pool")
        guard, stat = wait_until(lambda: (g := _guard(zk, mod, mod.in_flight, key)) and g[1].ephemeralOwner and g,
                             10, "the running guard in the pool process's session")
        assert guard.id == running.id and mod.in_flight.apply_async((key, 0), queue="enq-pool").id == running.id
        assert running.get(timeout=20) == key
        wait_until(lambda: _guard(zk, mod, mod.in_flight, key) is None, 5, "the guard to end with the run")

        other = _key()
        holder = mod.refresh.apply_async((other, 1000), queue="enq-pool")
        wait_until(lambda: _runs(mod, other), what="the holder to start")
        queued = mod.refresh.apply_async((other, 0), queue="enq-pool")
        assert mod.refresh.apply_async((other, 0), queue="enq-pool").id == queued.id
        assert holder.get(timeout=20) == other and queued.get(timeout=20) == other
        wait_until(lambda: _guard(zk, mod, mod.refresh, other) is None, 5, "the guard to end at its start")
    finally:
        w.stop()


def test_eager_calls_are_guarded_for_their_run(env, zk):
    """task_always_eager: the publish takes the guard, the run ends it (a nested publish of
    the same key during a ``finish`` run is deduped into the running one)."""
    from celery import Celery

    from celery_zklock import ZkLockedTask

    app = Celery("eager-enq", set_as_current=False)
    app.conf.update(task_always_eager=True, zklock_hosts=env["TEST_ZK_HOSTS"], zklock_root=env["TEST_ZK_ROOT"],
                    zklock_session_timeout=4.0)
    seen = []

    @app.task(bind=True, base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe", lock_enqueue_until="finish")
    def nested(self, user, depth=0):
        if depth == 0:
            seen.append(nested.delay(user, 1).id)  # the same key while this run is in flight
        return self.request.id

    key = _key()
    outer = nested.delay(key)
    assert seen == [outer.id] and outer.get() == outer.id
    path = guards.guard_path(env["TEST_ZK_ROOT"], nested.name, f"user:{key}")
    assert zk.exists(path) is None
    assert nested.delay(key).id != outer.id


def test_status_lists_guards(mod, env):
    """``celery zklock status`` shows each guard: queued or running, its task and id."""
    import subprocess
    import sys

    key = _key()
    queued = mod.refresh.apply_async((key, 0), queue=f"nobody-{key}")
    proc = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.enqueued", "zklock", "status", "--json"],
                          env={**os.environ, **env, "PYTHONPATH": os.getcwd()}, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    path = guards.guard_path(env["TEST_ZK_ROOT"], mod.refresh.name, f"user:{key}")
    (row,) = report[path]
    assert row["guard"] == "queued" and row["task_id"] == queued.id and row["task"] == mod.refresh.name
    assert 3000 < row["expires_in_s"] <= 3600  # zklock_enqueue_expires: the bound on a lost message


def test_a_dedupe_beat_job_never_piles_up(worker, mod, env, tmp_path):
    """beat ticks every 0.3 s a job that runs 1.2 s: without a guard its ticks queue up and
    run for long after beat stops; deduped until finish, at most one is queued or running."""
    import subprocess
    import sys

    key = f"beat-{_key()}"
    log = open(tmp_path / "beat.log", "wb")
    beat = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tests.apps.enqueued_beat", "beat", "-s",
                             str(tmp_path / "sched"), "-l", "info"],
                            env={**os.environ, **env, "TEST_BEAT_KEY": key, "PYTHONPATH": os.getcwd()},
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def sent() -> int:
        return (tmp_path / "beat.log").read_text().count("Scheduler: Sending due task")

    try:
        # Until beat has sent 12 ticks (3.6 s of ticking), not a fixed 5 s: beat's own start
        # takes 1.5 s on an idle machine but seconds more on a loaded one (7 ticks were seen).
        wait_until(lambda: sent() >= 12 or beat.poll() is not None, 60, interval=0.05, what="12 ticks sent")
    finally:
        beat.terminate()
        beat.wait(10)
    stopped = time.time()
    # A run in flight at the stop finishes (1.2 s); nothing queued behind it runs after it.
    holds_for(lambda: all(r["start"] < stopped + 1.3 for r in _runs(mod, key)), 2.5,
              what="no tick piled up to run after beat stopped")
    runs = _runs(mod, key)
    ticks = sent()
    assert ticks >= 10, ticks
    assert 2 <= len(runs) <= 6, (len(runs), ticks)  # ~3.6 s / 1.2 s, not one per tick
    assert all(r["start"] < stopped + 1.3 for r in runs), "ticks piled up and ran after beat stopped"


def test_zklock_tasks_turns_on_enqueue_guards_for_tasks_you_cannot_edit(env, redis_server):
    """zklock_tasks carries lock_enqueue like any lock option; a publisher locks the configured
    tasks with lock_configured_tasks(app), as the worker does at start."""
    from celery import Celery

    from celery_zklock import lock_configured_tasks

    app = Celery("bycfg-enq", set_as_current=False)
    app.conf.update(broker_url=redis_server.url, zklock_hosts=env["TEST_ZK_HOSTS"], zklock_root=env["TEST_ZK_ROOT"],
                    zklock_tasks={"bycfg.job": {"lock_key": "job:{n}", "lock_enqueue": "reject"}})

    @app.task(name="bycfg.job")
    def plain_job(n):
        return n

    assert lock_configured_tasks(app) == ["bycfg.job"]
    job = app.tasks["bycfg.job"]  # the configured base replaced plain_job's class
    key = _key()
    first = job.apply_async((key,), queue=f"nobody-{key}")
    with pytest.raises(AlreadyQueued) as refused:
        job.apply_async((key,), queue=f"nobody-{key}")
    assert refused.value.task_id == first.id and refused.value.key == f"job:{key}"


def test_deduped_and_rejected_publishes_send_events(mod, env):
    """With task_send_sent_event (Celery's switch for publisher events, as task-sent), a
    dedupe and a rejection each send a task-lock-* event naming the queued task."""
    with received_events(mod.app) as seen:
        mod.app.conf.task_send_sent_event = True
        try:
            key = _key()
            queued = mod.refresh.apply_async((key, 0), queue=f"nobody-{key}")
            mod.refresh.apply_async((key, 0), queue=f"nobody-{key}")
            other = mod.rejecting.apply_async((key, 0), queue=f"nobody-{key}")
            with pytest.raises(AlreadyQueued):
                mod.rejecting.apply_async((key, 0), queue=f"nobody-{key}")
            wait_until(lambda: {"task-lock-deduped", "task-lock-rejected"} <= {e["type"] for e in seen}, 10, "the events")
        finally:
            mod.app.conf.task_send_sent_event = False
    deduped = next(e for e in seen if e["type"] == "task-lock-deduped")
    rejected = next(e for e in seen if e["type"] == "task-lock-rejected")
    assert deduped["queued"] == queued.id and deduped["key"] == f"user:{key}"
    assert rejected["queued"] == other.id and rejected["name"] == mod.rejecting.name


def test_revoking_a_countdown_task_ends_its_guard_waiting_in_the_pool(mod, env, zk):
    """zklock_wait_in="pool": no lock agent ends the guard of a task the worker's main process
    discards (revoked, held for its countdown); a helper process does.  Before: the handler
    read the task off the request (Celery's Context, where ``task`` is the task's name), found
    no app and started no helper: the guard stayed for its bound (1 h), every publish of the
    key deduped into a task that would never run."""
    w = Worker({**env, "TEST_ZK_WAIT_IN": "pool"}, "enq-pool-revoke", app="tests.apps.enqueued", concurrency=1,
               extra=["-Q", "enq-pool-revoke"])
    w.start(mod.app)
    try:
        key = _key()
        queued = mod.refresh.apply_async((key, 0), queue="enq-pool-revoke", countdown=2)
        assert _guard(zk, mod, mod.refresh, key)[0].id == queued.id
        mod.app.control.revoke(queued.id)
        wait_until(lambda: _guard(zk, mod, mod.refresh, key) is None, 2 + 5, "the revoked task's guard to end")
        fresh = mod.refresh.apply_async((key, 0), queue="enq-pool-revoke")
        assert fresh.id != queued.id and fresh.get(timeout=20) == key
    finally:
        w.stop()


@pytest.mark.parametrize("carrying", ["link", "chain", "group", "chord"])
def test_a_publish_that_carries_more_work_is_never_deduped(worker, mod, carrying):
    """A publish with callbacks, a chain's rest or a group or chord membership is queued even
    while a task of its key is: the queued task carries none of it.  Before: it was deduped,
    the callback or the chain's rest never ran, and ``get()`` waited for good."""
    from celery import chain, chord, group

    key = _key()
    holder = mod.refresh.delay(key, 1500)
    wait_until(lambda: _runs(mod, key), what="the holder to start")
    queued = mod.refresh.delay(key, 0)
    if carrying == "link":
        callback = mod.echo.s()
        callback.freeze()
        first = mod.refresh.apply_async((key, 0), link=callback)
        done, expected = mod.app.AsyncResult(callback.id), key
    elif carrying == "chain":
        done, expected = chain(mod.refresh.s(key, 0), mod.echo.s()).delay(), key
        first = done.parent
    elif carrying == "group":
        done, expected = group(mod.refresh.s(key, 0), mod.refresh.s(key, 0)).delay(), [key, key]
        first = done.results[0]
    else:
        done, expected = chord([mod.refresh.s(key, 0), mod.refresh.s(key, 0)], mod.echo.s()).delay(), [key, key]
        first = done.parent.results[0]
    assert first.id != queued.id
    assert done.get(timeout=15) == expected
    assert holder.get(timeout=20) == key and queued.get(timeout=20) == key


def test_a_guarded_task_published_as_a_callback_is_never_deduped(worker, mod):
    """A guarded task linked as another task's callback: the worker publishes it with the
    parent's result as its first argument, and nothing else marks it as more work (one
    callback goes out alone, not as a group).  Before, it was deduped into the queued task of
    its key: the parent's result never reached it, and its own result never came."""
    key = _key()
    holder = mod.refresh.delay(key, 1500)
    wait_until(lambda: _runs(mod, key), what="the holder to start")
    queued = mod.refresh.delay(key, 0)
    callback = mod.refresh.s()
    callback.freeze()
    mod.echo.apply_async((key,), link=callback)  # echo(key) -> refresh(key), published by the worker
    assert mod.app.AsyncResult(callback.id).get(timeout=15) == key
    assert callback.id in [r["id"] for r in _runs(mod, key)]
    assert holder.get(timeout=20) == key and queued.get(timeout=20) == key


def test_reject_refuses_a_publish_that_carries_more_work_too(mod):
    """``reject`` is loud: the caller learns at once that nothing was queued, callbacks and
    chain included (the decision documented in docs/enqueue.md)."""
    from celery import chain

    key = _key()
    queue = f"nobody-{key}"
    queued = mod.rejecting.apply_async((key, 0), queue=queue)
    with pytest.raises(AlreadyQueued) as refused:
        chain(mod.rejecting.s(key, 0).set(queue=queue), mod.echo.s()).delay()
    assert refused.value.task_id == queued.id
    with pytest.raises(AlreadyQueued):
        mod.rejecting.apply_async((key, 0), queue=queue, link=mod.echo.s())


@pytest.mark.parametrize("task_name", ["keyed_by_callable", "one_at_a_time"])
def test_a_bad_call_raises_type_error_even_when_it_would_be_deduped(mod, task_name):
    """Celery's ``apply_async`` checks the call's arguments (``task.typing``) before it sends.
    Before: with a key that does not bind the arguments (a callable, or ``lock_key=None``), a
    bad call behind a queued task was deduped and returned that task's result."""
    task = getattr(mod, task_name)
    key = _key()
    queue = f"nobody-{key}"
    queued = task.apply_async((key, 0), queue=queue)
    assert task.apply_async((key, 0), queue=queue).id == queued.id
    with pytest.raises(TypeError):
        task.apply_async((key, 0, "one too many"), queue=queue)
    with pytest.raises(TypeError):
        task.apply_async((key,), {"nope": 1}, queue=queue)
