"""Enqueue-time singletons never lose work (issue 40): each path the review found, driven
against a real ZooKeeper, Redis and ``celery worker`` where it can be.

Every test here failed on the code before the fix (each says how); the README's enqueue
table lists what each failure can cost, and for how long.
"""

from __future__ import annotations

import datetime
import importlib
import socket
import threading
import time
import uuid

import pytest
from kazoo.client import KazooClient
from kazoo.security import make_acl

from celery_zklock import LockUnavailable, config, enqueue
from celery_zklock.engine import guards
from support.workers import Worker
from tests.enqueueutil import guard_of as _guard
from tests.enqueueutil import new_key as _key
from tests.enqueueutil import runs as _runs
from tests.lockutil import worker_env
from tests.polling import holds_for, wait_until
from tests.tcpproxy import TcpProxy


@pytest.fixture(scope="module")
def env(redis_server, zk_server):
    yield worker_env(redis_server, zk_server, "celery-zklock-noloss")


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
    w = Worker(env, "noloss", app="tests.apps.enqueued", concurrency=2)
    w.start(mod.app)
    yield w
    w.stop()


@pytest.fixture
def short_bound(mod):
    """zklock_enqueue_expires shortened to 3 s in this (the publishing) process."""
    mod.app.conf.zklock_enqueue_expires = 3.0
    config.reset_settings(mod.app)
    mod.refresh.__dict__.pop("_zk_options", None)
    yield 3.0
    mod.app.conf.zklock_enqueue_expires = 3600.0
    config.reset_settings(mod.app)
    mod.refresh.__dict__.pop("_zk_options", None)


# ------------------------------------------------------------------ the confirmed loss
def test_a_countdown_past_the_bound_runs(worker, mod, short_bound):
    """Before: the publish added ``expires=3`` (the bound) to a message due in 6 s; the worker
    logged 'Discarding revoked task' and the task was REVOKED, never run."""
    key = _key()
    result = mod.refresh.apply_async((key, 0), countdown=6)
    assert result.get(timeout=30) == key
    assert [r["id"] for r in _runs(mod, key)] == [result.id]


def test_a_backlog_longer_than_the_bound_is_not_discarded(worker, mod, zk, short_bound):
    """A queue no worker reads for longer than the bound: the message is not discarded when a
    worker finally reads it.  Past the bound a new publish queues again (the README's stated
    duplicate), and both run."""
    key = _key()
    queue = f"backlog-{key}"
    first = mod.refresh.apply_async((key, 0), queue=queue)
    assert mod.refresh.apply_async((key, 0), queue=queue).id == first.id  # deduped while trusted
    time.sleep(short_bound + 0.5)  # past the guard's bound
    second = mod.refresh.apply_async((key, 0), queue=queue)
    assert second.id != first.id  # the guard is past its bound: queued again, never lost
    mod.app.control.add_consumer(queue, destination=[f"noloss@{socket.gethostname()}"], reply=True, timeout=10)
    assert first.get(timeout=30) == key and second.get(timeout=30) == key
    assert sorted(r["id"] for r in _runs(mod, key)) == sorted([first.id, second.id])


def test_no_expires_is_added_to_the_message(mod, short_bound):
    """What a worker reads off the message: no ``expires`` the caller did not ask for; the
    caller's own is kept, and the guard's bound follows it."""
    key = _key()
    sent = []

    def capture(headers=None, **_kw):
        sent.append(headers)

    from celery import signals

    signals.before_task_publish.connect(capture, weak=False)
    try:
        mod.refresh.apply_async((key, 0), queue=f"nobody-{key}", countdown=60)
        mod.refresh.apply_async((_key(), 0), queue=f"nobody-{key}", expires=30)
    finally:
        signals.before_task_publish.disconnect(capture)
    assert sent[0]["expires"] is None and sent[1]["expires"] is not None


