"""Faults in the middle of a lock-cohorting streak.

Two workers share one hot key; each worker's agent holds one node for it and passes the lock
among its own tasks, so at any moment one worker is mid-streak with more of its tasks queued
in memory and the other's node queued in ZooKeeper.  Each scenario strikes there — the agent,
the pool process holding, ZooKeeper's leader, or the network between one worker and
ZooKeeper — and hands the whole history to the checker: no two validly fenced holds overlap,
no task is lost, no lock node is left behind.

The pool-process scenario's 250 ms bodies outlast the agent's lease
(``celery_zklock.worker.cohort_rules.FRESH_MAX``, 0.2 s): their handoffs wait for ZooKeeper's
reply.  The agent, leader-failover and partition scenarios use 10-40 ms bodies, whose handoffs
run on the lease (no round trip), so the faults strike that path too.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.faults import app as A
from tests.faults.harness import SESSION, Partition, record, wait_until

KEY = "streak"


def _returns(scenario) -> int:
    return sum(1 for e in scenario.store.events() if e["op"] == "return")


def _mid_streak(scenario, sent: list, done: int = 6) -> None:
    """Wait until a streak is under way: some tasks done, a holder and queued tasks behind it."""
    wait_until(lambda: _returns(scenario) >= done and scenario.contenders(KEY) >= 3, 60, interval=0.01,
               what="a streak under way on the hot key")


def _holder(scenario, sent: list):
    """A task of ``sent`` running now, and its pool process (the body records its pid first
    thing; the record outlives the run, so the task must not have ended yet)."""
    by_id = {r.id: r for r in sent}

    def running():
        for task_id, pid in scenario.store.redis.hgetall("faults:running").items():
            result = by_id.get(task_id.decode())
            if result is not None and not scenario.events(result.id, "return") and not result.ready():
                return result, int(pid)
        return None

    return wait_until(running, 30, interval=0.002, what="a running holder")


def test_agent_sigkilled_mid_streak(scenario):
    """The agent of the worker holding dies: its holder ends LockLost (no release proof);
    the other worker takes the key; the worker restarts its agent and its queued tasks run."""
    a = scenario.worker("a", concurrency=3)
    scenario.worker("b", concurrency=3)
    sent = [scenario.send(A.step, KEY, 40) for _ in range(60)]
    _mid_streak(scenario, sent)
    agent = a.agent_pid()
    os.kill(agent, signal.SIGKILL)
    wait_until(lambda: (p := a.agent_pid()) not in (None, agent) and p, SESSION * 5, what="a new agent")
    report = scenario.verify(allowed={"LockLost"})
    record("cohort-agent-sigkill", **report.figures)
    assert sum(r.state == "SUCCESS" for r in sent) >= len(sent) - 3


def test_pool_process_sigkilled_mid_streak(scenario):
    """The holder's process dies mid-streak: the agent passes the lock to its next task (or
    lets the node go) at once; the killed task ends WorkerLostError, nothing else is lost."""
    scenario.worker("a", concurrency=3)
    scenario.worker("b", concurrency=3)
    sent = [scenario.send(A.step, KEY, 250) for _ in range(30)]
    _mid_streak(scenario, sent)
    victim, pid = _holder(scenario, sent)
    killed = time.time()
    os.kill(pid, signal.SIGKILL)
    report = scenario.verify(allowed={"WorkerLostError"})
    later = [e["t"] for e in scenario.store.events() if e["op"] == "begin" and e["t"] > killed]
    record("cohort-child-sigkill", next_begin_s=round(min(later) - killed, 3) if later else None, **report.figures)
    assert later and min(later) - killed < 1.0
    assert victim.state == "FAILURE" and type(victim.result).__name__ == "WorkerLostError", victim.state
    assert all(r.state == "SUCCESS" for r in sent if r is not victim)


def test_leader_failover_mid_streak(scenario):
    """ZooKeeper's leader dies mid-streak: held nodes are unsafe while suspended, then
    re-verified or lost; streaks go on after the election; the checker finds no overlap."""
    scenario.worker("a", concurrency=3)
    scenario.worker("b", concurrency=3)
    sent = [scenario.send(A.step, KEY, 10) for _ in range(150)]
    _mid_streak(scenario, sent)
    _killed, elected = scenario.cluster.kill_leader()
    report = scenario.verify(allowed={"LockLost"})
    record("cohort-leader-killed", new_leader_s=round(elected, 3), **report.figures)
    assert scenario.cluster.healthy()


@pytest.mark.slow
def test_worker_cut_off_from_zookeeper_mid_streak(scenario):
    """The worker holding is silently cut off from the ensemble past its session: it declares
    its lock lost itself before the session expires; the other worker's streak takes over;
    late writes are fenced; the cut-off worker's queued tasks run once it is back."""
    part = Partition(scenario.cluster.ensemble)
    try:
        a = scenario.worker("a", concurrency=3, FAULTS_ZK_HOSTS=part.hosts)
        scenario.worker("b", concurrency=3)
        sent = [scenario.send(A.step, KEY, 10, queue=a.queue) for _ in range(50)]
        sent += [scenario.send(A.step, KEY, 10) for _ in range(100)]
        _mid_streak(scenario, sent)
        cut = time.time()
        part.cut()
        wait_until(lambda: _returns(scenario) >= 75, SESSION * 10, what="the other worker to go on")
        time.sleep(SESSION)  # the partition lasts a session longer: the cut-off worker's session expires
    finally:
        part.heal()
    report = scenario.verify(allowed={"LockLost", "LockUnavailable"})
    record("cohort-partition", cut_at=round(cut, 3), **report.figures)
    part.close()
