"""The rule that keeps a redelivered copy from running again: what a stored state says of an
earlier delivery of the same attempt (:func:`celery_zklock.redelivery.earlier_run`), and the
backend read built on it (:func:`~celery_zklock.redelivery.ran_before`), with a fake backend.
The real-broker tests are in tests/worker/test_held_aside.py."""

from __future__ import annotations

import pytest
from celery import states

from celery_zklock import redelivery
from celery_zklock.redelivery import Earlier, earlier_run, ran_before, redelivered
from celery_zklock.states import LOCK_WAITING, SKIPPED


@pytest.mark.parametrize("state, earlier", [
    (states.SUCCESS, Earlier.FINISHED),
    (states.FAILURE, Earlier.FINISHED),
    (states.REVOKED, Earlier.FINISHED),
    (SKIPPED, Earlier.FINISHED),  # its lock policy decided it: done
    (states.STARTED, Earlier.RUNNING),  # began: its final state may be about to land
    (states.PENDING, Earlier.UNKNOWN),
    (states.RETRY, Earlier.UNKNOWN),  # also what the previous attempt left
    (LOCK_WAITING, Earlier.UNKNOWN),  # held aside and given back: it never began
    (None, Earlier.UNKNOWN),
])
def test_what_a_stored_state_says_of_an_earlier_delivery(state, earlier):
    assert earlier_run(state) is earlier


@pytest.mark.parametrize("info, flagged", [
    ({"redelivered": True}, True), ({"redelivered": False}, False), ({}, False), (None, False),
])
def test_the_brokers_redelivered_flag(info, flagged):
    class Request:
        delivery_info = info

    assert redelivered(Request()) is flagged


class Backend:
    def __init__(self, *states_in_turn):
        self.states = list(states_in_turn)
        self.reads = 0

    def get_state(self, task_id):
        self.reads += 1
        return self.states[min(self.reads, len(self.states)) - 1]


class Task:
    ignore_result = False

    def __init__(self, backend):
        self.backend = backend


@pytest.mark.parametrize("stored, seen, ran, reads", [
    ((states.SUCCESS,), False, True, 1),
    ((states.PENDING,), False, False, 1),  # a requeued message that never began: runs at once
    ((states.STARTED, states.STARTED, states.SUCCESS), False, True, 3),  # began: waits for its end
    ((states.PENDING, states.PENDING, states.SUCCESS), True, True, 3),  # seen ahead: waits too
])
def test_a_copy_runs_only_if_no_earlier_delivery_finished(monkeypatch, stored, seen, ran, reads):
    monkeypatch.setattr(redelivery.time, "sleep", lambda s: None)
    backend = Backend(*stored)
    assert ran_before(Task(backend), "t1", seen=seen) is ran
    assert backend.reads == reads


def test_a_copy_that_began_elsewhere_and_never_ended_runs_after_the_grace(monkeypatch):
    """Its original's worker died mid-run (STARTED for good): the work is not dropped on a guess."""
    now = [0.0]
    monkeypatch.setattr(redelivery.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(redelivery.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    assert ran_before(Task(Backend(states.STARTED)), "t1") is False
    assert now[0] >= redelivery.RESULT_GRACE


def test_without_a_result_backend_a_copy_runs():
    from celery.backends.base import DisabledBackend

    task = Task(DisabledBackend.__new__(DisabledBackend))
    assert ran_before(task, "t1") is False
    task = Task(Backend(states.SUCCESS))
    task.ignore_result = True
    assert ran_before(task, "t1") is False
