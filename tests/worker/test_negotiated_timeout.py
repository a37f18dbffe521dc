"""The lease follows the *negotiated* session timeout, not the requested one (issue 35, finding 6).

Why: ZooKeeper clamps a client's wish to [minSessionTimeout, maxSessionTimeout] (2 and 20
ticks by default); the lease (``cohort_rules.fresh``) is bounded by a tenth of the session
timeout, and one computed from the wish outlives a shorter session the server granted.
Against a real ZooKeeper configured with a ``maxSessionTimeout`` below the request.
"""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient

from celery_zklock.config import ZkSettings
from celery_zklock.engine import kazoo_compat
from celery_zklock.engine.session import LEASED, WRITTEN
from celery_zklock.worker import agent_client
from celery_zklock.worker.agent_protocol import ENV, Connection, Hello, PeerRole, Release, Verdict, Wait
from tests.worker.cohort_host import LeaseClock, held_with_a_young_proof
from tests.worker.local_agent import answer, start_agent


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
    (200 ms); a proof 45 ms old no longer lets a handoff skip the round trip."""
    clock = LeaseClock()
    host, cohort, second, third = held_with_a_young_proof(short_client, clock)
    assert host.settings.session_timeout == 10.0
    clock.now += 0.045
    proof = cohort.release(second)
    assert proof is not LEASED
    assert proof.get(timeout=10) == WRITTEN
    host.run(lambda: len(host.grants) == 3)
    cohort.release(third)
    host.run(lambda: cohort.idle)


@pytest.mark.parametrize(
    "requested, granted, grace, why",
    [
        (9.0, 0.6, 0.2, "the server granted less: a third of that"),
        (9.0, 30.0, 3.0, "granted more: the request still bounds it"),
        (9.0, None, 3.0, "an agent that does not say: a third of the request"),
    ],
)
def test_silence_grace(requested, granted, grace, why):
    assert agent_client.silence_grace(requested, granted) == pytest.approx(grace), why


def test_a_claimer_trusts_agent_silence_for_a_third_of_the_negotiated_session(short_session_server, tmp_path,
                                                                                monkeypatch):
    """A pool process stops trusting its lock after a third of the session timeout of agent
    silence (the agent frozen: its session may expire meanwhile).  Asked for 10 s, granted
    0.4 s: the claim says so, and the grace is 0.13 s, not 3.3 s."""
    agent = start_agent(ZkSettings(hosts=short_session_server.hosts, session_timeout=10.0),
                        str(tmp_path / "agent.sock"))
    try:
        main = Connection.open(agent.path)
        main.send(Hello(PeerRole.MAIN))
        main.send(Wait("r1", ("/negotiated/k",), identity="r1"))
        answer(main, Verdict.GRANTED, "r1")
        monkeypatch.setenv(ENV, agent.path)
        monkeypatch.setattr(agent_client, "_link", None)
        link, claimed = agent_client.claim("r1", 5.0)
        assert claimed.verdict is Verdict.GRANTED
        assert claimed.session_timeout == pytest.approx(0.4)
        assert agent_client.silence_grace(10.0, claimed.session_timeout) == pytest.approx(0.4 / 3)
        link.conn.send(Release("r1"))
        main.close()
    finally:
        agent.stopped.set()
