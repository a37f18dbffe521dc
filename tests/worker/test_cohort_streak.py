"""The streak bound survives a failed read of the key's queue, against a real ZooKeeper.

Why (issue 35, finding 3): a node passes among our own tasks without bound until another
contender is seen queueing for the key, and the cohort learns that by reading the key's
children with a watch.  A read that failed was dropped, and no watch was left: the
contender that came next was never seen, and the streak ran to the node's token space (256
holds), with no time bound either, instead of ``zklock_cohort_handoffs``.  Here the read
fails for want of READ permission on the key's node (an ACL set for the moment of the read),
and a Curator-named contender queues once it is restored.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from types import SimpleNamespace

import pytest
from kazoo.security import OPEN_ACL_UNSAFE, make_acl

from celery_zklock.engine import znodes
from celery_zklock.worker.cohort import Cohort
from celery_zklock.worker.cohort_rules import FRESH_MAX
from tests.polling import wait_until
from tests.tcpproxy import TcpProxy
from tests.worker.cohort_host import Host, first_granted, waiter
from tests.zkclients import proxied_client


def _holding(cohort: Cohort) -> bool:
    return any(s.holder is not None for s in cohort.slots)


def _streak(cohort: Cohort, host: Host, waits: list) -> list[str]:
    """Let each holder go in turn while the node passes on: the nodes of the holds so far."""
    held = len(host.grants)
    while held < len(waits) and _holding(cohort):
        cohort.release(waits[held - 1])
        host.run(lambda held=held: len(host.grants) > held or not _holding(cohort))
        held = len(host.grants)
    return [node for _id, node, _token in host.grants]


def _first_holder(host, zk_client, handoffs: int, waiters: int) -> tuple[str, Cohort, list]:
    """A fresh key whose streak the count bounds (``handoffs``), ``waiters`` waits made and
    the first of them granted: the key's path, its cohort, the waits."""
    host.settings = dataclasses.replace(host.settings, cohort_handoffs=handoffs, cohort_hold=60.0)
    zk_client.ensure_path("/cohort-streak")
    path = f"/cohort-streak/{uuid.uuid4().hex[:8]}"
    cohort = Cohort(host, path, 1)
    waits = [waiter(cohort, f"w{i}") for i in range(waiters)]
    cohort.join(waits[0])
    host.run(lambda: host.grants)
    return path, cohort, waits


def test_a_failed_read_of_the_queue_keeps_the_streak_bounded(zk_client):
    host = Host(zk_client)
    path, cohort, waits = _first_holder(host, zk_client, handoffs=8, waiters=20)
    zk_client.set_acls(path, [make_acl("world", "anyone", create=True, delete=True, write=True, admin=True)])
    cohort.join(waits[1])  # the first waiter behind our holder: the cohort reads the key's queue, and fails
    [slot] = cohort.slots
    host.run(lambda: "_seen" in host.ran and slot.confirmed is not None)  # the read and the node's first proof answered
    zk_client.set_acls(path, OPEN_ACL_UNSAFE)
    foreign = zk_client.create(f"{path}/_c_{uuid.uuid4()}-lock-", ephemeral=True, sequence=True)
    for wait in waits[2:]:
        cohort.join(wait)

    nodes = _streak(cohort, host, waits)
    assert len(nodes) == 8 and set(nodes) == {nodes[0]}, (
        f"{len(nodes)} holds in a row on our node while {foreign} queued (bound: 8)")

    zk_client.delete(foreign)  # the contender's turn ends: our new node, queued behind it, holds
    host.run(lambda: len(host.grants) == 9)
    assert host.grants[8][1] != nodes[0] and host.grants[8][2] > host.grants[7][2]
    for wait in waits[9:]:
        cohort.leave(wait)
    cohort.release(waits[8]).get(timeout=10)
    host.run(lambda: cohort.idle)


