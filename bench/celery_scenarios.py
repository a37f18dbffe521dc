"""Scenarios 1 and 2 with real ``celery worker`` processes: per-task overhead, one hot key.

Why the method: a benchmark of a task lock must include everything a user pays -- the
publish (celery-once and celery-singleton lock there), the broker, the pool, the lock,
the unlock -- so tasks run in real prefork workers and every stamp is taken in the
worker (``bench.app``).  All contenders share the same workers, broker and ZooKeeper and
take turns: latency probes rotate contender by contender, bursts alternate order pass by
pass (A..E, then E..A), so drift in the machine's load favours none of them.  Ratios
against plain Celery from the same run are what the report judges.

:class:`Driver` is the runner's side of ``bench.app``: publish a task for a contender,
wait for the records the tasks leave in Redis.
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from dataclasses import dataclass
from itertools import pairwise

from . import floor
from .infra import log
from .lock_bench import rotated
from .stats import inverted, overlaps, summary


@dataclass(frozen=True)
class Sizes:
    """How much each Celery scenario runs; quick trades precision for time."""

    warmup: int  # trivial tasks per contender before measuring (connects every child's clients)
    latency_rounds: int  # sequential one-task-in-flight probes per contender
    burst: int  # tasks per contender per throughput pass
    burst_passes: int
    hot_tasks: int  # tasks on the hot key per contender per pass
    hot_passes: int
    loss_cap: float  # seconds to wait for a same-key task after SIGKILL before "still blocked"
    loss_repeats: int  # worker-loss samples for ZkLockedTask
    scale_keys: int  # distinct keys in the scale scenario
    scale_waiters: int  # waiters on one key in the scale scenario
    scale_waiter_procs: int


FULL = Sizes(warmup=40, latency_rounds=150, burst=500, burst_passes=4, hot_tasks=100, hot_passes=4,
             loss_cap=60.0, loss_repeats=3, scale_keys=10_000, scale_waiters=1000, scale_waiter_procs=4)
QUICK = Sizes(warmup=12, latency_rounds=20, burst=100, burst_passes=2, hot_tasks=30, hot_passes=1,
              loss_cap=3.0, loss_repeats=1, scale_keys=300, scale_waiters=100, scale_waiter_procs=2)


class Driver:
    """Publishes contender tasks from the runner and reads the records they leave."""

    def __init__(self, env: dict[str, str]) -> None:
        os.environ.update(env)
        import redis

        from . import app as bench_app

        self.mod = bench_app
        self.app = bench_app.app
        self.redis = redis.Redis.from_url(env["BENCH_REDIS_URL"])
        self.contenders = list(bench_app.CONTENDERS)
        self.label = bench_app.CONTENDERS
        # Publish to the broker the workers of this driver use (the app is imported once,
        # with the first driver's broker).
        broker = env.get("BENCH_BROKER_URL")
        self.connection = self.app.connection_for_write(broker) if broker else None

    @staticmethod
    def new_tag(what: str) -> str:
        return f"{what}-{uuid.uuid4().hex[:8]}"

    def publish(self, contender: str, n: str, tag: str, kind: str = "trivial", ms_: float = 0,
                announce: bool = False) -> str | None:
        """Send one task; its id, or None if the contender refused it (duplicate key)."""
        task_id = uuid.uuid4().hex
        result = self.mod.task(contender, kind).apply_async(
            args=(n,), kwargs={"ms": ms_, "tag": tag, "announce": announce}, task_id=task_id,
            connection=self.connection)
        return task_id if getattr(result, "id", None) == task_id else None

    def records(self, tag: str, expected: int, timeout: float) -> list[dict]:
        """Wait until ``expected`` tasks tagged ``tag`` finished; return their records."""
        key = f"bench:rec:{tag}"
        deadline = time.monotonic() + timeout
        while (have := self.redis.llen(key)) < expected:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{tag}: only {have} of {expected} tasks finished within {timeout:.0f}s")
            time.sleep(0.01)
        rows = [json.loads(x) for x in self.redis.lrange(key, 0, -1)]
        self.redis.delete(key)
        return rows

    def next_record(self, tag: str, timeout: float) -> dict:
        got = self.redis.blpop([f"bench:rec:{tag}"], timeout=timeout)
        if got is None:
            raise TimeoutError(f"{tag}: no task finished within {timeout:.0f}s")
        return json.loads(got[1])

    def warm_up(self, count: int) -> None:
        """Run ``count`` trivial tasks per contender so every pool child has its clients."""
        tag = self.new_tag("warmup")
        sent = sum(self.publish(c, f"warm-{c}-{i}", tag) is not None for i in range(count) for c in self.contenders)
        self.records(tag, sent, timeout=120)


# ------------------------------------------------------------------ scenario 1
def overhead(d: Driver, s: Sizes, meter) -> dict:
    """Trivial task, a distinct key per task: throughput of bursts and one-at-a-time latency.

    ``meter`` (:class:`bench.infra.CostMeter`) adds the CPU each burst cost per task in the
    workers, ZooKeeper, Redis and the publisher, and ZooKeeper requests per task.
    """
    d.warm_up(s.warmup)
    names = d.contenders
    latency: dict[str, list[float]] = {c: [] for c in names}
    to_start: dict[str, list[float]] = {c: [] for c in names}  # enqueue -> body start
    log(f"  latency: {s.latency_rounds} one-at-a-time tasks per contender, rotating")
    for i in range(s.latency_rounds):
        for c in rotated(names, i):
            tag = d.new_tag("lat")
            sent = time.time()
            d.publish(c, f"lat-{i}", tag)
            record = d.next_record(tag, timeout=60)
            latency[c].append(record["done"] - sent)
            to_start[c].append(record["start"] - sent)
    out = bursts(d, names, s.burst, s.burst_passes, lambda c: meter, lambda tag, p, i: f"b{p}-{i}", "throughput")
    for c in names:
        out[c] = {"label": d.label[c], **out[c], **summary(latency[c], "latency_"), **summary(to_start[c], "start_")}
    base = out["plain"]
    for c in names:
        out[c]["latency_p50_vs_plain"] = round(out[c]["latency_p50_ms"] / base["latency_p50_ms"], 3)
    log(f"  the floor: {s.burst * 2} keys joined and left by a bare kazoo client, and messages between two processes")
    measured = floor.measure(meter.services, tasks=s.burst * 2, messages=s.burst * 20)
    return {"contenders": out, "baseline": "plain", "samples_s": {c: latency[c] for c in names},
            "floor": {**measured, **floor.ceilings(base, measured)}}


def bursts(d: Driver, names: list[str], tasks: int, passes: int, meter_of, key_of, what: str,
           kind: str = "trivial", ms_: float = 0) -> dict[str, dict]:
    """``passes`` bursts of ``tasks`` per contender, the order alternating pass by pass (A..E,
    then E..A), each task on the key ``key_of(tag, pass, i)``; per contender: tasks run,
    throughput (first publish to last done), ``meter_of(contender)``'s costs per task
    (:class:`bench.infra.CostMeter`) and the throughput against ``plain``'s."""
    done = {c: 0 for c in names}
    busy = {c: 0.0 for c in names}
    cost: dict[str, dict[str, float]] = {c: {} for c in names}
    for p in range(passes):
        order = names if p % 2 == 0 else names[::-1]
        log(f"  {what} pass {p + 1}/{passes}: {tasks} tasks per contender, order {', '.join(order)}")
        for c in order:
            meter = meter_of(c)
            tag = d.new_tag("burst")
            before = meter.snapshot()
            t0 = time.time()
            sent = sum(d.publish(c, key_of(tag, p, i), tag, kind, ms_) is not None for i in range(tasks))
            rows = d.records(tag, sent, timeout=300)
            done[c] += len(rows)
            busy[c] += max(r["done"] for r in rows) - t0
            after = meter.snapshot()
            for k in before:
                cost[c][k] = cost[c].get(k, 0.0) + after[k] - before[k]
    out = {c: {"tasks": done[c], "throughput_per_s": round(done[c] / busy[c], 1),
               **meter_of(c).per_task(dict.fromkeys(cost[c], 0.0), cost[c], done[c])} for c in names}
    for c in names:
        out[c]["throughput_vs_plain"] = round(out[c]["throughput_per_s"] / out["plain"]["throughput_per_s"], 3)
    return out


