"""Turn the results dict into ``latest.json``, the Markdown report and the PNG plots.

Why one module decides the verdicts: every target of issue 5 is judged here, from the
numbers of one run (ratios against the baseline measured in the same run), and the same
list of verdicts goes to the JSON and to the Markdown table -- a target that is not met
says so in both, with its number.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from . import floor, lock_bench

SCENARIO_TITLES = {
    "overhead": "1. Per-task overhead, no contention (distinct keys)",
    "hot_key": "2. One hot key",
    "fairness": "3. Fairness under contention",
    "worker_loss": "4. Worker loss (SIGKILL of the child holding the lock)",
    "scale": "5. Scale",
    "pool_slots": "6. A hot key beside other keys: waiting in the worker's lock agent vs in the pool",
    "lock_engine": "7. Lock engine micro-benchmarks (bench/lock_bench.py)",
    "flash_sale": "8. The flash-sale demo's workload: waiting in the worker vs in the pool",
    "tls": "9. TLS to ZooKeeper: what it costs against plaintext",
    "burst": "10. A burst on one key (lock cohorting): waiting in the worker vs in the pool",
    "flash_sale_rabbitmq": "11. The flash-sale workload on RabbitMQ",
    "burst_rabbitmq": "12. The burst on one key on RabbitMQ",
    "enqueue": "13. Enqueue-time singletons (lock_enqueue) beside celery-once and celery-singleton",
    "design_floor": "14. The design's floor: the lock agent's chain with no lock logic (bench/skeleton_app.py)",
}

#: Scenarios run a second time on RabbitMQ: same tables, notes and targets as the first.
SAME_AS = {"flash_sale_rabbitmq": "flash_sale", "burst_rabbitmq": "burst"}


# ------------------------------------------------------------------ verdicts
def _target(scenario: str, contender: str, target: str, met: bool | None, value: str) -> dict:
    return {"scenario": scenario, "contender": contender, "target": target, "met": met, "value": value}


def targets(results: dict) -> list[dict]:
    """Every target of the issue, judged on this run's numbers (missing data = not met)."""
    sc = results["scenarios"]
    out = []
    if "overhead" in sc:
        o = sc["overhead"]["contenders"]
        zk, plain, naive = o["zklock"], o["plain"], o["naive"]
        out.append(_target("overhead", "ZkLockedTask", "throughput >= 0.8x plain Celery",
                           zk["throughput_vs_plain"] >= 0.8,
                           f"{zk['throughput_vs_plain']:.2f}x ({zk['throughput_per_s']:.0f} vs "
                           f"{plain['throughput_per_s']:.0f} tasks/s)"))
        vs_naive = zk["throughput_per_s"] / naive["throughput_per_s"]
        out.append(_target("overhead", "ZkLockedTask", "throughput > naive kazoo Lock task", vs_naive > 1.0,
                           f"{vs_naive:.2f}x ({zk['throughput_per_s']:.0f} vs {naive['throughput_per_s']:.0f} tasks/s)"))
    if "hot_key" in sc:
        h = sc["hot_key"]["contenders"]["zklock"]
        out.append(_target("hot_key", "ZkLockedTask", "makespan >= 0.9 of ideal (ideal / makespan)",
                           (h["efficiency"] or 0) >= 0.9,
                           f"{h['efficiency']:.3f} ({h['ideal_s']:.2f} s ideal / {h['makespan_s']:.2f} s)"))
        out.append(_target("hot_key", "ZkLockedTask", "zero FIFO inversions", h["fifo_inversions"] == 0,
                           f"{h['fifo_inversions']} of {h['ran']} tasks (clock-based: {h['clock_inversions']})"))
        out.append(_target("hot_key", "ZkLockedTask", "mutual exclusion: zero overlapping runs", h["overlaps"] == 0,
                           str(h["overlaps"])))
    if "hot_key" in sc:
        h = sc["hot_key"]["contenders"]["zklock"]
        out.append(_target("hot_key", "ZkLockedTask (lock cohorting)", "ideal / makespan >= 0.95 (issue 24)",
                           (h["efficiency"] or 0) >= 0.95, f"{h['efficiency']:.3f}"))
    if "overhead" in sc:
        zk = sc["overhead"]["contenders"]["zklock"]
        out.append(_target("overhead", "ZkLockedTask (lock cohorting)",
                           "distinct keys: >= 0.55x plain and <= 2.5 ZooKeeper requests per task (issue 24)",
                           zk["throughput_vs_plain"] >= 0.55 and zk["zk_requests_per_task"] <= 2.5,
                           f"{zk['throughput_vs_plain']:.2f}x; {zk['zk_requests_per_task']} requests/task"))
    if "fairness" in sc:
        f = sc["fairness"]["contenders"][next(iter(sc["fairness"]["contenders"]))]
        out.append(_target("fairness", f["label"], "0% consecutive holds by the same process",
                           f["same_holder_pct"] == 0, f"{f['same_holder_pct']:.2f}% of {f['holds']} holds"))
        out.append(_target("fairness", f["label"], "max wait <= 1.5x the fair bound",
                           f["max_wait_vs_fair_bound"] <= 1.5,
                           f"{f['max_wait_vs_fair_bound']:.2f}x ({f['wait_max_ms']:.1f} ms vs bound "
                           f"{f['fair_bound_ms']:.1f} ms; {f['queue_jumps']} queue jumps; "
                           f"longest gap {f['longest_gap_ms']:.1f} ms; "
                           f"ZooKeeper write max {sc['fairness']['zookeeper']['update_latency_max_ms']:.0f} ms)"))
        out.append(_target("fairness", f["label"], "max wait <= 2x the fair bound (issue 27)",
                           f["max_wait_vs_fair_bound"] <= 2.0, f"{f['max_wait_vs_fair_bound']:.2f}x"))
    if "worker_loss" in sc:
        w = sc["worker_loss"]["contenders"]["zklock"]
        value = "still blocked" if w["still_blocked"] else f"{w['recovery_s'] * 1000:.0f} ms (worst of {len(w['samples_s'])})"
        out.append(_target("worker_loss", "ZkLockedTask", "next same-key task starts < 1 s after SIGKILL",
                           (not w["still_blocked"]) and w["recovery_s"] < 1.0, value))
    if "enqueue" in sc:
        e = sc["enqueue"]
        st = e["storm"]["dedupe"]
        out.append(_target("enqueue", 'ZkLockedTask lock_enqueue="dedupe"',
                           f"no duplicate queued in a storm ({st['publishes']} publishes, 10 keys)",
                           st["duplicates_queued"] == 0, f"{st['duplicates_queued']} duplicates, max {st['queued_per_key_max']} per key"))
        rec = e["after_sigkill"]["dedupe"]
        out.append(_target("enqueue", 'ZkLockedTask lock_enqueue="dedupe"',
                           "the key accepts a publish < 1 s after SIGKILL of the running process",
                           (not rec["still_blocked"]) and rec["recovery_s"] < 1.0,
                           "still blocked" if rec["still_blocked"] else f"{rec['recovery_s'] * 1000:.0f} ms"))
    if "scale" in sc:
        s = sc["scale"]
        wt = s["one_key_waiters"]
        out.append(_target("scale", "ZkLockedTask engine", f"exactly one notification per release ({wt['waiters']} waiters)",
                           wt["max_notifications_per_release"] == 1 and wt["releases_with_none"] == 0,
                           f"mean {wt['notifications_per_release']}, max {wt['max_notifications_per_release']}, "
                           f"{wt['releases_with_more_than_one']} releases woke >1, {wt['releases_with_none']} woke none"))
        zk = s["contenders"]["zklock"]
        out.append(_target("scale", "ZkLockedTask", f"no znodes left after {zk['keys']} distinct keys",
                           zk["znodes_left"] <= 0, f"{zk['znodes_left']:+d} ({zk['znodes_before']} -> {zk['znodes_after']})"))
        out.append(_target("scale", "ZkLockedTask engine", "no znodes left after the one-key waiters",
                           wt["znodes_left"] <= 0, f"{wt['znodes_left']:+d}"))
        mk = s.get("many_keys")
        if mk:
            out.append(_target("scale", "ZkLockedTask engine",
                               f"one process waits on {mk['keys']} keys ({mk['waiters']} waiters) with a bounded thread count "
                               "(no more than with one waiter), every waiter granted in FIFO order",
                               mk["threads_with_all_waiting"] <= mk.get("threads_one_waiting", mk["threads_idle_client"])
                               and mk["fifo_violations"] == 0
                               and mk["granted_while_holder_held"] == 0 and mk["not_waiting_before_release"] == 0,
                               f"{mk['threads_with_all_waiting']} threads with all waiting "
                               f"({mk.get('threads_one_waiting', '?')} with one waiter, {mk['threads_idle_client']} "
                               f"idle); {mk['fifo_violations']} FIFO violations; last grant "
                               f"{mk['release_to_last_grant_s']} s after the holder's release began"))
    if "pool_slots" in sc:
        m = sc["pool_slots"]["modes"]
        w, p = m["worker"], m["pool"]
        out.append(_target("pool_slots", "ZkLockedTask (wait in the worker)", "distinct-key p95 <= 1.2x ideal beside a hot key",
                           w["cold_p95_vs_ideal"] <= 1.2,
                           f"{w['cold_p95_vs_ideal']}x ({w['cold_p95_s']} s vs ideal {w['ideal_cold_p95_s']} s); "
                           f"in the pool: {p['cold_p95_vs_ideal']}x"))
        out.append(_target("pool_slots", "ZkLockedTask (wait in the worker)", "hot-chain efficiency at least in-pool's",
                           w["hot_efficiency"] >= p["hot_efficiency"] * 0.95,
                           f"{w['hot_efficiency']} vs {p['hot_efficiency']} in the pool"))
        out.append(_target("pool_slots", "ZkLockedTask (wait in the worker)", "1 ZooKeeper session per worker",
                           w["zk_sessions_per_worker"] == 1,
                           f"{w['zk_sessions_per_worker']} (in the pool: {p['zk_sessions_per_worker']})"))
    if "overhead" in sc:
        zk = sc["overhead"]["contenders"]["zklock"]
        out.append(_target("overhead", "ZkLockedTask (wait in the worker)",
                           "per-task overhead: throughput >= 0.41x plain (issue 13: at least what waiting in the pool gave)",
                           zk["throughput_vs_plain"] >= 0.41,
                           f"{zk['throughput_vs_plain']:.2f}x; {zk['cpu_workers_ms_per_task']} ms worker CPU and "
                           f"{zk['zk_requests_per_task']} ZooKeeper requests per task"))
    for fs_name in ("flash_sale", "flash_sale_rabbitmq"):
        if fs_name not in sc:
            continue
        f = sc[fs_name]
        w, p, u = f["modes"]["worker"], f["modes"]["pool"], f["modes"].get("plain")
        out.append(_target(fs_name, "ZkLockedTask (wait in the worker)", "orders/s >= 2x waiting in the pool",
                           w["orders_per_s"] >= 2 * p["orders_per_s"],
                           f"{f['worker_vs_pool']}x ({w['orders_per_s']:.0f} vs {p['orders_per_s']:.0f} orders/s)"))
        if u is not None:
            out.append(_target(fs_name, "ZkLockedTask (wait in the worker)",
                               "orders/s >= 0.6x the same body with no lock (oversells)",
                               w["orders_per_s"] >= 0.6 * u["orders_per_s"],
                               f"{f['worker_vs_plain']}x ({w['orders_per_s']:.0f} vs {u['orders_per_s']:.0f} orders/s)"))
        out.append(_target(fs_name, "ZkLockedTask (wait in the worker)",
                           "enqueue->start p50 <= 0.5 s after publishing ends",
                           w["enqueue_to_start_p50_s"] - w["enqueue_s"] <= 0.5,
                           f"{w['enqueue_to_start_p50_s']:.2f} s from enqueue (in the pool {p['enqueue_to_start_p50_s']:.2f} s; "
                           f"publishing the burst took {w['enqueue_s']:.2f} s)"))
    for b_name in ("burst", "burst_rabbitmq"):
        if b_name not in sc:
            continue
        b = sc[b_name]
        w, p = b["modes"]["worker"], b["modes"]["pool"]
        safe = w["ran_exactly_once"] and w["overlaps"] == 0 and w["tokens_strictly_increasing"]
        out.append(_target(b_name, "ZkLockedTask (wait in the worker)",
                           f"{b['tasks']} tasks on one key: all exactly once, 0 overlaps, tokens strictly increasing",
                           safe, f"once: {w['ran_exactly_once']}, overlaps {w['overlaps']}, "
                                 f"tokens increasing: {w['tokens_strictly_increasing']}"))
        out.append(_target(b_name, "ZkLockedTask (wait in the worker)", "children under the key <= 2 per worker",
                           w["children_max"] <= 2 * w["workers"],
                           f"max {w['children_max']} in {w['children_samples']} samples, {w['workers']} workers "
                           f"(znodes max {w['znodes_max']}, ZooKeeper RSS max {w['zookeeper_rss_mib_max']} MiB)"))
        plain = b["modes"].get("plain")
        ceiling = (f"; no lock at all (overlaps): {plain['tasks_per_s']:.0f} tasks/s, ours {b['worker_vs_plain']}x of it"
                   if plain else "")
        out.append(_target(b_name, "ZkLockedTask (wait in the worker)", "throughput >= 2x waiting in the pool",
                           w["tasks_per_s"] >= 2 * p["tasks_per_s"],
                           f"{b['worker_vs_pool']}x ({w['tasks_per_s']:.0f} vs {p['tasks_per_s']:.0f} tasks/s{ceiling})"))
        if w.get("grant_share_min") is not None:
            out.append(_target(b_name, "ZkLockedTask (wait in the worker)",
                               "fairness across workers: each gets 40-60% of the grants while all wait",
                               0.4 <= w["grant_share_min"] and w["grant_share_max"] <= 0.6,
                               f"{w['grant_share_min']:.0%} / {w['grant_share_max']:.0%} of "
                               f"{w['grants_while_all_waited']} grants; longest run on one worker "
                               f"{w['longest_streak']} (bound: zklock_cohort_handoffs + 1, while another "
                               f"worker queues){_past_bound(w)}"))
    if "lock_engine" in sc:
        for t in sc["lock_engine"].get("targets", []):
            out.append(_target("lock_engine", t["contender"], t["target"], t["met"], t["value"]))
    return out + issue_39(sc)


