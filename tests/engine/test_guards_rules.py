"""The enqueue guard's pure rules, table-driven: what a publisher does about a guard in place,
and reading a guard header off requests."""

from __future__ import annotations

import pytest

from celery_zklock.engine import guards
from celery_zklock.engine.guards import HELD, OWN, STALE, Guard, verdict


def _g(task_id="a", expires_at=100.0, retries=0):
    return Guard(task_id, "t", "start", expires_at, retries, 1.0)


@pytest.mark.parametrize(
    "found, task_id, now, expected, why",
    [
        (_g("a"), "b", 50.0, HELD, "another task is queued: dedupe or refuse"),
        (_g("a"), "a", 50.0, OWN, "the same id (Task.retry republishes it): take it over"),
        (_g("a", retries=3), "a", 500.0, OWN, "ours even past its expiry"),
        (_g("a", expires_at=100.0), "b", 100.0, STALE, "its message has expired: nobody can run it"),
        (_g("a", expires_at=100.0), "b", 99.9, HELD, "not yet expired"),
        (None, "b", 1e12, HELD, "a node we cannot read is somebody else's: never deleted"),
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
    ],
)
def test_verdict_of_a_running_guard(found, task_id, now, expected, why):
    assert verdict(found, task_id, now, running=True) == expected, why


@pytest.mark.parametrize("raw", [b"", b"not json", b"{}", b'{"id": "x"}', b'{"id": "x", "expires_at": "soon"}', b"[1]"])
def test_unreadable_guards_load_as_none(raw):
    assert Guard.loads(raw) is None


def test_a_guard_round_trips_and_names_its_run():
    g = Guard("id-1", "tasks.refresh", "finish", 123.5, 2, 100.0)
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
