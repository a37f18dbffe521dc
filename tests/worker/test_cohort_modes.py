"""A path's readers and writers in one worker: the cohorts' rule that no node of ours passes a
request of the other mode that came first (pure cohort logic, on a fake ZooKeeper side)."""

from __future__ import annotations

import itertools
import types

import pytest

from celery_zklock.engine.attempt import State
from celery_zklock.worker import cohort as cohort_module


class _Result:
    def rawlink(self, callback) -> None:
        pass

    def ready(self) -> bool:
        return False


@pytest.fixture
def created(monkeypatch):
    """Every node the cohorts queue, as (kind, first waiter's name), in order; none answers."""
    made: list[tuple[str, str]] = []
    numbers = itertools.count()

    class Internals:
        def __init__(self, client, path, max_holders, identity, on_lost=None, watch_when_run=False, kind=None):
            self.kind, self.identity = kind, identity

        def attempt(self, deadline, on_wait=None, on_next=None):
            made.append((self.kind.name, self.identity.decode()))
            return types.SimpleNamespace(state=State.WAITING, pending=None, create_sent=None, result=_Result(),
                                         node=f"n{next(numbers)}", cancel=lambda: None, release=lambda: (False, None))

    monkeypatch.setattr(cohort_module, "LockInternals", Internals)
    monkeypatch.setattr(cohort_module, "on_ready", lambda result, callback: None)
    return made


class _Host:
    """The agent's side of a path's cohorts (Requests.earliest_elsewhere)."""

    settings = types.SimpleNamespace(curator_interop="mutex", cohort_handoffs=10, cohort_hold=1.0)
    client = None

    def __init__(self) -> None:
        self.cohorts: list = []

    def earliest_elsewhere(self, cohort):
        return min((o.queue.first().started for o in self.cohorts if o is not cohort and o.queue), default=None)

    def post(self, fn, *args) -> None:
        pass

    def on_queued(self, *args) -> None:
        pass

    def on_next(self, *args, **named) -> None:
        pass


def _wait(name: str, started: float):
    return types.SimpleNamespace(identity=name.encode(), started=started, expired=False, name=name)


def test_a_later_reader_queues_no_node_ahead_of_an_earlier_writer(created):
    """Found by review: the readers' cohort looked only at its first waiter, so r4 (after w2)
    queued a read node beside r1's, ahead of w2's node still to come."""
    host = _Host()
    readers, writers = cohort_module.Cohort(host, "/k", 4, reads=True), cohort_module.Cohort(host, "/k", 1)
    host.cohorts = [readers, writers]
    readers.join(_wait("r1", 1))
    writers.join(_wait("w2", 2))  # held back: r1 came first and has its node
    readers.join(_wait("r4", 4))  # held back: w2 came first and has none yet
    assert created == [("READ", "r1")]
    readers.queue.remove(readers.queue.first())  # r1 granted (or gone): w2 is the earliest now
    writers.pump()
    readers.pump()
    assert created == [("READ", "r1"), ("MUTEX", "w2")]
