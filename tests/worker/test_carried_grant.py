"""The grant that travels with its task (issue 39): a pool process starts on it without
waiting for its claim's answer, only while its proof is younger than the lease window.

Why these tests: the carried grant skips the claim-time state check for the starts the
lease covers, so each rule that keeps that safe is pinned here: the window read after the
claim is sent (a table, as ``cohort_rules``' are), the grant taken off the request before
the body runs, the agent's silence for a grant held as it said and its ``state`` for one it
does not hold, a plain claim after an aged one, and an agent that keeps an unclaimed carried
grant for its claim when the main process is gone.  Agent-level tests run a real agent on a
real ZooKeeper (as ``test_claim_timeout`` does); the last one runs real workers.
"""

from __future__ import annotations

import select
import time
import uuid

import pytest
from celery.app.task import Context

from celery_zklock.worker import agent_client
from celery_zklock.worker.agent_protocol import (
    CARRIED,
    Carry,
    Claim,
    Claimed,
    Connection,
    Hello,
    LockState,
    PeerRole,
    Release,
    Released,
    Verdict,
    Wait,
    as_wire,
)
from celery_zklock.worker.agent_requests import CARRY_GRACE
from celery_zklock.worker.cohort_rules import lease_window
from celery_zklock.worker.lease_clock import lease_clock
from support.workers import Worker
from tests.lockedapp import history
from tests.lockutil import children, overlapping
from tests.polling import holds_for, wait_until
from tests.worker.local_agent import answer

# ---------------------------------------------------------------------------- the rule
WINDOW = lease_window(10.0)  # 0.2 s: FRESH_MAX, a tenth of a 10 s session being longer

# (proof's age when read before the send, when read after it, the send went out) -> starts?
STARTS = [
    (0.0, 0.001, True, True),
    (WINDOW / 2, WINDOW / 2 + 0.01, True, True),
    (WINDOW - 0.01, WINDOW + 0.01, True, False),  # aged while it sent: waits for the answer
    (WINDOW + 0.01, WINDOW + 0.02, True, False),  # aged already: no carried claim at all
    (0.0, 0.001, False, False),  # the link is gone: no start on a grant nobody will hear of
    (-0.5, -0.5, True, False),  # a proof from the future (another clock): never trusted
]


@pytest.mark.parametrize("before, after, sent_ok, starts", STARTS)
def test_a_carried_grant_is_started_on_only_inside_the_lease_window(monkeypatch, before, after, sent_ok, starts):
    now = [1000.0 + before]
    sent = []

    def send(msg):
        sent.append(msg)
        now[0] = 1000.0 + after
        return sent_ok

    monkeypatch.setattr(agent_client, "lease_clock", lambda: now[0])
    carry = Carry(proof=1000.0, session_timeout=10.0, waited=0.0, tokens={"/k": 7})
    assert agent_client.starts_on_carried(send, "r1", carry) is starts
    assert sent == ([] if before >= WINDOW or before < 0 else [Claim("r1", carried=True)])


@pytest.mark.parametrize("carry", [{}, {"proof": "soon", "session_timeout": 10.0, "waited": None, "tokens": {}},
                                   {"proof": 1.0}, "a grant"])
def test_a_malformed_carried_grant_is_not_started_on(carry):
    request = Context({"id": "t1", "delivery_info": {CARRIED: carry}})
    assert agent_client.carried_grant(request) is None  # the claim's answer is waited for
    assert CARRIED not in request.delivery_info


def test_the_carried_grant_is_taken_off_the_request_before_the_body_runs():
    """Celery passes ``delivery_info`` on as a retry's publish options: once read, it is gone."""
    grant = Carry(proof=1.0, session_timeout=4.0, waited=0.0, tokens={})
    request = Context({"id": "t1", "delivery_info": {"routing_key": "celery", CARRIED: as_wire(grant)}})
    assert agent_client.carried_grant(request) == grant
    assert CARRIED not in request.delivery_info and request.delivery_info == {"routing_key": "celery"}
    assert agent_client.carried_grant(request) is None
    assert agent_client.carried_grant(Context({"id": "t2"})) is None  # no delivery_info (called directly)


# ---------------------------------------------------------------------------- the agent
def _main(agent) -> Connection:
    main = Connection.open(agent.path)
    main.send(Hello(PeerRole.MAIN))
    return main


def _carried_grant(agent, main: Connection, zk_client) -> tuple[str, Carry, str]:
    """Queue requests on one key and release each as soon as it is granted until a grant
    comes with a carry (a fresh node's first grant, or a local handoff, on a young proof):
    (its id, the carry, the key)."""
    key = f"/carried/{uuid.uuid4().hex[:8]}"
    zk_client.ensure_path("/carried")
    pool = Connection.open(agent.path)
    ids = [f"r{i}" for i in range(12)]
    for rid in ids:
        main.send(Wait(rid, (key,), identity=rid))
    for rid in ids:
        granted = answer(main, Verdict.GRANTED, rid)
        if granted.carry is not None:
            pool.close()
            return rid, granted.carry, key
        pool.send(Claim(rid))
        assert answer(pool, Claimed, rid).verdict is Verdict.GRANTED
        pool.send(Release(rid))
        assert answer(pool, Released, rid).proven is True
    raise AssertionError("no grant of 12 local handoffs came with a carry")


