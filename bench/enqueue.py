"""Scenario 12: enqueue-time singletons, side by side with the peers that lock at enqueue.

Contenders: ours (``lock_enqueue="dedupe"``, ``lock_enqueue_until="finish"``: at most one
queued or running per key, celery-once's semantics), celery-once (``QueueOnce``, graceful)
and celery-singleton (``Singleton``); plain Celery is the publish-cost baseline.

* **Publish cost per call**: each contender publishes ``n`` tasks on distinct keys (every
  publish queues: ours creates a guard znode, the peers a Redis key) and ``n`` on one key
  (the first queues, every other is deduped or refused), to a queue no worker reads.
* **Storm**: 8 processes publish 1,000 each on 10 keys, nothing consumes; the messages each
  key's queue holds afterwards (1 = no duplicate).
* **After a SIGKILL of the running worker process**: scenario 4's re-publish probe (every
  0.25 s until one is accepted and starts), run for ours and the peers.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
import uuid

from .celery_scenarios import Driver
from .infra import Workers, log
from .worker_loss import entry, republish_recovery

PEERS = ("once", "singleton")


def _publish(d: Driver, contender: str, n: str, queue: str) -> bool:
    """One publish to ``queue``; True if it queued a new task (not deduped or refused)."""
    task_id = uuid.uuid4().hex
    result = d.mod.task(contender, "trivial").apply_async(args=(n,), kwargs={"tag": "enq"}, task_id=task_id,
                                                          queue=queue, connection=d.connection)
    return getattr(result, "id", None) == task_id


def _cost(d: Driver, contender: str, calls: int) -> dict:
    tag = uuid.uuid4().hex[:8]
    queue = f"bench-enq-idle-{tag}"
    out = {}
    for shape in ("distinct", "same"):
        times, queued = [], 0
        for i in range(calls):
            key = f"{tag}-{i}" if shape == "distinct" else f"{tag}-one"
            t0 = time.perf_counter()
            queued += _publish(d, contender, key, queue)
            times.append((time.perf_counter() - t0) * 1000)
        times.sort()
        out[shape] = {"p50_ms": round(statistics.median(times), 3), "p99_ms": round(times[int(0.99 * (len(times) - 1))], 3),
                      "queued": queued}
    d.redis.delete(queue)
    return out


def _storm_part(args) -> int:
    env, contender, keys, calls, queue_of = args
    os.environ.update(env)
    from . import celery_scenarios

    d = celery_scenarios.Driver(env)
    sent = 0
    for i in range(calls):
        key = keys[i % len(keys)]
        sent += _publish(d, contender, key, queue_of + key)
    return sent


def _storm(d: Driver, env: dict, contender: str, procs: int, calls: int) -> dict:
    tag = uuid.uuid4().hex[:8]
    keys = [f"{tag}-{i}" for i in range(10)]
    queue_of = f"bench-enq-storm-{tag}-"
    ctx = multiprocessing.get_context("spawn")
    t0 = time.monotonic()
    with ctx.Pool(procs) as pool:
        accepted = sum(pool.map(_storm_part, [(env, contender, keys, calls, queue_of)] * procs))
    elapsed = time.monotonic() - t0
    per_key = [d.redis.llen(queue_of + k) for k in keys]
    for k in keys:
        d.redis.delete(queue_of + k)
    return {"publishes": procs * calls, "accepted": accepted, "queued_per_key_max": max(per_key),
            "queued_total": sum(per_key), "duplicates_queued": sum(max(0, c - 1) for c in per_key),
            "publishes_per_s": round(procs * calls / elapsed, 1)}


def run(d: Driver, workers: Workers, env: dict, quick: bool) -> dict:
    calls = 50 if quick else 300
    contenders = ["plain", "dedupe", *PEERS]
    cost = {}
    for c in contenders:
        log(f"  publish cost: {c}, {calls} calls on distinct keys and {calls} on one key")
        cost[c] = _cost(d, c, calls)
    plain = cost["plain"]["distinct"]["p50_ms"]
    for c in contenders:
        for shape in ("distinct", "same"):
            cost[c][shape]["vs_plain_p50"] = round(cost[c][shape]["p50_ms"] / plain, 2) if plain else None
    procs, per = (4, 100) if quick else (8, 1000)
    storm = {}
    for c in ["dedupe", *PEERS]:
        log(f"  storm: {c}, {procs} processes x {per} publishes on 10 keys, nothing consumes")
        storm[c] = _storm(d, env, c, procs, per)
    cap = 3.0 if quick else 20.0
    log(f"  SIGKILL of the running pool process, then re-publish every 0.25 s (cap {cap:.0f}s)")
    recovery = {c: entry([r["recovery_s"]], cap, f"same-key publish deduped/refused {r['refused_publishes']} times")
                for c, r in republish_recovery(d, workers, ["dedupe", *PEERS], cap).items()}
    labels = {**d.label, **d.mod.ENQUEUE}
    return {"publish_cost": cost, "storm": storm, "after_sigkill": recovery, "cap_s": cap,
            "labels": {c: labels[c] for c in contenders}}
