"""Direct calls and eager mode: documented behaviour, tested against a real ZooKeeper."""

from __future__ import annotations

import pytest
from celery import Celery

from celery_zklock import FairLock, LockTimeout, LockUnavailable, ZkLockedTask, current_lock, lock_path
from tests.lockutil import children
from tests.polling import wait_until


@pytest.fixture
def app(zk_server):
    app = Celery("inproc", broker="memory://", backend="cache+memory://")
    app.conf.update(zklock_hosts=zk_server.hosts, zklock_root="/inproc", zklock_session_timeout=4.0,
                    zklock_connect_timeout=1.0, task_always_eager=False)
    return app


def test_direct_call_is_locked_and_exposes_the_lock(app, zk_client):
    @app.task(base=ZkLockedTask, lock_key="sku:{sku_id}", shared=False)
    def buy(sku_id):
        lk = current_lock()
        children = zk_client.get_children(lk.path)
        return lk.key, lk.path, lk.token, lk.is_held(), len(children)

    key, path, token, held, n = buy(42)
    assert key == "sku:42" and path == lock_path("sku:42", app) == "/inproc/sku:42"
    assert held and token > 0 and n == 1
    # The release is pipelined: the delete lands a moment later.
    wait_until(lambda: children(zk_client, path) == [], 5, interval=0.01, what="the node deleted")


def test_current_lock_outside_a_task_is_an_error():
    with pytest.raises(RuntimeError, match="outside a running ZkLockedTask"):
        current_lock()


@pytest.mark.parametrize("policy", ["fail", "retry"])
def test_direct_call_timeout_raises(app, zk_client, policy):
    @app.task(base=ZkLockedTask, lock_key="k:{x}", lock_timeout=0.2, on_lock_timeout=policy, shared=False)
    def job(x):
        return "ran"

    blocker = FairLock(zk_client, "/inproc/k:1")
    blocker.acquire()
    try:
        with pytest.raises(LockTimeout) as info:
            job(1)
        assert info.value.key == "k:1" and len(info.value.holders) == 1
    finally:
        blocker.release()
    assert job(1) == "ran"


def test_direct_call_skip_returns_none(app, zk_client):
    @app.task(base=ZkLockedTask, lock_key="k:{x}", lock_timeout=0, on_lock_timeout="skip", shared=False)
    def job(x):
        return "ran"

    blocker = FairLock(zk_client, "/inproc/k:2")
    blocker.acquire()
    try:
        assert job(2) is None
    finally:
        blocker.release()


def test_eager_apply_is_locked(app, zk_client):
    @app.task(base=ZkLockedTask, lock_key="k:{x}", lock_timeout=0.2, on_lock_timeout="fail", shared=False)
    def job(x):
        return current_lock().token

    assert job.apply(args=(3,)).get() > 0
    blocker = FairLock(zk_client, "/inproc/k:3")
    blocker.acquire()
    try:
        res = job.apply(args=(3,))
        assert res.state == "FAILURE" and isinstance(res.result, LockTimeout)
    finally:
        blocker.release()


def test_unreachable_zookeeper_never_runs_the_body(zk_server):
    app = Celery("down", broker="memory://", backend="cache+memory://")
    app.conf.update(zklock_hosts="127.0.0.1:1", zklock_connect_timeout=0.5, zklock_on_unavailable="fail")
    ran = []

    @app.task(base=ZkLockedTask, shared=False)
    def job():
        ran.append(1)

    with pytest.raises(LockUnavailable, match="zklock_hosts"):
        job()
    res = job.apply()
    assert res.state == "FAILURE" and isinstance(res.result, LockUnavailable)
    assert ran == []