def test_a_queue_change_seen_while_suspended_keeps_the_streak_bounded(zk_server, zk_client):
    """The key's queue changes (a contender queues) and the child watch fires; before the
    agent's thread reads the queue, the connection drops: the node is suspended, the read
    was skipped, and the used-up watch was never set again.  Here the cut is the proxy's."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        client = proxied_client(proxy)
        try:
            host = Host(client)
            host.settings = dataclasses.replace(host.settings, cohort_handoffs=4, cohort_hold=60.0)
            zk_client.ensure_path("/cohort-streak")
            path = f"/cohort-streak/{uuid.uuid4().hex[:8]}"
            cohort = Cohort(host, path, 1)
            waits = [waiter(cohort, f"w{i}") for i in range(10)]
            cohort.join(waits[0])
            host.run(lambda: host.grants)
            for wait in waits[1:]:
                cohort.join(wait)  # our holder has waiters behind it: the cohort watches the queue
            [slot] = cohort.slots
            # The queue's read (its watch set) and the node's first proof have answered.
            host.run(lambda: "_seen" in host.ran and slot.confirmed is not None)
            assert not slot.foreign

            foreign = zk_client.create(f"{path}/_c_{uuid.uuid4()}-lock-", ephemeral=True, sequence=True)
            wait_until(lambda: host.events, 5.0, what="the child watch to fire")
            proxy.hold()
            wait_until(lambda: not slot.held, 5.0, what="the node suspended")
            host.run(lambda: True)  # the agent's thread gets to the fired watch now
            proxy.release_held()
            wait_until(lambda: slot.held, 5.0, what="the node verified again")
            host.run(lambda: True)

            nodes = _streak(cohort, host, waits)
            assert len(nodes) == 4 and set(nodes) == {nodes[0]}, (
                f"{len(nodes)} holds in a row on our node while {foreign} queued (bound: 4)")
            zk_client.delete(foreign)
            host.run(lambda: len(host.grants) == 5)
            assert host.grants[4][1] != nodes[0]
            for wait in waits[5:]:
                cohort.leave(wait)
            cohort.release(waits[4]).get(timeout=10)
            host.run(lambda: cohort.idle)
        finally:
            client.stop()
            client.close()


class _Told(Host):
    """Host that records what the cohort says about its next in line."""

    def __init__(self, client) -> None:
        super().__init__(client)
        self.nexts: list = []  # (waiter id, ours, streak_left)

    def on_next(self, wait, ours=True, streak_left=None) -> None:
        self.nexts.append((wait.id, ours, streak_left))


def test_the_waiter_behind_the_streaks_last_holder_is_not_told_it_is_next(zk_client):
    """Issue 39: with another contender queued, the waiter behind the streak's last holder
    does not get the node at that release (it goes to the contender): the cohort says its
    streak has nothing left (0), so the agent does not call it next in line, and no pool
    process idles for it through the contender's whole turn.  Once its own node queues
    behind the contender, it is told next behind holders that are not ours."""
    host = _Told(zk_client)
    path, cohort, waits = _first_holder(host, zk_client, handoffs=3, waiters=5)
    foreign = zk_client.create(f"{path}/_c_{uuid.uuid4()}-lock-", ephemeral=True, sequence=True)
    for wait in waits[1:]:
        cohort.join(wait)
    host.run(lambda: cohort.slots[0].foreign)  # the cohort has read the queue: someone else waits
    del host.nexts[:]

    nodes = _streak(cohort, host, waits)
    assert len(nodes) == 3 and set(nodes) == {nodes[0]}
    told = {(i, ours): left for i, ours, left in host.nexts}
    assert told[("w2", True)] == pytest.approx(60.0, abs=1.0)  # behind the 2nd of 3 holds: the node passes on
    assert told[("w3", True)] == 0.0  # behind the 3rd: its release ends the streak
    host.run(lambda: ("w3", False) in {(i, ours) for i, ours, _ in host.nexts})  # next behind the contender
    zk_client.delete(foreign)
    host.run(lambda: len(host.grants) == 4)
    assert host.grants[3][0] == "w3" and host.grants[3][1] != nodes[0]
    cohort.leave(waits[4])
    cohort.release(waits[3]).get(timeout=10)
    host.run(lambda: cohort.idle)


def test_the_agent_withholds_next_when_the_holders_release_ends_the_streak():
    """The agent's side of the rule above: ``next`` goes to the main process only when the
    expected hold fits in what is left of the streak; behind another contender's holders it
    goes with ``ours`` false (the main process parks it only in an idle pool)."""
    from celery_zklock.worker.agent_requests import Requests, WaitRequest

    sent: list = []
    loop = SimpleNamespace(client=None, monitor=None, settings=None, post=None)
    requests = Requests(loop, claims=None, guards=None)
    requests.hold_by_path["/k"] = 0.03  # holds on the key last 30 ms

    def waiter(name: str) -> WaitRequest:
        return WaitRequest(id=name, task="t", paths=["/k"], max_holders=1, deadline=None, identity=b"",
                    owner=SimpleNamespace(send=sent.append), early=True)

    requests.on_next(waiter("ends"), True, 0.0)
    requests.on_next(waiter("too-short"), True, 0.02)
    assert sent == []
    requests.on_next(waiter("fits"), True, 0.2)
    requests.on_next(waiter("unbounded"), True, None)
    requests.on_next(waiter("theirs"), False)
    assert [(m.id, m.ours) for m in sent] == [("fits", True), ("unbounded", True), ("theirs", False)]


def test_a_handoff_decided_before_a_contender_was_seen_is_judged_again_at_its_proofs_answer(zk_client):
    """A handoff that waits for ZooKeeper (the proof aged out) is decided while no one else
    queues; another contender is seen before the proof answers (a partition held the reply
    back, say).  The streak bound is judged again at the answer: at its bound, the node goes
    and the reserved waiter queues for a new one, behind the contender."""
    host, cohort, (first, second), slot = first_granted(zk_client, "/cohort-streak", "first", "second")
    host.settings = dataclasses.replace(host.settings, cohort_handoffs=1, cohort_hold=60.0)
    cohort.join(second)  # one of ours behind the holder: the node's first proof, and a read of the queue
    host.run(lambda: slot.confirmed is not None and not slot.proving)
    assert not slot.foreign
    time.sleep(FRESH_MAX * 1.5)  # the proof aged out: the handoff waits for a new one
    cohort.release(first)  # decided now (one grant so far, nobody else queues): reserved for `second`
    assert slot.handing_on and slot.holder is second
    other = zk_client.create(f"{cohort.path}/{znodes.node_prefix(uuid.uuid4().hex)}", b"peer",
                             ephemeral=True, sequence=True)  # a contender queues behind our node
    deadline = time.monotonic() + 5
    while not slot.foreign:  # the queue's watch, then its read, run before the proof's answer
        assert time.monotonic() < deadline, "the contender was not seen"
        ready = [e for e in host.events if getattr(e[0], "__name__", "") != "_passed"]
        if ready:
            host.events.remove(ready[0])
            ready[0][0](*ready[0][1])
        else:
            time.sleep(0.001)  # the loop's idle turn
    host.run(lambda: not slot.handing_on)  # now the proof's answer
    assert [g[0] for g in host.grants] == ["first"], "the node passed on past the bound, with a contender seen"
    assert slot not in cohort.slots and second in cohort.queue, "the reserved waiter lost its place"
    zk_client.delete(other)
    host.run(lambda: len(host.grants) == 2)
    assert host.grants[1][1] != host.grants[0][1]
    cohort.release(second).get(timeout=10)
    host.run(lambda: cohort.idle)
