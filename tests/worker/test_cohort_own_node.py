"""A holder's watch on its own node outlives the cohort's writes to it, against a real ZooKeeper.

Why (issue 35, finding 1): a ZooKeeper data watch is one-shot and fires on ``setData`` as
well as on a delete.  A local handoff writes to the node (the lease), which used the
holder's watch up; the watch was never set again, so an operator's force-delete of the
node under the next holder went unseen until its release.  The agent's event thread is
this test (see :mod:`tests.worker.test_cohort_replies`).
"""

from __future__ import annotations

import time
import uuid

from tests.worker.test_cohort_replies import Host, _wait

from celery_zklock.engine.attempt.holding import OWN_WATCH_WITHIN
from celery_zklock.engine.session import LEASED
from celery_zklock.testing_probes import four_letter_word
from celery_zklock.worker.cohort import Cohort


def test_a_node_deleted_after_a_local_handoff_is_lost_to_its_new_holder(zk_client):
    host = Host(zk_client)
    zk_client.ensure_path("/cohort-own-node")
    cohort = Cohort(host, f"/cohort-own-node/{uuid.uuid4().hex[:8]}", 1)
    first, second, third = (_wait(cohort, name) for name in ("first", "second", "third"))

    cohort.join(first)
    host.run(lambda: host.grants)
    cohort.slots[0].attempt.hold.running()  # claimed (Claims.send_verdict): the node is watched
    time.sleep(OWN_WATCH_WITHIN * 5)  # the holder's watch on its node is set by now
    cohort.join(second)  # one of ours queues behind the holder: the node's first proof is written
    [slot] = cohort.slots
    host.run(lambda: slot.confirmed is not None)  # that write has fired the watch
    assert cohort.release(first) is LEASED  # passed on the young proof, without another write
    host.run(lambda: len(host.grants) == 2)
    assert slot.holder is second and slot.held

    for _ in range(3):  # and every later write (the lease's renewals) fires it again
        zk_client.set(slot.node_path, b"renewed")
    time.sleep(0.1)
    zk_client.delete(slot.node_path)  # `celery zklock release KEY --node N --yes`
    host.run(lambda: second.lost, timeout=2.0)

    cohort.join(third)
    assert cohort.release(second) == "lost"
    host.run(lambda: len(host.grants) == 3)
    assert host.grants[2][1] != host.grants[1][1] and host.grants[2][2] > host.grants[1][2]
    cohort.release(third).get(timeout=10)
    host.run(lambda: cohort.idle)


def _own_watches(zk_server, path: str) -> int:
    """Sessions watching ``path``, as the server lists them (``wchp``: path, then its sessions)."""
    sessions, current = {}, None
    for line in four_letter_word("127.0.0.1", zk_server.client_port, "wchp").splitlines():
        if line.startswith("/"):
            current = sessions.setdefault(line, [])
        elif line.strip() and current is not None:
            current.append(line.strip())
    return len(sessions.get(path, ()))


def test_a_granted_node_is_watched_only_once_a_task_runs_under_it(zk_client, zk_server):
    """The agent grants ahead of a free pool process; a hold that only waits in the worker's
    queue costs no GetData (issue 39).  Claimed, it is watched within OWN_WATCH_WITHIN."""
    host = Host(zk_client)
    zk_client.ensure_path("/cohort-own-node")
    cohort = Cohort(host, f"/cohort-own-node/{uuid.uuid4().hex[:8]}", 1)
    first = _wait(cohort, "first")
    cohort.join(first)
    host.run(lambda: host.grants)
    [slot] = cohort.slots
    time.sleep(OWN_WATCH_WITHIN * 5)
    assert _own_watches(zk_server, slot.node_path) == 0  # granted, nobody runs: no watch
    slot.attempt.hold.running()
    slot.attempt.hold.running()  # a second claim through the node arms nothing more
    deadline = time.time() + 2
    while _own_watches(zk_server, slot.node_path) == 0 and time.time() < deadline:
        time.sleep(0.01)
    assert _own_watches(zk_server, slot.node_path) == 1
    zk_client.delete(slot.node_path)
    host.run(lambda: first.lost, timeout=2.0)
