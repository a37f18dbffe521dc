"""The agent's protocol: every message crosses the wire and reads back as itself, decisions
travel as enums whose values are the stable encoding, and a line that is no message is refused."""

import json
import types

import pytest

from celery_zklock.config import ZkSettings
from celery_zklock.decision import Outcome, claimed_lock
from celery_zklock.engine.attempt import Pending
from celery_zklock.engine.session import PROOFS, ReleaseOutcome
from celery_zklock.engine.tick_fence import Fenced
from celery_zklock.worker import agent_client, agent_protocol
from celery_zklock.worker.agent_protocol import (
    Bypass,
    Cancel,
    Carry,
    Claim,
    ClaimAnswer,
    Claimed,
    Decided,
    Dropped,
    Fence,
    FenceAnswer,
    Finished,
    Hello,
    LineReader,
    LockState,
    Next,
    PeerRole,
    Ping,
    ProtocolError,
    Queued,
    Release,
    Released,
    StopWaiting,
    Unclaim,
    Unguard,
    Verdict,
    Wait,
    as_wire,
    decode,
    encode,
    from_wire,
)

CARRY = Carry(proof=12.5, session_timeout=10.0, waited=0.25, tokens={"/a": 7 << 8 | 1, "/b": 9 << 8})

#: (a message, its wire line as an object): every op, with its optional fields at defaults and not.
MESSAGES = [
    (Hello(PeerRole.MAIN, 42), {"op": "hello", "role": "main", "pid": 42}),
    (Hello(PeerRole.POOL), {"op": "hello", "role": "pool"}),
    (Ping(), {"op": "ping"}),
    (Wait("r1", ("/a",)), {"op": "wait", "id": "r1", "paths": ["/a"]}),
    (Wait("r1", ("/a", "/b"), seq=3, task="t", max_holders=2, timeout=1.5, identity="i", early=True,
          guard={"paths": ["/g"], "until": "start"}, watched=False, read=("/b",), readers=4),
     {"op": "wait", "id": "r1", "paths": ["/a", "/b"], "seq": 3, "task": "t", "max_holders": 2, "timeout": 1.5,
      "identity": "i", "early": True, "guard": {"paths": ["/g"], "until": "start"}, "watched": False,
      "read": ["/b"], "readers": 4}),
    (Wait("r1", ("/a",), timeout=0), {"op": "wait", "id": "r1", "paths": ["/a"], "timeout": 0}),
    (StopWaiting("r1", Cancel.REVOKED), {"op": "cancel", "id": "r1", "why": "revoked"}),
    (StopWaiting("r1", Cancel.SHUTDOWN, in_pool=True), {"op": "cancel", "id": "r1", "why": "shutdown", "in_pool": True}),
    (Finished(("r1", "r2"), (1, 2)), {"op": "finished", "ids": ["r1", "r2"], "seqs": [1, 2]}),
    (Finished(("r1",)), {"op": "finished", "ids": ["r1"]}),
    (Dropped(("r1",), (None,)), {"op": "dropped", "ids": ["r1"], "seqs": [None]}),
    (Fence("t#1", "/beat/e", 5, 77), {"op": "fence", "id": "t#1", "path": "/beat/e", "seq": 5, "token": 77}),
    (Fence("t#1", "/beat/e", 5), {"op": "fence", "id": "t#1", "path": "/beat/e", "seq": 5}),
    (Unguard("r1", ("/g",), 2), {"op": "unguard", "id": "r1", "paths": ["/g"], "retries": 2}),
    (Decided("r1", Verdict.GRANTED, seq=3, queued=True, carry=CARRY),
     {"op": "decided", "id": "r1", "verdict": "granted", "seq": 3, "queued": True,
      "carry": {"proof": 12.5, "session_timeout": 10.0, "waited": 0.25, "tokens": {"/a": 7 << 8 | 1, "/b": 9 << 8}}}),
    (Decided("r1", Verdict.UNAVAILABLE, error="cut off"), {"op": "decided", "id": "r1", "verdict": "unavailable",
                                                           "error": "cut off"}),
    (Decided("r1", Verdict.REVOKED, seq=1), {"op": "decided", "id": "r1", "verdict": "revoked", "seq": 1}),
    (Queued("r1", 4, seq=2), {"op": "queued", "id": "r1", "position": 4, "seq": 2}),
    (Next("r1", 2, hold=0.01, ours=False), {"op": "next", "id": "r1", "seq": 2, "hold": 0.01, "ours": False}),
    (Next("r1"), {"op": "next", "id": "r1"}),
    (Bypass("r1", 5), {"op": "bypass", "id": "r1", "seq": 5}),
    (FenceAnswer("t#1", Fenced.DUPLICATE), {"op": "fenced", "id": "t#1", "verdict": "duplicate"}),
    (FenceAnswer("t#1", error="ConnectionLoss()"), {"op": "fenced", "id": "t#1", "error": "ConnectionLoss()"}),
    (Claim("r1"), {"op": "claim", "id": "r1"}),
    (Claim("r1", carried=True), {"op": "claim", "id": "r1", "carried": True}),
    (Unclaim("r1"), {"op": "unclaim", "id": "r1"}),
    (Release("r1"), {"op": "release", "id": "r1"}),
    (Claimed("r1", ClaimAnswer.PENDING), {"op": "claimed", "id": "r1", "verdict": "pending"}),
    (Claimed("r1", Verdict.TIMEOUT, waited=2.0, holders=["w2"]),
     {"op": "claimed", "id": "r1", "verdict": "timeout", "waited": 2.0, "holders": ["w2"]}),
    (Claimed("r1", Verdict.GRANTED, waited=0.5, tokens={"/a": 3}, nodes={"/a": "/a/n-0001"}, held=True,
             session_timeout=4.0),
     {"op": "claimed", "id": "r1", "verdict": "granted", "waited": 0.5, "tokens": {"/a": 3}, "nodes": {"/a": "/a/n-0001"},
      "held": True, "session_timeout": 4.0}),
    (LockState("r1", held=False, lost=True, reason="session expired"),
     {"op": "state", "id": "r1", "held": False, "lost": True, "reason": "session expired"}),
    (LockState("r1", held=True), {"op": "state", "id": "r1", "held": True}),
    (Released("r1", proven=True), {"op": "released", "id": "r1", "proven": True}),
    (Released("r1", proven=False, reason="not held"), {"op": "released", "id": "r1", "proven": False, "reason": "not held"}),
]


