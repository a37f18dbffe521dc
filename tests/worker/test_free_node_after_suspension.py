"""A node granted to us during a disconnection, whose waiter then left, is let go once verified.

Why (review finding, bug 1): a request with ``lock_timeout=0`` joined a key the agent had no
node for; the create's reply was read, then the connection dropped, so the node was taken
suspended (HELD_SUSPENDED) and not granted.  The request then timed out ("try once": the
first answer decided), and the cohort kept the suspended node for a waiter to come.  Verified
again within the grace, the node became held and nobody was told: the agent's heartbeat
pumped only keys with local waiters, so the node held the key for every worker until another
request for it reached this agent.  Here, against a real ZooKeeper, the cut is the proxy's and
the agent's event thread is the test (:class:`tests.worker.cohort_host.Host`).
"""

from __future__ import annotations

import uuid
from types import SimpleNamespace

from celery_zklock import FairLock
from celery_zklock.engine.internals import State
from celery_zklock.worker.agent_requests import Requests
from celery_zklock.worker.cohort import Cohort
from tests.lockutil import children
from tests.polling import wait_until
from tests.tcpproxy import OP_CREATE, OP_CREATE2, OP_MULTI, TcpProxy
from tests.worker.cohort_host import Host, TimesOutHost, waiter
from tests.zkclients import proxied_client


def _tick(host: Host, cohort: Cohort) -> None:
    """What the agent's heartbeat does to its keys (:meth:`Requests.tidy_all`)."""
    loop = SimpleNamespace(client=host.client, monitor=None, settings=host.settings, post=host.post)
    requests = Requests(loop, claims=None, guards=None)
    requests.cohorts[cohort.key] = cohort
    requests.tidy_all()


def test_a_node_verified_after_its_waiter_left_is_let_go(zk_server, zk_client):
    zk_client.ensure_path("/free-node")
    path = f"/free-node/{uuid.uuid4().hex[:8]}"
    with TcpProxy.to(zk_server.hosts) as proxy:
        client = proxied_client(proxy)
        try:
            # A first lock through the client shows it the server knows containers: a new key's
            # node is then made in one multi with its container, and holds at once (a node made
            # beside a container not yet proven waits for a read of the queue instead).
            warm = FairLock(client, f"{path}-warm")
            assert warm.acquire(timeout=5)
            warm.release()
            host = TimesOutHost(client)
            cohort = Cohort(host, path, 1)
            wait = waiter(cohort, "w")
            # The create's reply reaches kazoo, then the connection drops (and stays down).
            cut = proxy.arm_cut(opcodes=(OP_CREATE, OP_CREATE2, OP_MULTI), deliver_reply=True, then_hold=True)
            cohort.join(wait)
            assert cut.fired.wait(5), "the create was not sent"
            [slot] = cohort.slots
            wait_until(lambda: slot.attempt.state is State.HELD_SUSPENDED, 5.0,
                       what=lambda: f"the node held suspended (is {slot.attempt.state})")

            assert cohort.expire(wait) is False  # lock_timeout 0: the node's first answer decides
            host.run(lambda: host.timed_out)  # it came suspended: no grant, the request times out
            assert host.timed_out == ["w"] and not host.grants
            assert not cohort.queue

            proxy.release_held()
            wait_until(lambda: slot.attempt.state is State.HELD, 5.0, what="the node verified again")
            host.run(lambda: True)
            _tick(host, cohort)
            host.run(lambda: True)

            wait_until(lambda: children(zk_client, path) == [], 5.0,
                       what=lambda: f"our node {children(zk_client, path)}, held with nobody to grant, let go")
            host.run(lambda: cohort.idle)
        finally:
            client.stop()
            client.close()
