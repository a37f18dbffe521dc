"""Calling locked tasks from locked tasks (Curator's re-entry, at task level), with real
workers in every place a task waits, and eagerly: a locked call inside a locked body, on
keys that body holds, runs at once under the outer hold and never releases it."""

from __future__ import annotations

import uuid

import pytest

from support.workers import Worker

PLACES = [
    pytest.param("prefork", 3, {}, "re_outer", id="agent"),
    pytest.param("prefork", 3, {"TEST_ZK_WAIT_IN": "pool"}, "re_outer", id="pool"),
    pytest.param("prefork", 3, {}, "re_outer_late", id="acks_late"),
    pytest.param("threads", 4, {}, "re_outer", id="threads"),
    pytest.param("gevent", 8, {}, "re_outer", id="gevent"),
]


def _key() -> str:
    return uuid.uuid4().hex[:8]


def _assert_under_the_outer(r: dict) -> None:
    """The inner ran with the outer's token; after it returned the outer still held the key
    and another contender could not take it (the inner's end released nothing)."""
    assert r["inner"]["token"] == r["token"], r
    assert r["inner"]["held"], r
    assert r["after"] == {**r["after"], "held": True, "peer_gets_own_key": False}, r


def _scenarios(run) -> None:
    """Every re-entry shape, through ``run(task_name, *args)`` (a worker or eagerly)."""
    for how in ("direct", "apply"):
        _assert_under_the_outer(run("outer", _key(), how))
    # three levels deep: outer -> mid -> leaf, one hold
    r = run("outer", _key(), "direct", "mid")
    _assert_under_the_outer(r)
    assert r["inner"]["inner"]["token"] == r["token"], r
    # a superset: the inner takes only the key the outer lacks, and releases only that one
    r = run("outer", _key(), "direct", "pair", _key())
    assert r["token"] in r["inner"]["tokens"] and len(r["inner"]["tokens"]) == 2, r
    assert r["after"]["held"] and not r["after"]["peer_gets_own_key"], r
    assert r["after"]["peer_gets_other_key"], r
    # a subset: the outer holds two keys, the inner needs one
    r = run("pair_outer", _key(), _key(), "direct")
    assert r["inner"]["tokens"][0] in r["tokens"], r
    assert r["after"] == {"held": True, "peer_gets_own_key": False}, r
    # re-entry turned off: refused at once, naming the holder, never a wait for its own timeout
    r = run("outer", _key(), "direct", "strict")
    assert r["inner"]["error"].startswith("LockReentered: "), r
    assert "re_outer" in r["inner"]["error"] and "lock_reentrant=False" in r["inner"]["error"], r


@pytest.mark.parametrize("pool, conc, extra, outer", PLACES)
def test_a_locked_call_inside_a_locked_body_runs_under_its_hold(mod, env, pool, conc, extra, outer):
    w = Worker({**env, **extra}, f"re-{pool}-{outer}", pool=pool, concurrency=conc).start(mod.app)
    tasks = {"outer": getattr(mod, outer), "pair_outer": mod.re_pair_outer}
    try:
        _scenarios(lambda name, *args: tasks[name].delay(*args).get(timeout=60))
    finally:
        w.stop()


def test_eagerly(mod, env):
    """``apply()`` in the caller's process, and a direct call of the outer itself."""
    tasks = {"outer": mod.re_outer, "pair_outer": mod.re_pair_outer}
    _scenarios(lambda name, *args: tasks[name].apply(args=args).get())
    _assert_under_the_outer(mod.re_outer("k-" + _key(), "direct"))


def test_another_thread_is_not_the_owner(mod, env):
    """A thread the body starts queues like anyone else (as in Curator): behind its own
    caller, until its timeout (the outer holds the key throughout)."""
    w = Worker(env, "re-thread", pool="prefork", concurrency=2).start(mod.app)
    try:
        r = mod.re_outer.delay(_key(), "thread").get(timeout=60)
    finally:
        w.stop()
    assert r["inner"].get("error", "").startswith("LockTimeout: "), r
    assert "value" not in r["inner"], r
    assert r["after"]["held"] and not r["after"]["peer_gets_own_key"], r
