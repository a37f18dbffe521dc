"""Smoke test of the benchmark suite: ``python -m bench.run --quick --out DIR`` completes.

Why only a smoke test: benchmark numbers on a shared CI machine are noise, so no timing
threshold is asserted here; what must never rot is that the one command starts its
services and workers, runs every scenario for every contender and writes a report whose
fields are numbers (the full run, ``make bench``, is what gets read).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("matplotlib", reason="the bench extra (matplotlib, celery-once, ...) is not installed")
pytest.importorskip("celery_once")
pytest.importorskip("celery_singleton")
pytest.importorskip("redis_lock")

CELERY = ["plain", "zklock", "naive", "once", "singleton"]

#: scenario -> (contenders, numeric fields every contender must have)
EXPECTED = {
    "overhead": (CELERY, ["throughput_per_s", "throughput_vs_plain", "latency_p50_ms", "latency_p99_ms",
                          "cpu_workers_ms_per_task", "cpu_worker_main_ms_per_task", "cpu_worker_pool_ms_per_task",
                          "zk_requests_per_task"]),
    "hot_key": (CELERY, ["ran", "published", "makespan_s", "ideal_s", "efficiency", "overlaps", "wait_max_ms"]),
    "fairness": (["ZkLockedTask engine (FairLock)", "Redis SET NX + 1 ms poll", "python-redis-lock"],
                 ["holds", "same_holder_pct", "wait_max_ms", "fair_bound_ms", "max_wait_vs_fair_bound"]),
    "worker_loss": (["zklock", "naive", "once", "singleton"], ["waited_s"]),
    "scale": (["zklock", "naive"], ["keys", "throughput_per_s", "znodes_before", "znodes_after", "znodes_left",
                                    "child_rss_mib"]),
}
WAITER_FIELDS = ["waiters", "acquired", "notifications_per_release", "max_notifications_per_release",
                 "znodes_before", "znodes_after"]
LOCK_ENGINE = ["ours release(wait=True)", "ours release(wait=False)", "kazoo Lock", "redis SET NX + 1ms poll"]


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def test_quick_bench_writes_every_scenario_and_contender(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=420,  # ~2.5 min on 2 slow cores
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "scenario overhead: start" in proc.stderr  # progress goes to stderr

    results = json.loads((tmp_path / "latest.json").read_text())
    assert results["quick"] is True
    assert is_number(results["machine"]["cpus"]) and results["machine"]["zookeeper_version"]
    for scenario, (contenders, fields) in EXPECTED.items():
        rows = results["scenarios"][scenario]["contenders"]
        for contender in contenders:
            for field in fields:
                assert is_number(rows[contender].get(field)), (scenario, contender, field, rows[contender].get(field))
    floor = results["scenarios"]["overhead"]["floor"]
    for field in ("client_cpu_ms_per_task", "zookeeper_cpu_ms_per_task", "cpu_ms_per_message",
                  "ceiling_zookeeper_kazoo", "ceiling_with_messages"):
        assert is_number(floor[field]), (field, floor.get(field))
    assert 0 < floor["ceiling_with_messages"] <= floor["ceiling_zookeeper_kazoo"] < 1
    assert rows_agent(results) > 0  # the lock agent's CPU is its own column, not the pool's
    # ZkLockedTask recovers within the quick cap or says it is still blocked; either way a bool
    for row in results["scenarios"]["worker_loss"]["contenders"].values():
        assert isinstance(row["still_blocked"], bool)
    waiters = results["scenarios"]["scale"]["one_key_waiters"]
    for field in WAITER_FIELDS:
        assert is_number(waiters[field]), (field, waiters.get(field))
    many = results["scenarios"]["scale"]["many_keys"]
    for field in ("keys", "waiters", "threads_with_all_waiting", "fifo_violations", "release_to_last_grant_s"):
        assert is_number(many[field]), (field, many.get(field))
    modes = results["scenarios"]["pool_slots"]["modes"]
    for mode in ("worker", "pool"):
        for field in ("cold_p95_s", "cold_p95_vs_ideal", "hot_efficiency", "zk_sessions_per_worker"):
            assert is_number(modes[mode][field]), (mode, field, modes[mode].get(field))
    enq = results["scenarios"]["enqueue"]
    for contender in ("plain", "dedupe", "once", "singleton"):
        for shape in ("distinct", "same"):
            assert is_number(enq["publish_cost"][contender][shape]["p50_ms"]), (contender, shape)
    for contender in ("dedupe", "once", "singleton"):
        assert is_number(enq["storm"][contender]["duplicates_queued"]), contender
        assert isinstance(enq["after_sigkill"][contender]["still_blocked"], bool), contender
    design = results["scenarios"]["design_floor"]
    for workload, skeleton in (("distinct", "skeleton"), ("hot", "skeleton_local"), ("hot", "skeleton_local_full")):
        for contender in ("plain", skeleton, "zklock"):
            for field in ("throughput_per_s", "throughput_vs_plain", "cpu_worker_main_ms_per_task",
                          "cpu_worker_pool_ms_per_task", "switches_worker_pool_per_task"):
                assert is_number(design[workload][contender][field]), (workload, contender, field)
        # Its agent is counted as the agent: on distinct keys it joins and leaves ZooKeeper per
        # task, tens of ms in a quick run; on hot keys it only queues, which a quick run's few
        # tasks may finish within one clock tick of CPU (read as 0).
        agent_ms = design[workload][skeleton]["cpu_worker_agent_ms_per_task"]
        assert agent_ms > 0 if workload == "distinct" else is_number(agent_ms) and agent_ms >= 0, (workload, skeleton)
    # The skeleton's chain does what the report says: each distinct key joined and left in
    # ZooKeeper (a multi and a delete), the hot keys only queued in its agent.
    assert design["distinct"]["skeleton"]["zk_requests_per_task"] >= 1.5
    # The other design's chain joins and leaves from the main process, with no agent: its
    # delete on the pool's result counted (a hook Celery's request class bypassed once).
    assert is_number(design["distinct"]["skeleton_main"]["throughput_vs_plain"])
    assert design["distinct"]["skeleton_main"]["zk_requests_per_task"] >= 1.5
    # Its "agent" column is only idle processes (a few heartbeats over a quick run's few
    # tasks), well under the chain whose agent joins and leaves every key.
    assert (design["distinct"]["skeleton_main"]["cpu_worker_agent_ms_per_task"]
            < design["distinct"]["skeleton"]["cpu_worker_agent_ms_per_task"] / 2)
    assert design["hot"]["skeleton_local"]["zk_requests_per_task"] < 0.5
    assert design["hot"]["skeleton_local_full"]["zk_requests_per_task"] < 0.5
    flash = results["scenarios"]["flash_sale"]["modes"]
    for mode in ("worker", "pool", "plain"):
        for field in ("orders_per_s", "enqueue_to_start_p50_s", "enqueue_s"):
            assert is_number(flash[mode][field]), (mode, field, flash[mode].get(field))
    tls = results["scenarios"]["tls"]
    assert is_number(tls["engine_tls_vs_plain"]) and is_number(tls["celery_tls_vs_plain"])
    engine = results["scenarios"]["lock_engine"]["contenders"]
    for contender in LOCK_ENGINE:
        assert all(is_number(engine[contender][m]) for m in ("uncontended_p50_ms", "handoff_p50_ms", "throughput_per_s"))

    verdicts = results["targets"]
    burst = results["scenarios"]["burst"]["modes"]
    for mode in ("worker", "pool"):
        assert burst[mode]["ran_exactly_once"] and burst[mode]["overlaps"] == 0, (mode, burst[mode])
        for field in ("tasks_per_s", "children_max", "znodes_max"):
            assert is_number(burst[mode][field]), (mode, field, burst[mode].get(field))
    assert {t["scenario"] for t in verdicts} == set(EXPECTED) | {"lock_engine", "pool_slots", "flash_sale", "burst", "enqueue"}
    assert all(isinstance(t["met"], bool) for t in verdicts)
    md = (tmp_path / "latest.md").read_text()
    assert "## Targets" in md and md.count("| ") > 40
    for png in results["plots"]:
        assert (tmp_path / png).stat().st_size > 1000


def test_quick_rwlock_bench_writes_every_scenario_and_contender(tmp_path):
    """``python -m bench.rwlock --quick``: the read/write lock benchmark (issue 62), on its own."""
    proc = subprocess.run([sys.executable, "-m", "bench.rwlock", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-6000:]
    results = json.loads((tmp_path / "rwlock.json").read_text())
    assert results["quick"] is True
    sc = results["scenarios"]
    ours, mutex, kazoo = "ours ReadWriteLock", "ours FairLock (mutex)", "kazoo ReadLock/WriteLock"
    for scenario, contenders in (("readers", (ours, mutex, kazoo)), ("mix", (ours, kazoo)),
                                 ("scale_readers", (ours, kazoo)), ("scale_keys", (ours, kazoo))):
        for contender in contenders:
            row = sc[scenario][contender]
            for field in ("per_s", "read_acquire_p50_ms", "client_cpu_ms_per_acq", "zk_cpu_ms_per_acq",
                          "zk_requests_per_acq"):
                assert is_number(row[field]), (scenario, contender, field, row[field])
            assert row["exclusion_violations"] == 0 and row["timeouts"] == 0, (scenario, contender, row)
    assert sc["readers"][mutex]["max_holders_at_once"] == 1
    for contender in (ours, kazoo):
        assert is_number(sc["mix"][contender]["write_acquire_p50_ms"]), contender
    for cell in sc["writer_queue"].values():
        for contender in (ours, kazoo):
            for field in ("last_release_to_grant_ms", "wakeups", "children_reads", "zk_requests"):
                assert is_number(cell[contender][field]), (contender, field, cell[contender][field])
    assert "## 4. Scale" in (tmp_path / "rwlock.md").read_text()


def rows_agent(results) -> float:
    return results["scenarios"]["overhead"]["contenders"]["zklock"]["cpu_worker_agent_ms_per_task"]


@pytest.mark.parametrize("floor, ceilings", [
    # Plain Celery at 2 ms per task; ZooKeeper and kazoo 1 ms more: 2 / 3.
    ({"zookeeper_cpu_ms_per_task": 0.6, "client_cpu_ms_per_task": 0.4, "cpu_ms_per_message": 0.0, "min_messages": 3},
     (0.667, 0.667)),
    # Three messages of 0.1 ms: 2 / 3.3.
    ({"zookeeper_cpu_ms_per_task": 0.6, "client_cpu_ms_per_task": 0.4, "cpu_ms_per_message": 0.1, "min_messages": 3},
     (0.667, 0.606)),
    # Nothing but plain Celery: 1x.
    ({"zookeeper_cpu_ms_per_task": 0.0, "client_cpu_ms_per_task": 0.0, "cpu_ms_per_message": 0.0, "min_messages": 3},
     (1.0, 1.0)),
])
def test_floor_ceilings_are_plain_cpu_over_plain_plus_the_floor(floor, ceilings):
    from bench.floor import ceilings as compute

    plain = {"cpu_workers_ms_per_task": 1.2, "cpu_zookeeper_ms_per_task": 0.0, "cpu_redis_ms_per_task": 0.3,
             "cpu_publisher_ms_per_task": 0.5}
    got = compute(plain, floor)
    assert got["plain_cpu_ms_per_task"] == 2.0
    assert (got["ceiling_zookeeper_kazoo"], got["ceiling_with_messages"]) == ceilings


def test_fairness_stats_counts_a_repeat_only_over_a_steady_waiter():
    """Pure logic of the same-holder metric: (request, acquire, release) per hold, per process."""
    from bench.lock_bench import fairness_stats

    # Process 0 holds twice in a row although process 1's second request (steady state)
    # was made before process 0's second one: one repeat.
    unfair = [[[(0.0, 0.0, 1.0), (1.0, 1.1, 2.0)], [(0.0, 2.1, 3.0), (0.5, 3.1, 4.0)]]]
    assert fairness_stats(unfair)["same_holder_pct"] > 0
    # The only request "overtaken" is process 1's first one, stamped at the barrier: not a repeat.
    barrier_only = [[[(0.0, 0.0, 1.0), (1.0, 1.1, 2.0)], [(0.5, 2.1, 3.0)]]]
    assert fairness_stats(barrier_only)["same_holder_pct"] == 0


def test_rwlock_concurrency_counts_only_a_write_overlapping_as_a_violation():
    """Pure logic of bench.rwlock's exclusion check: (key, write, request, acquire, release) per hold."""
    from bench.rwlock import concurrency

    readers = [("k", False, 0.0, 0.0, 2.0), ("k", False, 0.0, 1.0, 3.0), ("k", False, 0.0, 1.5, 4.0)]
    assert concurrency(readers) == {"max_holders_at_once": 3, "exclusion_violations": 0}
    # A write after the readers, then a read inside the write, then one on another key.
    mixed = readers + [("k", True, 0.0, 4.5, 6.0), ("k", False, 0.0, 5.0, 5.5), ("j", False, 0.0, 5.0, 5.5)]
    assert concurrency(mixed)["exclusion_violations"] == 1
    # A write that begins while a read still holds.
    assert concurrency(readers + [("k", True, 0.0, 3.5, 5.0)])["exclusion_violations"] == 1
