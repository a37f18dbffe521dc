"""ZooKeeper frozen (SIGSTOP: sockets open, nothing answers) under a running task that waited
in the worker's lock agent.  The agent declares the lock lost a third of the session after
kazoo notices the silence; an ``interrupt`` task must then end LockLost while ZooKeeper is
still frozen, not when it answers again (its release has no proof left to wait for)."""
from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from celery_zklock import LockLost
from tests.lockedapp import started_pid
from tests.polling import wait_until

# The 4 s session + 2.5 s.  The lock is declared lost about one session into the freeze
# (kazoo notices the silence after 2/3 of it, the agent's grace is 1/3); waiting for a
# release proof would add up to another session + 1 s on top.
FROZEN_FOR = 6.5


@pytest.fixture(scope="module")
def zk_server():
    """A server of this module's own: freezing it must not touch other modules' tests."""
    from celery_zklock.testing import ZooKeeperServer

    with ZooKeeperServer() as server:
        yield server


def test_interrupted_task_ends_while_zookeeper_is_still_frozen(mod, workers, env, zk_server):
    key = f"frozen-{uuid.uuid4().hex[:6]}"
    result = mod.lose_interrupt.delay(key, 20000)
    started_pid(mod, key)
    frozen_at = time.time()
    os.kill(zk_server.proc.pid, signal.SIGSTOP)
    try:
        wait_until(result.ready, FROZEN_FOR, interval=0.05, what=f"the task to end within {FROZEN_FOR}s of the freeze")
        ended_after = time.time() - frozen_at
    finally:
        os.kill(zk_server.proc.pid, signal.SIGCONT)
    with pytest.raises(LockLost, match="safety margin"):
        result.get(timeout=30)
    assert mod._r.get(f"finished:{key}") is None  # the body was stopped, not run to its end
    print(f"frozen ZooKeeper: the interrupted task ended LockLost {ended_after:.2f}s into the freeze")