# ------------------------------------------------------------------ scenario 2
def hot_key(d: Driver, s: Sizes, services) -> dict:
    """Many 10-20 ms tasks on one key: makespan vs the ideal, handoff, FIFO order, waits.

    ZooKeeper's own write latency and fsync statistics are taken over each contender's
    passes (``srst`` before, ``mntr`` after): a handoff includes the release's write.
    """
    rng = random.Random(5)
    durations = [rng.uniform(10, 20) for _ in range(s.hot_tasks)]
    runs: dict[str, list[list[dict]]] = {c: [] for c in d.contenders}
    sent: dict[str, list[list[str | None]]] = {c: [] for c in d.contenders}
    zk: dict[str, list[dict]] = {c: [] for c in d.contenders}
    for p in range(s.hot_passes):
        order = d.contenders if p % 2 == 0 else d.contenders[::-1]
        log(f"  hot key pass {p + 1}/{s.hot_passes}: {s.hot_tasks} tasks of 10-20 ms per contender")
        for c in order:
            tag = d.new_tag("hot")
            key = f"hot-{tag}"
            services.reset_server_stats()
            ids = [d.publish(c, key, tag, "hold", ms_) for ms_ in durations]
            accepted = sum(i is not None for i in ids)
            runs[c].append(d.records(tag, accepted, timeout=300))
            sent[c].append(ids)
            zk[c].append(services.server_stats())
    return {"contenders": {c: hot_key_stats(d.label[c], runs[c], sent[c]) | server_stats(zk[c])
                           for c in d.contenders},
            "task_ms": [round(x, 3) for x in durations],
            "waits_s": {c: [r["start"] - r["joined"] for rows in runs[c] for r in rows] for c in d.contenders}}