def test_every_message_is_in_the_table():
    assert {type(m).op for m, _ in MESSAGES} == set(agent_protocol._BY_OP)


@pytest.mark.parametrize("message, wire", MESSAGES, ids=[f"{type(m).__name__}-{i}" for i, (m, _) in enumerate(MESSAGES)])
def test_a_message_crosses_the_wire_and_reads_back_as_itself(message, wire):
    line = encode(message)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == wire  # a field at its default is left out
    assert decode(line) == message
    [read] = LineReader().feed(line)
    assert read == message and type(read) is type(message)


def test_decisions_read_back_as_their_enums():
    decided = decode(encode(Decided("r1", Verdict.GRANTED)))
    assert decided.verdict is Verdict.GRANTED
    assert decode(encode(Claimed("r1", ClaimAnswer.UNKNOWN))).verdict is ClaimAnswer.UNKNOWN
    assert decode(encode(StopWaiting("r1", Cancel.REVOKED))).why is Cancel.REVOKED
    assert decode(encode(FenceAnswer("t", Fenced.STALE))).verdict is Fenced.STALE
    assert decode(b'{"op":"wait","id":"r","paths":["/a"]}').paths == ("/a",)  # a tuple, as declared


def test_the_encodings_are_the_values_three_processes_agree_on():
    assert {v.value for v in Verdict} == {"granted", "timeout", "unavailable", "revoked", "shutdown"}
    assert {c.value for c in ClaimAnswer} == {"pending", "unknown"}
    assert {c.value for c in Cancel} == {"revoked", "shutdown", "finished"}
    assert [k.value for k in Pending] == ["create", "ghost", "read", "cleanup"]
    assert ReleaseOutcome.EXPIRED == "expired" and set(PROOFS) == {ReleaseOutcome.DELETED, ReleaseOutcome.WRITTEN, ReleaseOutcome.LEASED}


