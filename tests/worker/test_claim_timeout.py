"""A claim answered after the pool process stopped waiting for it (issue 35, finding 4).

Why: a pool process waits ``_CLAIM_TIMEOUT`` for the agent's verdict, then locks in process.
When a busy agent answered later, it handed the grant to a claimer that had gone on
without it, and nothing let it go: the pool process queued in process behind the agent's
node for its own request, and ``finished`` does not release a claimed request.  The key
stayed blocked for every worker until that pool process exited.

Agent-level, against a real ZooKeeper: the agent runs here (its socket, event thread and
heartbeat), the main process is a socket, and the pool side is the production
:func:`celery_zklock.worker.agent_client.claim`; the agent is made busy for longer than the
claim's timeout by an event that sleeps on its event thread.
"""

from __future__ import annotations

import time
import uuid

from celery_zklock import FairLock
from celery_zklock.worker import agent_client
from celery_zklock.worker.agent_protocol import ENV, Connection, Finished, Hello, PeerRole, Verdict, Wait
from tests.polling import wait_until
from tests.worker.local_agent import answer


def test_a_late_claim_reply_does_not_leave_the_key_blocked(agent, zk_client, monkeypatch):
    key = f"/late-claim/{uuid.uuid4().hex[:8]}"
    zk_client.ensure_path("/late-claim")
    main = Connection.open(agent.path)
    main.send(Hello(PeerRole.MAIN))
    main.send(Wait("r1", (key,), identity="r1"))
    answer(main, Verdict.GRANTED, "r1")

    agent.post(time.sleep, 1.5)  # a busy agent: the claim is answered after its timeout
    monkeypatch.setenv(ENV, agent.path)
    monkeypatch.setattr(agent_client, "_link", None)
    assert agent_client.claim("r1", 0.5) is None  # the pool process goes on to lock in process

    mine = FairLock(zk_client, key)  # as the pool process's in-process lock does
    started = time.monotonic()
    assert mine.acquire(timeout=5), "the key stayed blocked by the abandoned claim"
    assert time.monotonic() - started < 3
    mine.release()

    main.send(Finished(("r1",)))
    other = FairLock(zk_client, key)  # and any other worker gets it too
    assert other.acquire(timeout=5)
    other.release()
    wait_until(lambda: "r1" not in agent.requests.waits and not agent.requests.cohorts, 5,
               what="the agent to forget the abandoned request")
    main.close()
