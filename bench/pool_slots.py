"""Scenario: does a hot key take the worker hostage?  Waiting in the agent vs in the pool.

Why: with prefork, a locked task that waits for its lock inside a pool process holds that
process; a hot key with many queued tasks then occupies every slot and tasks on other
keys wait behind the hot chain.  ``zklock_wait_in="worker"`` (the default) queues in the
worker's lock agent instead.  The workload (from the issue): 2 workers x ``prefork -c 3``,
one hot key with ``hot`` tasks of ``ms`` each, interleaved with ``cold`` tasks on distinct
keys of ``ms`` each, all published at once.  Both modes run on the same services in the
same run.

Figures per mode: the distinct-key tasks' p95 latency (publish -> done) against the ideal
(their total work spread over the slots the hot chain leaves: cold x ms / (slots - 1)),
the hot chain's efficiency (its total work / its makespan), the makespan, and ZooKeeper
sessions per worker (``cons`` on the server, with the workers up, minus before).  Each mode
runs the workload ``rounds`` times on the same workers; the figures are the medians (a p95 of
120 tasks on a shared 2-core machine varies by tens of percent from run to run).
"""

from __future__ import annotations

import statistics
import time

from .infra import Services, Workers, log
from .lock_bench import percentile

SLOTS_PER_WORKER = 3
WORKERS = 2


def _connections(services: Services) -> int:
    from celery_zklock.testing import four_letter_word

    host, port = services.zk_hosts.rsplit(":", 1)
    out = four_letter_word(host, int(port), "cons")
    return sum(1 for line in out.splitlines() if line.strip().startswith("/"))


def run(services: Services, driver, hot: int, cold: int, ms: float, rounds: int = 3) -> dict:
    """Each mode with its own workers; the workload ``rounds`` times per mode (medians)."""
    out = {}
    slots = SLOTS_PER_WORKER * WORKERS
    ideal = cold * ms / 1000.0 / (slots - 1)
    for mode in ("worker", "pool"):
        before = _connections(services)
        workers = Workers({**services.env(), "BENCH_ZK_WAIT_IN": mode}, count=WORKERS, concurrency=SLOTS_PER_WORKER)
        log(f"  mixed workload, waiting in the {mode}: 2 workers x prefork -c 3, {rounds} round(s)")
        samples = []
        try:
            workers.start(driver.app)
            warm = driver.new_tag("warm-slots")  # ZkLockedTask only: other contenders open sessions of their own
            driver.records(warm, sum(driver.publish("zklock", f"w-{warm}-{i}", warm) is not None for i in range(12)), 60)
            sessions = (_connections(services) - before) / WORKERS
            for _ in range(rounds):
                samples.append(_round(driver, hot, cold, ms, ideal))
        finally:
            workers.stop()
        out[mode] = {
            "label": f"wait in the {mode}",
            **{k: round(statistics.median(s[k] for s in samples), 3) for k in samples[0]},
            "ideal_cold_p95_s": round(ideal, 3),
            "cold_p95_vs_ideal_runs": [s["cold_p95_vs_ideal"] for s in samples],
            "hot_efficiency_runs": [s["hot_efficiency"] for s in samples],
            "zk_sessions_per_worker": sessions,
        }
    return {"hot": hot, "cold": cold, "ms": ms, "slots": slots, "rounds": rounds, "modes": out}


def _round(driver, hot: int, cold: int, ms: float, ideal: float) -> dict:
    tag = driver.new_tag("mixed")
    published: dict[str, float] = {}
    hot_key = f"hot-{tag}"
    order = ["hot" if i % 3 == 0 else "cold" for i in range(hot + cold)]  # interleaved, 1 hot : 2 cold
    h = c = 0
    for kind in order:
        if kind == "hot" and h < hot:
            n, h = hot_key, h + 1
        elif c < cold:
            n, c = f"cold-{tag}-{c}", c + 1
        else:
            n, h = hot_key, h + 1
        published[driver.publish("zklock", n, tag, "hold", ms)] = time.time()
    rows = driver.records(tag, hot + cold, timeout=300)
    hot_rows = [r for r in rows if r["n"] == hot_key]
    cold_rows = [r for r in rows if r["n"] != hot_key]
    cold_lat = [r["done"] - published[r["id"]] for r in cold_rows]
    hot_span = max(r["end"] for r in hot_rows) - min(r["start"] for r in hot_rows)
    start = min(published.values())
    return {
        "cold_p50_s": percentile(cold_lat, 50),
        "cold_p95_s": percentile(cold_lat, 95),
        "cold_p95_vs_ideal": round(percentile(cold_lat, 95) / ideal, 2),
        "hot_chain_s": hot_span,
        "hot_efficiency": round(hot * ms / 1000.0 / hot_span, 2),
        "makespan_s": max(r["done"] for r in rows) - start,
    }