def test_a_fresh_nodes_first_grant_carries_the_create_as_its_proof(agent, zk_client):
    """A key nobody holds: the create that made our node proves it ours as of its send, as a
    write does, so the first grant travels with its task (on distinct keys, every task's
    grant is a first grant: issue 39's claim round trip per task).  The proof is the
    create's send, no later: taken before the answer came."""
    main = _main(agent)
    key = f"/carried/{uuid.uuid4().hex[:8]}"
    before = lease_clock()
    main.send(Wait("f1", (key,), identity="f1"))
    granted = answer(main, Verdict.GRANTED, "f1")
    answered = lease_clock()
    carry = granted.carry
    assert carry is not None, "a fresh node's first grant did not carry"
    assert before <= carry.proof < answered
    pool = Connection.open(agent.path)
    pool.send(Claim("f1", carried=True))
    assert _silent_for(pool, 0.3, "f1") == []  # held as the grant said: no answer
    pool.send(Release("f1"))
    assert answer(pool, Released, "f1").proven is True
    pool.close()
    main.close()


def _silent_for(conn: Connection, seconds: float, request_id: str) -> list:
    """What ``conn`` hears about ``request_id`` within ``seconds`` (pings aside)."""
    heard = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if select.select([conn.sock], [], [], left)[0]:
            messages = conn.receive()
            assert messages is not None, "the agent went away"
            heard += [m for m in messages if getattr(m, "id", None) == request_id]
    return heard


def test_a_carried_claim_of_a_grant_held_as_it_said_is_not_answered(agent, zk_client):
    main = _main(agent)
    rid, carry, key = _carried_grant(agent, main, zk_client)
    assert carry.tokens[key] > 0
    pool = Connection.open(agent.path)
    pool.send(Claim(rid, carried=True))
    assert _silent_for(pool, 0.5, rid) == []  # no "claimed": the round trip it saves
    assert any(w.id == rid for w in agent.claims.claimed)  # yet the lock is the pool's now
    pool.send(Release(rid))
    assert answer(pool, Released, rid).proven is True
    pool.close()
    main.close()


def test_a_carried_claim_the_agent_does_not_hold_is_told_lost(agent, zk_client):
    pool = Connection.open(agent.path)
    pool.send(Claim("never-granted-here", carried=True))
    state = answer(pool, LockState, "never-granted-here")
    assert state.held is False and state.lost is True and "no longer holds" in state.reason
    pool.close()


def test_a_plain_claim_after_an_aged_carried_one_is_answered_with_the_verdict(agent, zk_client):
    main = _main(agent)
    rid, carry, key = _carried_grant(agent, main, zk_client)
    pool = Connection.open(agent.path)
    pool.send(Claim(rid, carried=True))
    pool.send(Claim(rid))  # the window closed between its two reads
    reply = answer(pool, Claimed, rid)
    assert reply.verdict is Verdict.GRANTED and reply.held is True and reply.tokens == carry.tokens
    pool.send(Release(rid))
    assert answer(pool, Released, rid).proven is True
    pool.close()
    main.close()


def test_an_unclaimed_carried_grant_outlives_its_main_process_until_its_window_ends(agent, zk_client):
    """The main process may die right after handing the task to a pool process, which may
    then start on the grant: its node stays for the window and CARRY_GRACE, then goes, and
    the agent, with nothing left, stops."""
    main = _main(agent)
    rid, carry, key = _carried_grant(agent, main, zk_client)
    node = children(zk_client, key)
    assert len(node) == 1
    main.close()
    holds_for(lambda: children(zk_client, key) == node and not agent.stopped.is_set(), min(0.5, CARRY_GRACE / 2),
              what="the carried grant kept while its pool process could start on it")
    # [] once the key's container is swept too
    wait_until(lambda: not children(zk_client, key), WINDOW + CARRY_GRACE + 5, interval=0.05,
               what="the carried grant let go")
    assert agent.stopped.wait(5), "the agent did not stop once nothing was held"


def test_a_carried_grant_claimed_after_its_main_process_left_holds_to_its_release(agent, zk_client):
    main = _main(agent)
    rid, carry, key = _carried_grant(agent, main, zk_client)
    pool = Connection.open(agent.path)
    main.close()
    pool.send(Claim(rid, carried=True))
    time.sleep(CARRY_GRACE + WINDOW + 0.3)  # past the time an unclaimed one is let go
    assert len(zk_client.get_children(key)) == 1 and not agent.stopped.is_set()
    pool.send(Release(rid))
    assert answer(pool, Released, rid).proven is True
    pool.close()
    assert agent.stopped.wait(5)


# ---------------------------------------------------------------------------- real workers
def test_a_hot_key_runs_on_carried_grants_in_real_workers(mod, env):
    """Two workers x -c 3 with no handoff slots (every local handoff reaches a pool process
    with its task, none waits there early), 120 tasks of 10 ms on one key: each ran once,
    never two at once, tokens strictly increasing, and most started on a carried grant."""
    ws = [Worker({**env, "TEST_ZK_HANDOFF_SLOTS": "0"}, f"carry{i}", concurrency=3).start(mod.app) for i in (1, 2)]
    try:
        key = f"carry-{uuid.uuid4().hex[:6]}"
        results = [mod.hold.delay(key, 10, i) for i in range(120)]
        for r in results:
            r.get(timeout=120)
        rows = [r for r in history(mod, "hold") if r["key"] == key]
        assert sorted(r["tag"] for r in rows) == list(range(120))
        assert overlapping([(r["start"], r["end"]) for r in rows]) is None
        tokens = [r["token"] for r in sorted(rows, key=lambda r: r["start"])]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
        carried = sum(1 for r in rows if r["carried"])
        assert carried >= len(rows) // 2, f"only {carried} of {len(rows)} started on a carried grant"
    finally:
        for w in ws:
            w.stop()
