"""The enqueue guard's pure rules, table-driven: what a publisher does about a guard in place,
and reading a guard header off requests."""

from __future__ import annotations

import pytest

from celery_zklock.engine import guards
from celery_zklock.engine.guards import HELD, OWN, STALE, UNCONFIRMED, Guard, bound, verdict


def _g(task_id="a", expires_at=100.0, retries=0, confirmed=True, publish_by=0.0, node=0):
    return Guard(task_id, "t", "start", expires_at, retries, 1.0, confirmed=confirmed, publish_by=publish_by,
                 node=node)


@pytest.mark.parametrize(
    "found, task_id, now, expected, why",
    [
        (_g("a"), "b", 50.0, HELD, "another task is queued: dedupe or refuse"),
        (_g("a"), "a", 50.0, OWN, "the same id (Task.retry republishes it): take it over"),
        (_g("a", retries=3), "a", 500.0, OWN, "ours even past its expiry"),
        (_g("a", expires_at=100.0), "b", 100.0, STALE, "its message has expired: nobody can run it"),
        (_g("a", expires_at=100.0), "b", 99.9, HELD, "not yet expired"),
        (None, "b", 1e12, HELD, "a node we cannot read is somebody else's: never deleted"),
        (_g("a", confirmed=False, publish_by=60.0), "b", 50.0, UNCONFIRMED,
         "its publish is under way: wait, never dedupe into a message that may not be sent"),
        (_g("a", confirmed=False, publish_by=60.0), "b", 60.0, STALE, "never confirmed in time: its publisher died"),
        (_g("a", expires_at=10.0, confirmed=False, publish_by=60.0), "b", 50.0, UNCONFIRMED,
         "unconfirmed: the publish window decides, not the bound"),
        (_g("a", confirmed=False, publish_by=60.0), "a", 50.0, OWN, "our own, even unconfirmed"),
    ],
)
def test_verdict(found, task_id, now, expected, why):
    assert verdict(found, task_id, now) == expected, why


@pytest.mark.parametrize(
    "found, task_id, now, expected, why",
    [
        (_g("a", expires_at=100.0), "b", 500.0, HELD, "running past its message's expiry: the session bounds it"),
        (_g("a"), "a", 500.0, OWN, "a retry published by the running body: its own guard"),
        (_g("a"), "b", 50.0, HELD, "running, not expired: held, as queued"),
        (_g("a", confirmed=False, publish_by=10.0), "b", 50.0, HELD,
         "moved to the running session before its publisher confirmed it: running"),
    ],
)
def test_verdict_of_a_running_guard(found, task_id, now, expected, why):
    assert verdict(found, task_id, now, running=True) == expected, why


@pytest.mark.parametrize(
    "found, task_id, czxid, expected, why",
    [
        (_g("a", node=7), "b", 7, HELD, "confirmed on the node its publisher made: dedupe into it"),
        (_g("a", node=7), "b", 9, STALE,
         "confirmed onto node 9, made by another publisher after a's run began: names nobody"),
        (_g("a", node=7), "a", 9, STALE, "not a's node either: a retry of a replaces it"),
        (_g("a", node=0), "b", 9, HELD, "a guard of an older version names no node: trusted as before"),
        (_g("a", node=7), "b", 0, HELD, "the node's czxid unknown: trusted"),
        (_g("a", confirmed=False, publish_by=60.0, node=0), "b", 9, UNCONFIRMED, "unconfirmed: its own create"),
    ],
)
def test_verdict_of_a_guard_confirmed_onto_a_node(found, task_id, czxid, expected, why):
    assert verdict(found, task_id, 50.0, czxid=czxid) == expected, why


@pytest.mark.parametrize(
    "found, running, expected, why",
    [
        (_g("a", node=7), True, HELD, "running: a late confirm of its own landed on it; its session bounds it"),
        (_g("a", node=7), False, STALE, "queued: its publisher's confirm landed on another's node"),
    ],
)
def test_a_running_guard_is_never_misplaced(found, running, expected, why):
    assert verdict(found, "b", 50.0, running=running, czxid=9) == expected, why


