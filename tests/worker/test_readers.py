"""lock_mode="read" with real workers: readers of a key run together, a writer alone, in
both waiting places (the worker's lock agent, whose cohort keeps one read node per pool
process at most, and the pool process)."""

from __future__ import annotations

import uuid

import pytest

from support.workers import Worker
from tests.lockedapp import history
from tests.lockutil import children, write_overlaps


def _most_at_once(spans) -> int:
    edges = sorted([(s[1], 1) for s in spans] + [(s[2], -1) for s in spans], key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@pytest.mark.parametrize("wait_in", ["worker", "pool"])
def test_six_readers_share_a_key_and_writers_never_overlap_them(mod, env, zk_client, wait_in):
    """Six 800 ms readers, a writer, eighteen readers, a writer, on one key, through one worker
    (-c 6): the six run together; each writer runs alone, after the readers ahead of it and
    before those behind it; and the worker's agent keeps no more read nodes than its pool."""
    mod._r.delete("history")
    key = f"rw-{wait_in}-{uuid.uuid4().hex[:6]}"
    w = Worker({**env, "TEST_ZK_WAIT_IN": wait_in}, f"readers-{wait_in}", concurrency=6).start(mod.app)
    try:
        # Every pool process up first: six readers run together only if six processes can take
        # them (a grant waiting for a process is given back, behind the writer).
        warm = [mod.hold.delay(f"warm-{i}-{key}", 300, i) for i in range(6)]
        for r in warm:
            r.get(timeout=30)
        assert len({row["pid"] for row in history(mod, "hold") if row["key"].startswith("warm-")}) == 6
        plan = ["read"] * 6 + ["write"] + ["read"] * 18 + ["write"]
        last = len(plan) - 1
        results = [(mod.read_hold if side == "read" else mod.hold).delay(key, 800 if side == "read" else 100, i)
                   for i, side in enumerate(plan)]
        nodes = []
        for r in results:
            nodes.append(sum("__READ__" in n for n in children(zk_client, f"{env['TEST_ZK_ROOT']}/k:{key}")))
            r.get(timeout=60)
        assert w.alive(), w.log_tail(3000)
    finally:
        w.stop()
    spans = sorted([("read", r["start"], r["end"], r["tag"]) for r in history(mod, "read") if r["key"] == key]
                   + [("write", r["start"], r["end"], r["tag"]) for r in history(mod, "hold") if r["key"] == key],
                   key=lambda s: s[1])
    assert len(spans) == len(plan)
    assert not write_overlaps(spans), write_overlaps(spans)[:3]
    first_six = [s for s in spans if s[0] == "read" and s[3] < 6]
    assert _most_at_once(first_six) == 6, f"the six readers did not all run together (nodes seen: {nodes})"
    # FIFO between the sides: the readers queued before a writer ran before it, those after, after.
    writes = {s[3]: s for s in spans if s[0] == "write"}
    assert all(s[2] <= writes[6][1] for s in first_six)
    if wait_in == "worker":  # the agent queues them as they came; in the pool, a request reaches
        # the lock when a process takes it, and processes freed together take the next ones in
        # an order of their own
        assert all(writes[6][2] <= s[1] <= writes[last][1] for s in spans if s[0] == "read" and 6 < s[3] < last)
    # No node per waiting request: eighteen readers waited behind the writer, and the agent
    # kept at most a pool's worth of read nodes, each perhaps with its replacement for the
    # next reader queued before its own delete lands.
    assert max(nodes) <= 2 * 6, nodes


def test_tasks_reading_one_key_and_writing_another_neither_deadlock_nor_overlap(mod, env):
    """Forty tasks over two workers, each reading one of three keys and writing another, in
    every direction (x read y written, y read x written, ...): all run (keys are taken in
    canonical order whatever the modes), and no write of a key overlaps any hold of it."""
    mod._r.delete("history")
    keys = [f"mix-{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
    workers = [Worker(env, f"mixed{i}", concurrency=3).start() for i in range(2)]
    try:
        for w in workers:
            w.wait_ready(mod.app)
        pairs = [(keys[i % 3], keys[(i + 1 + (i // 3) % 2) % 3]) for i in range(40)]  # each read/write direction
        results = [mod.read_one_write_other.delay(r, w, 30, i) for i, (r, w) in enumerate(pairs)]
        modes = [res.get(timeout=90) for res in results]
    finally:
        for w in workers:
            w.stop()
    assert modes[0] == {f"k:{pairs[0][0]}": "read", f"k:{pairs[0][1]}": "write"}
    for key in keys:
        spans = [("read", r["start"], r["end"], r["tag"]) for r in history(mod, "read") if r["key"] == key]
        spans += [("write", r["start"], r["end"], r["tag"]) for r in history(mod, "hold") if r["key"] == key]
        assert not write_overlaps(spans), (key, write_overlaps(spans)[:3])
