"""Lock-engine micro-benchmark: our FairLock vs kazoo's Lock vs a Redis SET-NX poll lock.

Run from the project root::

    .venv/bin/python -m bench.lock_bench [--quick] [--json PATH]

Why one script measures all contenders in one run: latency on a loopback ZooKeeper with
fsync on depends mostly on the disk and the machine's load at that moment, so numbers
taken in separate runs cannot be compared.  Here every contender runs against the same
freshly started ZooKeeper (fsync on, the default) and Redis, and the contenders take
turns (interleaved blocks, or time windows in alternating order) so that drift in the
machine's state over the run favours none of them.

Scenarios (all timings with ``time.perf_counter``, which on Linux is the system-wide
CLOCK_MONOTONIC, so stamps taken in different processes are comparable):

1. uncontended acquire+release, a new lock object each iteration, on one key and on a new
   key each time (the per-order-id pattern: parent creation is on the path);
2. handoff: a holder process releases while a waiter process is blocked in ``acquire``;
   latency from just before ``release()`` to the waiter's ``acquire()`` returning;
3. throughput: K processes loop acquire/release on one key for a fixed time;
4. fairness: 8 processes each hold 5 ms and immediately re-request; we report how often
   the same process holds twice in a row and the longest request-to-acquire wait.

``run(quick)`` returns the results as a dict (for ``bench/run.py``); the command line also
prints a table with ratios against kazoo's ``Lock`` and writes JSON.

KazooClients are created only inside child processes (a client's threads and socket do
not survive a fork).  Children are forked: the parent never holds a KazooClient or starts a
thread, and forking costs milliseconds where spawning (re-importing kazoo and celery in
every child) would cost half a second per process -- the fairness scenario alone starts
8 processes per pass.  A caller folding :func:`run` into a bigger runner must call it
before it starts threads of its own (forking a threaded process is unsafe).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
import traceback
import uuid
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Callable

DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "lock_bench.json"
BASELINE = "kazoo Lock"

# ---------------------------------------------------------------------------------------
# What is measured, and how much of it
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    """One row of the table: a lock implementation and how it is released."""

    name: str
    kind: str  # "ours" | "kazoo" | "redis" | "redis-lock" (python-redis-lock, used by bench.fairness)
    wait_release: bool = True

    @property
    def slug(self) -> str:
        """Namespace for this contender's keys, so rows never share a znode or Redis key."""
        return self.kind if self.wait_release else f"{self.kind}-nowait"


CONTENDERS = (
    Contender("ours release(wait=True)", "ours", True),
    Contender("ours release(wait=False)", "ours", False),
    Contender(BASELINE, "kazoo"),
    Contender("redis SET NX + 1ms poll", "redis"),
)


@dataclass(frozen=True)
class Settings:
    """Sizes of each scenario; QUICK trades precision (mainly p99) for run time."""

    uncontended_iters: int
    warmup: int  # per contender and variant; the first one also warms the server's JIT
    block: int  # uncontended iterations a contender runs before the next takes its turn
    handoff_rounds: int
    handoff_settle: float  # seconds the holder waits after seeing the waiter queued
    throughput_procs: int
    throughput_seconds: float
    fairness_procs: int
    fairness_seconds: float
    fairness_hold: float
    passes: int  # time windows are split in this many passes of alternating contender order


FULL = Settings(
    uncontended_iters=500, warmup=150, block=10, handoff_rounds=150, handoff_settle=0.01,
    throughput_procs=4, throughput_seconds=6.0, fairness_procs=8, fairness_seconds=6.0, fairness_hold=0.005, passes=6,
)
QUICK = Settings(
    uncontended_iters=150, warmup=60, block=10, handoff_rounds=40, handoff_settle=0.01,
    throughput_procs=4, throughput_seconds=2.0, fairness_procs=8, fairness_seconds=2.0, fairness_hold=0.005, passes=2,
)

