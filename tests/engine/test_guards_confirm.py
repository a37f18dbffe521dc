"""A publisher's confirm that arrives late, against a real ZooKeeper: its task has already
started (its guard ended) and another publisher has taken the key again.  The confirm was a
write conditional on version 0, and every new guard is at version 0: it landed on the other
publisher's guard, naming a task whose run had begun, and every publish of the key was then
deduped into work already under way (the storm test of test_enqueue saw 972 such publishes
in 0.8 s).  Now a confirm names the node it was meant for, and a guard confirmed onto
another node names nobody: never deduped into, cleared by whoever finds it."""

from __future__ import annotations

import time

import pytest
from kazoo.client import KazooClient

from celery_zklock.engine import guards
from celery_zklock.engine.guards import Guard, TakeOutcome


@pytest.fixture
def zk(zk_server):
    c = KazooClient(hosts=zk_server.hosts)
    c.start(timeout=10)
    yield c
    c.stop()
    c.close()


def _guard(task_id: str, until: str = "start") -> Guard:
    return Guard(task_id, "t", until, time.time() + 3600, 0, time.time())


@pytest.mark.parametrize("until", ["start", "finish"])
def test_a_late_confirm_never_names_a_run_already_under_way(zk, request, until):
    path = guards.guard_path("/g-confirm", "t", f"user:{request.node.name}")
    first = _guard("T1", until)
    taken = guards.take(zk, [path], first)
    assert taken.outcome is TakeOutcome.TAKEN  # T1 published; its publisher is slow to confirm
    guards.start(zk, [path], "T1", 0, until)  # T1's worker starts it first
    if until == "finish":
        assert len(guards.release(zk, [path], "T1", 0, running=True)) == 1  # ... and finishes it
    assert zk.exists(path) is None
    second = guards.take(zk, [path], _guard("T2", until))
    assert second.outcome is TakeOutcome.TAKEN  # work published after T1 began: queued
    guards.confirm(zk, taken, first)  # T1's confirm arrives only now
    third = guards.take(zk, [path], _guard("T3", until))
    assert not (third.outcome is TakeOutcome.HELD and third.found.id == "T1"), \
        "a publish after T1's start was deduped into T1: its work is lost"
    assert third.outcome is TakeOutcome.TAKEN  # T2's guard names nobody now: a duplicate at worst


def test_a_guard_confirmed_onto_another_node_is_cleared_by_a_start(zk, request):
    """Nobody may dedupe into it, and nobody's run names it: the next start on the key
    (here T2's own, whose node it is) clears it rather than leaving a node behind."""
    path = guards.guard_path("/g-confirm", "t", f"user:{request.node.name}")
    first = _guard("T1")
    taken = guards.take(zk, [path], first)
    guards.start(zk, [path], "T1", 0, "start")
    assert guards.take(zk, [path], _guard("T2")).outcome is TakeOutcome.TAKEN
    guards.confirm(zk, taken, first)
    guards.start(zk, [path], "T2", 0, "start")
    assert zk.exists(path) is None


def test_a_late_confirm_never_lands_on_a_running_guard(zk, request):
    """``until="finish"``: T2 runs (its guard an ephemeral node of its session) when T1's
    confirm arrives; the running guard still names T2 and ends with T2's run."""
    path = guards.guard_path("/g-confirm", "t", f"user:{request.node.name}")
    first = _guard("T1", "finish")
    taken = guards.take(zk, [path], first)
    guards.start(zk, [path], "T1", 0, "finish")
    guards.release(zk, [path], "T1", 0, running=True)
    second = _guard("T2", "finish")
    guards.confirm(zk, guards.take(zk, [path], second), second)
    guards.start(zk, [path], "T2", 0, "finish")
    guards.confirm(zk, taken, first)  # T1's, only now
    held = guards.take(zk, [path], _guard("T3", "finish"))
    assert held.outcome is TakeOutcome.HELD and held.found.id == "T2"
    assert [g.id for g in guards.release(zk, [path], "T2", 0, running=True)] == ["T2"]
    assert zk.exists(path) is None


def test_a_timely_confirm_still_dedupes(zk, request):
    path = guards.guard_path("/g-confirm", "t", f"user:{request.node.name}")
    first = _guard("T1")
    taken = guards.take(zk, [path], first)
    guards.confirm(zk, taken, first)
    held = guards.take(zk, [path], _guard("T2"))
    assert held.outcome is TakeOutcome.HELD and held.found.id == "T1"
    guards.start(zk, [path], "T1", 0, "start")
    assert zk.exists(path) is None