def hot_key_stats(label: str, passes: list[list[dict]], sent: list[list[str | None]]) -> dict:
    """Summarise one contender's hot-key passes.

    * efficiency = ideal / makespan, ideal = sum of the body durations that ran, makespan
      = last body end - first body start (per pass, summed);
    * handoff = next body start - previous body end, in hold order;
    * wait = body start - ``task_prerun`` (time spent waiting for the lock in the worker);
    * FIFO inversions (tokens): holders that acquired before a task that had joined the
      lock queue earlier, where the queue order is the lock's own order token (see
      ``bench.app._order_token``); a second, token-free count uses the ``task_prerun``
      stamps and counts only pairs that joined at least 5 ms apart;
    * publish-order inversions: the same count against the order tasks were published --
      it mixes in the broker and the pool (prefetch, which child is free), not the lock,
      so it is shown for context and is not a target.
    """
    ideal = makespan = 0.0
    handoffs: list[float] = []
    waits: list[float] = []
    n_overlaps = token_inv = clock_inv = publish_inv = ran = 0
    has_tokens = True
    for rows, ids in zip(passes, sent, strict=True):  # one list of ids per pass
        ran += len(rows)
        if not rows:
            continue
        rows = sorted(rows, key=lambda r: r["start"])
        ideal += sum(r["end"] - r["start"] for r in rows)
        makespan += rows[-1]["end"] - rows[0]["start"]
        n_overlaps += overlaps([(r["start"], r["end"]) for r in rows])
        handoffs += [b["start"] - a["end"] for a, b in pairwise(rows) if b["start"] >= a["end"]]
        waits += [r["start"] - r["joined"] for r in rows]
        if any(r.get("token") is None for r in rows):
            has_tokens = False
        else:
            token_inv += inverted([r["token"] for r in rows])
        clock_inv += clock_inversions(rows, min_gap=0.005)
        position = {task_id: i for i, task_id in enumerate(ids) if task_id}
        publish_inv += inverted([position.get(r["id"], 0) for r in rows])
    total_sent = sum(len(ids) for ids in sent)
    return {
        "label": label,
        "published": total_sent,
        "ran": ran,
        "rejected_or_deduplicated": total_sent - sum(sum(i is not None for i in ids) for ids in sent),
        "ideal_s": round(ideal, 4),
        "makespan_s": round(makespan, 4),
        "efficiency": round(ideal / makespan, 3) if makespan else None,
        "overlaps": n_overlaps,
        "fifo_inversions": token_inv if has_tokens else None,
        "clock_inversions": clock_inv,
        "publish_order_inversions": publish_inv,
        **summary(handoffs, "handoff_"),
        **summary(waits, "wait_"),
    }


def server_stats(windows: list[dict]) -> dict:
    """ZooKeeper's fsyncs and write latency over a contender's passes (ms)."""

    def mean(what: str, count: str) -> float:
        n = sum(w[count] for w in windows)
        return round(sum(w[what] * w[count] for w in windows) / n, 3) if n else 0.0

    return {
        "zk_fsyncs": sum(w["fsyncs"] for w in windows),
        "zk_fsync_avg_ms": mean("fsync_avg_ms", "fsyncs"),
        "zk_fsync_max_ms": max(w["fsync_max_ms"] for w in windows),
        "zk_writes": sum(w["updates"] for w in windows),
        "zk_write_avg_ms": mean("update_latency_avg_ms", "updates"),
        "zk_write_p99_ms": max(w["update_latency_p99_ms"] for w in windows),
    }


def clock_inversions(rows_by_start: list[dict], min_gap: float) -> int:
    """Holders that acquired before a task whose ``task_prerun`` was ``min_gap`` s earlier."""
    count = 0
    for i, r in enumerate(rows_by_start):
        if any(o["joined"] < r["joined"] - min_gap for o in rows_by_start[i + 1:]):
            count += 1
    return count
