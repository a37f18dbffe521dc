"""Read/write lock benchmark (issue 62): our ``ReadWriteLock`` vs kazoo's ``ReadLock``/``WriteLock``.

Run from the project root::

    .venv/bin/python -m bench.rwlock [--quick] [--out DIR]

It writes ``rwlock.md`` and ``rwlock.json`` to ``bench/results`` (or ``DIR``); progress goes to
stderr.  About 1.5 minutes on 2 cores (``--quick``: about 20 s, not measurements).

Method (``bench/lock_bench.py``'s): one run, one freshly started private ZooKeeper (fsync on,
``tickTime`` 2000 ms, loopback only), every contender against it, ratios read within the
run; an unrecorded warm-up per contender, then time windows split in passes of alternating
contender order (A B C, then C B A);
KazooClients made only in forked children (the parent never has a thread or a client).
Each measuring process has one KazooClient shared by its threads (a worker process's one
session, as ``bench/scale.py``'s waiters); threads are spread over ``procs`` processes.
Every lock object is new per acquisition (a task's pattern: its construction is timed).
All releases wait for their delete (ours ``release()``'s default, kazoo's only way).

Scenarios:

1. **Readers on one key** (``readers``): N threads loop read-acquire, hold H, release.
   Ours ``ReadWriteLock.read`` vs our ``FairLock`` (a mutex: it serializes) vs kazoo's
   ``ReadLock``.  Acquisitions per second in the window, acquire latency, and the most
   holders seen at once (intervals from after ``acquire`` returned to before ``release``
   was called: inside the true hold, so an overlap is never a false alarm).
2. **90% readers / 10% writers on one key** (``mix``): the same loop, each thread drawing
   read or write from its own seeded generator (the same sequence for both contenders):
   throughput, and acquire latency p50/p99 per side.  Exclusion is checked (a write must
   overlap nothing).
3. **A writer behind R readers** (``writer_queue``): one process takes R read locks on a key;
   a writer (its own process and session) queues behind them; once its node is seen and
   a settle time has passed, the readers release one after another in an order: ``fifo``
   (oldest first: the writer's nearest node goes last), ``random`` (seeded), ``reverse``
   (newest first: the nearest goes first, every time).  Measured: last reader's
   ``release()`` called -> writer's ``acquire()`` returned, and first release -> grant; the
   writer's wake-ups (watch callbacks of its client, counted as ``bench/scale.py`` does) and
   children reads (``get_children`` requests of its client), and, ZooKeeper-side, the
   requests its session sent from request to grant (``cons``: that connection's ``recved``,
   pings included, and the own-node watch ours sets on its grant when it arrives first).
4. **Scale** (``scale``): scenario 1 again at 10x readers on one key, and at 10x keys with
   N readers each (as many threads as the 10x-readers case, so the two differ only in how
   many share a key).  Besides throughput and latency, cost per acquisition: the measuring
   processes' CPU, ZooKeeper's CPU (``/proc``) and ZooKeeper's packets received
   (``mntr``), per acquisition in the window.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import resource
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from celery_zklock.engine.attempt import OWN_WATCH_WITHIN

from .lock_bench import Contender, _ctx, percentile, run_processes

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
ACQUIRE_CAP = 60.0  # seconds; no acquire here should ever wait this long

OURS = Contender("ours ReadWriteLock", "rw-ours")
MUTEX = Contender("ours FairLock (mutex)", "rw-mutex")
KAZOO = Contender("kazoo ReadLock/WriteLock", "rw-kazoo")

now = time.perf_counter


@dataclass(frozen=True)
class Settings:
    hold: float  # H, seconds each holder holds
    procs: int  # measuring processes per window (one KazooClient each); threads spread over them
    readers: int  # N: threads in scenarios 1 and 2, readers per key in 4's 10x keys
    window: float  # seconds per contender in scenarios 1 and 4 (split in passes)
    mix_window: float  # seconds per contender in scenario 2
    write_pct: int
    passes: int
    scale_readers: int  # readers on one key, 10x
    scale_keys: int  # keys with ``readers`` each, 10x
    queue_sizes: tuple[int, ...]  # R in scenario 3
    orders: tuple[str, ...]
    queue_rounds: int  # per (R, order, contender)
    settle: float  # seconds the writer's watch is given before the readers release
    warmup: float  # seconds per contender, not recorded, before anything is (the server's JIT)


FULL = Settings(hold=0.010, procs=4, readers=10, window=4.0, mix_window=6.0, write_pct=10, passes=2,
                scale_readers=100, scale_keys=10, queue_sizes=(10, 100), orders=("fifo", "random", "reverse"),
                queue_rounds=2, settle=0.05, warmup=1.0)
QUICK = Settings(hold=0.005, procs=2, readers=4, window=0.6, mix_window=0.6, write_pct=25, passes=1,
                 scale_readers=8, scale_keys=2, queue_sizes=(5,), orders=("random",), queue_rounds=1, settle=0.02,
                 warmup=0.2)


def _log(msg: str) -> None:
    print(f"[rwlock] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# One contender's locks (children only)
# ---------------------------------------------------------------------------------------


def zk_path(b, key: str) -> str:
    return f"/bench/{b.contender.slug}/{key}"


def new_lock(b, key: str, write: bool):
    """A new lock object on ``key``: the write or the read side of the contender."""
    path = zk_path(b, key)
    kind = b.contender.kind
    if kind == "rw-ours":
        from celery_zklock import ReadWriteLock

        rw = ReadWriteLock(b.zk, path)
        return rw.write if write else rw.read
    if kind == "rw-mutex":
        from celery_zklock import FairLock

        return FairLock(b.zk, path)
    from kazoo.recipe.lock import ReadLock, WriteLock

    return (WriteLock if write else ReadLock)(b.zk, path, identifier=str(os.getpid()))


def acquire(lock, timeout: float = ACQUIRE_CAP) -> bool:
    """Blocking acquire bounded by ``timeout``; False (never an exception) on timeout."""
    from kazoo.exceptions import LockTimeout

    try:
        return bool(lock.acquire(timeout=timeout))
    except LockTimeout:
        return False


def machine_busy_s() -> float:
    """CPU seconds every process on the machine has used since boot (``/proc/stat``: not idle, not iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(zk_pid: int | None) -> float:
    """CPU seconds of this process, its reaped children (the measuring processes) and our ZooKeeper."""
    from .infra import cpu_seconds

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime + (cpu_seconds(zk_pid) if zk_pid else 0.0)


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------------------------------
# Scenarios 1, 2, 4: threads looping on keys for a time window
# ---------------------------------------------------------------------------------------


def window_worker(backends, barrier, seconds: float, hold: float, keys: list[str], tids: list[int],
                  write_pct: int, seed: int) -> dict:
    """Threads ``tids`` loop acquire (read, or write with ``write_pct`` % odds), hold, release.

    Thread ``tid`` works on ``keys[tid % len(keys)]`` and draws its sides from its own
    generator, seeded by ``seed`` and ``tid`` (the same sequence for every contender).  The
    window opens when every process is connected; acquisitions pending at its end run to
    completion (only those acquired inside it count).
    """
    (b,) = backends.values()
    go = threading.Event()
    end = [0.0]
    out: list = [([], 0)] * len(tids)
    errors: list[str] = []

    def loop(slot: int, tid: int) -> None:
        try:
            run_thread(slot, tid)
        except BaseException:
            errors.append(traceback.format_exc())
            go.set()

    def run_thread(slot: int, tid: int) -> None:
        key = keys[tid % len(keys)]
        rng = random.Random(seed * 1_000_003 + tid)
        ops, failures = [], 0
        go.wait()
        while now() < end[0]:
            write = rng.random() * 100 < write_pct
            t_req = now()
            lock = new_lock(b, key, write)
            if not acquire(lock):
                failures += 1
                continue
            t_acq = now()
            time.sleep(hold)
            t_rel = now()
            lock.release()
            ops.append((key, write, t_req, t_acq, t_rel))
        out[slot] = (ops, failures)

    threads = [threading.Thread(target=loop, args=(i, tid), daemon=True) for i, tid in enumerate(tids)]
    for t in threads:
        t.start()
    barrier.wait()
    cpu0 = process_cpu()
    end[0] = now() + seconds
    go.set()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} threads failed; the first:\n{errors[0]}")
    return {"ops": [op for ops, _ in out for op in ops], "failures": sum(f for _, f in out),
            "cpu_s": process_cpu() - cpu0, "end": end[0]}


