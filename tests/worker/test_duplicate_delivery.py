"""Two deliveries of one task id at once (a publish repeated with a fixed ``task_id``, as
idempotency keys do), real workers, Redis and ZooKeeper.  Why: the second delivery, arriving
while the first waits in the lock agent, goes straight to the pool (the worker holds one
request per id aside); its pool process used to claim the agent's wait by task id, which is
the *first* delivery's, and run on its grant, while the main process handed the first one
over with the same grant, carried: two bodies of one key at once, the second told "lost"
only after it had started."""

from __future__ import annotations

import uuid

from support.workers import Worker
from tests.lockedapp import history, in_broker
from tests.lockutil import overlapping
from tests.polling import wait_until


def test_two_deliveries_of_one_task_id_never_run_at_once(mod, env):
    """-c 2, both processes busy for 150 ms: the two deliveries arrive together on a free key;
    the first waits in the agent and is granted at once (its grant carried with it), the
    second goes to the pool's queue ahead of it.  Both processes free together, well within
    the carried grant's lease: the second claims by task id, the first starts on its grant."""
    mod._r.delete("history")
    w = Worker(env, "dup", concurrency=2).start(mod.app)
    try:
        for _ in range(5):
            key = "dup-" + uuid.uuid4().hex[:6]
            busy = [mod.plain_hold.delay(f"busy-{key}-{i}", 150, "busy") for i in range(2)]
            wait_until(lambda: in_broker(mod) == 0, 5, interval=0.005, what="the busy tasks at the worker first")
            task_id = "dup-" + uuid.uuid4().hex
            for _ in range(2):
                mod.hold.apply_async((key, 300, "dup"), task_id=task_id)
            for b in busy:
                b.get(timeout=30)

            def runs(key: str = key):
                return [r for r in history(mod, "hold") if r["key"] == key]

            wait_until(lambda: len(runs()) == 2, 20, "both deliveries ran")
            rows = runs()
            assert overlapping([(r["start"], r["end"]) for r in rows]) is None, rows
    finally:
        w.stop()