# ------------------------------------------------------------------ finding 1: a retry with ZooKeeper gone
def test_a_retry_is_published_when_zookeeper_is_unreachable(mod, env):
    """``on_lock_unavailable="retry"`` calls Task.retry, which publishes through the guard.
    Before: LockUnavailable there became Reject(requeue=False): the task was dropped.  Now the
    retry is sent (its old guard names its id; its run ends it)."""
    from celery import Celery
    from celery.exceptions import Reject, Retry

    from celery_zklock import ZkLockedTask

    app = Celery("noloss-retry", set_as_current=False)
    app.conf.update(broker_url=env["TEST_REDIS_URL"], zklock_hosts="127.0.0.1:1", zklock_connect_timeout=1.0,
                    zklock_root=env["TEST_ZK_ROOT"])

    @app.task(bind=True, base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe")
    def job(self, user):
        return user

    key, task_id = _key(), str(uuid.uuid4())
    job.push_request(id=task_id, args=(key,), kwargs={}, retries=0, called_directly=False, delivery_info={"routing_key": f"nobody-{key}"})
    try:
        with pytest.raises(Retry):
            job.retry(countdown=0, queue=f"nobody-{key}", exc=LockUnavailable("ZooKeeper unreachable"))
    except Reject:  # pragma: no cover - the bug
        pytest.fail("the retry was rejected (dropped) because its guard needs ZooKeeper")
    finally:
        job.pop_request()
    import redis

    queued = redis.Redis.from_url(env["TEST_REDIS_URL"]).lrange(f"nobody-{key}", 0, -1)
    assert len(queued) == 1 and task_id.encode() in queued[0]


# ------------------------------------------------------------------ finding 3: ending the guard at the start fails
def test_a_guard_that_cannot_end_at_the_start_keeps_the_body_from_running(env, zk):
    """ZooKeeper refuses the guard's delete at the start (here: its folder's ACL denies it).
    Before: the error was swallowed and the body ran, the guard outliving the start and
    swallowing the publishes made during the run.  Now the body does not run
    (``on_lock_unavailable``: here "fail")."""
    from celery import Celery

    from celery_zklock import ZkLockedTask

    app = Celery("noloss-start", set_as_current=False)
    app.conf.update(task_always_eager=True, zklock_hosts=env["TEST_ZK_HOSTS"], zklock_root=env["TEST_ZK_ROOT"],
                    zklock_on_unavailable="fail", zklock_connect_timeout=3.0)
    ran = []

    @app.task(bind=True, base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe", name=f"noloss.start.{_key()}")
    def job(self, user):
        ran.append(user)
        return user

    key, task_id = _key(), str(uuid.uuid4())
    path = guards.guard_path(env["TEST_ZK_ROOT"], job.name, f"user:{key}")
    zk.ensure_path(guards.folder_of(guards.folder_of(path)))
    # Anyone may read and create in the task's folder, nobody may delete from it.
    zk.create(guards.folder_of(path), acl=[make_acl("world", "anyone", read=True, create=True, admin=True)])
    try:
        zk.create(path, guards.Guard(task_id, job.name, "start", time.time() + 60).dumps())
        header = {"paths": [path], "until": "start", "retries": 0}
        result = job.apply((key,), task_id=task_id, headers={guards.HEADER: header})
        assert ran == [] and isinstance(result.result, LockUnavailable), result.result
    finally:
        zk.set_acls(guards.folder_of(path), [make_acl("world", "anyone", all=True)])
        zk.delete(guards.folder_of(path), recursive=True)


# ------------------------------------------------------------------ finding 4: work deduped into a task that ends unrun
def test_publishes_deduped_into_a_skipped_task_are_reported(worker, mod, zk):
    """A queued task that ends by ``on_lock_timeout="skip"`` takes the publishes deduped into
    it along: before, nothing said so.  Now its process says how many (a WARNING, the event
    ``task-lock-unrun`` and a metric)."""
    key = _key()
    holder = mod.refresh.delay(key, 4000)  # holds the key's execution lock
    wait_until(lambda: _runs(mod, key), what="the holder to start")
    skipped = mod.skipping.delay(key, 0)  # lock_timeout 1 s, on_lock_timeout="skip", lock_enqueue_unrun="report"
    assert [mod.skipping.delay(key, 0).id for _ in range(3)] == [skipped.id] * 3
    wait_until(lambda: _guard(zk, mod, mod.skipping, key) is None, 15, "the skipped task's guard to end")
    wait_until(lambda: f"{skipped.id}] ended unrun (timeout: skipped); 3 publish(es) deduped into it"
           in open(worker.log_path).read(), 10, "the worker to report the deduped publishes")
    assert holder.get(timeout=20) == key
    assert mod.skipping.delay(key, 0).id != skipped.id  # free again: the next publish queues


def test_lock_enqueue_unrun_republish_runs_the_deduped_work_once(worker, mod, zk):
    """``lock_enqueue_unrun="republish"`` (the default): the skipped task is published once more, as a new
    task with the same arguments, and that one runs (it is not republished again).  The holder
    keeps the key 3 s: the first waits 2 s and is skipped, its republished copy gets the key."""
    key = _key()
    holder = mod.refresh.delay(key, 3000)
    wait_until(lambda: _runs(mod, key), what="the holder to start")
    skipped = mod.republishing.delay(key, 0)
    assert mod.republishing.delay(key, 0).id == skipped.id
    assert holder.get(timeout=20) == key
    again = wait_until(lambda: [r for r in _runs(mod, key) if r["kind"] == "republishing"], 20, "the republished run")
    assert [r["id"] for r in again] != [skipped.id] and len(again) == 1
    holds_for(lambda: len([r for r in _runs(mod, key) if r["kind"] == "republishing"]) == 1, 1.0,
              what="one republished run")


# ------------------------------------------------------------------ finding 2: the pool process dies before its claim
def test_a_finish_guard_ends_when_the_pool_process_dies_before_claiming(worker, mod, zk):
    """``until="finish"``, waiting in the worker: the guard moved to the agent's session at the
    grant; the pool process died before it claimed the request (here: in ``before_start``).
    Before, the ``finished`` path dropped the request and kept the guard for the agent's
    whole life (until the worker restarts): every publish of the key was deduped away."""
    key = _key()
    lost = mod.dying.delay(key, 0)
    lost.get(timeout=30, propagate=False)  # WorkerLostError: Celery's own outcome for it
    wait_until(lambda: _guard(zk, mod, mod.dying, key) is None, 10, "the dead request's guard to end")
    again = mod.dying.delay(key, 0)
    assert again.id != lost.id and again.get(timeout=30) == key


# ------------------------------------------------------------------ finding 5: the publisher dies between guard and publish
def test_a_guard_whose_publisher_died_before_publishing_is_not_deduped_into(worker, mod, zk):
    """A guard created and never published (its publisher died, or the create's reply was
    lost): before, every publish for the bound (1 h) was deduped into a task that did not
    exist.  Now such a guard is unconfirmed: publishers wait for it, then take the key over."""
    key = _key()
    path = guards.guard_path(mod.app.conf.zklock_root, mod.refresh.name, f"user:{key}")
    ghost = guards.Guard("never-sent", mod.refresh.name, "start", time.time() + 3600, 0, time.time(),
                         confirmed=False, publish_by=time.time() + 1.0)
    zk.create(path, ghost.dumps(), makepath=True)
    result = mod.refresh.delay(key, 0)
    assert result.id != "never-sent" and result.get(timeout=20) == key


def test_an_unconfirmed_guard_from_a_publisher_whose_clock_runs_ahead_is_waited_for_one_window(mod, zk):
    """A guard's publish window is written by its publisher's clock and was judged by every
    other publisher's own: a publisher whose clock ran an hour ahead, then died before its
    publish was confirmed, made every publish of the key wait an hour (past
    ``zklock_connect_timeout``; a retry inside a worker with a time limit was killed and
    lost).  A reader waits for one window of its own clock at most, then takes the key over."""
    key = _key()
    path = guards.guard_path(mod.app.conf.zklock_root, mod.refresh.name, f"user:{key}")
    ghost = guards.Guard("ahead", mod.refresh.name, "start", time.time() + 7200, 0, time.time() + 3600,
                         confirmed=False, publish_by=time.time() + 3600 + guards.PUBLISH_WINDOW)
    zk.create(path, ghost.dumps(), makepath=True)
    outcome: list = []
    publisher = threading.Thread(target=lambda: outcome.append(
        mod.refresh.apply_async((key, 0), queue=f"nobody-{key}").id), daemon=True)
    publisher.start()
    publisher.join(guards.PUBLISH_WINDOW + 5)
    assert outcome and outcome[0] != "ahead", "the publish waited on the publisher's clock"
    assert guards.Guard.loads(zk.get(path)[0]).id == outcome[0]  # the key taken over


def test_a_publish_waits_for_an_unconfirmed_guard_and_then_dedupes_into_it(mod, zk):
    """The other side of the same rule: a publisher that finds a publish under way waits for
    its confirmation, and then dedupes (no duplicate for a slow but live publisher)."""
    key = _key()
    path = guards.guard_path(mod.app.conf.zklock_root, mod.refresh.name, f"user:{key}")
    slow = guards.Guard("slow-one", mod.refresh.name, "start", time.time() + 3600, 0, time.time(),
                        confirmed=False, publish_by=time.time() + 8.0)
    zk.create(path, slow.dumps(), makepath=True)
    made = guards.TakeResult(guards.TakeOutcome.TAKEN, nodes={path: zk.exists(path).czxid})  # what take() returns
    threading.Timer(0.5, lambda: guards.confirm(zk, made, slow)).start()
    assert mod.refresh.apply_async((key, 0), queue=f"nobody-{key}").id == "slow-one"
    wait_until(lambda: guards.dedupes(zk, path) == 1, 5, "the dedupe to be counted")


# ------------------------------------------------------------------ finding 6: ZooKeeper gone after connecting
def test_a_publish_with_zookeeper_gone_raises_within_the_connect_timeout(env):
    """A publisher whose client was connected before the outage: before, ``sync()`` and
    ``get()`` waited for ZooKeeper to come back, so ``apply_async`` hung."""
    from celery import Celery

    from celery_zklock import ZkLockedTask

    with TcpProxy.to(env["TEST_ZK_HOSTS"]) as proxy:
        app = Celery("noloss-gone", set_as_current=False)
        app.conf.update(broker_url=env["TEST_REDIS_URL"], zklock_hosts=proxy.hosts, zklock_connect_timeout=2.0,
                        zklock_root=env["TEST_ZK_ROOT"], zklock_session_timeout=20.0)

        @app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe")
        def job(user):
            return user

        key = _key()
        job.apply_async((key,), queue=f"nobody-{key}")  # connected
        proxy.hold()
        outcome = []
        t = threading.Thread(target=lambda: outcome.append(_raised(job.apply_async, (_key(),), queue=f"nobody-{key}")),
                             daemon=True)
        t.start()
        t.join(30)
        proxy.release_held()
        assert outcome and isinstance(outcome[0], LockUnavailable), outcome or "apply_async still blocked after 30 s"


def _raised(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        return exc
    return None


# ------------------------------------------------------------------ finding 7: a naive datetime
@pytest.mark.parametrize("tz", [None, "America/New_York", "Asia/Tokyo"])
def test_a_naive_datetime_is_read_as_the_worker_reads_it(tz):
    """The guard's bound and the worker's discard agree on a naive ``expires``: both read it
    through Celery's ``maybe_make_aware(value, app.conf.timezone)`` (celery.worker.request)."""
    from celery import Celery
    from celery.utils.time import maybe_make_aware

    app = Celery("tz", set_as_current=False)
    app.conf.timezone = tz
    naive = datetime.datetime(2030, 1, 2, 3, 4, 5)
    assert enqueue._instant(naive, app, 0.0) == maybe_make_aware(naive, app.conf.timezone).timestamp()
    assert enqueue._instant(naive.isoformat(), app, 0.0) == maybe_make_aware(naive, app.conf.timezone).timestamp()
    assert enqueue._instant(5, app, 100.0) == 105.0


# ------------------------------------------------------------------ review 2: the enqueue dedupe path
def test_work_deduped_before_a_retry_takes_the_guard_over_is_republished(worker, mod, zk):
    """``timing_out`` (lock_timeout 1 s, one retry) times out twice behind a holder; a publish
    was deduped into it before its retry took its guard over (a new node, a new czxid).
    Before: the count named the old node, the retry's end read none, and the deduped work went
    unreported and was never republished.  Now a takeover's guard keeps the count."""
    key, flag = _key(), f"enq:flag:{_key()}"
    holder = mod.holding.delay(key, flag)
    try:
        wait_until(lambda: _runs(mod, key), what="the holder to start")
        timed = mod.timing_out.delay(key, 0)
        assert mod.timing_out.delay(key, 0).id == timed.id  # deduped before the retry
        timed.get(timeout=30, propagate=False)
        assert timed.state == "FAILURE"  # timed out on both tries: ended unrun
    finally:
        mod._r.set(flag, 1, ex=600)
    again = wait_until(lambda: [r for r in _runs(mod, key) if r["kind"] == "timing_out"], 15, "the republished run")
    assert [r["id"] for r in again] != [timed.id]
    assert holder.get(timeout=20) == key



def test_a_takeover_keeps_the_deduped_count_and_another_guard_starts_over(env, zk):
    """The same, publish by publish against ZooKeeper: a retry's takeover (a new node of the
    same task id) keeps the count of the node it replaced; a guard of another task does not
    inherit a counter left by an older guard of the key.  Before: 0 after the takeover."""
    from celery_zklock.engine import guard_counts

    path = guards.guard_path(env["TEST_ZK_ROOT"], "noloss.counts", f"user:{_key()}")

    def publish(task_id: str, retries: int = 0) -> guards.TakeResult:
        guard = guards.Guard(task_id, "noloss.counts", "start", time.time() + 60, retries, time.time())
        taken = guards.take(zk, [path], guard)
        if taken.outcome is not guards.TakeOutcome.HELD:
            guards.confirm(zk, taken, guard)
        return taken

    assert publish("T1").outcome is guards.TakeOutcome.TAKEN
    assert publish("D1").outcome is guards.TakeOutcome.HELD
    wait_until(lambda: guards.dedupes(zk, path) == 1, 5, "the dedupe to be counted")
    before = zk.exists(path).czxid
    assert publish("T1", retries=1).outcome is guards.TakeOutcome.OWN  # the retry takes it over
    assert zk.exists(path).czxid != before
    assert guards.dedupes(zk, path) == 1
    assert publish("D2").outcome is guards.TakeOutcome.HELD
    wait_until(lambda: guards.dedupes(zk, path) == 2, 5, "the second dedupe to be counted")
    (gone,) = guards.release(zk, [path], "T1", 1)
    assert gone.deduped == 2 and zk.exists(guard_counts.counter_path(path)) is None

    zk.create(guard_counts.counter_path(path), b'{"guard":1,"id":"T0","n":5}')  # left by an older guard
    assert publish("T2").outcome is guards.TakeOutcome.TAKEN
    assert guards.dedupes(zk, path) == 0
    assert publish("D3").outcome is guards.TakeOutcome.HELD
    wait_until(lambda: guards.dedupes(zk, path) == 1, 5, "the count to start over")
    assert [g.deduped for g in guards.release(zk, [path], "T2", 0)] == [1]

def test_the_unrun_step_follows_a_release_tried_again_in_the_background(env, zk):
    """A task ends unrun with a publish deduped into it while ZooKeeper is unreachable: the
    release is tried again in the background.  Before: that release dropped the count, and
    the deduped work was never reported or republished.  Now the unrun step runs once the
    release went through (here: ``republish``, the default)."""
    import redis
    from celery import Celery

    from celery_zklock import ZkLockedTask

    r = redis.Redis.from_url(env["TEST_REDIS_URL"])
    with TcpProxy.to(env["TEST_ZK_HOSTS"]) as proxy:
        app = Celery("noloss-later", set_as_current=False)
        app.conf.update(broker_url=env["TEST_REDIS_URL"], zklock_hosts=proxy.hosts, zklock_connect_timeout=1.0,
                        zklock_root=env["TEST_ZK_ROOT"], zklock_session_timeout=20.0)

        @app.task(base=ZkLockedTask, lock_key="user:{user}", lock_enqueue="dedupe", name=f"noloss.later.{_key()}")
        def job(user):
            return user

        key = _key()
        queue = f"nobody-{key}"
        queued = job.apply_async((key,), queue=queue)
        assert job.apply_async((key,), queue=queue).id == queued.id
        path = guards.guard_path(env["TEST_ZK_ROOT"], job.name, f"user:{key}")
        wait_until(lambda: guards.dedupes(zk, path) == 1, 5, "the dedupe to be counted")
        header = {"paths": [path], "until": "start", "retries": 0}
        job.push_request(id=queued.id, args=(key,), kwargs={}, retries=0, called_directly=False,
                         delivery_info={"exchange": "", "routing_key": queue}, **{guards.HEADER: header})
        proxy.hold()
        try:
            enqueue.finished(job, job.request, job.lock_options(), ran=False, why="skipped")
        finally:
            job.pop_request()
        assert zk.exists(path) is not None  # not ended: ZooKeeper unreachable
        proxy.release_held()
        wait_until(lambda: len(r.lrange(queue, 0, -1)) == 2, 15, "the deduped work to be republished")
        assert enqueue.REPUBLISHED.encode() in r.lrange(queue, 0, -1)[0]  # LPUSH: the newest first


def test_a_retry_in_the_way_of_anothers_guard_carries_not_the_old_guard_header(mod, zk):
    """``Task.retry`` copies the request's headers, the old guard header among them.  A retry
    in the way of another's guard is published unguarded; before, it still carried that header,
    naming paths its run then ended or guarded (``finish``) as if they were its own.  Now its
    header only lets its run end an older guard of its own (``start``), on its own paths."""
    from celery import signals
    from celery.exceptions import Retry

    key = _key()
    queue = f"nobody-{key}"
    mod.refresh.apply_async((key, 0), queue=queue)  # another task's guard on the key
    task_id = str(uuid.uuid4())
    old = {"paths": [guards.guard_path(mod.app.conf.zklock_root, mod.refresh.name, f"user:{_key()}")],
           "until": "finish", "retries": 0}
    sent = []

    def capture(headers=None, **_kw):
        if headers and headers.get("id") == task_id:
            sent.append(headers)

    signals.before_task_publish.connect(capture, weak=False)
    mod.refresh.push_request(id=task_id, args=(key, 0), kwargs={}, retries=0, called_directly=False,
                             delivery_info={"exchange": "", "routing_key": queue}, **{guards.HEADER: old})
    try:
        with pytest.raises(Retry):
            mod.refresh.retry(countdown=0)
    finally:
        mod.refresh.pop_request()
        signals.before_task_publish.disconnect(capture)
    (headers,) = sent
    own = guards.guard_path(mod.app.conf.zklock_root, mod.refresh.name, f"user:{key}")
    assert headers[guards.HEADER] == {"paths": [own], "until": "start", "retries": 1}