class ServerMeter:
    """ZooKeeper's packets received (``mntr``) and, when we started it, its CPU (``/proc``)."""

    def __init__(self, port: int, pid: int | None) -> None:
        self.port, self.pid = port, pid

    def snapshot(self) -> tuple[int, float | None]:
        from celery_zklock.testing import four_letter_word

        from .infra import cpu_seconds

        out = four_letter_word("127.0.0.1", self.port, "mntr", timeout=5)
        m = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
        return int(m["zk_packets_received"]), (cpu_seconds(self.pid) if self.pid else None)


def run_window(c: Contender, endpoints: dict, meter: ServerMeter, s: Settings, seconds: float, threads: int,
               keys: list[str], write_pct: int, seed: int) -> dict:
    """One pass of one contender: ``threads`` threads over ``s.procs`` processes, for ``seconds``."""
    procs = min(s.procs, threads)
    tids = [list(range(p, threads, procs)) for p in range(procs)]
    barrier = _ctx.Barrier(procs)
    jobs = [(window_worker, (barrier, seconds, s.hold, keys, t, write_pct, seed)) for t in tids]
    packets0, zk_cpu0 = meter.snapshot()
    results = run_processes([c], endpoints, jobs, timeout=seconds + 180)
    packets1, zk_cpu1 = meter.snapshot()
    end = min(r["end"] for r in results)
    return {
        "ops": [op for r in results for op in r["ops"]],
        "in_window": sum(1 for r in results for op in r["ops"] if op[3] <= r["end"]),
        "failures": sum(r["failures"] for r in results),
        "client_cpu_s": sum(r["cpu_s"] for r in results),
        "zk_packets": packets1 - packets0,
        "zk_cpu_s": None if zk_cpu0 is None else zk_cpu1 - zk_cpu0,
        "end": end,
    }