@pytest.mark.parametrize(
    "line, says",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"id": "r1"}', "unknown op None"),
        (b'{"op": "granted", "id": "r1"}', "unknown op 'granted'"),  # a verdict is no op
        (b'{"op": 7}', "unknown op 7"),
        (b'{"op": "wait", "paths": ["/a"]}', "Wait: field 'id' missing"),
        (b'{"op": "wait", "id": 1, "paths": ["/a"]}', "Wait: field 'id'"),
        (b'{"op": "wait", "id": "r1", "paths": "/a"}', "Wait: field 'paths'"),
        (b'{"op": "wait", "id": "r1", "paths": [1]}', "Wait: field 'paths'"),
        (b'{"op": "wait", "id": "r1", "paths": ["/a"], "early": 1}', "Wait: field 'early'"),
        (b'{"op": "wait", "id": "r1", "paths": ["/a"], "max_holders": true}', "Wait: field 'max_holders'"),
        (b'{"op": "wait", "id": "r1", "paths": ["/a"], "priority": 1}', "Wait: unknown field(s) ['priority']"),
        (b'{"op": "cancel", "id": "r1", "why": "bored"}', "StopWaiting: field 'why'"),
        (b'{"op": "claimed", "id": "r1", "verdict": "maybe"}', "Claimed: field 'verdict'"),
        (b'{"op": "claimed", "id": "r1", "verdict": "granted", "tokens": {"/a": "x"}}', "Claimed: field 'tokens'"),
        (b'{"op": "decided", "id": "r1", "verdict": "granted", "carry": {"proof": 1}}', "Carry: field 'session_timeout' missing"),
        (b'{"op": "ping", "pad": "x"}', "Ping: unknown field(s) ['pad']"),
        (b'{"op": "released", "id": "r1"}', "Released: field 'proven' missing"),
    ],
)
def test_a_line_that_is_no_message_is_refused_with_what_is_wrong(line, says):
    with pytest.raises(ProtocolError, match=None) as refused:
        decode(line)
    assert says in str(refused.value)


def test_a_reader_skips_a_bad_line_and_keeps_the_rest(caplog):
    lines = encode(Claim("r1")) + b'{"op": "nope"}\n' + encode(Release("r1"))
    reader = LineReader()
    assert reader.feed(lines[:7]) == []  # a line split across reads waits for its end
    assert reader.feed(lines[7:]) == [Claim("r1"), Release("r1")]
    assert "unknown op 'nope'" in caplog.text


def test_a_carried_grant_travels_as_plain_data_and_stands_for_the_claims_answer():
    """The main process puts the grant in ``delivery_info`` as plain data (``celery inspect``
    sends it as JSON); the pool process reads it back, and claims on it as on a grant."""
    info = as_wire(CARRY)
    assert json.loads(json.dumps(info)) == info and from_wire(Carry, info) == CARRY
    claimed = CARRY.as_claimed("r1")
    assert claimed.verdict is Verdict.GRANTED and claimed.carried is True and claimed.held is True
    assert claimed.tokens == CARRY.tokens and claimed.session_timeout == 10.0 and claimed.waited == 0.25
    assert not claimed.lost and claimed.reason is None


def test_a_claims_answer_off_the_wire_is_never_a_carried_one():
    granted = Claimed("r1", Verdict.GRANTED, waited=0.5, tokens={"/a": 3}, nodes={"/a": "/a/n"}, held=False,
                      reason="ZooKeeper connection suspended", session_timeout=4.0)
    assert decode(encode(granted)) == granted and not granted.carried
    assert "carried" not in as_wire(granted)