def issue_39(sc: dict) -> list[dict]:
    """Issue 39's targets: the price of a lock per task, and a hot key beside other keys."""
    out = []
    who = "ZkLockedTask (issue 39)"
    if "overhead" in sc:
        o = sc["overhead"]["contenders"]
        zk, plain = o["zklock"], o["plain"]
        peers = [o[c]["throughput_vs_plain"] for c in ("once", "singleton") if c in o]
        out.append(_target("overhead", who, "distinct keys: throughput >= 0.6x plain Celery",
                           zk["throughput_vs_plain"] >= 0.6,
                           f"{zk['throughput_vs_plain']:.2f}x (celery-once {peers[0] if peers else '-'}x, "
                           f"celery-singleton {peers[1] if len(peers) > 1 else '-'}x"
                           + (f"; with all of our code free {sc['overhead']['floor']['ceiling_zookeeper_kazoo']}x"
                              if sc["overhead"].get("floor") else "")
                           + (f"; the design's floor {_skeleton(sc, 'distinct')}x" if _skeleton(sc, "distinct") else "")
                           + (f"; another design's floor, the lock in the main process with no agent, {main}x"
                              if (main := _skeleton(sc, "distinct", MAIN)) else "")
                           + ")"))
        out.append(_target("overhead", who, "worker CPU per task <= 4.5 ms", zk["cpu_workers_ms_per_task"] <= 4.5,
                           f"{zk['cpu_workers_ms_per_task']} ms (plain {plain['cpu_workers_ms_per_task']} ms)"))
        out.append(_target("overhead", who, "ZooKeeper requests per task <= 2.5", zk["zk_requests_per_task"] <= 2.5,
                           f"{zk['zk_requests_per_task']}"))
    if "pool_slots" in sc:
        w = sc["pool_slots"]["modes"]["worker"]
        out.append(_target("pool_slots", who, "mixed: distinct-key p95 <= 1.3x ideal, hot chain efficiency >= 0.85",
                           w["cold_p95_vs_ideal"] <= 1.3 and w["hot_efficiency"] >= 0.85,
                           f"{w['cold_p95_vs_ideal']}x; hot chain {w['hot_efficiency']}"))
    if "hot_key" in sc:
        h = sc["hot_key"]["contenders"]["zklock"]
        out.append(_target("hot_key", who, "one hot key: ideal / makespan >= 0.92", (h["efficiency"] or 0) >= 0.92,
                           f"{h['efficiency']:.3f}"))
    for fs_name in ("flash_sale", "flash_sale_rabbitmq"):
        u = sc.get(fs_name, {}).get("modes", {}).get("plain")
        if u is not None:
            w = sc[fs_name]["modes"]["worker"]
            floor_hot = _skeleton(sc, "hot")
            out.append(_target(fs_name, who, "flash sale: orders/s >= 0.7x the same body with no lock",
                               w["orders_per_s"] >= 0.7 * u["orders_per_s"], f"{sc[fs_name]['worker_vs_plain']}x"
                               + (f" (five hot keys in scenario 14: ours {_skeleton(sc, 'hot', 'zklock')}x, the "
                                  f"design's floor {floor_hot}x"
                                  + (f", with ours' six messages {six}x" if (six := _skeleton(sc, 'hot', SIX)) else "")
                                  + ")" if floor_hot else "")))
    for b_name in ("burst", "burst_rabbitmq"):
        if b_name in sc:
            b = sc[b_name]
            out.append(_target(b_name, who, "burst on one key: >= 2x waiting in the pool",
                               b["modes"]["worker"]["tasks_per_s"] >= 2 * b["modes"]["pool"]["tasks_per_s"],
                               f"{b['worker_vs_pool']}x"))
    return out