def windowed(contenders: list[Contender], endpoints: dict, meter: ServerMeter, s: Settings, label: str,
             seconds: float, threads: int, keys: int, write_pct: int) -> dict[str, dict]:
    """Each contender for ``seconds`` in total, in ``s.passes`` passes of alternating order."""
    per: dict[str, list[dict]] = {c.name: [] for c in contenders}
    for k in range(s.passes):
        for c in contenders if k % 2 == 0 else contenders[::-1]:
            _log(f"  {label} pass {k + 1}/{s.passes}: {c.name}")
            names = [f"{label}-{i}" for i in range(keys)]
            per[c.name].append(run_window(c, endpoints, meter, s, seconds / s.passes, threads, names, write_pct,
                                          seed=k))
    return {name: summarize(passes, seconds, s.hold) for name, passes in per.items()}


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def summarize(passes: list[dict], seconds: float, hold: float) -> dict:
    ops = [op for p in passes for op in p["ops"]]
    n = sum(p["in_window"] for p in passes)
    reads = [op[3] - op[2] for op in ops if not op[1]]
    writes = [op[3] - op[2] for op in ops if op[1]]
    zk_cpu = [p["zk_cpu_s"] for p in passes]
    holds = [op for p in passes for op in p["ops"]]
    row = {
        "acquisitions": n,
        "per_s": round(n / seconds, 1),
        "reads": len(reads),
        "writes": len(writes),
        "read_acquire_p50_ms": ms(percentile(reads, 50)) if reads else None,
        "read_acquire_p99_ms": ms(percentile(reads, 99)) if reads else None,
        "write_acquire_p50_ms": ms(percentile(writes, 50)) if writes else None,
        "write_acquire_p99_ms": ms(percentile(writes, 99)) if writes else None,
        "client_cpu_ms_per_acq": ms(sum(p["client_cpu_s"] for p in passes) / max(1, len(ops))),
        "zk_cpu_ms_per_acq": None if None in zk_cpu else ms(sum(zk_cpu) / max(1, len(ops))),
        "zk_requests_per_acq": round(sum(p["zk_packets"] for p in passes) / max(1, len(ops)), 2),
        "timeouts": sum(p["failures"] for p in passes),
        **concurrency(holds),
    }
    # Mean holders at once over the window (each hold is ``hold`` long): above 1 means sharing.
    row["mean_holders"] = round(n * hold / seconds, 2)
    return row


