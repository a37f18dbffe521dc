"""The lease follows the *negotiated* session timeout, not the requested one (issue 35, finding 6).

Why: ZooKeeper clamps a client's wish to [minSessionTimeout, maxSessionTimeout] (2 and 20
ticks by default); the lease (``cohort_rules.fresh``) is bounded by a tenth of the session
timeout, and one computed from the wish outlives a shorter session the server granted.
Against a real ZooKeeper configured with a ``maxSessionTimeout`` below the request.
"""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient

from celery_zklock.engine import kazoo_compat
from celery_zklock.engine.session import LEASED, WRITTEN
from celery_zklock.testing_servers import ZooKeeperServer
from tests.worker.test_lease_clock import Clock, _held_with_a_young_proof


@pytest.fixture(scope="module")
def short_session_server():
    """A server that grants at most 400 ms sessions (tickTime 200: the least it may grant too)."""
    server = ZooKeeperServer(extra_config={"maxSessionTimeout": "400"}).start()
    yield server
    server.close()


@pytest.fixture
def short_client(short_session_server):
    client = KazooClient(hosts=short_session_server.hosts, timeout=10.0)  # asks for 10 s
    client.start(timeout=15)
    yield client
    client.stop()
    client.close()


def test_the_negotiated_session_timeout_is_read_not_the_requested_one(short_client):
    assert kazoo_compat.session_timeout(short_client) == pytest.approx(0.4)


def test_the_lease_follows_the_negotiated_session_timeout(short_client):
    """Asked for 10 s, granted 0.4 s: the lease is a tenth of 0.4 s (40 ms), not FRESH_MAX
    (50 ms); a proof 45 ms old no longer lets a handoff skip the round trip."""
    clock = Clock()
    host, cohort, second, third = _held_with_a_young_proof(short_client, clock)
    assert host.settings.session_timeout == 10.0
    clock.now += 0.045
    proof = cohort.release(second)
    assert proof is not LEASED
    assert proof.get(timeout=10) == WRITTEN
    host.run(lambda: len(host.grants) == 3)
    cohort.release(third)
    host.run(lambda: cohort.idle)