def _skeleton(sc: dict, workload: str, contender: str | None = None):
    """Scenario 14's throughput against plain Celery: the skeleton's (the design's floor), or
    ``contender``'s in the same bursts; None when the run has no scenario 14."""
    rows = sc.get("design_floor", {}).get(workload)
    if not rows:
        return None
    name = contender or next(c for c in rows if c.startswith("skeleton"))
    return rows[name]["throughput_vs_plain"] if name in rows else None


#: Scenario 14's skeleton with ours' whole message chain on a hot key (claim and next too).
SIX = "skeleton_local_full"
#: Scenario 14's other design: the main process joins and leaves the key itself, no agent.
MAIN = "skeleton_main"


def _past_bound(w: dict) -> str:
    """Whether the other worker queued during the longest run, when that run passed the bound."""
    seen = w.get("children_during_longest_streak")
    if not seen:
        return ""
    most = max(seen)
    who = ("only our node: the other worker queued nothing then" if most <= 1
           else "more than one node: the other worker's, or our next one")
    return f"; during it the key had at most {most} children ({who})"


# ------------------------------------------------------------------ Markdown
def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return lines


def _rows(contenders: dict, columns: list[tuple[str, str]]) -> tuple[list[str], list[list]]:
    header = ["contender"] + [label for _, label in columns]
    return header, [[row.get("label", name)] + [row.get(key) for key, _ in columns] for name, row in contenders.items()]


