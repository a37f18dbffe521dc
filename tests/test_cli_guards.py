"""`celery zklock guards` after a purge (issue 36 item 6), against a real ZooKeeper and Redis:
guarded tasks published to a queue no worker reads, the queue deleted (what `celery purge`
does), then `guards --clear` removes the guards so that a new publish is queued again."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import uuid

import pytest
from kazoo.client import KazooClient

from celery_zklock.engine import guard_counts, guards
from support.workers import ROOT
from tests.enqueueutil import guard_of
from tests.lockutil import worker_env


@pytest.fixture(scope="module")
def env(redis_server, zk_server):
    yield worker_env(redis_server, zk_server, "celery-zklock-guards")


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


def cli(env, *args):
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.enqueued", "zklock", "guards", *args],
                          env={**os.environ, **env, "PYTHONPATH": ROOT}, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_guards_clear_after_a_purge_lets_a_new_publish_queue(env, mod, zk):
    queue = f"nobody-{uuid.uuid4().hex[:6]}"
    keys = [uuid.uuid4().hex[:8] for _ in range(2)]
    queued = {k: mod.refresh.apply_async((k, 0), queue=queue) for k in keys}
    for k in keys:  # deduped while queued, and counted
        assert mod.refresh.apply_async((k, 0), queue=queue).id == queued[k].id
    assert mod._r.llen(queue) == 2
    mod._r.delete(queue)  # celery purge

    listed = cli(env, "--json")
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    paths = {k: guards.guard_path(mod.app.conf.zklock_root, mod.refresh.name, f"user:{k}") for k in keys}
    assert {report[paths[k]][0]["task_id"] for k in keys} == {r.id for r in queued.values()}
    assert all(report[paths[k]][0]["deduped"] == 1 for k in keys)
    text = cli(env)
    assert all(p in text.stdout for p in paths.values()) and "enqueue guard (queued)" in text.stdout
    assert mod.refresh.apply_async((keys[0], 0), queue=queue).id == queued[keys[0]].id  # still deduped into nothing

    one = cli(env, "--clear", "--task", mod.refresh.name, "--key", f"user:{keys[0]}")
    assert one.returncode == 0, one.stderr
    assert f"removed {paths[keys[0]]}" in one.stdout and paths[keys[1]] not in one.stdout
    assert guard_of(zk, mod, mod.refresh, keys[0]) is None and guard_of(zk, mod, mod.refresh, keys[1]) is not None
    assert not zk.exists(guard_counts.counter_path(paths[keys[0]]))

    rest = cli(env, "--clear")
    assert rest.returncode == 0, rest.stderr
    assert f"removed {paths[keys[1]]}" in rest.stdout
    assert all(guard_of(zk, mod, mod.refresh, k) is None for k in keys)
    again = {k: mod.refresh.apply_async((k, 0), queue=queue) for k in keys}
    assert all(again[k].id != queued[k].id for k in keys)  # queued, not deduped
    assert mod._r.llen(queue) == 2
    mod._r.delete(queue)
    assert "no enqueue guards removed" in cli(env, "--clear", "--task", "no.such.task").stdout


def test_guards_clear_keeps_a_running_guard_unless_forced(env, mod, zk):
    key = uuid.uuid4().hex[:8]
    path = guards.guard_path(mod.app.conf.zklock_root, mod.in_flight.name, f"user:{key}")
    other = KazooClient(hosts=env["TEST_ZK_HOSTS"])
    other.start(timeout=20)
    try:  # a running guard: an ephemeral node of the running worker's session
        g = guards.Guard(id="run-1", task=mod.in_flight.name, until="finish", expires_at=0.0)
        other.create(path, g.dumps(), ephemeral=True, makepath=True)
        kept = cli(env, "--clear", "--key", f"user:{key}")
        assert kept.returncode != 0 and "a running guard" in kept.stderr and "--force" in kept.stderr
        assert other.exists(path)
        forced = cli(env, "--clear", "--key", f"user:{key}", "--force")
        assert forced.returncode == 0, forced.stderr
        assert f"removed {path} (running" in forced.stdout and not other.exists(path)
    finally:
        other.stop()
        other.close()
