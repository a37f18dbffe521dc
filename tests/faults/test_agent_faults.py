"""Faults of the worker's lock agent (waiting outside the pool, the default for prefork).

The agent holds the worker's one ZooKeeper session and every lock its pool processes run
under.  Each scenario strikes it — or the worker around it — while a task holds a lock
with others queued behind it, asserts the outcome the README promises, and hands the
whole history to the checker (exclusion, fencing, accounting, no lock node left behind).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.faults import app as A
from tests.faults.harness import SESSION, record, task_pid, wait_until


def _new_agent(worker, old: int) -> int:
    return wait_until(lambda: (p := worker.agent_pid()) not in (None, old) and p, SESSION * 5,
                      what="the worker to restart its lock agent")


def test_sigkill_of_the_pool_process_holding_a_lock_frees_it_through_the_agent(scenario):
    """Promise: the agent sees the dead process's socket close and deletes its node at once
    (no reaper, no session timeout): the next same-key task starts right away."""
    w = scenario.worker("w", concurrency=3)
    delays, victims = [], []
    for round_ in range(3):
        key = f"kill-{round_}"
        held = scenario.send(A.step, key, 30000, queue=w.queue)
        pid = task_pid(scenario.store, held.id)
        waiters = [scenario.send(A.step, key, 30, queue=w.queue) for _ in range(2)]
        scenario.wait_contenders(key, 3)  # one holding, two queued in the agent
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        nxt = wait_until(lambda waiters=waiters: scenario.first(x.id for x in waiters), 30,
                         what="a waiter to take over")
        delays.append(round(nxt["t"] - killed, 3))
        victims.append(held)
    report = scenario.verify(allowed={"WorkerLostError"})
    assert all(v.state == "FAILURE" and type(v.result).__name__ == "WorkerLostError" for v in victims)
    record("agent-sigkill-child", recover_s=delays, **report.figures)
    assert max(delays) < 1.0, f"next task started {delays} s after the kills"


def test_sigkill_of_the_agent(scenario):
    """Promise: running tasks lose their locks and follow on_lock_lost (LockLost: the release
    cannot be proven); the worker restarts the agent; the waiting tasks queue again and run,
    one at a time; nothing runs unprotected."""
    w = scenario.worker("w", concurrency=3)
    held = scenario.send(A.step, "ak", 3000, queue=w.queue)
    task_pid(scenario.store, held.id)
    waiters = [scenario.send(A.step, "ak", 30, queue=w.queue) for _ in range(3)]
    scenario.wait_contenders("ak", 4)
    agent = w.agent_pid()
    assert agent is not None, "no lock agent under the worker"
    os.kill(agent, signal.SIGKILL)
    _new_agent(w, agent)
    report = scenario.verify(allowed={"LockLost"})
    record("agent-sigkill", **report.figures)
    assert (held.state, type(held.result).__name__) == ("FAILURE", "LockLost"), (held.state, held.result)
    assert all(x.state == "SUCCESS" for x in waiters)


def test_sigkill_of_the_worker_main_process_while_its_agent_survives(scenario):
    """Promise: the worker's main process alone is SIGKILLed while one of its pool processes
    runs a locked body and two more requests wait in its agent.  Celery kills the pool
    processes with their parent (PR_SET_PDEATHSIG), and the agent, which outlives them,
    sees their sockets close: it deletes every node of that worker at once, so another
    worker's waiter takes the lock within a fraction of the session timeout.  The agent,
    with nobody left to serve, then exits.  The killed run's message was acknowledged when
    it started, so Celery itself loses that task (not ours to report); the waiting ones
    stay unacknowledged with the dead worker."""
    victim = scenario.worker("victim", concurrency=2)
    survivor = scenario.worker("survivor", concurrency=1)
    held = scenario.send(A.step, "mk", 5000, queue=victim.queue)
    task_pid(scenario.store, held.id)
    for _ in range(2):  # not awaited: their messages stay with the dead worker
        A.step.apply_async(("mk", 30, 0), queue=victim.queue)
    scenario.wait_contenders("mk", 3)
    taker = scenario.send(A.step, "mk", 30, queue=survivor.queue)
    scenario.wait_contenders("mk", 4)
    agent = victim.agent_pid()
    assert agent is not None, "no lock agent under the worker"
    killed = time.time()
    os.kill(victim.pid, signal.SIGKILL)
    took = wait_until(lambda: scenario.first([taker.id]), SESSION * 5, what="the survivor's waiter to run")
    takeover = took["t"] - killed
    wait_until(lambda: not os.path.exists(f"/proc/{agent}"), SESSION * 3, what="the orphaned agent to exit")
    report = scenario.verify(acked_lost=[held.id])
    record("agent-survives-main-sigkill", recover_s=round(takeover, 3), **report.figures)
    assert taker.state == "SUCCESS"
    assert takeover < SESSION / 2, f"the survivor took the lock {takeover:.2f}s after the kill: a session expiry"


@pytest.mark.slow
def test_agent_frozen_past_the_session_timeout(scenario):
    """Promise: a frozen agent stops its heartbeats; the worker kills and restarts it, the
    running task's lock is no longer trusted and the run ends LockLost, another worker's
    waiter takes the lock once the frozen session expires, and exclusion holds."""
    w = scenario.worker("w", concurrency=2)
    other = scenario.worker("other", concurrency=1)
    held = scenario.send(A.step, "afz", 4000, queue=w.queue)
    task_pid(scenario.store, held.id)
    taker = scenario.send(A.step, "afz", 30, queue=other.queue)
    scenario.wait_contenders("afz", 2)
    agent = w.agent_pid()
    os.kill(agent, signal.SIGSTOP)
    try:
        _new_agent(w, agent)
    finally:
        try:
            os.kill(agent, signal.SIGCONT)
        except ProcessLookupError:
            pass
    wait_until(lambda: scenario.events(taker.id, "return"), SESSION * 5, what="the other worker's waiter to run")
    report = scenario.verify(allowed={"LockLost"})
    record("agent-freeze", **report.figures)
    assert (held.state, type(held.result).__name__) == ("FAILURE", "LockLost"), (held.state, held.result)
    assert taker.state == "SUCCESS"


@pytest.mark.slow
def test_pool_replacing_children_non_stop_while_locks_are_waited_for(scenario):
    """max_tasks_per_child=1: every task runs in a fresh pool process, forked while the
    main process holds requests for the agent.  2,000 tasks on 20 keys: nothing hangs,
    nothing overlaps, every task runs once."""
    w = scenario.worker("churn", concurrency=3, FAULTS_CONF='{"worker_max_tasks_per_child": 1}')
    results = [scenario.send(A.step, f"churn-{i % 20}", 1, queue=w.queue) for i in range(2000)]
    report = scenario.verify(timeout=900)
    record("agent-child-churn", **report.figures)
    assert report.figures["succeeded"] == len(results)