def concurrency(ops: list[tuple]) -> dict:
    """Most holders seen at once on one key, and exclusion violations (a write overlapping anything).

    Intervals run from after ``acquire`` returned to before ``release`` was called: inside
    the true hold, so a reported overlap is a real one.
    """
    by_key: dict[str, list[tuple]] = {}
    for key, write, _, t_acq, t_rel in ops:
        by_key.setdefault(key, []).append((t_acq, t_rel, write))
    most = violations = 0
    for intervals in by_key.values():
        events = sorted([(a, 1) for a, _, _ in intervals] + [(r, -1) for _, r, _ in intervals],
                        key=lambda e: (e[0], e[1]))
        level = 0
        for _, d in events:
            level += d
            most = max(most, level)
        end_all = end_write = float("-inf")
        for a, r, write in sorted(intervals):
            if a < (end_all if write else end_write):
                violations += 1
            end_all = max(end_all, r)
            if write:
                end_write = max(end_write, r)
    return {"max_holders_at_once": most, "exclusion_violations": violations}


# ---------------------------------------------------------------------------------------
# Scenario 3: a writer behind R readers
# ---------------------------------------------------------------------------------------


def release_order(locks: list, order: str, seed: int) -> list:
    if order == "fifo":
        return list(locks)
    if order == "reverse":
        return locks[::-1]
    shuffled = list(locks)
    random.Random(seed).shuffle(shuffled)
    return shuffled


def queue_readers(backends, pipe, plan: list[tuple], settle: float) -> list[dict]:
    """Per round: take R reads, let the writer queue behind them, release them in ``order``."""
    out = []
    for name, r, order, key, seed in plan:
        b = backends[name]
        locks = []
        for _ in range(r):
            lk = new_lock(b, key, False)
            if not acquire(lk, 30):
                raise RuntimeError(f"{name}: a reader could not take its read lock")
            locks.append(lk)
        pipe.send((name, key))
        deadline = now() + 30
        while len(b.zk.get_children(zk_path(b, key))) < r + 1:
            if now() > deadline:
                raise RuntimeError(f"{name}: the writer never queued")
            time.sleep(0.002)
        time.sleep(settle)
        seq = release_order(locks, order, seed)
        t_first = now()
        for lk in seq[:-1]:
            lk.release()
        t_last = now()
        seq[-1].release()
        t_last_returned = now()
        w = pipe.recv()
        if w is None:
            raise RuntimeError(f"{name}: the writer timed out")
        out.append({"contender": name, "readers": r, "order": order, "first_release": t_first,
                    "last_release": t_last, "last_release_returned": t_last_returned, **w})
    pipe.send(None)
    return out


def session_requests(port: int, session_id: int) -> int | None:
    """Requests ZooKeeper received on the connection of ``session_id`` (``cons``'s ``recved``)."""
    from celery_zklock.testing import four_letter_word

    text = four_letter_word("127.0.0.1", port, "cons", timeout=5)
    for line in text.splitlines():
        sid = re.search(r"sid=0x([0-9a-f]+)", line)
        got = re.search(r"recved=(\d+)", line)
        if sid and got and int(sid.group(1), 16) == session_id:
            return int(got.group(1))
    return None


def queue_writer(backends, pipe, port: int) -> None:
    """On each request: queue a write lock, stamp its grant, count what it took to get there."""
    from .scale import WatchProbe

    probes = {name: WatchProbe(b.zk) for name, b in backends.items()}

    def counts(probe) -> tuple[int, int, int]:
        r = probe.result()
        wakeups = sum(v for k, v in r["callbacks"].items() if "own_node" not in k)
        return wakeups, r["children_reads"], r["wire"]

    while (msg := pipe.recv()) is not None:
        name, key = msg
        b, probe = backends[name], probes[name]
        sid = b.zk.client_id[0]
        before, req0 = counts(probe), session_requests(port, sid)
        lk = new_lock(b, key, True)
        t_req = now()
        got = acquire(lk)
        t_grant = now()
        after, req1 = counts(probe), session_requests(port, sid)
        if not got:
            pipe.send(None)
            return
        lk.release()
        pipe.send({"requested": t_req, "granted": t_grant, "wakeups": after[0] - before[0],
                   "children_reads": after[1] - before[1], "watch_events": after[2] - before[2],
                   "zk_requests": None if req0 is None or req1 is None else req1 - req0})