class _Link:
    """What an AgentLock asks of its link: alive, heard just now, no state pushed early."""

    alive = True

    def register(self, lock):
        return None

    def silent_for(self):
        return 0.0


SETTINGS = ZkSettings(session_timeout=9.0)


@pytest.mark.parametrize("answer, outcome, waited, holders, error", [
    (Claimed("r1", Verdict.TIMEOUT, waited=2.0, holders=["w2"]), Outcome.TIMED_OUT, 2.0, ["w2"], None),
    (Claimed("r1", Verdict.UNAVAILABLE, error="no quorum"), Outcome.UNAVAILABLE, 0.0, None, "no quorum"),
    (Claimed("r1", Verdict.UNAVAILABLE), Outcome.UNAVAILABLE, 0.0, None, "the lock agent could not reach ZooKeeper"),
    (Claimed("r1", Verdict.REVOKED, waited=1.0), Outcome.REVOKED, 1.0, None, None),
    (Claimed("r1", Verdict.SHUTDOWN), Outcome.SHUTDOWN, 0.0, None, None),
])
def test_a_claims_answer_that_is_no_grant_reads_as_its_outcome(answer, outcome, waited, holders, error):
    decision = claimed_lock(None, (_Link(), answer), SETTINGS, lambda lock: None)
    assert (decision.outcome, decision.waited, decision.holders, decision.lock) == (outcome, waited, holders, None)
    assert (None if decision.error is None else str(decision.error)) == error


@pytest.mark.parametrize("answer, suspended, carried, grace", [
    (Claimed("r1", Verdict.GRANTED, waited=0.5, tokens={"/a": 3}, held=False,
             reason="ZooKeeper connection suspended", session_timeout=4.0),
     "ZooKeeper connection suspended", False, 4.0 / 3),
    (CARRY.as_claimed("r1"), None, True, 3.0),
    (Claimed("r1", Verdict.GRANTED, tokens={"/a": 3}, held=True), None, False, 3.0),
])
def test_a_granted_claims_answer_is_held_as_it_says(answer, suspended, carried, grace):
    task = types.SimpleNamespace(request=types.SimpleNamespace(id="r1", retries=0, delivery_info={}))
    decision = claimed_lock(task, (_Link(), answer), SETTINGS, lambda lock: None)
    lock = decision.lock
    assert decision.outcome is Outcome.GRANTED and decision.waited == (answer.waited or 0.0)
    assert (lock.tokens, lock.suspended_reason, lock.carried) == (answer.tokens, suspended, carried)
    assert lock.grace == pytest.approx(grace) and decision.confirm_within == 10.0 and decision.copies is None


@pytest.mark.parametrize("held, reason", [(True, None), (False, "ZooKeeper connection suspended")],
                         ids=["held", "suspended"])
def test_a_lock_told_lost_stays_lost_when_an_older_state_comes_after(held, reason):
    """The claim's answer and a push kept for the lock are applied at registration, after a
    push the link may already have delivered: an older state must neither revive a lock the
    agent said was lost nor make it read suspended (a body would wait to see it safe again)."""
    lock = agent_client.AgentLock(_Link(), "r1", {"/a": 3}, grace=5.0, release_bound=5.0)
    lock.update(False, True, "the node is gone")
    lock.update(held, False, reason)
    assert not lock.is_held() and lock.lost_reason == "the node is gone"
    assert lock.suspended_reason is None and not lock.confirmed(0.0)


class _PushingLink(_Link):
    """A link whose thread delivers a push the moment the lock registers."""

    def register(self, lock):
        lock.update(False, False, "ZooKeeper connection suspended")
        return None


def test_a_push_delivered_as_the_lock_registers_is_not_overwritten_by_the_claims_answer():
    answer = Claimed("r1", Verdict.GRANTED, tokens={"/a": 3}, held=True)
    lock = agent_client.AgentLock(_PushingLink(), "r1", {"/a": 3}, grace=5.0, release_bound=5.0, state=answer)
    assert not lock.is_held() and lock.suspended_reason == "ZooKeeper connection suspended"