TABLES = {
    "overhead": [("throughput_per_s", "tasks/s"), ("throughput_vs_plain", "vs plain"),
                 ("latency_p50_ms", "latency p50 ms"), ("latency_p99_ms", "p99 ms"),
                 ("latency_p50_vs_plain", "p50 vs plain"), ("start_p50_ms", "enqueue->start p50 ms"),
                 ("start_p99_ms", "p99 ms"), ("cpu_workers_ms_per_task", "worker CPU ms/task"),
                 ("cpu_zookeeper_ms_per_task", "ZooKeeper CPU ms/task"), ("cpu_redis_ms_per_task", "Redis CPU ms/task"),
                 ("cpu_publisher_ms_per_task", "publisher CPU ms/task"), ("zk_requests_per_task", "ZK requests/task"),
                 ("tasks", "tasks")],
    "hot_key": [("ran", "ran"), ("published", "published"), ("efficiency", "ideal/makespan"),
                ("makespan_s", "makespan s"), ("ideal_s", "ideal s"), ("handoff_p50_ms", "handoff p50 ms"),
                ("handoff_p99_ms", "handoff p99 ms"), ("wait_p50_ms", "wait p50 ms"), ("wait_max_ms", "max wait ms"),
                ("fifo_inversions", "FIFO inversions"), ("clock_inversions", "clock inversions"),
                ("overlaps", "overlaps"), ("publish_order_inversions", "publish-order inversions"),
                ("zk_write_avg_ms", "ZK write avg ms"), ("zk_write_p99_ms", "ZK write p99 ms"),
                ("zk_fsync_avg_ms", "ZK fsync avg ms")],
    "fairness": [("holds", "holds"), ("same_holder_pct", "same-holder %"), ("wait_p50_ms", "wait p50 ms"),
                 ("wait_p99_ms", "p99 ms"), ("wait_max_ms", "max ms"), ("fair_bound_ms", "fair bound ms"),
                 ("max_wait_vs_fair_bound", "max / bound"), ("queue_jumps_pct", "queue jumps %"),
                 ("longest_gap_ms", "longest gap ms"), ("mean_cycle_ms", "mean cycle ms"),
                 ("exclusion_overlaps", "overlaps")],
    "worker_loss": [("recovery_s", "next start after kill (s)"), ("still_blocked", "still blocked"),
                    ("samples_s", "samples (s)"), ("how", "how")],
    "pool_slots": [("cold_p50_s", "distinct-key p50 s"), ("cold_p95_s", "p95 s"), ("ideal_cold_p95_s", "ideal s"),
                   ("cold_p95_vs_ideal", "p95 / ideal"), ("hot_chain_s", "hot chain s"),
                   ("hot_efficiency", "hot-chain efficiency"), ("makespan_s", "makespan s"),
                   ("zk_sessions_per_worker", "ZK sessions/worker"), ("cold_p95_vs_ideal_runs", "p95/ideal, each round"),
                   ("hot_efficiency_runs", "efficiency, each round")],
    "tls": [("acquire_release_p50_ms", "engine acquire+release p50 ms"), ("acquire_release_p99_ms", "p99 ms"),
            ("throughput_per_s", "Celery tasks/s"), ("cpu_workers_ms_per_task", "worker CPU ms/task")],
    "flash_sale": [("orders_per_s", "orders/s"), ("orders_per_s_runs", "each round"), ("enqueue_s", "publish s"),
                   ("enqueue_to_start_p50_s", "enqueue->start p50 s"), ("enqueue_to_start_p99_s", "p99 s"),
                   ("lock_wait_p50_s", "prerun->body p50 s"), ("lock_retries", "lock retries")],
    "burst": [("tasks_per_s", "tasks/s"), ("total_s", "total s"), ("publish_s", "publish s"),
              ("ran_exactly_once", "all once"), ("overlaps", "overlaps"), ("tokens_strictly_increasing", "tokens up"),
              ("children_max", "children max"), ("znodes_max", "znodes max"), ("zookeeper_rss_mib_max", "ZK RSS MiB"),
              ("grant_share_min", "min worker share"), ("longest_streak", "longest run on one worker")],
    "scale": [("keys", "keys"), ("throughput_per_s", "tasks/s"), ("znodes_before", "znodes before"),
              ("znodes_after", "after"), ("znodes_left", "left"), ("child_rss_mib", "child RSS MiB"),
              ("child_rss_growth_mib", "child RSS growth MiB"), ("parent_rss_mib", "parent RSS MiB")],
}

