"""Requests held aside in the worker's main process, against real workers, ZooKeeper and Redis:
an agent restart under a large backlog, and what the broker is told at a stop.

Why a module apart from test_wait_outside_pool: these tests hold hundreds of requests aside
on one key (held by this test process), which takes a worker of its own per test."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from celery_zklock.engine import FairLock
from support.workers import Worker
from tests.polling import wait_until
from tests.test_celery_workers import env, history, mod  # noqa: F401  (module fixtures)


@pytest.fixture(autouse=True)
def clean(mod):
    mod._r.delete("history", "arrivals")
    yield


def _held_by_us(zk_client, mod, key: str) -> FairLock:
    """Take ``hold(key)``'s lock from this process, so the worker's requests for it wait aside."""
    opts = mod.hold.lock_options()
    [path] = mod.hold.lock_paths((key,), {}, opts)
    lock = FairLock(zk_client, path, identifier="the test holds it")
    assert lock.acquire(timeout=10)
    return lock


def _waiting_aside(worker, mod) -> int:
    """Requests the worker holds aside (``celery zklock status``'s source: the inspect command)."""
    node = f"{worker.name}@{os.uname().nodename}"
    replies = mod.app.control.inspect(destination=[node], timeout=2.0)._request("zklock_waiting") or {}
    return sum(len(v) for reply in replies.values() for v in reply.values())


def test_an_agent_restart_with_a_large_backlog_resumes_every_request_in_order(mod, env, zk_client):
    """5,000 requests held aside on one key, the agent SIGKILLed: the new agent gets them all
    again without either process blocking on the other (before: both socket buffers filled,
    1 of 801 ran in 120 s, and the worker ignored SIGTERM), and they run in publish order."""
    n = int(os.environ.get("HELD_N", "5000"))
    key = f"backlog-{uuid.uuid4().hex[:6]}"
    lock = _held_by_us(zk_client, mod, key)
    w = Worker(env, "backlog", concurrency=2, extra=["-E"]).start(mod.app)  # events: each wait is answered
    try:
        results = [mod.hold.delay(key, 0, i) for i in range(n)]
        wait_until(lambda: _waiting_aside(w, mod) >= n, 60, interval=0.5, what=f"{n} requests held aside")
        agent = w.agent_pid()
        os.kill(agent, signal.SIGKILL)
        wait_until(lambda: w.agent_pid() not in (None, agent), 15, what="a new agent")
        lock.release()
        wait_until(lambda: len(history(mod, "hold")) >= n, 90, interval=0.5,
                   what=f"all {n} to run after the agent's restart")
        assert all(r.get(timeout=10) is not None for r in results)
        rows = history(mod, "hold")
        assert len(rows) == n, f"{len(rows)} runs for {n} tasks"
        tags = [r["tag"] for r in sorted(rows, key=lambda r: r["start"])]
        assert tags == sorted(tags), "the backlog ran out of its order"
    finally:
        if lock.is_held():
            lock.release()
        w.stop(timeout=30)
        assert not w.alive(), "the worker did not complete its warm shutdown"
