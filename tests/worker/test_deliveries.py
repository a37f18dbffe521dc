"""A task id can reach the worker again while the agent still knows its first delivery.

Why: a body that retries with no countdown publishes its own task id again, and the worker
may read the new message just after the first delivery let go of its lock.  The main
process then tells the agent that the first delivery ended (``finished``), and if that
names only the task id, it ends the *second* delivery's wait: no verdict ever comes, and
the retry stays held aside for good.  Found by a review of Celery's worker paths; with real
workers the window is about a millisecond wide (a 150-task run did not hit it), so the
rule is shown here, agent-level, against a real ZooKeeper: the agent runs in this process,
the main and pool processes are sockets speaking its protocol.
"""

from __future__ import annotations

import uuid

from celery_zklock.worker.agent_protocol import (
    Claim,
    Claimed,
    Connection,
    Finished,
    Hello,
    PeerRole,
    Release,
    Released,
    Verdict,
    Wait,
)
from tests.worker.local_agent import answer

#: How long an answer the test waits for may take (s): a missing one fails the test.
WITHIN = 10.0


def _wait(main: Connection, request_id: str, seq: int, key: str) -> None:
    main.send(Wait(request_id, (key,), seq, identity=request_id))


def _run(pool: Connection, request_id: str) -> None:
    """The pool side of one delivery: claim its grant, release it with the proof."""
    pool.send(Claim(request_id))
    assert answer(pool, Claimed, request_id, WITHIN).verdict is Verdict.GRANTED
    pool.send(Release(request_id))
    assert answer(pool, Released, request_id, WITHIN).proven


def test_the_end_of_a_delivery_does_not_end_the_next_delivery_of_its_task_id(agent, zk_client):
    zk_client.ensure_path("/deliveries")
    key = f"/deliveries/{uuid.uuid4().hex[:8]}"
    main = Connection.open(agent.path)
    main.send(Hello(PeerRole.MAIN))
    pool = Connection.open(agent.path)
    pool.send(Hello(PeerRole.POOL, 1))

    _wait(main, "retried", 1, key)  # the first delivery: granted, run, released
    assert answer(main, Verdict.GRANTED, "retried", WITHIN)
    _run(pool, "retried")
    _wait(main, "holder", 2, key)
    assert answer(main, Verdict.GRANTED, "holder", WITHIN)
    _wait(main, "retried", 3, key)  # the retry: waits behind the holder
    main.send(Finished(("retried",), (1,)))  # the first delivery's end

    _run(pool, "holder")
    assert answer(main, Verdict.GRANTED, "retried", WITHIN), "the first delivery's end ended the retry's wait"


def test_a_finished_delivery_still_lets_go_of_a_grant_nobody_claimed(agent, zk_client):
    """The other half of the rule: ``finished`` naming the delivery the agent holds lets go."""
    zk_client.ensure_path("/deliveries")
    key = f"/deliveries/{uuid.uuid4().hex[:8]}"
    main = Connection.open(agent.path)
    main.send(Hello(PeerRole.MAIN))
    _wait(main, "dropped", 1, key)
    assert answer(main, Verdict.GRANTED, "dropped", WITHIN)
    main.send(Finished(("dropped",), (1,)))
    _wait(main, "next", 2, key)
    assert answer(main, Verdict.GRANTED, "next", WITHIN), "the unclaimed grant was not let go"