NOTES = {
    "design_floor": "The skeleton (`bench/skeleton_app.py`) is the lock agent's design with nothing else in it: the "
                    "worker's main process holds a request aside and sends `wait` to one agent process, which joins the "
                    "key with the multi ours sends for a new key (distinct keys) or queues it in its memory (hot keys: a "
                    "local handoff, no ZooKeeper request) and answers `granted`; the main process then hands the request "
                    "to the pool, whose process runs the body, sends `release` and waits for `released` (the delete's "
                    "reply, or the next holder's grant). Four messages per task, three processes, no queue order, "
                    "lease, claim, cohort bound, event, signal, timeout or fault handling: not a lock, the cost floor of "
                    "its chain. On hot keys, \"the design's six messages\" adds the two ours sends beyond those four: "
                    "the pool process's one-way `claim` as the body starts, and the `next` notice for the first "
                    "request behind the holder. \"Another design's chain\" has no agent and no message of ours: the worker's "
                    "main process joins the key with its own kazoo client (the same multi), hands the request to the pool "
                    "on the reply (one pipe wake-up of its event loop), and deletes the node when the pool's result comes "
                    "back (Celery's `task_ready`; nobody waits for the delete's reply, unlike the chain's pool process): "
                    "the floor of moving the lock into the main process. All contenders "
                    "run in the same two workers (prefork -c 2), in turn, order "
                    "alternating pass by pass.",
    "overhead": "Throughput: bursts of trivial tasks on distinct keys, alternating contender order per pass; "
                "latency: one task in flight, publish to `task_postrun` (after the contender's unlock), "
                "contenders rotating task by task. CPU per task: all worker processes, the ZooKeeper and Redis servers "
                "and the publishing process, over the bursts (this machine's cores are shared by all of them).",
    "hot_key": "All tasks of a pass share one key and are published at once; each sleeps 10-20 ms (same "
               "durations for every contender). Reject-style peers refuse duplicates at publish time: see *ran*. "
               "Plain Celery has no lock (overlaps expected). FIFO inversions use the lock's own queue order "
               "(fencing token / node sequence); clock inversions use `task_prerun` stamps >= 5 ms apart; "
               "publish-order inversions include broker and pool scheduling and are context only. "
               "ZK write/fsync: ZooKeeper's own statistics during that contender's passes (write = request in "
               "to reply out in the server, 1 ms resolution); each release is a write, so it is part of every "
               "handoff.",
    "fairness": "Processes hold 5 ms and re-request at once. Fair bound = (P-1) x mean interval between "
                "acquisitions of that contender (what a FIFO queue gives). Queue jumps = holds that began before a "
                "hold requested earlier (FIFO: 0; steady state: each process's first request at the window's "
                "start is left out); longest gap = longest time between two acquisitions (a stall "
                "every waiter sits through).",
    "worker_loss": "Time from SIGKILL of the pool child holding the lock to the start of the next same-key task.",
    "scale": "Znode counts from `mntr` after the container sweep; RSS of every worker process after the run.",
    "pool_slots": "2 workers x `prefork -c 3`; one hot key (30 ms tasks) interleaved 1:2 with tasks on distinct keys "
                  "(30 ms), all published at once. Ideal distinct-key p95 = their work over the 5 slots the hot chain "
                  "leaves. Latency = publish to `task_postrun`. Sessions = ZooKeeper client connections with the "
                  "workers up, minus before, per worker. In the other scenarios ZkLockedTask runs with the default "
                  "(`zklock_wait_in=\"worker\"`), so its 'wait' there (prerun -> body) no longer includes the time "
                  "queued in the agent.",
    "tls": "A TLS-only ZooKeeper (Netty `secureClientPort`, `ssl.clientAuth=need`, certificates made at run time) "
           "beside the plaintext one, same machine, same run. Engine: uncontended `FairLock` acquire + release, one "
           "after another (first 10% dropped). Celery: one burst of trivial locked tasks on distinct keys through 2 "
           "workers x `prefork -c 2` waiting in the worker (one TLS session per worker, in its lock agent).",
    "burst": "`bench/burst.py`: N trivial tasks on one key published at once to 2 workers x `prefork -c 3`, each "
             "mode with fresh workers on the same servers; the key's children sampled every 20 ms from another "
             "session, ZooKeeper's znode count and RSS every 0.5 s. tasks/s from the first publish to the last done.",
    "flash_sale": "`python -m examples.flash_sale --orders N --json` as a subprocess on the benchmark's servers "
                  "(5 SKUs, 2 workers x `prefork -c 3`, one burst; every order is on a hot key), alternating modes; "
                  "medians. orders/s counts from the first order sent to the last one done, as the demo prints it, so "
                  "it includes publishing the burst, which shares the CPUs with the workers. Every run must pass the "
                  "demo's checks (no oversell, no overlap, tokens increasing) or the benchmark fails.",
}


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"# celery-zklock benchmark ({'quick smoke run' if results['quick'] else 'full run'})",
        "",
        f"{results['started_at']}, {results['elapsed_s']:.0f} s. {m['cpus']} CPUs, Python {m['python']}, "
        f"ZooKeeper {_version(m['zookeeper_version'])} (fsync {'on' if m['zookeeper_fsync'] else 'off'}, tickTime "
        f"{m['zookeeper_tick_ms']} ms, container sweep {m['zookeeper_container_check_ms']} ms), "
        f"Redis {m['redis_version']}; 1-min load average {results['loadavg'][0]:.2f} at start, "
        f"{results['loadavg'][1]:.2f} at end. Workers: {results['workers']}.",
        "",
        "## Targets",
        "",
    ]
    verdict = {True: "met", False: "**NOT met**", None: "n/a"}
    lines += _table(["scenario", "contender", "target", "value", "verdict"],
                    [[t["scenario"], t["contender"], t["target"], t["value"], verdict[t["met"]]]
                     for t in results["targets"]])
    if results["quick"]:
        lines += ["", "Quick mode: small samples, short caps; a smoke run, not a measurement."]
    for name, title in SCENARIO_TITLES.items():
        data = results["scenarios"].get(name)
        if data is None:
            continue
        lines += ["", f"## {title}", ""]
        if name == "lock_engine":
            lines += ["```text", lock_bench.format_table(data), "```"]
            continue
        if name == "enqueue":
            lines += _enqueue_tables(data)
            continue
        if name == "design_floor":
            lines += _design_floor_lines(data)
            continue
        same = SAME_AS.get(name, name)
        lines += _table(*_rows(data["modes"] if same in ("pool_slots", "flash_sale", "burst") else data["contenders"], TABLES[same]))
        if name == "overhead" and data.get("floor"):
            lines += ["", *_floor_lines(data)]
        if name == "tls":
            lines += ["", f"TLS against plaintext: engine acquire+release p50 {data['engine_tls_vs_plain']}x, "
                          f"Celery throughput {data['celery_tls_vs_plain']}x."]
        if name == "worker_loss":
            lines += [f"| plain Celery | n/a | | | {data['not_applicable']['plain']} |"]
        if name == "scale":
            lines += ["", *_waiters_table(data["one_key_waiters"])]
            if data.get("many_keys"):
                mk = data["many_keys"]
                lines += ["", f"One process, {mk['waiters']} waiters on {mk['keys']} keys held by another process "
                              "(the event-driven engine, `LockInternals`, no thread per waiter):", "",
                          *_table(["metric", "value"], [[k, v] for k, v in mk.items()])]
        if name == "fairness":
            z = data["zookeeper"]
            lines += ["", f"ZooKeeper during these windows (used by the FairLock row only): {z['fsyncs']} fsyncs, "
                          f"avg {z['fsync_avg_ms']:.1f} ms, max {z['fsync_max_ms']:.0f} ms; {z['updates']} writes, "
                          f"latency avg {z['update_latency_avg_ms']:.1f} ms, p99 {z['update_latency_p99_ms']:.0f} ms, "
                          f"max {z['update_latency_max_ms']:.0f} ms (server clock, 1 ms resolution)."]
        lines += ["", NOTES[same] + (" Broker: RabbitMQ (127.0.0.1:5672)." if same != name else "")]
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in results.get("plots", [])), ""]
    return "\n".join(lines)