def measure_writer_queue(endpoints: dict, s: Settings) -> dict:
    contenders = [OURS, KAZOO]
    plan = []
    for r in s.queue_sizes:
        for order in s.orders:
            for k in range(s.queue_rounds):
                for c in contenders if k % 2 == 0 else contenders[::-1]:
                    plan.append((c.name, r, order, f"queue-{r}-{order}-{k}", 1000 * r + k))
    readers_end, writer_end = _ctx.Pipe()
    port = int(endpoints["zk_hosts"].rsplit(":", 1)[1])
    jobs = [(queue_readers, (readers_end, plan, s.settle)), (queue_writer, (writer_end, port))]
    rounds, _ = run_processes(contenders, endpoints, jobs, timeout=600)
    out: dict = {}
    for r in s.queue_sizes:
        for order in s.orders:
            cell = {}
            for c in contenders:
                rows = [x for x in rounds if x["contender"] == c.name and x["readers"] == r and x["order"] == order]
                cell[c.name] = {
                    "rounds": len(rows),
                    "last_release_to_grant_ms": median_ms([x["granted"] - x["last_release"] for x in rows]),
                    "last_release_returned_to_grant_ms": median_ms(
                        [x["granted"] - x["last_release_returned"] for x in rows]),
                    "first_release_to_grant_ms": median_ms([x["granted"] - x["first_release"] for x in rows]),
                    "wakeups": median([x["wakeups"] for x in rows]),
                    "children_reads": median([x["children_reads"] for x in rows]),
                    "watch_events": median([x["watch_events"] for x in rows]),
                    "zk_requests": median([x["zk_requests"] for x in rows if x["zk_requests"] is not None]),
                    "samples": [{k: x[k] for k in ("wakeups", "children_reads", "zk_requests")}
                                | {"last_release_to_grant_ms": ms(x["granted"] - x["last_release"])} for x in rows],
                }
            out[f"R={r} {order}"] = cell
    return out


def median(values: list[float]) -> float | None:
    if not values:
        return None
    v = sorted(values)
    mid = len(v) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def median_ms(values: list[float]) -> float | None:
    m = median(values)
    return None if m is None else ms(m)


# ---------------------------------------------------------------------------------------
# Run, report
# ---------------------------------------------------------------------------------------


def start_zookeeper():
    from celery_zklock.testing import ZooKeeperServer

    zk = ZooKeeperServer(tick_ms=2000, fsync=True, container_check_ms=1000)
    try:
        zk.start(timeout=60, new_session=True)
    except BaseException:
        zk.close()
        raise
    return zk


def ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 3)


def run(quick: bool = False, endpoints: dict | None = None, settings: Settings | None = None) -> dict:
    """Every scenario against one ZooKeeper (started here unless ``endpoints`` names one)."""
    s = settings or (QUICK if quick else FULL)
    started = time.monotonic()
    load_start = os.getloadavg()[0]
    server = None if endpoints else start_zookeeper()
    zk_pid = server.proc.pid if server is not None else None
    busy0, own0 = machine_busy_s(), own_cpu_s(zk_pid)
    try:
        if server is not None:
            endpoints = {"zk_hosts": server.hosts}
        port = int(endpoints["zk_hosts"].rsplit(":", 1)[1])
        meter = ServerMeter(port, server.proc.pid if server is not None else None)
        machine = environment(port)
        sc: dict[str, Any] = {}
        durations: dict[str, float] = {}

        def timed(name: str, fn, *args):
            _log(name)
            t0 = time.monotonic()
            sc[name] = fn(*args)
            durations[name] = round(time.monotonic() - t0, 1)

        n = s.readers
        for c in (OURS, MUTEX, KAZOO):  # reads and writes, so that both sides' paths are warm
            _log(f"warm-up: {c.name}")
            run_window(c, endpoints, meter, s, s.warmup, n, ["warm-up"], s.write_pct, seed=99)
        timed("readers", windowed, [OURS, MUTEX, KAZOO], endpoints, meter, s, "readers", s.window, n, 1, 0)
        timed("mix", windowed, [OURS, KAZOO], endpoints, meter, s, "mix", s.mix_window, n, 1, s.write_pct)
        timed("writer_queue", measure_writer_queue, endpoints, s)
        timed("scale_readers", windowed, [OURS, KAZOO], endpoints, meter, s, "scale-readers", s.window,
              s.scale_readers, 1, 0)
        timed("scale_keys", windowed, [OURS, KAZOO], endpoints, meter, s, "scale-keys", s.window,
              n * s.scale_keys, s.scale_keys, 0)
        # Other processes' CPU over the run: the machine's busy time less ours (only exact with our own server).
        others = round(machine_busy_s() - busy0 - (own_cpu_s(zk_pid) - own0), 1) if zk_pid else None
    finally:
        if server is not None:
            server.close()
    results = {
        "benchmark": "rwlock",
        "quick": quick,
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(time.time() - (time.monotonic() - started))),
        "settings": asdict(s),
        "machine": machine | {"loadavg_1min_start": load_start, "loadavg_1min_end": os.getloadavg()[0],
                              "other_processes_cpu_s": others},
        "scenarios": sc,
        "durations_s": durations,
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    results["ratios"] = ratios(results)
    results["growth"] = growth(results)
    return results


