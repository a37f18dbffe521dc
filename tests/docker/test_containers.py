"""Locked tasks across worker containers (pytest-celery's ``celery_setup``: our ZooKeeper
node, Redis broker and backend, two worker containers with ``-c 2``)."""
from __future__ import annotations

import time
from datetime import timezone
from itertools import pairwise

import pytest
from celery import group
from kazoo.client import KazooClient

from celery_zklock.cli import lock_report
from celery_zklock.config import load_settings
from celery_zklock.engine.znodes import fencing_token
from celery_zklock.errors import LockLost
from tests.docker import tasks
from tests.docker.conftest import SESSION_TIMEOUT
from tests.polling import wait_until

pytestmark = pytest.mark.docker

RESULT_TIMEOUT = 120


def test_hot_key_never_overlaps_across_containers(celery_setup):
    """20 tasks on one key from two containers (4 pool processes): they run one at a time, in
    both containers, and the fencing token grows with every run."""
    queue = celery_setup.worker.worker_queue
    runs = group(tasks.hold.s("sku-1", 0.1) for _ in range(20)).apply_async(queue=queue).get(timeout=RESULT_TIMEOUT)
    runs.sort(key=lambda r: r["start"])
    overlaps = [(a, b) for a, b in pairwise(runs) if b["start"] < a["end"]]
    assert overlaps == []
    tokens = [r["token"] for r in runs]
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    hosts = {r["host"] for r in runs}
    assert hosts == {container_host(w) for w in celery_setup.worker_cluster}, hosts


