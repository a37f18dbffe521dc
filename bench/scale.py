"""Scenario 5: scale -- many distinct keys through real workers, many waiters on one key.

Why two parts:

* **10,000 distinct keys** (order ids, SKUs): every key is a parent znode.  We run that
  many ZkLockedTask tasks (and, for comparison, naive kazoo-``Lock`` tasks) through the
  workers and compare the server's znode count (``mntr`` ``zk_znode_count``) before and
  after, once the container sweep has run, and the RSS of every worker process before and
  after (a per-key cache or leak would show there).
* **1,000 waiters on one key**: no machine runs 1,000 pool processes, so the waiters are
  ``FairLock`` instances -- the engine ZkLockedTask uses -- in a few processes, one thread
  each, all queued behind a gate holder before it lets go.  We count the watch
  notifications that reach the waiters' processes per release (no herd: exactly one
  waiter should wake per release) by instrumenting each process's own KazooClient: its
  callback dispatcher and its wire-level watch-event reader are wrapped to count (the
  lock protocol itself is untouched, nothing is mocked).  A callback is classed as the
  holder's watch on its *own* node when its function's name says ``own_node``; every
  other watch callback counts as a waiter wake-up -- if the library renames that
  function, wake-ups are over-counted, never hidden.

The waiter part forks processes (``lock_bench.run_processes``) and must run before the
runner has threads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from .infra import Services, Workers, log, rss_kib
from .lock_bench import Contender, run_processes

ENGINE = Contender("FairLock", "ours", wait_release=False)


# ------------------------------------------------------------------ 10,000 distinct keys
def distinct_keys(d, workers: Workers, services: Services, keys: int) -> dict:
    """Run ``keys`` single-use keys per contender; znodes and worker RSS before/after."""
    out = {}
    for c in ("zklock", "naive"):
        log(f"  {d.label[c]}: {keys} tasks on distinct keys")
        znodes_before = services.settled_znode_count()
        rss_before = workers.rss_kib()
        tag = d.new_tag("scale")
        t0 = time.time()
        sent = sum(d.publish(c, f"s-{tag}-{i}", tag) is not None for i in range(keys))
        rows = d.records(tag, sent, timeout=900)
        elapsed = max(r["done"] for r in rows) - t0
        znodes_after = services.settled_znode_count()
        rss_after = workers.rss_kib()
        out[c] = {
            "label": d.label[c],
            "keys": len(rows),
            "throughput_per_s": round(len(rows) / elapsed, 1),
            "znodes_before": znodes_before,
            "znodes_after": znodes_after,
            "znodes_left": znodes_after - znodes_before,
            **rss_summary(rss_before, rss_after),
        }
    return out


def rss_summary(before: dict[str, int], after: dict[str, int]) -> dict:
    """Mean RSS of the pool children and of the worker parents after the run, and growth.

    Growth is per process present before and after (a replaced child has no baseline).
    """
    children = [v for k, v in after.items() if k.startswith("child")]
    parents = [v for k, v in after.items() if k.startswith("parent")]
    growth = [after[k] - before[k] for k in after if k in before and k.startswith("child")]
    return {
        "child_rss_mib": round(sum(children) / len(children) / 1024, 1) if children else None,
        "parent_rss_mib": round(sum(parents) / len(parents) / 1024, 1) if parents else None,
        "child_rss_growth_mib": round(sum(growth) / len(growth) / 1024, 2) if growth else None,
        "rss_kib_before": before,
        "rss_kib_after": after,
    }


# ------------------------------------------------------------------ 1,000 waiters on one key
class WatchProbe:
    """Counts what one process's KazooClient receives: wire watch events, watch callbacks
    (by the callback function's name and by the path whose event woke them) and
    ``get_children`` requests."""

    def __init__(self, zk) -> None:
        self.guard = threading.Lock()
        self.wire = 0
        self.callbacks: Counter = Counter()
        self.wakeups_by_path: Counter = Counter()
        self.children_reads = 0
        dispatch = zk.handler.dispatch_callback
        read_event = zk._connection._read_watch_event
        children_async = zk.get_children_async

        def counting_dispatch(callback):
            if callback.type == "watch":
                name = getattr(callback.func, "__qualname__", repr(callback.func))
                with self.guard:
                    self.callbacks[name] += 1
                    if "own_node" not in name:
                        self.wakeups_by_path[callback.args[0].path] += 1
            return dispatch(callback)

        def counting_read(buffer, offset):
            with self.guard:
                self.wire += 1
            return read_event(buffer, offset)

        def counting_children(*args, **kwargs):
            with self.guard:
                self.children_reads += 1
            return children_async(*args, **kwargs)

        zk.handler.dispatch_callback = counting_dispatch
        zk._connection._read_watch_event = counting_read
        zk.get_children_async = counting_children

    def result(self) -> dict:
        return {"wire": self.wire, "callbacks": dict(self.callbacks), "wakeups_by_path": dict(self.wakeups_by_path),
                "children_reads": self.children_reads}


def gate_holder(backends, held, total: int, path: str) -> dict:
    """Hold the lock until ``total`` waiters are queued (and have had time to set their
    watches), then release and stamp the moment."""
    from celery_zklock import FairLock

    (b,) = backends.values()
    probe = WatchProbe(b.zk)
    lock = FairLock(b.zk, path)
    lock.acquire(timeout=60)
    node = lock.node
    held.set()
    deadline = time.monotonic() + 300
    while len(b.zk.get_children(path)) < total + 1:
        if time.monotonic() > deadline:
            raise RuntimeError("waiters did not all queue within 300 s")
        time.sleep(0.05)
    queued = time.perf_counter()
    time.sleep(1.0)
    released = time.perf_counter()
    lock.release()
    b.drain()
    return {"released": released, "queued": queued, "nodes": [node], "probe": probe.result(),
            "rss_kib": rss_kib("self", "VmHWM")}


def waiters(backends, held, threads: int, path: str) -> dict:
    """``threads`` FairLocks queue once each on ``path``; each holds ~0 s and releases."""
    from celery_zklock import FairLock

    (b,) = backends.values()
    probe = WatchProbe(b.zk)
    if not held.wait(120):
        raise RuntimeError("gate holder never took the lock")
    acquired: list[float] = []
    nodes: list[str] = []
    failures: list[str] = []

    def one() -> None:
        lock = FairLock(b.zk, path)
        if not lock.acquire(timeout=600):
            failures.append("acquire timed out")
            return
        nodes.append(lock.node)
        acquired.append(time.perf_counter())
        lock.release(wait=ENGINE.wait_release)

    pool = [threading.Thread(target=one, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    b.drain()
    if failures:
        raise RuntimeError(f"{len(failures)} waiters failed: {failures[0]}")
    return {"acquired": acquired, "nodes": nodes, "probe": probe.result(), "rss_kib": rss_kib("self", "VmHWM")}


def many_waiters(services: Services, total: int, procs: int) -> dict:
    """1 gate + ``total`` waiters in ``procs`` processes on one key; notifications per release."""
    import multiprocessing as mp

    # A top-level key: its parent is "/", so no persistent ancestor is created and every
    # znode the waiters make is theirs (the container and its children).
    path = f"/bench-one-key-{services.run_id}"
    znodes_before = services.settled_znode_count()
    held = mp.get_context("fork").Event()
    per_proc = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
    jobs = [(gate_holder, (held, total, path))] + [(waiters, (held, n, path)) for n in per_proc]
    log(f"  {total} FairLock waiters in {procs} processes queue behind a gate, then drain")
    gate, *rest = run_processes([ENGINE], {**services.endpoints()}, jobs, timeout=900)
    znodes_after = services.settled_znode_count()
    return waiter_stats(gate, rest, total) | {
        "znodes_before": znodes_before, "znodes_after": znodes_after, "znodes_left": znodes_after - znodes_before,
    }


def waiter_stats(gate: dict, rest: list[dict], total: int) -> dict:
    """Notifications per release: waiter wake-ups grouped by the released node's path."""
    everyone = [gate] + rest
    wakeups: Counter = Counter()
    callbacks: Counter = Counter()
    for r in everyone:
        wakeups.update(r["probe"]["wakeups_by_path"])
        callbacks.update(r["probe"]["callbacks"])
    released = [n for r in everyone for n in r["nodes"]]  # every lock node that was held and released
    last = max(released, key=lambda p: int(p[-10:]))
    followed = [n for n in released if n != last]  # releases that had a waiter behind them
    per_release = [wakeups.get(n, 0) for n in followed]
    acquired = sorted(t for r in rest for t in r["acquired"])
    drain = acquired[-1] - gate["released"] if acquired else None
    return {
        "label": "ZkLockedTask engine (FairLock)",
        "waiters": total,
        "acquired": len(acquired),
        "releases_with_successor": len(followed),
        "notifications_per_release": round(sum(per_release) / len(per_release), 4) if per_release else None,
        "max_notifications_per_release": max(per_release, default=None),
        "releases_with_more_than_one": sum(1 for x in per_release if x > 1),
        "releases_with_none": sum(1 for x in per_release if x == 0),
        "wire_watch_events": sum(r["probe"]["wire"] for r in everyone),
        "watch_callbacks_by_function": dict(callbacks),
        "children_reads_per_waiter": round(sum(r["probe"]["children_reads"] for r in rest) / max(1, total), 3),
        "drain_s": round(drain, 3) if drain is not None else None,
        "handoffs_per_s": round(len(acquired) / drain, 1) if drain else None,
        "waiter_process_peak_rss_mib": round(max(r["rss_kib"] or 0 for r in rest) / 1024, 1),
    }
