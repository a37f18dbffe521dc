"""Scenario 4: SIGKILL the prefork child that holds the lock; how long until the key is usable?

Why this matters: OOM kills and hard time limits SIGKILL pool children; nothing runs in
the child, so a lock released in ``finally``/``after_return``/``on_success`` stays held.
The measure is the time from the SIGKILL to the start of the next task on the same key:

* waiting locks (ZkLockedTask, naive kazoo Lock): a second task is already queued on the
  lock in another pool child before the kill (that is how they are used), and we wait
  for its body to start;
* reject-style peers (celery-once, celery-singleton) cannot queue a second task: its
  publish is refused while the lock exists.  We re-publish every 0.25 s (the best a
  caller can do) and wait for one to be accepted and start.

Waits are capped (60 s in a full run); a contender that has not recovered by then is
reported as still blocked (its ``recovery_s`` is null, ``waited_s`` is the cap).
Only pool children of our own workers are ever killed (checked against /proc).
"""

from __future__ import annotations

import json
import os
import signal
import time

from .celery_scenarios import Driver, Sizes
from .infra import Workers, log

HOLD_MS = 600_000  # the holder would hold for 10 minutes if not killed
RETRY_EVERY = 0.25


class Events:
    """The ``joined``/``start`` announcements of the tasks of one tag, read from Redis."""

    def __init__(self, d: Driver, tag: str) -> None:
        self.d, self.key, self.seen = d, f"bench:events:{tag}", []

    def find(self, kind: str, task_id: str, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while True:
            for ev in self.seen:
                if ev["kind"] == kind and ev["id"] == task_id:
                    return ev
            left = deadline - time.monotonic()
            if left <= 0:
                # A look without waiting still reads what has arrived (timeout=0 used to
                # return before reading anything: a recovered key was never seen).
                got = self.d.redis.lpop(self.key)
                if got is None:
                    return None
                self.seen.append(json.loads(got))
                continue
            got = self.d.redis.blpop([self.key], timeout=max(0.01, min(left, 0.05)))
            if got is not None:
                self.seen.append(json.loads(got[1]))


def kill_child(workers: Workers, pid: int) -> float:
    """SIGKILL pool child ``pid`` of one of our workers; returns the wall-clock kill time."""
    ours = {c for children in workers.pids().values() for c in children}
    if pid not in ours:
        raise RuntimeError(f"pid {pid} is not a pool child of our workers ({sorted(ours)})")
    at = time.time()
    os.kill(pid, signal.SIGKILL)
    return at


def start_holder(d: Driver, contender: str, key: str, tag: str, events: Events) -> dict:
    holder = d.publish(contender, key, tag, "hold", HOLD_MS, announce=True)
    if holder is None:
        raise RuntimeError(f"{contender}: the holder task itself was refused")
    started = events.find("start", holder, timeout=60)
    if started is None:
        raise RuntimeError(f"{contender}: the holder task did not start")
    return started


def queued_waiter_recovery(d: Driver, workers: Workers, contender: str, cap: float) -> float | None:
    """Kill the holder while a same-key task waits on the lock; seconds until it starts."""
    tag = d.new_tag("loss")
    key, events = f"loss-{tag}", Events(d, tag)
    holder = start_holder(d, contender, key, tag, events)
    waiter = d.publish(contender, key, tag, "hold", 10, announce=True)
    # ZkLockedTask waits in the worker's lock agent, not in a pool child: no "joined" there.
    if events.find("joined", waiter, timeout=2 if contender == "zklock" else 60) is None and contender != "zklock":
        raise RuntimeError(f"{contender}: the waiting task never reached a pool child")
    time.sleep(0.5)  # its lock node and watch are in place well before this
    if events.find("start", waiter, timeout=0) is not None:
        raise RuntimeError(f"{contender}: the second task ran while the first held the lock")
    killed = kill_child(workers, holder["pid"])
    started = events.find("start", waiter, timeout=cap)
    return None if started is None else started["at"] - killed


def republish_recovery(d: Driver, workers: Workers, contenders: list[str], cap: float) -> dict[str, dict]:
    """Kill each holder, then re-publish the same key every 0.25 s until one run starts."""
    state = {}
    for c in contenders:
        tag = d.new_tag("loss")
        events = Events(d, tag)
        holder = start_holder(d, c, f"loss-{tag}", tag, events)
        state[c] = {"tag": tag, "events": events, "holder": holder, "accepted": None, "refused": 0}
    for c in contenders:
        state[c]["killed"] = kill_child(workers, state[c]["holder"]["pid"])
    out: dict[str, dict] = {}
    while len(out) < len(contenders):
        for c in contenders:
            st = state[c]
            if c in out:
                continue
            waited = time.time() - st["killed"]
            if st["accepted"] is None:
                st["accepted"] = d.publish(c, f"loss-{st['tag']}", st["tag"], "hold", 10, announce=True)
                st["refused"] += st["accepted"] is None
            started = st["accepted"] and st["events"].find("start", st["accepted"], timeout=0)
            if started:
                out[c] = {"recovery_s": round(started["at"] - st["killed"], 4), "refused_publishes": st["refused"]}
            elif waited >= cap:
                out[c] = {"recovery_s": None, "refused_publishes": st["refused"]}
        time.sleep(RETRY_EVERY)
    return out


def worker_loss(d: Driver, workers: Workers, s: Sizes) -> dict:
    out: dict[str, dict] = {}
    samples = []
    for i in range(s.loss_repeats):
        log(f"  ZkLockedTask: kill the holder with a waiter queued ({i + 1}/{s.loss_repeats})")
        samples.append(queued_waiter_recovery(d, workers, "zklock", s.loss_cap))
    out["zklock"] = entry(samples, s.loss_cap, "waiter queued on the lock before the kill")
    log(f"  naive kazoo Lock: kill the holder with a waiter queued (cap {s.loss_cap:.0f}s)")
    out["naive"] = entry([queued_waiter_recovery(d, workers, "naive", s.loss_cap)], s.loss_cap,
                         "waiter queued on the lock before the kill")
    log(f"  celery-once, celery-singleton: kill the holders, re-publish every {RETRY_EVERY}s (cap {s.loss_cap:.0f}s)")
    for c, res in republish_recovery(d, workers, ["once", "singleton"], s.loss_cap).items():
        out[c] = entry([res["recovery_s"]], s.loss_cap,
                       f"same-key publish refused {res['refused_publishes']} times after the kill")
    for c in out:
        out[c]["label"] = d.label[c]
    return {"contenders": out, "cap_s": s.loss_cap,
            "not_applicable": {"plain": "no lock: nothing to recover (and no exclusion)"}}


def entry(samples: list[float | None], cap: float, how: str) -> dict:
    """One contender's result; ``recovery_s`` is the worst sample, null if any stayed blocked."""
    blocked = any(x is None for x in samples)
    worst = None if blocked else max(samples)
    return {
        "recovery_s": None if worst is None else round(worst, 4),
        "samples_s": [None if x is None else round(x, 4) for x in samples],
        "still_blocked": blocked,
        "waited_s": cap if blocked else round(worst, 4),
        "how": how,
    }
