"""The agent's wire: decisions travel as enums whose values are the stable encoding."""

import json

from celery_zklock.engine.attempt.state import Pending
from celery_zklock.engine.session import PROOFS, ReleaseOutcome
from celery_zklock.worker.agent_protocol import Cancel, ClaimAnswer, LineReader, Verdict, encode


def test_the_encodings_are_the_values_three_processes_agree_on():
    assert {v.value for v in Verdict} == {"granted", "timeout", "unavailable", "revoked", "shutdown"}
    assert {c.value for c in ClaimAnswer} == {"pending", "unknown"}
    assert {c.value for c in Cancel} == {"revoked", "shutdown", "finished"}
    assert [k.value for k in Pending] == ["create", "ghost", "read", "cleanup"]
    assert ReleaseOutcome.EXPIRED == "expired" and set(PROOFS) == {ReleaseOutcome.DELETED, ReleaseOutcome.WRITTEN, ReleaseOutcome.LEASED}


def test_an_enum_crosses_the_wire_as_its_value_and_reads_back():
    line = encode({"op": Verdict.GRANTED, "id": "r1", "why": Cancel.REVOKED})
    assert json.loads(line) == {"op": "granted", "id": "r1", "why": "revoked"}
    [msg] = LineReader().feed(line)
    assert Verdict(msg["op"]) is Verdict.GRANTED and Cancel(msg["why"]) is Cancel.REVOKED
    assert msg["op"] == Verdict.GRANTED  # a plain string from the wire compares equal
