"""The tick fence: each beat tick's body runs at most once at the workers, and never after a
later tick of its entry (celery_zklock.engine.tick_fence).  Its rule table by table; its
ZooKeeper record against a real server; and real workers given the copies a broker makes
(a publish retried after its reply was lost, a deposed leader's late tick)."""

from __future__ import annotations

import json
import threading
import uuid

import pytest

from celery_zklock.engine.tick_fence import Fenced, Tick, consume, decide
from support.workers import Worker
from tests.lockedapp import history
from tests.polling import holds_for, wait_until


@pytest.mark.parametrize("last, seq, token, expected", [
    (None, 1, 5, Fenced.RUN),  # an entry's first tick
    ((4, 5), 5, 5, Fenced.RUN),  # the next tick of the term
    ((4, 5), 4, 5, Fenced.DUPLICATE),  # the same tick again: a publish sent twice
    ((4, 5), 4, 6, Fenced.DUPLICATE),  # the same seq is one tick, whoever re-sent it
    ((5, 6), 4, 5, Fenced.STALE),  # a deposed leader's tick 4 after the new leader's 5
    ((5, 6), 3, 6, Fenced.STALE),  # any older tick
    ((5, 6), 7, 5, Fenced.STALE),  # a higher seq from an older term: no working election makes one
    ((5, None), 6, 5, Fenced.RUN),  # a record without a token (written by hand): the seq decides
    ((5, 6), 6, None, Fenced.RUN),
])
def test_decide(last, seq, token, expected):
    assert decide(last, seq, token) is expected


@pytest.mark.parametrize("header, expected", [
    (None, None),
    ({"entry": "e", "seq": 3, "token": 9}, None),  # no fence path: a beat that does not fence
    ({"entry": "e", "seq": 3, "token": 9, "fence": "/r/.beat/g/ran/e"}, Tick("/r/.beat/g/ran/e", 3, 9)),
    ({"entry": "e", "seq": "x", "fence": "/p"}, None),  # unreadable: not a tick of ours
])
def test_tick_of_header(header, expected):
    assert Tick.of(header) == expected


def test_consume_records_each_tick_once_even_when_workers_race(zk_client):
    path = f"/fence-{uuid.uuid4().hex[:8]}/ran/e"
    verdicts: list = []

    def one(seq):
        verdicts.append((seq, consume(zk_client, Tick(path, seq, 1))))

    threads = [threading.Thread(target=one, args=(1,)) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(v for _, v in verdicts).count(Fenced.RUN) == 1, verdicts
    assert consume(zk_client, Tick(path, 3, 1)) is Fenced.RUN
    assert consume(zk_client, Tick(path, 2, 1)) is Fenced.STALE
    assert json.loads(zk_client.get(path)[0]) == {"seq": 3, "token": 1}


def _tick(mod, env, task, args, seq, token, task_id=None, entry="every-second"):
    fence = f"{env['TEST_ZK_ROOT']}/.beat/default/ran/{entry}"
    header = {"entry": entry, "seq": seq, "due": "2026-11-28T00:00:00+00:00", "token": token, "fence": fence}
    return task.apply_async(args, headers={"zklock_beat": header}, task_id=task_id)


def test_a_tick_published_twice_or_late_runs_once_at_the_workers(mod, env):
    """Two workers.  Tick 1 published twice with one task id (kombu's publish retry after a
    lost reply), tick 3 of the new term, then the deposed leader's tick 2, late: ticks 1 and 3
    run once each, tick 2 never; a locked task's tick is fenced the same way.  Without the
    fence all four copies ran."""
    mod._r.delete("history", "arrivals")  # rows of other modules' tests on this Redis
    ws = [Worker(env, f"fence{i}", concurrency=2).start(mod.app) for i in (1, 2)]
    try:
        first = str(uuid.uuid4())
        _tick(mod, env, mod.plain_hold, ("t", 50, "tick1"), 1, 7, task_id=first)
        _tick(mod, env, mod.plain_hold, ("t", 50, "tick1"), 1, 7, task_id=first)
        wait_until(lambda: len(history(mod, "plain")) >= 1, 20, what="tick 1 to run")
        _tick(mod, env, mod.plain_hold, ("t", 50, "tick3"), 3, 8)
        wait_until(lambda: len(history(mod, "plain")) >= 2, 20, what="tick 3 to run")
        _tick(mod, env, mod.plain_hold, ("t", 50, "tick2"), 2, 7)
        _tick(mod, env, mod.hold, ("fenced", 20, "locked1"), 1, 7, entry="locked")
        _tick(mod, env, mod.hold, ("fenced", 20, "locked1"), 1, 7, entry="locked")
        wait_until(lambda: len(history(mod, "hold")) >= 1, 20, what="the locked tick to run")
        # A copy not fenced would run within 2 s.
        holds_for(lambda: sorted(r["tag"] for r in history(mod, "plain")) == ["tick1", "tick3"]
                  and [r["tag"] for r in history(mod, "hold")] == ["locked1"], 2.0, what="each tick run once, in order")
        logs = "".join(w.log_tail(200_000) for w in ws)
        assert logs.count("not run: it already ran") == 2 and logs.count("not run: a later tick") == 1, logs[-3000:]
    finally:
        for w in ws:
            w.stop()