def _floor_lines(data: dict) -> list[str]:
    """Scenario 1's CPU per task by process, and the floor under it (bench/floor.py)."""
    f, o = data["floor"], data["contenders"]
    roles = [("cpu_worker_main_ms_per_task", "worker main"), ("cpu_worker_agent_ms_per_task", "lock agent"),
             ("cpu_worker_pool_ms_per_task", "pool processes"), ("cpu_zookeeper_ms_per_task", "ZooKeeper"),
             ("cpu_redis_ms_per_task", "Redis"), ("cpu_publisher_ms_per_task", "publisher")]
    rows = [[o[c].get("label", c)] + [o[c].get(k) for k, _ in roles] for c in ("plain", "zklock") if c in o]
    agent = o.get("zklock", {}).get("cpu_worker_agent_ms_per_task")
    return [
        "Where the CPU of a task goes (ms per task, same bursts):", "",
        *_table(["contender"] + [label for _, label in roles], rows), "",
        f"The floor (`bench/floor.py`, same run): a bare kazoo client joining and leaving {f['tasks']} keys as the "
        f"agent does (a multi with the key's container, then a delete; {floor.WINDOW} keys at a time) spent "
        f"{f['client_cpu_ms_per_task']} ms of its own CPU and {f['zookeeper_cpu_ms_per_task']} ms of ZooKeeper's per "
        f"key ({f['zk_requests_per_task']} requests); a one-line JSON message between two processes over a Unix "
        f"socket {f['cpu_ms_per_message']} ms, both ends. With plain Celery's {f['plain_cpu_ms_per_task']} ms per task, "
        f"a lock whose own code cost nothing would reach **{f['ceiling_zookeeper_kazoo']}x** plain Celery "
        f"({f['ceiling_with_messages']}x with the {f['min_messages']} messages a task's lock needs at least between "
        f"the worker's processes)." + (f" Our lock agent spent {agent} ms per task, "
                                       f"{agent / f['client_cpu_ms_per_task']:.1f}x the bare kazoo client."
                                       if agent else ""),
    ]


