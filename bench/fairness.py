"""Scenario 3: fairness under contention -- our lock vs two Redis locks people use instead.

P processes each hold the lock a few ms, release, and ask again at once, for a fixed time
window (split in passes of alternating contender order, see ``lock_bench.windowed``).
Contenders: the engine ZkLockedTask waits in (``FairLock``, pipelined release as in the
task), a Redis ``SET NX`` + 1 ms sleep-poll lock, and python-redis-lock (``SET NX``, then
``BLPOP`` on a signal list the releaser pushes to).

Reported per contender:

* **same-holder %** -- of consecutive holds, how often the same process held twice in a
  row while another process was already waiting (``lock_bench.fairness_stats``);
* **max wait** -- longest request-to-acquire time, against the **fair bound**: in a FIFO
  queue a request made right after a release has the other P-1 processes ahead of it, so
  it waits about (P-1) x the mean interval between two acquisitions of that contender.
  ``max_wait / fair_bound`` near 1 is what a fair lock gives; the target is <= 1.5;
* **queue jumps** -- holds that began before a hold requested earlier (FIFO: 0), and the
  **longest gap** between two acquisitions: they tell an unfair lock (jumps) from a stall
  that every waiter sat through (a long gap, no jumps).

Why processes and not Celery tasks: fairness is a property of the lock; with Celery the
pool's own scheduling between one task and the next would blur which lock did what.
Scenario 2 shows the same queue order through real workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from . import lock_bench
from .lock_bench import Contender
from .stats import ms, summary

CONTENDERS = (
    Contender("ZkLockedTask engine (FairLock)", "ours", wait_release=False),
    Contender("Redis SET NX + 1 ms poll", "redis"),
    Contender("python-redis-lock", "redis-lock"),
)
BASELINE = CONTENDERS[1].name


@dataclass(frozen=True)
class FairnessSizes:
    procs: int
    hold: float
    seconds: float  # per contender, over all passes
    passes: int


FULL = FairnessSizes(procs=8, hold=0.005, seconds=8.0, passes=4)
QUICK = FairnessSizes(procs=8, hold=0.005, seconds=1.5, passes=1)


def fairness(services, s: FairnessSizes) -> dict:
    """Run the windows; ZooKeeper's own fsync/write latency over them is recorded too
    (only the FairLock contender uses ZooKeeper here, so they are its server's stalls)."""
    services.reset_server_stats()
    res = lock_bench.windowed(list(CONTENDERS), services.endpoints(), s.procs, s.seconds, s.passes,
                              lock_bench.fairness_worker, s.hold)
    server = services.server_stats()
    out, waits = {}, {}
    for c in CONTENDERS:
        passes = res[c.name]
        stats = lock_bench.fairness_stats(passes)
        cycle = mean_cycle(passes)
        bound = (s.procs - 1) * cycle
        waits[c.name] = [acq - req for per_proc in passes for hs in per_proc for req, acq, _ in hs]
        out[c.name] = {
            "label": c.name,
            "holds": stats["fairness_holds"],
            "same_holder_pct": stats["same_holder_pct"],
            "exclusion_overlaps": stats["exclusion_overlaps"],
            "mean_cycle_ms": ms(cycle),
            "fair_bound_ms": ms(bound),
            "max_wait_vs_fair_bound": round(max(waits[c.name]) / bound, 3),
            "queue_jumps": (jumps := queue_jumps(passes)),
            "queue_jumps_pct": round(100.0 * jumps / max(1, stats["fairness_holds"]), 2),
            "longest_gap_ms": ms(longest_gap(passes)),
            "holds_per_s": round(stats["fairness_holds"] / s.seconds, 1),
            **summary(waits[c.name], "wait_"),
        }
    return {"contenders": out, "baseline": BASELINE, "procs": s.procs, "hold_ms": s.hold * 1000,
            "window_s": s.seconds, "zookeeper": server, "waits_s": waits}


def _gaps(passes) -> list[float]:
    gaps = []
    for per_proc in passes:
        acquired = sorted(acq for hs in per_proc for _, acq, _ in hs)
        gaps += [b - a for a, b in pairwise(acquired)]
    return gaps


def mean_cycle(passes: list[list[list[tuple[float, float, float]]]]) -> float:
    """Mean time between two consecutive acquisitions (one hold plus one handoff)."""
    gaps = _gaps(passes)
    return sum(gaps) / len(gaps)


def longest_gap(passes) -> float:
    """The longest time between two consecutive acquisitions: a stall everyone waited through."""
    return max(_gaps(passes))


def queue_jumps(passes) -> int:
    """Holds that began before a hold whose request was made earlier (by another process).

    Acquisition order against request order, in the steady state: for a FIFO lock this is
    0.  Each process's first request of a window is left out on both sides: all processes
    make it at the same instant (a barrier) on 2 busy cores, and its client-side stamp can
    precede the request reaching the server by tens of ms of scheduling delay (measured:
    up to ~100 ms), so it says nothing about queue order.  After that a process asks again
    right after its own release, one at a time.  A process has one request outstanding at
    a time, so an earlier request acquired later is always another process's.
    """
    jumps = 0
    for per_proc in passes:
        holds = sorted((acq, req, i == 0) for hs in per_proc for i, (req, acq, _) in enumerate(hs))
        earliest_later = float("inf")
        for _, req, first in reversed(holds):
            if first:
                continue
            if earliest_later < req:
                jumps += 1
            earliest_later = min(earliest_later, req)
    return jumps
