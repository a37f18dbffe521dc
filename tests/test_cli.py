"""`celery zklock` sub-command (entry point celery.commands) against a real ZooKeeper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

import pytest

from celery_zklock import FairLock
from celery_zklock.keys import key_path
from support.workers import ROOT, Worker
from tests.lockutil import locked_app
from tests.polling import wait_until


def run_cli(zk_server, root, *args, redis_url=None, input=None):
    env = {**os.environ, "PYTHONPATH": ROOT, "TEST_ZK_HOSTS": zk_server.hosts, "TEST_ZK_ROOT": root}
    if redis_url:
        env["TEST_REDIS_URL"] = redis_url
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.locked", "zklock", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, input=input)


def test_status_shows_holder_and_waiter(zk_server, zk_client):
    root = f"/cli-{uuid.uuid4().hex[:6]}"
    path = key_path(root, "sku/7")
    holder = FairLock(zk_client, path, identifier='{"task":"buy","pid":1}')
    holder.acquire()
    try:
        out = run_cli(zk_server, root, "status", "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert list(report) == [path]
        assert report[path][0]["holder"] is True and json.loads(report[path][0]["data"])["task"] == "buy"
        text = run_cli(zk_server, root, "status", "sku/7")
        assert "HOLDS" in text.stdout and path in text.stdout
    finally:
        holder.release()
    assert "no locks held" in run_cli(zk_server, root, "status").stdout


def test_status_shows_readers_sharing_and_the_writer_behind_them(zk_server, zk_client):
    from celery_zklock import ReadWriteLock

    root = f"/cli-{uuid.uuid4().hex[:6]}"
    path = key_path(root, "catalog")
    readers = [ReadWriteLock(zk_client, path, identifier=f'{{"task":"read{i}"}}') for i in range(2)]
    for r in readers:
        assert r.read.acquire(timeout=5)
    writer = ReadWriteLock(zk_client, path, identifier='{"task":"rebuild"}')
    waiting = threading.Thread(target=writer.write.acquire, kwargs={"timeout": 10})
    waiting.start()
    try:
        wait_until(lambda: len(zk_client.get_children(path)) == 3, 5, what="the writer to queue")
        rows = json.loads(run_cli(zk_server, root, "status", "--json").stdout)[path]
        assert [(r["mode"], r["holder"]) for r in rows] == [("read", True), ("read", True), ("write", False)]
        text = run_cli(zk_server, root, "status").stdout
        assert text.count("HOLDS read") == 2 and "waits write" in text
    finally:
        for r in readers:
            r.read.release()
        waiting.join(10)
        writer.write.release()


def test_path_prints_the_znode(zk_server):
    out = run_cli(zk_server, "/r", "path", "order:1/ü")
    assert out.stdout.strip() == "/r/order:1%2F%C3%BC"



def test_path_json(zk_server):
    out = run_cli(zk_server, "/r", "path", "order:1", "--json")
    assert json.loads(out.stdout) == {"key": "order:1", "path": "/r/order:1"}


# ------------------------------------------------------------------ with real workers
@pytest.fixture(scope="module")
def cli_env(redis_server, zk_server):
    values = {"TEST_REDIS_URL": redis_server.url, "TEST_ZK_HOSTS": zk_server.hosts,
              "TEST_ZK_ROOT": f"/cli-{uuid.uuid4().hex[:8]}", "TEST_ZK_SESSION": "4"}
    with locked_app(values) as mod:
        w = Worker(values, "cliw", concurrency=3, extra=["-E"]).start(mod.app)
        yield values, mod, w
        w.stop()


def test_status_shows_every_holder_of_a_semaphore_with_task_worker_and_pid(cli_env, zk_server):
    values, mod, w = cli_env
    key = f"sem-{uuid.uuid4().hex[:6]}"
    # The holds last until the test lets them go: every check below runs while the first two
    # hold, however slow each CLI run (a fresh Python process) is on a loaded machine.
    go = f"go-{key}"
    running = [mod.hold_two.delay(key, 0, f"t{i}", go) for i in range(3)]
    try:
        _check_semaphore_status(values, zk_server, key, running)
    finally:
        mod._r.set(go, 1)
    for r in running:
        r.get(timeout=30)


def _check_semaphore_status(values, zk_server, key, running):
    root = values["TEST_ZK_ROOT"]

    def report():
        out = run_cli(zk_server, root, "status", f"k:{key}", "--json", redis_url=values["TEST_REDIS_URL"])
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout).get(key_path(root, f"k:{key}"), [])

    wait_until(lambda: len(report()) == 3, 10)
    text = run_cli(zk_server, root, "status", f"k:{key}").stdout
    assert text.count("HOLDS") == 2 and text.count("waits") == 1 and "task_id=" in text
    rows = report()
    assert [r["holder"] for r in rows] == [True, True, False]  # lock_max_holders=2: two hold
    assert {r["task_id"] for r in rows} == {r.id for r in running}
    assert all(r["task"] == "tests.apps.locked.hold_two" and r["worker"].startswith("cliw") and r["pid"] for r in rows)
    assert all(r["for_s"] >= 0 for r in rows)
    by_prefix = json.loads(run_cli(zk_server, root, "status", "--prefix", "k:sem-", "--json").stdout)
    assert key_path(root, f"k:{key}") in by_prefix
    assert json.loads(run_cli(zk_server, root, "status", "--prefix", "k:nothing-", "--json").stdout) == {}


def test_release_deletes_exactly_the_named_node_and_logs_who(cli_env, zk_server, zk_client):
    values, mod, w = cli_env
    root = values["TEST_ZK_ROOT"]
    path = key_path(root, "k:dead-machine")
    dead = FairLock(zk_client, path, identifier='{"host":"gone-01","pid":4242,"task":"t","task_id":"x"}')
    assert dead.acquire(timeout=5)
    waiter = mod.hold.delay("dead-machine", 10, "after")
    wait_until(lambda: len(zk_client.get_children(path)) == 2, 10)
    node = dead.node.rsplit("/", 1)[-1]
    refused = run_cli(zk_server, root, "release", "k:dead-machine", "--node", node[:-1], "--yes")
    assert refused.returncode != 0 and "nothing deleted" in refused.stderr
    aborted = run_cli(zk_server, root, "release", "k:dead-machine", "--node", node, input="n\n")
    assert aborted.returncode != 0 and node in zk_client.get_children(path)
    out = run_cli(zk_server, root, "release", "k:dead-machine", "--node", node, "--yes", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["deleted"] == f"{path}/{node}" and result["was_holder"] and result["owner"]["host"] == "gone-01"
    assert "force-deleted lock node" in out.stderr and result["by"] in out.stderr
    assert waiter.get(timeout=10) is not None  # the next task went in


def test_watch_streams_lock_events_for_a_prefix(cli_env, zk_server):
    values, mod, w = cli_env
    env = {**os.environ, "PYTHONPATH": ROOT, **values}

    def bound() -> set:  # the event queues bound to Celery's events exchange (kombu's Redis transport)
        return mod._r.smembers("_kombu.binding.celeryev")

    before = bound()
    watcher = subprocess.Popen([sys.executable, "-m", "celery", "-A", "tests.apps.locked", "zklock", "watch",
                                "--prefix", "k:watched", "--json", "--limit", "4", "--timeout", "30"],
                               env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_until(lambda: bound() - before, 30, interval=0.1, what="the watcher's event queue bound")
    mod.hold.delay("other", 10, "ignored").get(timeout=10)
    first = mod.hold.delay("watched", 300, "a")
    second = mod.hold.delay("watched", 10, "b")
    first.get(timeout=10)
    second.get(timeout=10)
    out, err = watcher.communicate(timeout=40)
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(events) == 4, err[-2000:]
    assert all(e["key"] == "k:watched" for e in events)
    types = [e["type"] for e in events]
    assert types.count("task-lock-acquired") >= 1 and "task-lock-released" in types
    assert {e["uuid"] for e in events} <= {first.id, second.id}


def test_status_lists_each_waiting_request_once(cli_env, zk_server, zk_client):
    """Five requests for a key the test holds, waiting in a worker (its agent queues one node
    for them in ZooKeeper, named after the first, and keeps the rest in memory): the status
    lists each request once, the holder and all five (before: the first twice, once by its
    node and once among its worker's in-memory waiters)."""
    values, mod, w = cli_env
    root = values["TEST_ZK_ROOT"]
    key = f"once-{uuid.uuid4().hex[:6]}"
    lock = FairLock(zk_client, key_path(root, f"k:{key}"), identifier="the test holds it")
    assert lock.acquire(timeout=10)
    try:
        sent = [mod.hold.delay(key, 0, f"o{i}") for i in range(5)]

        def report():
            out = run_cli(zk_server, root, "status", f"k:{key}", "--json", redis_url=values["TEST_REDIS_URL"])
            assert out.returncode == 0, out.stderr
            return json.loads(out.stdout).get(key_path(root, f"k:{key}"), [])

        rows = wait_until(lambda: (lambda r: r if len({x["task_id"] for x in r} - {None}) >= 5 else None)(report()), 20,
                          what="all five waiters listed")
        ids = [r["task_id"] for r in rows if r["task_id"]]
        assert sorted(ids) == sorted(r.id for r in sent), rows  # each once
        assert sum(1 for r in rows if r["holder"]) == 1
    finally:
        lock.release()
    for r in sent:
        r.get(timeout=30)
