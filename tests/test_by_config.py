"""Locking tasks by configuration (``zklock_tasks``): tasks whose code does not change — a
``shared_task`` and Celery's own ``celery.backend_cleanup`` — locked through real workers;
every configuration mistake stops the worker with a message naming what to fix."""

from __future__ import annotations

import json
import uuid

import pytest
from celery import Celery

from celery_zklock import ConfigurationError, FairLock, ZkLockedTask, lock_configured_tasks
from celery_zklock.config import ZkSettings
from celery_zklock.engine.client import connect, disconnect
from celery_zklock.keys import key_path
from support.workers import Worker
from tests.lockutil import locked_app, overlapping, worker_refuses

TASKS = {
    "tests.apps.shared.*": {"lock_key": "plain:{key}", "lock_timeout": 30},
    "celery.backend_cleanup": {"lock_key": "cleanup", "lock_timeout": 0, "on_lock_timeout": "skip"},
}


@pytest.fixture(scope="module")
def configured(redis_server, zk_server):
    values = {
        "TEST_REDIS_URL": redis_server.url, "TEST_ZK_HOSTS": zk_server.hosts,
        "TEST_ZK_ROOT": f"/bycfg-{uuid.uuid4().hex[:8]}", "TEST_ZK_SESSION": "4",
        "TEST_ZK_TASKS": json.dumps(TASKS),
    }
    with locked_app(values) as mod:
        w = Worker(values, "bycfg", concurrency=3).start(mod.app)
        yield values, mod, w
        w.stop()


def test_a_shared_task_is_serialized_per_key_without_a_code_change(configured):
    values, mod, w = configured
    mod._r.delete("history")
    results = [mod.plain_hold.delay(f"k{i % 2}", 80, i) for i in range(8)]
    for r in results:
        r.get(timeout=30)
    rows = [json.loads(x) for x in mod._r.lrange("history", 0, -1)]
    assert len(rows) == 8
    for key in ("k0", "k1"):
        spans = [(r["start"], r["end"]) for r in rows if r["key"] == key]
        assert len(spans) == 4 and overlapping(spans) is None
    # ...and the two keys did run side by side (it is a lock per key, not a global one).
    assert overlapping([(r["start"], r["end"]) for r in rows]) is not None


def test_celerys_own_backend_cleanup_is_locked_by_configuration(configured, zk_server):
    """A task from an installed package (Celery's ``celery.backend_cleanup``): while its
    configured key is held elsewhere it is skipped (lock_timeout 0, skip) — proof that it
    queued for the lock; once the key is free it runs."""
    values, mod, w = configured
    client = connect(ZkSettings(hosts=zk_server.hosts))
    try:
        lock = FairLock(client, key_path(values["TEST_ZK_ROOT"], "cleanup"), identifier="test holder")
        assert lock.acquire(timeout=5)
        skipped = mod.app.send_task("celery.backend_cleanup")
        assert skipped.get(timeout=20) is None  # skipped: SUCCESS, with the result None, and said so
        assert f"celery.backend_cleanup[{skipped.id}]: lock 'cleanup' not acquired" in w.log(), w.log()[-2000:]
        lock.release()
        ran = mod.app.send_task("celery.backend_cleanup")
        ran.get(timeout=20)
        assert ran.state == "SUCCESS"
    finally:
        disconnect(client)


# ------------------------------------------------------------------ mistakes
def _app(tasks: dict) -> Celery:
    app = Celery(f"bycfg-{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.zklock_tasks = tasks

    @app.task(name="proj.billing.sync_account")
    def sync_account(account_id, full=False):
        return account_id

    @app.task(name="proj.billing.locked", base=ZkLockedTask, lock_key="x")
    def already(x):
        return x

    app.finalize()
    return app


@pytest.mark.parametrize(
    "tasks, expected",
    [
        ({"proj.billing.sync_acount": {"lock_key": "a"}},
         r"'proj.billing.sync_acount' matches no registered task. Did you mean 'proj.billing.sync_account'"),
        ({"proj.billing.sync_account": {"lock_keys": "a"}}, r"unknown lock option 'lock_keys'. Did you mean 'lock_key'"),
        # an option without its lock_ prefix, or under its setting's name: the option meant
        ({"proj.billing.sync_account": {"key": "acct:{account_id}"}}, r"unknown lock option 'key'. Did you mean 'lock_key'"),
        ({"proj.billing.sync_account": {"lock_key": "a", "on_timeout": "skip"}},
         r"unknown lock option 'on_timeout'. Did you mean 'on_lock_timeout'"),
        ({"proj.billing.sync_account": {"lock_key": "a", "zklock_on_lost": "interrupt"}},
         r"unknown lock option 'zklock_on_lost'. Did you mean 'on_lock_lost'"),
        ({"proj.billing.sync_account": {"lock_key": "acct:{acount_id}"}}, r"acount_id"),
        ({"proj.billing.sync_account": {"lock_key": "a", "lock_timeout": -1}}, r"lock_timeout"),
        ({"proj.billing.*": {"lock_key": "a"}}, r"'proj.billing.locked' is a ZkLockedTask already"),
        ("proj.billing.sync_account", r"zklock_tasks.*must be a dict"),
    ],
)
def test_each_mistake_names_what_to_fix(tasks, expected):
    with pytest.raises(ConfigurationError, match=expected):
        lock_configured_tasks(_app(tasks))


def test_the_locked_version_replaces_the_task_under_its_name():
    app = _app({"proj.billing.sync_account": {"lock_key": "acct:{account_id}", "lock_timeout": 5}})
    assert lock_configured_tasks(app) == ["proj.billing.sync_account"]
    task = app.tasks["proj.billing.sync_account"]
    assert isinstance(task, ZkLockedTask) and task.lock_timeout == 5
    assert task.lock_keys((42,), {}) == ["acct:42"]
    assert lock_configured_tasks(app) == ["proj.billing.sync_account"]  # a second call changes nothing
    assert app.tasks["proj.billing.sync_account"] is task


def test_worker_with_a_bad_entry_refuses_to_start(redis_server, zk_server):
    env = {"TEST_REDIS_URL": redis_server.url, "TEST_ZK_HOSTS": zk_server.hosts,
           "TEST_ZK_ROOT": f"/bycfg-{uuid.uuid4().hex[:8]}",
           "TEST_ZK_TASKS": json.dumps({"tests.apps.shared.plain_hld": {"lock_key": "x"}})}
    assert "matches no registered task. Did you mean 'tests.apps.shared.plain_hold'" in worker_refuses(env, "bycfg-bad")
