"""The same setup on a 3-server ZooKeeper ensemble (``celery_zookeeper_ensemble``), and the
leader killed under a hot key."""
from __future__ import annotations

from itertools import pairwise

import pytest
from celery import group

from celery_zklock.errors import LockLost
from tests.docker import tasks
from tests.polling import wait_until

pytestmark = pytest.mark.docker

RESULT_TIMEOUT = 180


@pytest.fixture
def celery_zookeeper(celery_zookeeper_ensemble):
    """Lock on the ensemble: how a user switches a setup from one server to three."""
    return celery_zookeeper_ensemble


def test_leader_killed_under_a_hot_key(celery_setup, celery_zookeeper):
    """30 tasks of 0.1 s on one key; the leader is SIGKILLed after the first ones ran.  No two
    successful runs overlap and their tokens grow; a run whose lock went with the leader's
    connections ends FAILURE with LockLost (never a silent success); the key works after."""
    assert len(celery_zookeeper) == 3
    assert {node.mode() for node in celery_zookeeper} == {"leader", "follower"}
    queue = celery_setup.worker.worker_queue
    results = group(tasks.hold.s("ens-1", 0.1) for _ in range(30)).apply_async(queue=queue)
    wait_until(lambda: results.completed_count() >= 5, 60, interval=0.05, what="the first 5 runs")
    leader = celery_zookeeper.leader()
    assert leader is not None
    leader.kill()
    runs, lost = [], []
    for result in results.results:
        result.get(timeout=RESULT_TIMEOUT, propagate=False)
        if result.state == "SUCCESS":
            runs.append(result.result)
        else:
            assert result.state == "FAILURE" and isinstance(result.result, LockLost), (result.state, result.result)
            lost.append(result)
    runs.sort(key=lambda r: r["start"])
    assert [(a, b) for a, b in pairwise(runs) if b["start"] < a["end"]] == []
    tokens = [r["token"] for r in runs]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    print(f"ensemble leader killed: {len(runs)} runs succeeded, {len(lost)} lost their lock, none overlapped")
    after = tasks.hold.s("ens-1", 0.1).apply_async(queue=queue).get(timeout=RESULT_TIMEOUT)
    assert after["token"] > tokens[-1]
    survivors = [node for node in celery_zookeeper if node is not leader]
    assert {node.mode() for node in survivors} == {"leader", "follower"}