def _design_floor_lines(data: dict) -> list[str]:
    """Scenario 14: each workload's contenders, CPU and wake-ups per task by process."""
    columns = [("throughput_per_s", "tasks/s"), ("throughput_vs_plain", "vs plain"),
               ("cpu_worker_main_ms_per_task", "main ms"), ("cpu_worker_agent_ms_per_task", "agent ms"),
               ("cpu_worker_pool_ms_per_task", "pool ms"), ("cpu_zookeeper_ms_per_task", "ZooKeeper ms"),
               ("cpu_redis_ms_per_task", "Redis ms"), ("cpu_publisher_ms_per_task", "publisher ms"),
               ("zk_requests_per_task", "ZK req"), ("switches_worker_main_per_task", "main wake-ups"),
               ("switches_worker_agent_per_task", "agent wake-ups"), ("switches_worker_pool_per_task", "pool wake-ups")]
    lines = []
    for workload, what in (("distinct", f"{data['tasks_per_pass']} trivial tasks on distinct keys"),
                           ("hot", f"{data['tasks_per_pass']} tasks of {data['hot_ms']:g} ms on {data['hot_keys']} keys")):
        rows = data.get(workload)
        if not rows:
            continue
        lines += [f"{what.capitalize()}, {data['passes']} pass(es) per contender (per task; wake-ups: context switches):", "",
                  *_table(["contender"] + [h for _, h in columns],
                          [[r.get("label", c)] + [r.get(k) for k, _ in columns] for c, r in rows.items()]), ""]
    return lines + [NOTES["design_floor"]]