@pytest.mark.parametrize(
    "found, czxid, expected",
    [
        (_g(node=7), 7, False), (_g(node=7), 8, True), (_g(node=0), 8, False), (_g(node=7), 0, False),
        (_g(confirmed=False, node=7), 8, False), (None, 8, False),
    ],
)
def test_misplaced(found, czxid, expected):
    assert guards.misplaced(found, czxid) is expected


@pytest.mark.parametrize(
    "now, eta, expires, staleness, expected, why",
    [
        (1000.0, None, None, 3600.0, 4600.0, "no ETA: counted from the publish"),
        (1000.0, 7000.0, None, 3.0, 7003.0, "a countdown longer than the bound: counted from the ETA (issue 40)"),
        (1000.0, 500.0, None, 3.0, 1003.0, "an ETA in the past: from now"),
        (1000.0, 7000.0, 1500.0, 3600.0, 1500.0, "the caller's own expires: the worker discards the message then"),
    ],
)
def test_bound(now, eta, expires, staleness, expected, why):
    assert bound(now, eta, expires, staleness) == expected, why


@pytest.mark.parametrize(
    "guard, task_id, retries, expected, why",
    [
        (_g("a", retries=1), "a", 1, True, "its own try"),
        (_g("a", retries=1), "a", 2, True, "an earlier try's guard that the retry could not take over"),
        (_g("a", retries=2), "a", 1, False, "a later try's: the run that retried must not end it"),
        (_g("a", retries=0), "b", 0, False, "another task's"),
    ],
)
def test_ended_by(guard, task_id, retries, expected, why):
    assert guard.ended_by(task_id, retries) is expected, why


def test_guards_of_earlier_versions_read_as_confirmed():
    raw = b'{"id":"x","task":"t","until":"start","expires_at":5.0,"retries":0,"at":1.0}'
    assert Guard.loads(raw).confirmed and Guard.loads(raw).deduped == 0


@pytest.mark.parametrize("raw", [b"", b"not json", b"{}", b'{"id": "x"}', b'{"id": "x", "expires_at": "soon"}', b"[1]"])
def test_unreadable_guards_load_as_none(raw):
    assert Guard.loads(raw) is None


def test_a_guard_round_trips_and_names_its_run():
    g = Guard("id-1", "tasks.refresh", "finish", 123.5, 2, 100.0, node=42)
    back = Guard.loads(g.dumps())
    assert back == g and back.names("id-1", 2) and not back.names("id-1", 1) and not back.names("id-2", 2)


class _Req:
    def __init__(self, attr=None, request_dict=None):
        if attr is not None:
            setattr(self, guards.HEADER, attr)
        self.request_dict = request_dict


GOOD = {"paths": ["/r/.enqueue/t/k"], "until": "start", "retries": 0}


@pytest.mark.parametrize(
    "source, expected",
    [
        ({guards.HEADER: GOOD}, GOOD),  # a message's headers
        (_Req(attr=GOOD), GOOD),  # a task's request context
        (_Req(request_dict={guards.HEADER: GOOD}), GOOD),  # a worker's Request
        (_Req(), None),
        ({guards.HEADER: {"paths": "/not/a/list", "until": "start"}}, None),
        ({guards.HEADER: {"paths": [], "until": "forever"}}, None),
        ({}, None),
    ],
)
def test_guarded(source, expected):
    assert guards.guarded(source) == expected


def test_guards_live_where_no_lock_key_can():
    from celery_zklock.keys import encode_key, key_path

    assert guards.guard_path("/root", "t", "k").startswith("/root/.enqueue/")
    assert key_path("/root", ".enqueue") != "/root/.enqueue" and encode_key(".enqueue") != guards.FOLDER