def epoch(when) -> float:
    """A result's ``date_done`` as a Unix time (Celery stores UTC, naive or aware)."""
    return (when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp()


def container_host(worker) -> str:
    """The worker container's hostname (what ``socket.gethostname()`` says inside it)."""
    return worker.container.attrs["Config"]["Hostname"]


def holders(celery_setup, celery_zookeeper, key: str) -> list[dict]:
    """The contenders holding ``key`` now, read from ZooKeeper by the test process."""
    client = KazooClient(hosts=celery_zookeeper.host_hosts)
    client.start(timeout=15)
    try:
        report = lock_report(client, load_settings(celery_setup.app.conf).root, key=key)
        found = []
        for path, rows in report.items():
            for row in rows:
                stat = client.exists(f"{path}/{row['node']}") if row["holder"] else None
                if stat is not None:  # its fencing token comes from the node's czxid
                    found.append({**row, "token": fencing_token(stat.czxid)})
    finally:
        client.stop()
        client.close()
    return found


def wait_held(celery_setup, celery_zookeeper, key: str, timeout: float = 60.0) -> dict:
    found = wait_until(lambda: holders(celery_setup, celery_zookeeper, key), timeout, interval=0.1,
                       what=f"a holder of {key!r}")
    return found[0]


def test_killed_worker_container_frees_the_lock_after_the_session_timeout(celery_setup, celery_zookeeper):
    """SIGKILL of the whole container holding the lock: the next task runs on the other
    container, after the kill, with a higher fencing token.  Usually nothing in the container
    can close the session, and the lock stays held until ZooKeeper expires it.  But the kernel
    kills a container's processes one after another: when the holding pool process dies
    first, its agent may still see it go and free its node at once (worker-loss release, as
    for a pool process killed alone), which is as safe, since the holder is dead."""
    queue = celery_setup.worker.worker_queue
    tasks.hold.s("kill-1", 120).apply_async(queue=queue)
    holder = wait_held(celery_setup, celery_zookeeper, "hot:kill-1")
    victim = next(w for w in celery_setup.worker_cluster if container_host(w) == holder["host"])
    survivor = next(w for w in celery_setup.worker_cluster if w is not victim)
    killed_at = time.time()
    victim.kill()
    nxt = tasks.hold.s("kill-1", 0.1).apply_async(queue=queue)
    run = nxt.get(timeout=RESULT_TIMEOUT)
    recovery = run["start"] - killed_at
    how = "at the session's expiry" if recovery > SESSION_TIMEOUT / 2 else "by its agent, before the container's end"
    print(f"killed container {holder['host']}: next task started {recovery:.2f}s later on {run['host']} (freed {how})")
    assert run["host"] == container_host(survivor)
    assert 0 < recovery < SESSION_TIMEOUT + 10
    assert run["token"] > holder["token"]


def test_paused_zookeeper_costs_the_lock_per_policy(celery_setup, celery_zookeeper):
    """ZooKeeper frozen past the session timeout under two running holders: the one with
    on_lock_lost="interrupt" gets LockLost inside its body at once, the one with "fail" runs
    its body to the end and is then reported FAILURE with LockLost.  Afterwards the key
    is usable again."""
    queue = celery_setup.worker.worker_queue
    failing = tasks.hold_fail_on_lost.s("p1", 8).apply_async(queue=queue)
    interrupted = tasks.hold_interrupt_on_lost.s("p2", 8).apply_async(queue=queue)
    wait_held(celery_setup, celery_zookeeper, "lost:p1")
    wait_held(celery_setup, celery_zookeeper, "lost:p2")
    paused_at = time.time()
    celery_zookeeper.pause()
    try:
        time.sleep(SESSION_TIMEOUT + 1.5)  # the fault under test: frozen past the session timeout
    finally:
        celery_zookeeper.unpause()
        unpaused_at = time.time()
    for result in (failing, interrupted):
        result.get(timeout=RESULT_TIMEOUT, propagate=False)
        assert result.state == "FAILURE", result.state
        assert isinstance(result.result, LockLost), repr(result.result)
    # "interrupt" stopped its body and ended while ZooKeeper was still frozen (the worker
    # declares the lock lost itself); "fail" let its body finish
    assert epoch(interrupted.date_done) < unpaused_at
    assert epoch(failing.date_done) - epoch(interrupted.date_done) > 1.5
    print(f"ZooKeeper paused {SESSION_TIMEOUT + 1.5:.1f}s: 'interrupt' ended {epoch(interrupted.date_done) - paused_at:.2f}s "
          f"after the pause, 'fail' {epoch(failing.date_done) - paused_at:.2f}s after (its body's end)")
    celery_zookeeper.wait_serving()
    again = tasks.hold_fail_on_lost.s("p1", 0.1).apply_async(queue=queue).get(timeout=RESULT_TIMEOUT)
    assert again["token"] > 0


def test_skip_policy_across_containers(celery_setup, celery_zookeeper):
    """A task on a key held in one container, sent to the other container with a 0.5 s
    lock timeout and on_lock_timeout="skip", ends without running (None); once the key is
    free the same task runs there."""
    queue = celery_setup.worker.worker_queue
    held = tasks.hold.s("skip-1", 4).apply_async(queue=queue)
    holder = wait_held(celery_setup, celery_zookeeper, "hot:skip-1")
    other = next(w for w in celery_setup.worker_cluster if container_host(w) != holder["host"])
    celery_setup.app.control.add_consumer("zklock-other", destination=[other.hostname()], reply=True)
    skipped = tasks.hold_or_skip.s("skip-1", 0.1).apply_async(queue="zklock-other")
    assert skipped.get(timeout=RESULT_TIMEOUT) is None  # skipped: SUCCESS, with None (a run returns its host)
    held.get(timeout=RESULT_TIMEOUT)
    ran = tasks.hold_or_skip.s("skip-1", 0.1).apply_async(queue="zklock-other").get(timeout=RESULT_TIMEOUT)
    assert ran["host"] == container_host(other)


def test_zookeeper_restart_between_tasks(celery_setup, celery_zookeeper):
    """ZooKeeper restarted between two tasks on one key (the node helper for failover tests):
    the workers reconnect by themselves and the next task locks with a higher token; the
    test process finds the server again even if Docker published another host port."""
    queue = celery_setup.worker.worker_queue
    before = tasks.hold.s("restart-1", 0.1).apply_async(queue=queue).get(timeout=RESULT_TIMEOUT)
    celery_zookeeper.restart()
    assert celery_zookeeper.mode() == "standalone"
    after = tasks.hold.s("restart-1", 0.1).apply_async(queue=queue).get(timeout=RESULT_TIMEOUT)
    assert after["token"] > before["token"]
    assert holders(celery_setup, celery_zookeeper, "hot:restart-1") == []