def _enqueue_tables(e: dict) -> list[str]:
    labels, cost = e["labels"], e["publish_cost"]
    rows = [[labels[c], v["distinct"]["p50_ms"], v["distinct"]["p99_ms"], v["distinct"]["vs_plain_p50"],
             v["same"]["p50_ms"], v["same"]["queued"]] for c, v in cost.items()]
    out = _table(["contender", "publish p50 (ms), new key", "p99", "x plain", "publish p50 (ms), key queued", "queued of the same-key calls"], rows)
    out += ["", *_table(["contender", "publishes", "publishes/s", "queued (10 keys)", "duplicates queued"],
                        [[labels[c], v["publishes"], v["publishes_per_s"], v["queued_total"], v["duplicates_queued"]]
                         for c, v in e["storm"].items()])]
    out += ["", *_table(["contender", "key accepts a publish after SIGKILL (s)", "still blocked", "how"],
                        [[labels[c], v["recovery_s"], v["still_blocked"], v["how"]] for c, v in e["after_sigkill"].items()])]
    out += ["", f"Publish cost: one call at a time from the runner to a queue no worker reads. Storm: 8 processes, "
                f"nothing consumes. SIGKILL: of the pool process running the key's task (cap {e['cap_s']:.0f} s; the "
                "peers' locks have a 1 h TTL). Ours dedupes until finish here, celery-once's semantics."]
    return out


def _version(text: str | None) -> str:
    """``3.8.0`` out of ZooKeeper's ``3.8.0-<commit>, built on <date>`` banner."""
    import re

    found = re.match(r"\d+(\.\d+)+", text or "")
    return found.group(0) if found else str(text)


def _waiters_table(w: dict) -> list[str]:
    keys = ["waiters", "acquired", "releases_with_successor", "notifications_per_release",
            "max_notifications_per_release", "releases_with_more_than_one", "releases_with_none", "wire_watch_events",
            "children_reads_per_waiter", "drain_s", "handoffs_per_s", "waiter_process_peak_rss_mib", "znodes_before",
            "znodes_after", "znodes_left"]
    return [f"One key, {w['waiters']} waiting FairLocks (the engine of ZkLockedTask):", "",
            *_table(["metric", "value"], [[k, w[k]] for k in keys])]


# ------------------------------------------------------------------ plots
def plots(results: dict, out: Path) -> list[str]:
    """Latency and wait distributions per contender (empirical CDFs), worker-loss bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    sc = results["scenarios"]
    made = []

    def save(fig, name: str):
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)

    def cdf(name: str, series: dict[str, list[float]], title: str, xlabel: str, marks: dict[str, float] | None = None):
        """One empirical CDF per contender, log x axis; ``marks`` draws a dotted line per contender."""
        fig, ax = plt.subplots(figsize=(8, 5))
        for label, values in series.items():
            if not values:
                continue
            xs = sorted(max(v, 1e-5) * 1000 for v in values)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            line, = ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})")
            if marks and label in marks:
                ax.axvline(marks[label], color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction <= x")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        save(fig, name)

    def labelled(scenario: dict, series: dict[str, list[float]]) -> dict[str, list[float]]:
        return {scenario["contenders"][c]["label"]: v for c, v in series.items()}

    if "overhead" in sc:
        cdf("latency_overhead.png", labelled(sc["overhead"], sc["overhead"]["samples_s"]),
            "Scenario 1: per-task latency, one task in flight (publish -> postrun)", "latency (ms, log scale)")
    if "hot_key" in sc:
        cdf("wait_hot_key.png", labelled(sc["hot_key"], sc["hot_key"]["waits_s"]),
            "Scenario 2: wait for the lock in the worker (prerun -> body start), one hot key", "wait (ms, log scale)")
    if "fairness" in sc:
        f = sc["fairness"]
        cdf("wait_fairness.png", f["waits_s"], f"Scenario 3: request -> acquire, {f['procs']} processes, "
            f"{f['hold_ms']:.0f} ms holds (dotted: fair bound)", "wait (ms, log scale)",
            marks={n: row["fair_bound_ms"] for n, row in f["contenders"].items()})
    if "worker_loss" in sc:
        w = sc["worker_loss"]
        fig, ax = plt.subplots(figsize=(8, 3.5))
        rows = list(w["contenders"].values())
        values = [r["waited_s"] for r in rows]
        bars = ax.barh([r["label"] for r in rows], values, color=["#d62728" if r["still_blocked"] else "#2ca02c"
                                                                  for r in rows])
        for bar, r in zip(bars, rows, strict=True):  # a bar per row
            text = f"still blocked after {r['waited_s']:.0f} s" if r["still_blocked"] else f"{r['recovery_s']:.3f} s"
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + text, va="center", fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("SIGKILL -> next same-key task starts (s, log scale; capped)")
        ax.set_title("Scenario 4: worker loss")
        save(fig, "worker_loss.png")
    return made


# ------------------------------------------------------------------ files
def write(results: dict, out: Path) -> None:
    """``latest.json``, ``latest.md`` and the PNGs into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots(results, out)
    (out / "latest.json").write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    (out / "latest.md").write_text(markdown(results))


def _json_default(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"not JSON serialisable: {value!r}")
