"""An ``acks_late`` copy of a ``lock_enqueue_until="finish"`` task, redelivered after its
first worker died, against a real ZooKeeper: the first run's ephemeral guard went with that
worker's session, so the copy guards its own run again, unless another task of the key was
queued since (then that task's guard is left exactly as it is)."""

from __future__ import annotations

import time

from celery_zklock.engine import guards
from celery_zklock.engine.guards import Guard


def _publish(client, path: str, task_id: str) -> str:
    guard = Guard(task_id, "t", "finish", time.time() + 3600, 0, time.time())
    return guards.take(client, [path], guard).outcome


def _first_run_died(clients, path: str, task_id: str) -> None:
    """Published and started on a worker whose session then ended (SIGKILL, expiry)."""
    first = clients()
    assert _publish(first, path, task_id) is guards.TakeOutcome.TAKEN
    guards.start(first, [path], task_id, 0, "finish")
    assert first.exists(path).ephemeralOwner == first.client_id[0]
    first.stop()  # its session ends: the running guard goes with it
    first.close()


def test_a_redelivered_copy_guards_its_run_again(clients, request):
    path = guards.guard_path("/g", "t", f"user:{request.node.name}")
    _first_run_died(clients, path, "T")
    checker = clients()
    assert checker.exists(path) is None
    second = clients()
    guards.start(second, [path], "T", 0, "finish")  # the redelivered copy starts
    raw, stat = checker.get(path)
    assert Guard.loads(raw).names("T", 0) and stat.ephemeralOwner == second.client_id[0]
    assert _publish(checker, path, "U") is guards.TakeOutcome.HELD  # at most one in flight again
    assert len(guards.release(second, [path], "T", 0, running=True)) == 1  # and it ends with the run
    assert checker.exists(path) is None


def test_a_redelivered_copy_leaves_a_guard_queued_since_alone(clients, request):
    path = guards.guard_path("/g", "t", f"user:{request.node.name}")
    _first_run_died(clients, path, "T")
    publisher = clients()
    assert _publish(publisher, path, "U") is guards.TakeOutcome.TAKEN  # work that arrived after the crash
    _, before = publisher.get(path)
    second = clients()
    guards.start(second, [path], "T", 0, "finish")
    raw, after = publisher.get(path)
    assert Guard.loads(raw).names("U", 0) and after.ephemeralOwner == 0
    assert (after.version, after.czxid) == (before.version, before.czxid)
