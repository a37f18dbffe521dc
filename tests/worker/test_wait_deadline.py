"""A request whose deadline passed is timed out, not left waiting with no deadline.

Why (review finding, bug 2): the agent arms one timer per request; when it fired while the
request could not give up yet (its key's fresh node had not answered: with
``lock_timeout=0`` that answer decides, "try once"; or it was reserved for a local handoff),
the timer was spent.  A multi-key request granted its first key then joined the next with
no deadline at all, and waited there, holding the first, for as long as another worker held
the next; a reserved request whose handoff's write failed went back to the queue with no
deadline either.  Against a real ZooKeeper: agent-level (the agent runs here, the main
process is a socket, tests/worker/test_deliveries.py), and cohort-level for the handoff
(the agent's event thread is the test, tests/worker/cohort_host.py).
"""

from __future__ import annotations

import time
import uuid

import pytest

from celery_zklock import FairLock
from celery_zklock.engine.session import LEASED
from celery_zklock.worker.agent_protocol import Connection, Finished, Hello, PeerRole, Verdict, Wait
from celery_zklock.worker.cohort import Cohort
from tests.lockutil import children
from tests.polling import wait_until
from tests.worker.cohort_host import TimesOutHost, waiter
from tests.worker.local_agent import answer, start_agent

#: How long the verdict may take (s): a lock_timeout of 0 is one try, a round trip or two.
WITHIN = 5.0


def _keys() -> tuple[str, str]:
    base = f"/overdue/{uuid.uuid4().hex[:8]}"
    return f"{base}-a", f"{base}-b"  # taken in this order (canonical: sorted)


def _main(agent) -> Connection:
    main = Connection.open(agent.path)
    main.send(Hello(PeerRole.MAIN))
    return main


def test_a_multi_key_wait_past_its_deadline_does_not_wait_on_its_next_key(agent, zk_client):
    zk_client.ensure_path("/overdue")
    a, b = _keys()
    other = FairLock(zk_client, b)  # another worker holds the second key
    assert other.acquire(timeout=10)
    try:
        main = _main(agent)
        main.send(Wait("w", (a, b), 1, timeout=0, identity="w"))
        started = time.monotonic()
        verdict = answer(main, Verdict.TIMEOUT, "w", WITHIN)
        assert verdict is not None, f"no timeout verdict within {WITHIN}s while {b} is held elsewhere"
        assert time.monotonic() - started < WITHIN
        wait_until(lambda: children(zk_client, a) == [], WITHIN,
                   what=lambda: f"{a} let go after the timeout (held by {children(zk_client, a)})")
        main.close()
    finally:
        other.release()


def test_a_multi_key_wait_with_no_time_to_wait_still_gets_free_keys(agent, zk_client):
    """The other half: ``lock_timeout=0`` is one try on each key (as MultiLock's in-process
    acquire), not a timeout for every request whose first key answered after its deadline."""
    zk_client.ensure_path("/overdue")
    a, b = _keys()
    main = _main(agent)
    main.send(Wait("free", (a, b), 1, timeout=0, identity="free"))
    assert answer(main, Verdict.GRANTED, "free", WITHIN), "both keys free, yet no grant"
    main.send(Finished(("free",), (1,)))  # nobody claims it: let go
    wait_until(lambda: children(zk_client, a) == children(zk_client, b) == [], WITHIN, what="both keys let go")
    main.close()


def test_a_reserved_wait_past_its_deadline_is_not_queued_again_when_the_handoff_fails(zk_client):
    """Its deadline passes while it is reserved for a local handoff (granted once the write
    answers); the write finds the node gone (deleted behind our back, and the key taken by
    another worker): it times out instead of queueing for a new node with no deadline."""
    zk_client.ensure_path("/overdue")
    path = f"/overdue/{uuid.uuid4().hex[:8]}"
    host = TimesOutHost(zk_client)
    cohort = Cohort(host, path, 1)
    first, second = waiter(cohort, "first"), waiter(cohort, "second")
    cohort.join(first)
    host.run(lambda: host.grants)
    [slot] = cohort.slots
    zk_client.delete(slot.node_path)  # our node goes (nobody runs under it yet: no watch tells)
    other = FairLock(zk_client, path)
    assert other.acquire(timeout=10)
    try:
        cohort.join(second)  # behind our holder: the node's first proof is sent (and fails)
        proof = cohort.release(first)  # no proof yet: `second` is reserved, granted on the write's reply
        assert proof is not LEASED and slot.holder is second and slot.handing_on
        assert cohort.expire(second) is False  # its deadline: reserved, it waits for that reply

        requeued = lambda: second in cohort.queue and cohort.slots and all(s.answered for s in cohort.slots)  # noqa: E731
        host.run(lambda: host.timed_out or host.grants[1:] or requeued(), timeout=WITHIN)
        assert host.timed_out == ["second"], "the reserved wait went back to the queue with no deadline"
        assert len(host.grants) == 1 and not cohort.queue
        wait_until(lambda: len(children(zk_client, path)) == 1, WITHIN,
                   what=lambda: f"only the other worker's node: {children(zk_client, path)}")
    finally:
        other.release()
    host.run(lambda: cohort.idle)


@pytest.mark.parametrize("timeout", [0.5, 0.0], ids=["timeout", "try-once"])
def test_a_wait_while_zookeeper_is_unreachable_ends_unavailable_at_its_deadline(zk_server, tmp_path, timeout):
    """Cut off from ZooKeeper, a request on a key the agent has no node for: its create
    waits for the connection, so no first answer will come to decide it.  Its deadline
    ends the wait (as ``FairLock`` gives up at its deadline when cut off), and the verdict is
    ``unavailable`` (``on_lock_unavailable`` decides), never ``timeout``: nothing says the key
    is busy (before: a try-once singleton sent during an outage was skipped as busy)."""
    from celery_zklock.config import ZkSettings
    from tests.tcpproxy import TcpProxy

    with TcpProxy.to(zk_server.hosts) as proxy:
        agent = start_agent(ZkSettings(hosts=proxy.hosts), str(tmp_path / "agent.sock"))
        try:
            main = _main(agent)
            proxy.hold()
            wait_until(lambda: not agent.client.connected, 5, what="the agent cut off")
            key = f"/overdue/{uuid.uuid4().hex[:8]}-cut"
            main.send(Wait("w", (key,), 1, timeout=timeout, identity="w"))
            reply = answer(main, Verdict.UNAVAILABLE, "w", WITHIN)
            assert reply is not None, "no 'unavailable' while ZooKeeper is unreachable"
            assert "unreachable" in reply.error, reply
        finally:
            proxy.release_held()
            agent.stopped.set()
