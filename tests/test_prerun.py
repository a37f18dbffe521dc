"""``task_prerun``/``task_postrun`` mean the same wherever a locked task waits: prerun fires
once the lock is decided (held, or given up before a policy), so the wait is never inside
prerun -> postrun.  Pinned with real workers in every waiting place, and eagerly."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from celery_zklock import FairLock
from support.workers import Worker
from tests.lockedapp import history
from tests.lockutil import children
from tests.polling import wait_until

HOLD_MS = 1200


@pytest.fixture(autouse=True)
def clean(mod):
    mod._r.delete("history", "arrivals", "signals")
    yield


def _signals(mod, task_id: str) -> dict[str, list[dict]]:
    rows = [json.loads(x) for x in mod._r.lrange("signals", 0, -1)]
    out: dict[str, list[dict]] = {"prerun": [], "postrun": [], "body": []}
    for row in rows:
        if row["id"] == task_id:
            out[row["sig"]].append(row)
    return out


def _hold_then(mod, key: str, probe):
    """A blocker holds ``key`` for HOLD_MS; once it runs, ``probe()`` sends the task under test.
    Returns (probe result, time it was sent, the blocker's end)."""
    mod._r.delete("history", "arrivals")
    blocker = mod.hold.delay(key, HOLD_MS, "blocker")
    deadline = time.time() + 30
    while time.time() < deadline and not mod._r.llen("arrivals"):
        time.sleep(0.01)
    assert mod._r.llen("arrivals"), "the blocker never started"
    sent = time.time()
    result = probe()
    deadline = time.time() + 60
    while time.time() < deadline and result.state not in ("SUCCESS", "FAILURE"):
        time.sleep(0.02)
    blocker.get(timeout=30)
    end = history(mod, "hold")[0]["end"]
    return result, sent, end


def _signals_after_postrun(mod, task_id: str) -> dict[str, list[dict]]:
    """:func:`_signals` once postrun's record is in (or 10 s passed): task_postrun is sent
    after the result is stored, and a fresh-clone CI run on a busy machine read between."""
    deadline = time.time() + 10
    while not _signals(mod, task_id)["postrun"] and time.time() < deadline:
        time.sleep(0.02)
    return _signals(mod, task_id)


def _assert_prerun_after_the_wait(mod, result, sent: float, blocker_end: float) -> None:
    sig = _signals_after_postrun(mod, result.id)
    assert len(sig["prerun"]) == 1 and len(sig["postrun"]) == 1, sig  # paired, once each
    body = sig["body"][0]
    prerun, postrun = sig["prerun"][0]["at"], sig["postrun"][0]["at"]
    assert prerun >= blocker_end, f"prerun {blocker_end - prerun:.3f}s before the holder let go: inside the wait"
    assert prerun <= body["start"] and body["end"] <= postrun
    # The wait itself is on current_lock(): most of the blocker's hold, measured where it waited.
    assert body["wait"] >= (blocker_end - sent) - 0.25, (body["wait"], blocker_end - sent)
    assert body["acquired_at"] <= body["start"] and body["acquired_at"] >= blocker_end


PLACES = [
    pytest.param("prefork", 3, {}, "timed_hold", id="agent"),
    pytest.param("prefork", 3, {"TEST_ZK_WAIT_IN": "pool"}, "timed_hold", id="pool"),
    pytest.param("prefork", 3, {}, "timed_late", id="acks_late"),
    pytest.param("threads", 4, {}, "timed_hold", id="threads"),
    pytest.param("gevent", 8, {}, "timed_hold", id="gevent"),
]


@pytest.mark.parametrize("pool, conc, extra, task", PLACES)
def test_prerun_fires_after_the_lock_wait(mod, env, pool, conc, extra, task):
    w = Worker({**env, **extra}, f"pre-{pool}-{task}", pool=pool, concurrency=conc).start(mod.app)
    try:
        key = f"pre-{uuid.uuid4().hex[:6]}"
        result, sent, end = _hold_then(mod, key, lambda: getattr(mod, task).delay(key, 10))
        assert result.successful(), result.result
        _assert_prerun_after_the_wait(mod, result, sent, end)

        # Not granted: prerun fires at the decision (lock_timeout after it could run), paired
        # with postrun (the skipped run ends SUCCESS, with the result None).
        key = f"pre-{uuid.uuid4().hex[:6]}"
        result, sent, _ = _hold_then(mod, key, lambda: mod.timed_skip.delay(key))
        assert result.state == "SUCCESS" and result.result is None
        sig = _signals_after_postrun(mod, result.id)
        assert len(sig["prerun"]) == 1 and len(sig["postrun"]) == 1, sig
        assert sig["prerun"][0]["at"] >= sent + 0.3 - 0.02
    finally:
        w.stop()


def test_prerun_fires_after_the_lock_wait_next_in_line(mod, env):
    """A hot key of short holds: the request next in line may reach a pool process before its
    grant (parked there, claiming); its prerun still waits for the grant."""
    w = Worker(env, "pre-next", concurrency=3).start(mod.app)
    try:
        key = f"pre-{uuid.uuid4().hex[:6]}"
        for r in [mod.hold.delay(key, 50, f"warm{i}") for i in range(4)]:
            r.get(timeout=30)  # the agent learns that locks on this key are held briefly
        mod._r.delete("history", "arrivals")
        blocker = mod.hold.delay(key, 400, "blocker")
        while not mod._r.llen("arrivals"):
            time.sleep(0.005)
        sent = time.time()
        probes = [mod.timed_hold.delay(key, 10) for _ in range(3)]
        for p in probes:
            assert p.get(timeout=30)
        blocker.get(timeout=30)
        end = history(mod, "hold")[0]["end"]
        _assert_prerun_after_the_wait(mod, probes[0], sent, end)
        for p in probes:
            sig = _signals(mod, p.id)
            assert len(sig["prerun"]) == 1 and sig["prerun"][0]["at"] >= end
            assert sig["prerun"][0]["at"] <= sig["body"][0]["start"]
    finally:
        w.stop()


def test_prerun_fires_after_the_lock_wait_eagerly(mod, env, zk_client):
    """``apply()`` in this process waits here; the tracer's prerun waits with it."""
    key = f"pre-{uuid.uuid4().hex[:6]}"
    path = f"{env['TEST_ZK_ROOT']}/k:{key}"
    holder = FairLock(zk_client, path)
    assert holder.acquire(timeout=5)
    released = []
    sent = time.time()

    def let_go():
        try:
            wait_until(lambda: len(children(zk_client, path)) == 2, 30, what="the task to queue behind the holder")
            time.sleep(max(0.0, sent + 0.8 - time.time()))  # the hold under test: 0.8 s from the send
        finally:
            released.append(time.time())
            holder.release()

    threading.Thread(target=let_go).start()
    result = mod.timed_hold.apply(args=(key, 10))
    assert result.successful(), result.result
    sig = _signals_after_postrun(mod, result.id)
    assert len(sig["prerun"]) == 1 and len(sig["postrun"]) == 1
    assert sig["prerun"][0]["at"] >= released[0]
    assert sig["body"][0]["wait"] >= released[0] - sent - 0.1