ACQUIRE_CAP = 30.0  # seconds; no scenario should ever wait this long for one acquire
HANDOFF_WARMUP_ROUNDS = 3  # per contender, not recorded

# ---------------------------------------------------------------------------------------
# The Redis contender: the lock people hand-roll when they "just use Redis"
# ---------------------------------------------------------------------------------------

_COMPARE_AND_DELETE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""


class RedisPollLock:
    """``SET key token NX PX ttl``, polled every 1 ms; released by compare-and-delete.

    Why this design as the Redis contender: it is the usual hand-written Redis mutex (and
    what most Celery "once"/"singleton" helpers do).  It has no queue, so it is not fair:
    whoever polls first after a release wins, typically the releaser itself.
    """

    POLL = 0.001

    def __init__(self, client, key: str, release_script, ttl_ms: int = 30_000) -> None:
        self.client = client
        self.key = key
        self.release_script = release_script
        self.ttl_ms = ttl_ms
        self.token = uuid.uuid4().hex

    def acquire(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.client.set(self.key, self.token, nx=True, px=self.ttl_ms):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(self.POLL)

    def release(self) -> None:
        self.release_script(keys=[self.key], args=[self.token])


# ---------------------------------------------------------------------------------------
# One process's view of a contender
# ---------------------------------------------------------------------------------------


class Backend:
    """A connection to one contender's server plus a uniform new/acquire/release API.

    Why: the scenarios below are written once; everything contender-specific is here.
    Constructed inside child processes only (it may own a KazooClient).
    """

    def __init__(self, contender: Contender, endpoints: dict[str, Any]) -> None:
        self.contender = contender
        self.zk = None
        self.redis = None
        if contender.kind in ("redis", "redis-lock"):
            import redis

            self.redis = redis.Redis(host="127.0.0.1", port=endpoints["redis_port"])
            self.redis.ping()
            self.release_script = self.redis.register_script(_COMPARE_AND_DELETE)
        else:
            from kazoo.client import KazooClient

            self.zk = KazooClient(hosts=endpoints["zk_hosts"], timeout=10.0)
            self.zk.start(timeout=20)

    def zk_path(self, key: str) -> str:
        return f"/bench/{self.contender.slug}/{key}"

    def new_lock(self, key: str):
        kind = self.contender.kind
        if kind == "redis":
            return RedisPollLock(self.redis, f"bench:{self.contender.slug}:{key}", self.release_script)
        if kind == "redis-lock":  # python-redis-lock: SET NX, then BLPOP on a signal list
            import redis_lock

            return redis_lock.Lock(self.redis, f"bench:{self.contender.slug}:{key}")
        path = self.zk_path(key)
        if kind == "ours":
            from celery_zklock import FairLock

            return FairLock(self.zk, path)
        from kazoo.recipe.lock import Lock

        return Lock(self.zk, path, identifier=str(os.getpid()))

    def acquire(self, lock, timeout: float = ACQUIRE_CAP) -> bool:
        """Blocking acquire bounded by ``timeout``; False (never an exception) on timeout."""
        if self.contender.kind == "kazoo":
            from kazoo.exceptions import LockTimeout

            try:
                return lock.acquire(timeout=timeout)
            except LockTimeout:
                return False
        return lock.acquire(timeout=timeout)

    def release(self, lock) -> None:
        if self.contender.kind == "ours":
            lock.release(wait=self.contender.wait_release)
        else:
            lock.release()

    def queue_length(self, key: str) -> int | None:
        """Contenders queued on ``key`` (holder included); None where there is no queue (Redis)."""
        if self.zk is None:
            return None
        return len(self.zk.get_children(self.zk_path(key)))

    def drain(self) -> None:
        """Wait until every request this session sent has been answered (e.g. a pipelined delete).

        ZooKeeper answers one session's requests in order, so one cheap read suffices.
        """
        if self.zk is not None:
            self.zk.exists("/")

    def close(self) -> None:
        if self.zk is not None:
            self.zk.stop()
            self.zk.close()
        if self.redis is not None:
            self.redis.close()


# ---------------------------------------------------------------------------------------
# Scenario bodies (run in child processes; each gets {contender name: Backend})
# ---------------------------------------------------------------------------------------

now = time.perf_counter


def rotated(names: list[str], k: int) -> list[str]:
    """``names`` rotated by ``k``: who goes first changes from block to block."""
    k %= len(names)
    return names[k:] + names[:k]


def uncontended_worker(backends: dict[str, Backend], iters: int, warmup: int, block: int) -> dict:
    """Acquire+release with a new lock object each time; one key, then a new key each time.

    Contenders take turns in blocks of ``block`` iterations (first mover rotating) so that
    drift in the server -- JIT warm-up, disk write-back, a busy neighbour -- hits every
    contender alike instead of whoever happened to run first.  Within a block iterations
    run back to back, so a ``release(wait=False)`` delete still in flight is paid for by
    the next acquire on the same session, as in a real tight loop; at a block's end it is
    drained outside the timing so it does not land on the next contender.

    Constructing the lock is inside the timing: a new object per task run is how a lock
    is used in a Celery task, so its setup cost is part of what users pay.
    """
    names = list(backends)
    out: dict[str, dict[str, list[float]]] = {n: {"same_key": [], "new_key": []} for n in names}
    counter = iter(range(10**9))  # unique suffixes for the new-key variant

    def loop(name: str, variant: str, n: int, sink: list[float] | None) -> None:
        b = backends[name]
        for _ in range(n):
            key = f"new-{next(counter)}" if variant == "new_key" else "same"
            t0 = now()
            lock = b.new_lock(key)
            if not b.acquire(lock, timeout=10):
                raise RuntimeError(f"{name}: uncontended acquire timed out ({variant})")
            b.release(lock)
            if sink is not None:
                sink.append(now() - t0)
        b.drain()

    for variant in ("same_key", "new_key"):
        for name in names:
            loop(name, variant, warmup, None)
        for k, start in enumerate(range(0, iters, block)):
            for name in rotated(names, k):
                loop(name, variant, min(block, iters - start), out[name][variant])
    return out


def handoff_holder(backends: dict[str, Backend], pipe, rounds: int, warmup: int, settle: float) -> dict:
    """Hold, let the waiter queue up, release; the waiter reports when its acquire returned.

    Contenders take turns round by round (see :func:`uncontended_worker` for why).  A
    waiter not yet blocked would measure an uncontended acquire instead of a handoff, so
    before releasing the holder sees the waiter's node in the queue (ZooKeeper) and then
    sleeps ``settle`` more, for the waiter's watch to be set (the Redis waiter is polling
    as soon as it has called acquire).
    """
    names = list(backends)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        for name in rotated(names, r):
            b = backends[name]
            lock = b.new_lock("handoff")
            if not b.acquire(lock):
                raise RuntimeError(f"{name}: handoff holder could not acquire")
            pipe.send(name)
            wait_for_waiter(b, "handoff")
            time.sleep(settle)
            t0 = now()
            b.release(lock)
            t1 = pipe.recv()
            if t1 is None:
                raise RuntimeError(f"{name}: handoff waiter timed out")
            if r >= warmup:
                samples[name].append(t1 - t0)
    pipe.send(None)
    return samples


def wait_for_waiter(b: Backend, key: str, timeout: float = 10.0) -> None:
    """Block until a second contender is queued on ``key`` (no-op where queues are invisible)."""
    deadline = now() + timeout
    while (n := b.queue_length(key)) is not None and n < 2:
        if now() > deadline:
            raise RuntimeError(f"{b.contender.name}: handoff waiter never queued")
        time.sleep(0.001)


def handoff_waiter(backends: dict[str, Backend], pipe) -> None:
    """Block on acquire while the holder holds; stamp the moment acquire returns."""
    while (name := pipe.recv()) is not None:
        b = backends[name]
        lock = b.new_lock("handoff")
        got = b.acquire(lock)
        t1 = now()
        if got:
            b.release(lock)
        pipe.send(t1 if got else None)


def throughput_worker(backends: dict[str, Backend], barrier, seconds: float) -> int:
    """Loop acquire/release on one key; count acquisitions that completed in the window."""
    (b,) = backends.values()
    barrier.wait()
    end = now() + seconds
    count = 0
    while now() < end:
        lock = b.new_lock("throughput")
        if not b.acquire(lock):
            continue
        if now() <= end:
            count += 1
        b.release(lock)
    return count


def fairness_worker(backends: dict[str, Backend], barrier, seconds: float, hold: float) -> list[tuple]:
    """Hold ``hold`` s, release, re-request at once; return (request, acquire, release) stamps.

    Requests stop at the end of the window but pending ones run to completion, so a
    starved waiter's full wait is counted rather than cut off.
    """
    (b,) = backends.values()
    barrier.wait()
    end = now() + seconds
    holds = []
    while now() < end:
        lock = b.new_lock("fairness")
        t_req = now()
        if not b.acquire(lock):
            raise RuntimeError(f"fairness acquire waited more than {ACQUIRE_CAP}s")
        t_acq = now()
        time.sleep(hold)
        t_rel = now()
        b.release(lock)
        holds.append((t_req, t_acq, t_rel))
    return holds


# ---------------------------------------------------------------------------------------
# Process plumbing
# ---------------------------------------------------------------------------------------

_ctx = mp.get_context("fork")


def _child(index: int, fn: Callable, contenders: list[Contender], endpoints: dict, args: tuple, out) -> None:
    """Child entry point: open a Backend per contender, run ``fn``, report its result or traceback."""
    backends: dict[str, Backend] = {}
    try:
        for c in contenders:
            backends[c.name] = Backend(c, endpoints)
        out.put((index, True, fn(backends, *args)))
    except BaseException:
        out.put((index, False, traceback.format_exc()))
    finally:
        for b in backends.values():
            b.close()


def run_processes(
    contenders: list[Contender], endpoints: dict, jobs: list[tuple[Callable, tuple]], timeout: float
) -> list:
    """Run each ``(fn, args)`` in its own process at once; return results in job order.

    On any failure or timeout the processes started here (and only those) are killed and
    the child's traceback is raised.
    """
    out = _ctx.Queue()
    procs = [
        _ctx.Process(target=_child, args=(i, fn, contenders, endpoints, args, out), daemon=True)
        for i, (fn, args) in enumerate(jobs)
    ]
    for p in procs:
        p.start()
    results: list = [None] * len(jobs)
    deadline = time.monotonic() + timeout
    try:
        for _ in jobs:
            index, ok, payload = out.get(timeout=max(0.1, deadline - time.monotonic()))
            if not ok:
                raise RuntimeError(f"child {index} ({fn_names(jobs)[index]}) failed:\n{payload}")
            results[index] = payload
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return results


def fn_names(jobs: list[tuple[Callable, tuple]]) -> list[str]:
    return [fn.__name__ for fn, _ in jobs]


# ---------------------------------------------------------------------------------------
# Scenarios as seen from the parent
# ---------------------------------------------------------------------------------------


def percentile(samples: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100): an observed value, never an interpolation."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def measure_uncontended(contenders: list[Contender], endpoints: dict, s: Settings) -> dict[str, dict]:
    """All contenders interleaved in one process (see :func:`uncontended_worker`)."""
    job = (uncontended_worker, (s.uncontended_iters, s.warmup, s.block))
    (res,) = run_processes(contenders, endpoints, [job], timeout=600)
    return {
        name: {
            "uncontended_p50_ms": ms(percentile(r["same_key"], 50)),
            "uncontended_p99_ms": ms(percentile(r["same_key"], 99)),
            "new_key_p50_ms": ms(percentile(r["new_key"], 50)),
            "new_key_p99_ms": ms(percentile(r["new_key"], 99)),
        }
        for name, r in res.items()
    }


def measure_handoff(contenders: list[Contender], endpoints: dict, s: Settings) -> dict[str, dict]:
    """One holder and one waiter process, all contenders taking turns round by round."""
    holder_end, waiter_end = _ctx.Pipe()
    jobs = [
        (handoff_holder, (holder_end, s.handoff_rounds, HANDOFF_WARMUP_ROUNDS, s.handoff_settle)),
        (handoff_waiter, (waiter_end,)),
    ]
    samples, _ = run_processes(contenders, endpoints, jobs, timeout=600)
    return {
        name: {"handoff_p50_ms": ms(percentile(v, 50)), "handoff_p99_ms": ms(percentile(v, 99))}
        for name, v in samples.items()
    }


def windowed(
    contenders: list[Contender], endpoints: dict, procs: int, seconds: float, passes: int, worker: Callable, *args
) -> dict:
    """Run ``worker`` in ``procs`` processes for ``seconds``, per contender, split in passes.

    Time-window scenarios cannot interleave contenders within a window, so the window is
    split into ``passes`` parts run in alternating contender order (A B C D, then D C B A):
    a server that speeds up or slows down over the run then favours no one.
    Returns, per contender, one list of per-process results per pass.
    """
    out: dict[str, list] = {c.name: [] for c in contenders}
    for k in range(passes):
        for c in contenders if k % 2 == 0 else contenders[::-1]:
            _log(f"  {worker.__name__} pass {k + 1}/{passes}: {c.name}")
            barrier = _ctx.Barrier(procs)
            jobs = [(worker, (barrier, seconds / passes) + args)] * procs
            out[c.name].append(run_processes([c], endpoints, jobs, timeout=seconds + 120))
    return out


def measure_throughput(contenders: list[Contender], endpoints: dict, s: Settings) -> dict[str, dict]:
    """Total acquisitions per second on one key with ``throughput_procs`` looping processes."""
    res = windowed(contenders, endpoints, s.throughput_procs, s.throughput_seconds, s.passes, throughput_worker)
    return {n: {"throughput_per_s": round(sum(map(sum, p)) / s.throughput_seconds, 1)} for n, p in res.items()}


def measure_fairness(contenders: list[Contender], endpoints: dict, s: Settings) -> dict[str, dict]:
    """Hold order and waits of ``fairness_procs`` processes re-requesting after each hold."""
    res = windowed(
        contenders, endpoints, s.fairness_procs, s.fairness_seconds, s.passes, fairness_worker, s.fairness_hold
    )
    return {name: fairness_stats(passes) for name, passes in res.items()}


def fairness_stats(passes: list[list[list[tuple[float, float, float]]]]) -> dict:
    """Order each pass's holds by acquire time and summarise repeats, waits and exclusion.

    A *same-holder repeat* is a process holding twice in a row while another process was
    already waiting (had requested before the repeat's request and not yet acquired).
    Without that condition the end of every window would count: once the others have
    stopped re-requesting, the last active process legitimately holds twice in a row.
    Each process's first request of a window does not count as "already waiting": all
    processes stamp it at the same instant (a barrier) on 2 busy cores, and the stamp can
    precede the request reaching the server by tens of ms of scheduling delay, so it says
    nothing about queue order (the same rule as ``fairness.queue_jumps``).

    ``overlaps`` counts holds that began before the previous holder started releasing:
    for a mutex it must be 0, so a non-zero value is a correctness bug, not a speed issue.
    """
    holds_total = pairs = repeats = overlaps = 0
    waits: list[float] = []
    for per_proc in passes:
        holds = sorted((a, proc, r, rel) for proc, hs in enumerate(per_proc) for r, a, rel in hs)
        steady = [(a, proc, r, rel) for proc, hs in enumerate(per_proc) for r, a, rel in hs[1:]]
        holds_total += len(holds)
        pairs += max(0, len(holds) - 1)
        repeats += sum(1 for prev, cur in pairwise(holds) if prev[1] == cur[1] and overtook(cur, steady))
        overlaps += sum(1 for prev, cur in pairwise(holds) if cur[0] < prev[3])
        waits += [t_acq - t_req for t_acq, _, t_req, _ in holds]
    return {
        "fairness_holds": holds_total,
        "same_holder_pct": round(100.0 * repeats / max(1, pairs), 2),
        "max_wait_ms": ms(max(waits)) if waits else None,
        "p50_wait_ms": ms(percentile(waits, 50)) if waits else None,
        "p99_wait_ms": ms(percentile(waits, 99)) if waits else None,
        "exclusion_overlaps": overlaps,
    }


def overtook(hold: tuple, holds: list[tuple]) -> bool:
    """True if another process requested before ``hold`` did and acquired after it."""
    t_acq, proc, t_req, _ = hold
    return any(p != proc and r < t_req and a > t_acq for a, p, r, _ in holds)


SCENARIOS = (
    ("uncontended", measure_uncontended),
    ("handoff", measure_handoff),
    ("throughput", measure_throughput),
    ("fairness", measure_fairness),
)

LATENCY_METRICS = (
    "uncontended_p50_ms",
    "uncontended_p99_ms",
    "new_key_p50_ms",
    "new_key_p99_ms",
    "handoff_p50_ms",
    "handoff_p99_ms",
)

# ---------------------------------------------------------------------------------------
# Run, judge, report
# ---------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[lock_bench] {msg}", file=sys.stderr, flush=True)


def start_servers():
    """Start a standalone ZooKeeper (fsync on) and a Redis, both throwaway, on free ports."""
    from celery_zklock.testing import ZooKeeperServer
    from support.redis_server import RedisServer

    zk = ZooKeeperServer(fsync=True)
    redis_server = RedisServer()
    try:
        zk.start()
        redis_server.start()
    except BaseException:
        zk.close()
        redis_server.close()
        raise
    return zk, redis_server


def run(quick: bool = False, endpoints: dict | None = None, settings: Settings | None = None) -> dict:
    """Measure every contender in every scenario; return the results (progress goes to stderr).

    ``endpoints`` (``zk_hosts``, ``redis_port``) lets a bigger runner (``bench/run.py``)
    use the servers it started for everything; by default fresh ones are started here.
    ``settings`` overrides the sizes (the runner's smoke mode uses smaller ones).
    """
    settings = settings or (QUICK if quick else FULL)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    servers = () if endpoints else start_servers()
    try:
        if servers:
            endpoints = {"zk_hosts": servers[0].hosts, "redis_port": servers[1].port}
        rows: dict[str, dict] = {c.name: {} for c in CONTENDERS}
        for scenario, measure in SCENARIOS:
            _log(scenario)
            for name, metrics in measure(list(CONTENDERS), endpoints, settings).items():
                rows[name].update(metrics)
    finally:
        for server in servers:
            server.close()
    results = {
        "benchmark": "lock_engine",
        "quick": quick,
        "settings": asdict(settings),
        "environment": environment() | {"loadavg_1min_start": load_before, "loadavg_1min_end": os.getloadavg()[0]},
        "contenders": rows,
        "ratios_vs_kazoo": ratios(rows),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    results["targets"] = targets(results)
    return results


def environment() -> dict:
    import kazoo
    import redis

    return {
        "python": platform.python_version(),
        "kazoo": getattr(kazoo, "__version__", None) or _dist_version("kazoo"),
        "redis-py": redis.__version__,
        "cpus": os.cpu_count(),
        "zookeeper_fsync": True,
        "platform": platform.platform(),
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def ratios(rows: dict[str, dict]) -> dict[str, dict[str, float]]:
    """Each latency metric divided by kazoo Lock's (below 1 means faster than kazoo)."""
    base = rows[BASELINE]
    return {
        name: {m: round(row[m] / base[m], 3) for m in LATENCY_METRICS if base.get(m)}
        for name, row in rows.items()
        if name != BASELINE
    }


def targets(results: dict) -> list[dict]:
    """The goals the lock engine was built for, judged per 'ours' row (reported, not asserted)."""
    out = []
    for c in CONTENDERS:
        if c.kind != "ours":
            continue
        row, ratio = results["contenders"][c.name], results["ratios_vs_kazoo"][c.name]
        checks = (
            ("uncontended acquire+release p50 <= 0.5x kazoo", ratio["uncontended_p50_ms"] <= 0.5,
             f"{ratio['uncontended_p50_ms']:.2f}x"),
            ("uncontended acquire+release p50 <= 0.86x kazoo (issue 27)", ratio["uncontended_p50_ms"] <= 0.86,
             f"{ratio['uncontended_p50_ms']:.2f}x"),
            ("handoff p50 <= kazoo", ratio["handoff_p50_ms"] <= 1.0, f"{ratio['handoff_p50_ms']:.2f}x"),
            ("0% same-holder repeats", row["same_holder_pct"] == 0, f"{row['same_holder_pct']:.2f}%"),
        )
        out += [{"contender": c.name, "target": t, "met": bool(met), "value": v} for t, met, v in checks]
    return out


COLUMNS = (
    ("uncontended_p50_ms", "uncont p50 ms"),
    ("uncontended_p99_ms", "uncont p99 ms"),
    ("new_key_p50_ms", "new-key p50 ms"),
    ("new_key_p99_ms", "new-key p99 ms"),
    ("handoff_p50_ms", "handoff p50 ms"),
    ("handoff_p99_ms", "handoff p99 ms"),
    ("throughput_per_s", "acq/s"),
    ("same_holder_pct", "same-holder %"),
    ("max_wait_ms", "max wait ms"),
)


def format_table(results: dict) -> str:
    """Rows are contenders; latency cells carry '(ratio x)' against kazoo's Lock."""
    rows, rel = results["contenders"], results["ratios_vs_kazoo"]

    def cell(name: str, metric: str) -> str:
        value = rows[name].get(metric)
        if value is None:
            return "-"
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        if metric in rel.get(name, {}):
            text += f" ({rel[name][metric]:.2f}x)"
        return text

    header = ["contender"] + [label for _, label in COLUMNS]
    body = [[name] + [cell(name, m) for m, _ in COLUMNS] for name in rows]
    widths = [max(len(r[i]) for r in [header] + body) for i in range(len(header))]

    def fmt(r: list[str]) -> str:
        return "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))

    lines = [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in body]
    lines.append("(x) = this row / kazoo Lock, for latency metrics; below 1.00x is faster than kazoo.")
    env = results["environment"]
    lines.append(
        f"ZooKeeper fsync on; {env['cpus']} CPUs; 1-min load average {env['loadavg_1min_start']:.2f} at start,"
        f" {env['loadavg_1min_end']:.2f} at end (other processes on this machine add noise)."
    )
    overlaps = {n: r["exclusion_overlaps"] for n, r in rows.items() if r.get("exclusion_overlaps")}
    if overlaps:
        lines.append(f"WARNING: mutual exclusion violated (overlapping holds) for {overlaps}")
    lines.append("")
    lines.append("Targets:")
    for t in results["targets"]:
        verdict = "met    " if t["met"] else "NOT met"
        lines.append(f"  [{verdict}] {t['contender']:<26} {t['target']:<58} ({t['value']})")
    return "\n".join(lines)


def write_json(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lock_bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller samples, shorter windows (< 40 s)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"results file (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    results = run(quick=args.quick)
    print(format_table(results))
    write_json(results, args.json)
    print(f"\nwrote {args.json} ({results['elapsed_s']} s, {'quick' if args.quick else 'full'} run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
