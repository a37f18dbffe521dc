"""A cohort's ZooKeeper replies, each acted on once, against a real ZooKeeper.

Why: kazoo's ``rawlink`` on a result that is already set dispatches every callback linked
before, not only the new one.  The agent links the local handoff's write three times (the
cohort's bookkeeping, the reserved waiter's grant, the release's answer); when the write's
reply came in between, the grant ran twice, and the second run found the node free and
deleted it (or passed it on) under the holder it had just granted.  It surfaced once in
2,000 tasks under pool-process churn (``tests/faults``), as a task failing ``LockLost`` at
release.  Here the race is made certain: the agent's event thread is this test, which runs
the posted callbacks only after the reply is in.
"""

from __future__ import annotations

import uuid

from celery_zklock.engine import kazoo_compat
from celery_zklock.engine.session import DELETED, WRITTEN
from celery_zklock.worker.cohort import Cohort
from tests.polling import holds_for, wait_until
from tests.worker.cohort_host import Host, waiter


def test_a_handoff_whose_reply_beats_a_later_link_grants_once_and_keeps_the_node(zk_client):
    host = Host(zk_client)
    path = f"/cohort-replies/{uuid.uuid4().hex[:8]}"
    zk_client.ensure_path("/cohort-replies")
    cohort = Cohort(host, path, 1)
    first, second = waiter(cohort, "first"), waiter(cohort, "second")

    cohort.join(first)
    host.run(lambda: host.grants)
    cohort.join(second)  # waits locally, behind our own node; the node's first proof is sent
    # Its reply is not run yet (the host runs posted callbacks only in run()): the handoff
    # must wait for that write.  (CI: running them here let a quick reply make it a lease.)
    [slot] = cohort.slots
    assert slot.confirmed is None and slot.proving

    proof = cohort.release(first)  # passes the node to `second` once the write answers
    assert proof.get(timeout=10) == WRITTEN
    answered = []
    kazoo_compat.on_ready(proof, lambda result: host.post(answered.append, result.get()))  # the release's answer
    host.run(lambda: answered and len(host.grants) == 2)

    assert answered == [WRITTEN]
    assert [g[0] for g in host.grants] == ["first", "second"]
    assert host.grants[1][1] == host.grants[0][1] and host.grants[1][2] > host.grants[0][2]
    assert cohort.slots == [slot] and slot.holder is second and slot.held and not second.lost
    assert slot.proving == 0 and slot.confirmed is not None  # the write counted once
    assert zk_client.exists(slot.node_path) is not None, "the node was deleted under its new holder"

    assert cohort.release(second).get(timeout=10) == DELETED
    host.run(lambda: cohort.idle)
    assert zk_client.exists(slot.node_path) is None


def test_on_ready_runs_each_callback_once_however_late_it_is_linked(zk_client):
    """kazoo alone re-runs earlier callbacks when one is linked to a ready result."""
    zk_client.ensure_path("/cohort-replies")
    calls: list[str] = []
    raw = zk_client.exists_async("/cohort-replies")
    raw.get(timeout=10)
    raw.rawlink(lambda r: calls.append("raw-a"))
    raw.rawlink(lambda r: calls.append("raw-b"))
    ours = zk_client.exists_async("/cohort-replies")
    ours.get(timeout=10)
    for name in ("a", "b", "c"):
        kazoo_compat.on_ready(ours, lambda r, name=name: calls.append(name))
    wait_until(lambda: len(calls) >= 6, 5, interval=0.01, what="the six callbacks")
    holds_for(lambda: len(calls) == 6, 0.1, what="no callback run again")
    assert sorted(c for c in calls if c.startswith("raw")) == ["raw-a", "raw-a", "raw-b"]  # the quirk itself
    assert [c for c in calls if not c.startswith("raw")] == ["a", "b", "c"]