def ratios(results: dict) -> dict:
    sc = results["scenarios"]
    rd, mix = sc["readers"], sc["mix"]
    o, k, m = rd[OURS.name], rd[KAZOO.name], rd[MUTEX.name]
    out = {
        "readers_per_s_ours_vs_kazoo": ratio(o["per_s"], k["per_s"]),
        "readers_per_s_ours_vs_mutex": ratio(o["per_s"], m["per_s"]),
        "readers_per_s_kazoo_vs_mutex": ratio(k["per_s"], m["per_s"]),
        "readers_acquire_p50_ours_vs_kazoo": ratio(o["read_acquire_p50_ms"], k["read_acquire_p50_ms"]),
        "mix_per_s_ours_vs_kazoo": ratio(mix[OURS.name]["per_s"], mix[KAZOO.name]["per_s"]),
    }
    for side in ("read", "write"):
        for p in ("p50", "p99"):
            f = f"{side}_acquire_{p}_ms"
            out[f"mix_{side}_{p}_ours_vs_kazoo"] = ratio(mix[OURS.name][f], mix[KAZOO.name][f])
    for cell, row in sc["writer_queue"].items():
        out[f"writer_queue {cell}: last release to grant, ours vs kazoo"] = ratio(
            row[OURS.name]["last_release_to_grant_ms"], row[KAZOO.name]["last_release_to_grant_ms"])
    for label in ("scale_readers", "scale_keys"):
        out[f"{label}_per_s_ours_vs_kazoo"] = ratio(sc[label][OURS.name]["per_s"], sc[label][KAZOO.name]["per_s"])
    return out


GROWTH_FIELDS = ("per_s", "read_acquire_p50_ms", "read_acquire_p99_ms", "client_cpu_ms_per_acq", "zk_cpu_ms_per_acq",
                 "zk_requests_per_acq")


def growth(results: dict) -> dict:
    """10x readers on one key, and 10x keys, each against scenario 1 (N readers on one key)."""
    sc = results["scenarios"]
    out = {}
    for c in (OURS, KAZOO):
        base = sc["readers"][c.name]
        out[c.name] = {
            label: {f: ratio(sc[label][c.name][f], base[f]) for f in GROWTH_FIELDS}
            for label in ("scale_readers", "scale_keys")
        }
    return out


def environment(port: int) -> dict:
    from importlib.metadata import version

    from celery_zklock.testing import four_letter_word

    from .infra import source_state

    srvr = four_letter_word("127.0.0.1", port, "srvr", timeout=5)
    zk_version = next((ln.split(":", 1)[1].strip().split("-")[0] for ln in srvr.splitlines()
                       if ln.startswith("Zookeeper version")), None)
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "kazoo": version("kazoo"), "zookeeper_version": zk_version, "zookeeper_fsync": True,
            "source": source_state()}


# ---------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------


def fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]


WINDOW_COLUMNS = (("per_s", "acq/s"), ("read_acquire_p50_ms", "read acquire p50 ms"),
                  ("read_acquire_p99_ms", "p99 ms"), ("mean_holders", "holders at once (mean)"),
                  ("max_holders_at_once", "max"), ("client_cpu_ms_per_acq", "client CPU ms/acq"),
                  ("zk_cpu_ms_per_acq", "ZK CPU ms/acq"), ("zk_requests_per_acq", "ZK requests/acq"),
                  ("exclusion_violations", "exclusion violations"))


