"""A request Celery drops as expired after it asked for its lock (real workers, Redis and
ZooKeeper).  Why: the worker hands a granted request to Celery's dispatch, which drops it
without running it once its ``expires`` has passed; nothing then claimed or let go of its
grant, and the key stayed held by nobody until the worker stopped."""

from __future__ import annotations

import uuid

import pytest

from support.workers import Worker
from tests.lockedapp import active_ids, history, started
from tests.polling import wait_until


@pytest.fixture(autouse=True)
def clean(mod):
    mod._r.delete("history", "arrivals")


def test_a_request_that_expires_while_it_waits_stops_waiting(mod, env):
    """Behind a 6 s holder, a request with ``expires=0.8`` is REVOKED while the holder still
    runs (not granted and dropped after it), and the next request on the key runs.  Why 6 s:
    the wait for REVOKED (5 s) must end before the holder could, or a request dropped only
    at the grant also reads REVOKED in time (mutant 27 survived 2 runs in 3 with a 3 s holder)."""
    w = Worker(env, "exp1", concurrency=2).start(mod.app)
    try:
        key = "exp-" + uuid.uuid4().hex[:6]
        holder = mod.hold.delay(key, 6000, "holder")
        wait_until(lambda: started(mod, "holder"), 10, what="the holder runs")
        expiring = mod.hold_tracked.apply_async((key, 10, "expiring"), expires=0.8)
        after = mod.hold.delay(key, 10, "after")
        wait_until(lambda: expiring.state == "REVOKED", 5, "the expired request is REVOKED")
        assert not holder.ready()
        holder.get(timeout=30)
        after.get(timeout=30)
        assert [r["tag"] for r in history(mod, "hold")] == ["holder", "after"]
    finally:
        w.stop()


def test_a_granted_request_that_expires_before_a_process_frees_lets_go_of_its_key(mod, env):
    """-c 1: a plain task takes the only process; a locked request on a free key is granted
    at once and waits for the process, and expires there.  Celery drops it when the process
    frees; its grant must go with it, or the next request on the key never runs."""
    w = Worker(env, "exp2", concurrency=1).start(mod.app)
    try:
        key = "expg-" + uuid.uuid4().hex[:6]
        busy = mod.plain_hold.delay("busy-" + uuid.uuid4().hex[:6], 1500, "busy")
        wait_until(lambda: busy.id in active_ids(mod, "exp2"), 10, what="the busy task takes the only process")
        expiring = mod.hold_tracked.apply_async((key, 10, "expiring"), expires=0.5)
        busy.get(timeout=30)
        wait_until(lambda: expiring.state == "REVOKED", 5, "the expired request is dropped")
        mod.hold.delay(key, 10, "after").get(timeout=30)
        assert [r["tag"] for r in history(mod, "hold")] == ["after"]
    finally:
        w.stop()
