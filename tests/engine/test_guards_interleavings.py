"""The enqueue guard's protocol under many interleavings, against a real ZooKeeper: publishers
and workers as threads with sessions of their own, a queue for the broker, and pauses drawn
at random in the windows where the order of their steps matters (between the broker taking a
message and its publisher's confirm, before a worker's start, during a run).

What must hold, publish by publish (docs/design.md, "Enqueue guards"): a publish is deduped
only into a task whose work is still to come, never into one whose body had begun
(``until="start"``) or whose run had ended (``until="finish"``) before the publish was made;
every message the broker took runs exactly once; and once all is done, no guard is left that
anybody could dedupe into.  The storm test of test_enqueue checks the same end to end, where
its windows are a few microseconds wide; here they are stretched, and a late confirm that
landed on another publisher's guard (found by the fresh-clone CI as that storm test failing)
shows in every run."""

from __future__ import annotations

import queue
import random
import threading
import time
import uuid

import pytest

from celery_zklock.engine import guards
from celery_zklock.engine.guards import Guard, TakeOutcome

PAUSES = (0.0, 0.0, 0.0, 0.0005, 0.002, 0.01)


@pytest.mark.parametrize("until", ["start", "finish"])
def test_no_publish_is_deduped_into_work_already_done(clients, until):
    root = f"/g-interleave-{uuid.uuid4().hex[:8]}"
    keys = [guards.guard_path(root, "t", f"k:{i}") for i in range(3)]
    broker: queue.Queue = queue.Queue()
    rows: list = []  # (path, mine, got, made_at)
    begun: dict[str, float] = {}  # task id -> when its body began (start returned)
    ended: dict[str, float] = {}  # task id -> when its run ended (finish returned)
    runs: list[str] = []
    def publisher(seed: int) -> None:
        zk, rnd = clients(), random.Random(seed)
        for _ in range(60):
            path, mine = rnd.choice(keys), str(uuid.uuid4())
            made_at = time.time()
            guard = Guard(mine, "t", until, time.time() + 3600, 0, time.time())
            taken = guards.take(zk, [path], guard)
            if taken.outcome is TakeOutcome.HELD:
                rows.append((path, mine, taken.found.id, made_at))
                continue
            broker.put((path, mine))  # the broker has the message: a worker may run it now
            time.sleep(rnd.choice(PAUSES))  # the publisher is slow to confirm
            guards.confirm(zk, taken, guard)
            rows.append((path, mine, mine, made_at))

    def worker(seed: int) -> None:
        zk, rnd = clients(), random.Random(seed)
        while True:
            item = broker.get()
            if item is None:
                return
            path, task_id = item
            time.sleep(rnd.choice(PAUSES))  # a pause drawn before the worker's start
            guards.start(zk, [path], task_id, 0, until)
            begun[task_id] = time.time()
            runs.append(task_id)
            time.sleep(rnd.choice(PAUSES))  # the body
            if until == "finish":
                guards.release(zk, [path], task_id, 0, running=True)
                ended[task_id] = time.time()

    checker = clients()
    workers = [threading.Thread(target=worker, args=(100 + i,)) for i in range(2)]
    publishers = [threading.Thread(target=publisher, args=(i,)) for i in range(6)]
    for t in workers + publishers:
        t.start()
    for t in publishers:
        t.join(120)
    for _ in workers:
        broker.put(None)
    for t in workers:
        t.join(120)
    queued = sorted(mine for _p, mine, got, _m in rows if got == mine)
    assert len(rows) == 360 and sorted(runs) == queued  # every message the broker took ran once
    done = begun if until == "start" else ended
    late = [(got, round(made_at - done[got], 4)) for _p, mine, got, made_at in rows
            if got != mine and got in done and made_at > done[got]]
    assert not late, f"{len(late)} publishes deduped into work already under way or done, e.g. {late[:3]}"
    assert len(queued) < len(rows)  # deduping did happen
    for path in keys:  # what is left names nobody: a publish now queues again
        if checker.exists(path) is not None:
            raw, stat = checker.get(path)
            assert guards.misplaced(Guard.loads(raw), stat.czxid), (path, Guard.loads(raw), stat)
