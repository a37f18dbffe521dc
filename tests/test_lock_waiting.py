"""What a waiting task says (celery_zklock.lock_waiting): one account for a wait in the
process that runs the task and for one held aside in the worker's main process."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
from celery import Celery

from celery_zklock import FairLock, ZkLockedTask, lock_waiting, metrics
from celery_zklock.lock_waiting import Waiter
from celery_zklock.logs import TASK_LOGGER
from celery_zklock.states import LOCK_WAITING
from tests.polling import wait_until


@pytest.fixture
def recorded(monkeypatch):
    out: list = []
    monkeypatch.setattr(metrics, "record", lambda event, task, **fields: out.append(event))
    return out


def _waiter(log, track_started=True, store_fails=False, stored=True):
    def store(state, meta):
        if store_fails:
            raise OSError("backend down")
        log.append(("state", state, meta))

    task = SimpleNamespace(track_started=track_started, ignore_result=False)
    return Waiter(task, "t1", "sku:1", lambda type_, **fields: log.append(("event", type_, fields)),
                  store if stored else None, logging.getLogger("tests.lock_waiting"))


@pytest.mark.parametrize("first, track_started, stored, says", [
    (True, True, True, ["waiting", "event", "state"]),
    (False, True, True, ["event", "state"]),  # counted once per wait, said at each new position
    (True, False, True, ["waiting", "event"]),  # LOCK_WAITING only where STARTED is tracked
    (True, True, False, ["waiting", "event"]),  # a direct call stores no state
])
def test_what_a_wait_says(recorded, first, track_started, stored, says):
    log: list = []
    lock_waiting.record(_waiter(log, track_started, stored=stored), 3, first)
    said = recorded + [entry[0] for entry in log]
    assert said == says
    assert ("event", "task-lock-waiting", {"key": "sku:1", "position": 3}) in log
    if "state" in says:
        assert ("state", LOCK_WAITING, {"key": "sku:1", "position": 3}) in log


def test_a_state_that_cannot_be_stored_is_a_warning(recorded, caplog):
    log: list = []
    with caplog.at_level(logging.WARNING, "tests.lock_waiting"):
        lock_waiting.record(_waiter(log, store_fails=True), 1, True)
    assert "could not record that task t1 waits for lock sku:1: OSError('backend down')" in caplog.text
    assert recorded == ["waiting"]


def test_a_request_held_aside_says_it_through_its_request(recorded):
    stored, events = [], []
    task = SimpleNamespace(track_started=True, ignore_result=False,
                           lock_keys=lambda args, kwargs: [f"k:{args[0]}", "other"],
                           backend=SimpleNamespace(store_result=lambda *a: stored.append(a)))
    req = SimpleNamespace(id="t2", task=task, args=[7], kwargs=None,
                          send_event=lambda type_, **fields: events.append((type_, fields)))
    lock_waiting.record(Waiter.held_aside(req), 2, True)
    assert recorded == ["waiting"]
    assert events == [("task-lock-waiting", {"key": ["k:7", "other"], "position": 2})]
    assert stored == [("t2", {"key": ["k:7", "other"], "position": 2}, LOCK_WAITING)]


def test_a_multi_key_wait_in_process_is_counted_once(zk_server, zk_client, recorded, caplog):
    """Each key of a multi-key lock may make it wait (once per key): the gauge counts the
    wait once, so the one "waited" at its end brings it back to where it was."""
    app = Celery("waiting", broker="memory://", backend="cache+memory://")
    app.conf.update(zklock_hosts=zk_server.hosts, zklock_root="/waiting", zklock_session_timeout=4.0,
                    zklock_connect_timeout=1.0)

    @app.task(base=ZkLockedTask, lock_key=["a:{x}", "b:{x}"], shared=False)
    def both(x):
        return "ran"

    blockers = [FairLock(zk_client, "/waiting/a:1"), FairLock(zk_client, "/waiting/b:1")]
    for blocker in blockers:
        blocker.acquire()
    result: list = []

    def waits_said() -> int:  # the call's "waiting for lock" lines: one each time it waits
        return sum("waiting for lock" in r.getMessage() for r in caplog.records)

    caplog.set_level(logging.INFO, logger=TASK_LOGGER)
    runner = threading.Thread(target=lambda: result.append(both(1)))
    runner.start()
    try:
        for n, blocker in enumerate(blockers, 1):  # one key at a time: the call waits once for each
            wait_until(lambda n=n: waits_said() >= n, 10, what=f"the call to wait behind blocker {n}")
            blocker.release()
    finally:
        for blocker in blockers:
            blocker.release()
        runner.join(10)
    assert result == ["ran"]
    waits = [e for e in recorded if e in ("waiting", "waited")]
    assert waits == ["waiting", "waited"], recorded
