"""How the simulator's cost grows: schedules of a fixed shape (workers, keys, request rate,
faults), timed.  ``python -m bench.sim_scale`` prints a markdown table (bench/results/sim.md).

Why fixed shapes: the CI seeds draw their shape, so their average says little about growth;
here one dimension changes at a time, the seeds (and so the faults and the load's timing)
staying the same."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time


def measure(shape: dict, seeds: int) -> tuple[float, float, float]:
    """(seconds per schedule, events per schedule, requests per schedule)."""
    from sim.run import run_seed

    started, events, requests = time.monotonic(), 0, 0
    for seed in range(1, seeds + 1):
        violation, run = run_seed(seed, shape=shape)
        if violation:
            raise SystemExit(f"shape {shape}, seed {seed}: {violation}")
        events += run.world.events
        requests += sum(len(w.main.requests) for w in run.workers)
    elapsed = time.monotonic() - started
    return elapsed / seeds, events / seeds, requests / seeds


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "bench.sim_scale", *sys.argv[1:]])
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    logging.getLogger("celery_zklock").propagate = False
    base = {"workers": 2, "keys": 2, "pools": 2, "rate": 20.0, "faults": 2}
    rows = [("base", base)]
    rows += [(f"workers={n}", {**base, "workers": n}) for n in (1, 4, 8)]
    rows += [(f"keys={n}", {**base, "keys": n}) for n in (1, 8, 32)]
    rows += [(f"rate={r:g}/s per worker", {**base, "rate": r}) for r in (5.0, 60.0)]
    rows += [(f"faults={n}", {**base, "faults": n}) for n in (0, 6)]
    print(f"| shape ({args.seeds} seeds each) | s/schedule | events/schedule | requests/schedule | events/request | events/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, shape in rows:
        sec, events, requests = measure(shape, args.seeds)
        print(f"| {label} | {sec:.2f} | {events:.0f} | {requests:.0f} | {events / max(requests, 1):.0f} | "
              f"{events / sec:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