def markdown(res: dict) -> str:
    s, sc, m, rt = res["settings"], res["scenarios"], res["machine"], res["ratios"]
    hold_ms = s["hold"] * 1000
    lines = [
        "# Read/write lock: ours vs kazoo's ReadLock/WriteLock (issue 62)",
        "",
        f"`python -m bench.rwlock{' --quick' if res['quick'] else ''}` "
        f"({res['measured_at']}, commit {m['source']['commit']}"
        f"{', library changed' if m['source']['library_uncommitted_changes'] else ''}): "
        f"{m['cpus']} CPUs, Python {m['python']}, kazoo {m['kazoo']}, ZooKeeper {m['zookeeper_version']} "
        f"(standalone, fsync on, loopback), 1-min load {m['loadavg_1min_start']:.2f} at start and "
        f"{m['loadavg_1min_end']:.2f} at end; {res['elapsed_s']:.0f} s in all"
        + (f"; other processes used {m['other_processes_cpu_s']:g} CPU-seconds meanwhile "
           f"({m['other_processes_cpu_s'] / (res['elapsed_s'] * m['cpus']):.0%} of the machine)."
           if m.get("other_processes_cpu_s") is not None else "."),
        "",
    ]
    if res.get("note"):
        lines += [f"Machine note: {res['note']}", ""]
    if res["quick"]:
        lines += ["**Quick run: the suite works; these numbers are not measurements.**", ""]
    lines += [
        f"Every contender against the same ZooKeeper in the same run; windows in {s['passes']} passes of "
        f"alternating order; {s['procs']} processes with one KazooClient each, threads spread over them; "
        f"a new lock object per acquisition; hold H = {hold_ms:g} ms; releases wait for their delete. "
        "Ratios are ours / kazoo (or / the mutex) within this run."
        + (f" Our holders watch their own node within {OWN_WATCH_WITHIN * 1000:g} ms of the grant (batched per "
           f"client): with holds of {hold_ms:g} ms only those still held when a batch runs pay that request."
           if s["hold"] < OWN_WATCH_WITHIN else
           f" Our holders watch their own node within {OWN_WATCH_WITHIN * 1000:g} ms of the grant: one request "
           "more per hold, in these figures."),
        "",
        f"## 1. {s['readers']} readers on one key, each holding {hold_ms:g} ms",
        "",
        f"{s['window']:g} s per contender. The ceiling with free locks: {s['readers'] / s['hold']:,.0f} acq/s "
        f"shared, {1 / s['hold']:,.0f} acq/s for a mutex.",
        "",
    ]
    lines += window_table(sc["readers"], (OURS, MUTEX, KAZOO))
    lines += ["", f"Ratios: ours read / kazoo ReadLock **{fmt(rt['readers_per_s_ours_vs_kazoo'])}x** acq/s "
              f"(acquire p50 {fmt(rt['readers_acquire_p50_ours_vs_kazoo'])}x); ours read / our mutex "
              f"**{fmt(rt['readers_per_s_ours_vs_mutex'])}x**; kazoo ReadLock / our mutex "
              f"{fmt(rt['readers_per_s_kazoo_vs_mutex'])}x.", ""]
    lines += [f"## 2. {100 - s['write_pct']}% readers / {s['write_pct']}% writers on one key",
              "", f"{s['readers']} threads, {s['mix_window']:g} s per contender, H = {hold_ms:g} ms for both sides.",
              ""]
    rows = []
    for c in (OURS, KAZOO):
        r = sc["mix"][c.name]
        rows.append([c.name, r["per_s"], r["reads"], r["writes"], r["read_acquire_p50_ms"], r["read_acquire_p99_ms"],
                     r["write_acquire_p50_ms"], r["write_acquire_p99_ms"], r["exclusion_violations"]])
    rows.append(["ours / kazoo", rt["mix_per_s_ours_vs_kazoo"], None, None, rt["mix_read_p50_ours_vs_kazoo"],
                 rt["mix_read_p99_ours_vs_kazoo"], rt["mix_write_p50_ours_vs_kazoo"], rt["mix_write_p99_ours_vs_kazoo"],
                 None])
    lines += table(["contender", "acq/s", "reads", "writes", "read acquire p50 ms", "read p99 ms",
                    "write acquire p50 ms", "write p99 ms", "exclusion violations"], rows)
    lines += ["", "## 3. A writer behind R readers", "",
              f"Medians of {s['queue_rounds']} rounds per cell. *last release -> grant*: the last reader's `release()` "
              "called to the writer's `acquire()` returned; *first release -> grant*: the whole drain (the readers "
              "release one after another from one session, each waiting for its delete). *wake-ups*: watch callbacks "
              "in the writer's client (a watch set on a node already gone gets no event: the writer reads the "
              "children again without one); *children reads*: its `get_children` requests; *ZK requests*: its "
              "session's requests from request to grant, counted by ZooKeeper (`cons`, pings included).", ""]
    rows = []
    for cell, row in sc["writer_queue"].items():
        for c in (OURS, KAZOO):
            r = row[c.name]
            rows.append([cell, c.name, r["last_release_to_grant_ms"], r["first_release_to_grant_ms"], r["wakeups"],
                         r["children_reads"], r["zk_requests"]])
        rows.append([cell, "ours / kazoo", ratio(row[OURS.name]["last_release_to_grant_ms"],
                                                 row[KAZOO.name]["last_release_to_grant_ms"]),
                     ratio(row[OURS.name]["first_release_to_grant_ms"], row[KAZOO.name]["first_release_to_grant_ms"]),
                     None, None, None])
    lines += table(["readers ahead, release order", "contender", "last release -> grant ms",
                    "first release -> grant ms", "wake-ups", "children reads", "ZK requests"], rows)
    lines += ["", "## 4. Scale: 10x readers on one key, 10x keys", ""]
    lines += [f"Scenario 1 ({s['readers']} readers, 1 key) against {s['scale_readers']} readers on 1 key and "
              f"{s['readers']} readers on each of {s['scale_keys']} keys ({s['readers'] * s['scale_keys']} threads, "
              "as many as the 10x-readers case).", ""]
    rows = []
    for label, title in (("readers", f"{s['readers']} readers x 1 key"),
                         ("scale_readers", f"{s['scale_readers']} readers x 1 key"),
                         ("scale_keys", f"{s['readers']} readers x {s['scale_keys']} keys")):
        for c in (OURS, KAZOO):
            r = sc[label][c.name]
            rows.append([title, c.name] + [r[f] for f in GROWTH_FIELDS] + [r["exclusion_violations"]])
    lines += table(["shape", "contender", "acq/s", "read acquire p50 ms", "p99 ms", "client CPU ms/acq",
                    "ZK CPU ms/acq", "ZK requests/acq", "exclusion violations"], rows)
    lines += ["", "Growth against scenario 1 (x):", ""]
    rows = []
    for c in (OURS, KAZOO):
        for label, title in (("scale_readers", "10x readers"), ("scale_keys", "10x keys")):
            g = res["growth"][c.name][label]
            rows.append([c.name, title] + [g[f] for f in GROWTH_FIELDS])
    lines += table(["contender", "shape", "acq/s", "acquire p50", "p99", "client CPU/acq", "ZK CPU/acq",
                    "ZK requests/acq"], rows)
    lines += ["", f"Durations (s): {', '.join(f'{k} {v:g}' for k, v in res['durations_s'].items())}."]
    return "\n".join(lines) + "\n"


def window_table(rows: dict, contenders) -> list[str]:
    return table(["contender"] + [label for _, label in WINDOW_COLUMNS],
                 [[c.name] + [rows[c.name][f] for f, _ in WINDOW_COLUMNS] for c in contenders])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.rwlock", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (~20 s): tiny windows, not measurements")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--hold-ms", type=float, default=None,
                        help=f"H, how long each holder holds (default {FULL.hold * 1000:g}; shorter holds than "
                             f"{OWN_WATCH_WITHIN * 1000:g} ms mostly end before ours watch their own node)")
    parser.add_argument("--note", default="", help="a sentence about the machine at the time, put in rwlock.md")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.hold_ms is not None:
        settings = replace(settings, hold=args.hold_ms / 1000)
    results = run(quick=args.quick, settings=settings)
    results["note"] = args.note
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(results)
    (args.out / "rwlock.md").write_text(md)
    (args.out / "rwlock.json").write_text(json.dumps(results, indent=2) + "\n")
    print(md)
    print(f"wrote {args.out / 'rwlock.md'} and rwlock.json ({results['elapsed_s']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
