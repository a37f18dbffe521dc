"""A holder's watch on its own node outlives writes to it, against a real ZooKeeper.

Why (issue 35, finding 1): a ZooKeeper data watch is one-shot and fires on ``setData`` as
well as on a delete.  A local handoff wrote to the node (the lease's renewal, a check since
issue 39), which used the holder's watch up; the watch was never set again, so an
operator's force-delete of the node under the next holder went unseen until its release.
The agent's event thread is this test (see :mod:`tests.worker.cohort_host`).
"""

from __future__ import annotations

import time

from celery_zklock.engine.attempt import OWN_WATCH_WITHIN
from celery_zklock.engine.session import LEASED
from celery_zklock.testing_probes import four_letter_word
from celery_zklock.worker.cohort_rules import FRESH_MAX, RENEW_AFTER
from tests.lockutil import watching
from tests.polling import holds_for, wait_until
from tests.worker.cohort_host import first_granted


def test_a_node_deleted_after_a_local_handoff_is_lost_to_its_new_holder(zk_client):
    host, cohort, (first, second, third), _ = first_granted(zk_client, "/cohort-own-node", "first", "second", "third")
    cohort.slots[0].attempt.hold.running()  # claimed (Claims.send_verdict): the node is watched
    wait_until(lambda: watching(zk_client, cohort.slots[0].node_path), 5, what="the holder's watch on its node")
    cohort.join(second)  # one of ours queues behind the holder: the node's first proof (a check)
    [slot] = cohort.slots
    host.run(lambda: slot.confirmed is not None)
    assert cohort.release(first) is LEASED  # passed on the young proof, without another write
    host.run(lambda: len(host.grants) == 2)
    assert slot.holder is second and slot.held

    for _ in range(3):  # writes by someone else (until issue 39, the lease's renewals) fire it
        zk_client.set(slot.node_path, b"renewed")
    # ZooKeeper tells a session of a change before it answers the session's read of it: the
    # watch fired by the last write has been used up by now, and is set again.
    wait_until(lambda: watching(zk_client, slot.node_path), 5, what="the holder's watch set again")
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
    host, cohort, (first,), slot = first_granted(zk_client, "/cohort-own-node", "first")
    holds_for(lambda: _own_watches(zk_server, slot.node_path) == 0, OWN_WATCH_WITHIN * 5,
              what="no watch: granted, nobody runs under it")
    slot.attempt.hold.running()
    slot.attempt.hold.running()  # a second claim through the node arms nothing more
    wait_until(lambda: _own_watches(zk_server, slot.node_path), 2, interval=0.01, what="the claimed node watched")
    assert _own_watches(zk_server, slot.node_path) == 1
    zk_client.delete(slot.node_path)
    host.run(lambda: first.lost, timeout=2.0)


def test_a_streaks_proofs_wake_no_watcher_and_leave_the_node_as_it_was(zk_client):
    """A lease's renewals check the node instead of writing the next holder's name into it.
    Why (issue 39): each write was a data-change event for every contender watching the node
    (another worker's agent, a kazoo or Curator peer) and for the holder's own watch, each of
    which then read the node again: on the flash sale, 950 reads and 914 events per 3,000
    orders beside 385 writes."""
    host, cohort, waits, slot = first_granted(zk_client, "/cohort-own-node", *(f"t{i}" for i in range(4)))
    woken: list = []
    zk_client.get(slot.node_path, watch=woken.append)  # a peer's watch on the holder's node
    proofs = []
    for i in range(1, 4):
        cohort.join(waits[i])  # one of ours queues behind the holder: a proof (or a renewal)
        host.run(lambda: slot.confirmed is not None and not slot.proving)
        proofs.append(slot.confirmed)
        time.sleep(RENEW_AFTER * 1.5)  # the proof is old enough to be renewed at the handoff
        assert cohort.release(waits[i - 1]) is LEASED
        host.run(lambda i=i: len(host.grants) == i + 1 and not slot.proving)
    host.run(lambda: slot.confirmed > proofs[-1])  # the last handoff renewed the lease too
    assert len(set(proofs)) == 3, proofs  # every handoff but the first found a proof to renew
    data, stat = zk_client.get(slot.node_path)
    assert stat.version == 0 and data == b"t0", (stat.version, data)  # named for its first holder
    assert woken == [], woken
    cohort.release(waits[3]).get(timeout=10)
    host.run(lambda: cohort.idle)


def test_a_proof_of_a_node_deleted_before_its_watch_is_set_reports_it_lost(zk_client):
    """A node granted ahead of a pool process is watched only once a task runs under it; an
    operator's delete in that window is seen by the node's next proof, whose failed check
    tells the holder, and nothing is passed on locally from that node."""
    host, cohort, (first, second), slot = first_granted(zk_client, "/cohort-own-node", "first", "second")
    assert slot.confirmed is None and not slot.proving
    zk_client.delete(slot.node_path)  # `celery zklock release KEY --node N --yes`, before any watch
    cohort.join(second)  # one of ours queues behind the holder: the node's first proof is sent
    host.run(lambda: first.lost, timeout=5.0)
    assert slot.confirmed is None, "a check of a deleted node was taken as a proof"
    assert cohort.release(first) == "lost"
    host.run(lambda: len(host.grants) == 2)
    assert host.grants[1][1] != host.grants[0][1], "the deleted node was handed on"
    cohort.release(second).get(timeout=10)
    host.run(lambda: cohort.idle)


def test_a_handoff_that_waits_for_zookeeper_names_its_next_holder(zk_client):
    """A handoff whose proof has aged out (a hold longer than the lease) waits for ZooKeeper
    anyway: it writes the next holder's name, so `celery zklock status` names a long hold
    right (a lease's quick handoffs only check the node)."""
    host, cohort, (first, second), slot = first_granted(zk_client, "/cohort-own-node", "first", "second")
    cohort.join(second)
    host.run(lambda: slot.confirmed is not None and not slot.proving)
    time.sleep(FRESH_MAX * 1.5)  # the first holder held longer than the lease
    proof = cohort.release(first)
    assert proof is not LEASED
    host.run(lambda: len(host.grants) == 2)
    assert zk_client.get(slot.node_path)[0] == b"second"
    cohort.release(second).get(timeout=10)
    host.run(lambda: cohort.idle)
