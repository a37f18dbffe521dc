"""``make bench`` / ``python -m bench.run [--quick] [--out DIR]``: every scenario, every contender.

Why one runner: the issue asks for numbers that can be compared, which means one run,
one set of freshly started services (a private ZooKeeper with fsync on and a private
Redis on free loopback ports), real ``celery worker`` processes, and every verdict taken
from ratios within that run.  It writes ``latest.json``, ``latest.md`` and PNG plots to
``bench/results`` (or ``--out``) and prints progress to stderr.

Order of the scenarios: the engine-level ones fork their measuring processes
(``multiprocessing`` with ``fork``, see ``bench/lock_bench.py``), which is only safe while
this process has no threads -- so they run first, before this process talks to Celery.
Then the workers start and the Celery scenarios run; worker loss comes last because it
kills pool children (the scale scenario reads the RSS of the original ones).

``--quick`` (CI smoke run, < 2 min) uses small samples and a 3 s cap in the worker-loss
scenario; its numbers are not measurements and no threshold is asserted on them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

from celery_zklock.engine.client import close_clients

from . import (
    burst,
    celery_scenarios,
    design_floor,
    enqueue,
    fairness,
    flash_sale,
    lock_bench,
    many_keys,
    pool_slots,
    report,
    scale,
    tls,
    worker_loss,
)
from .infra import CostMeter, Services, Workers, log

DEFAULT_OUT = Path(__file__).resolve().parent / "results"

#: lock_bench sizes for the quick mode (its own QUICK takes ~30 s; a smoke run needs less).
LOCK_BENCH_SMOKE = lock_bench.Settings(
    uncontended_iters=60, warmup=30, block=10, handoff_rounds=20, handoff_settle=0.01, throughput_procs=4,
    throughput_seconds=1.0, fairness_procs=8, fairness_seconds=1.0, fairness_hold=0.005, passes=1,
)


def timed(results: dict, name: str, fn, *args, **kwargs):
    """Run one scenario, log its start and duration, store its result under ``name``."""
    log(f"scenario {name}: start")
    t0 = time.monotonic()
    value = fn(*args, **kwargs)
    elapsed = round(time.monotonic() - t0, 1)
    results["durations_s"][name] = elapsed
    log(f"scenario {name}: done in {elapsed:.1f}s")
    return value


def run(quick: bool, out: Path, burst_tasks: int | None = None) -> dict:
    sizes = celery_scenarios.QUICK if quick else celery_scenarios.FULL
    started = time.monotonic()
    results: dict = {
        "quick": quick,
        "started_at": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "durations_s": {},
        "sizes": sizes.__dict__,
        "scenarios": {},
    }
    load_start = os.getloadavg()[0]
    log(f"{'quick' if quick else 'full'} run; starting ZooKeeper and Redis")
    services = Services()
    try:
        services.start()
        results["machine"] = services.machine()
        sc = results["scenarios"]
        endpoints = services.endpoints()
        # Forking scenarios first (no threads in this process yet).
        sc["lock_engine"] = timed(results, "lock_engine", lock_bench.run, quick, endpoints,
                                  LOCK_BENCH_SMOKE if quick else None)
        sc["fairness"] = timed(results, "fairness", fairness.fairness, services,
                               fairness.QUICK if quick else fairness.FULL)
        waiters = timed(results, "scale_one_key_waiters", scale.many_waiters, services, sizes.scale_waiters,
                        sizes.scale_waiter_procs)
        # One process waiting on many keys (threads in this process from here on).
        many = timed(results, "scale_many_keys", many_keys.run, services.zk_hosts, sizes.scale_waiters)
        # Celery scenarios.
        driver = celery_scenarios.Driver(services.env())
        workers = Workers(services.env(), count=2, concurrency=2)
        results["workers"] = "2 x `celery worker -P prefork -c 2` (Redis broker)"
        log("starting 2 celery workers (prefork, -c 2)")
        try:
            workers.start(driver.app)
            sc["overhead"] = timed(results, "overhead", celery_scenarios.overhead, driver, sizes,
                                   CostMeter(services, workers))
            sc["hot_key"] = timed(results, "hot_key", celery_scenarios.hot_key, driver, sizes, services)
            keys = timed(results, "scale_distinct_keys", scale.distinct_keys, driver, workers, services,
                         sizes.scale_keys)
            sc["scale"] = {"contenders": keys, "one_key_waiters": waiters, "many_keys": many}
            sc["worker_loss"] = timed(results, "worker_loss", worker_loss.worker_loss, driver, workers, sizes)
            sc["enqueue"] = timed(results, "enqueue", enqueue.run, driver, workers, services.env(), quick)
        except BaseException:
            log(f"worker logs kept in {workers.procs.logdir}")
            raise
        finally:
            log("stopping workers")
            workers.stop(timeout=5 if quick else 20)
        workers.procs.remove_logs()
        # Scenario 1's floor in real workers: the agent's chain with no lock logic in it.
        sc["design_floor"] = timed(results, "design_floor", design_floor.design, services, 100 if quick else 500,
                                   1 if quick else 4)
        hot, cold = (12, 24) if quick else (60, 120)
        sc["pool_slots"] = timed(results, "pool_slots", pool_slots.run, services, driver, hot, cold, 30,
                                 1 if quick else 3)
        sc["flash_sale"] = timed(results, "flash_sale", flash_sale.run, services, 300 if quick else 1200,
                                 1 if quick else flash_sale.ROUNDS)
        # With "plain" (no lock: it overlaps), the same burst's ceiling on this machine, in the same run.
        burst_tasks = burst_tasks or (600 if quick else burst.DEFAULT_TASKS)
        sc["burst"] = timed(results, "burst", burst.run, services, burst_tasks, 2, 3, None,
                            ("worker", "pool", "plain"))
        if quick:
            pass  # the RabbitMQ runs repeat scenarios 8 and 10 on another broker: full runs only
        elif burst.rabbitmq_reachable():  # Celery's first-choice broker, where the machine has one
            sc["flash_sale_rabbitmq"] = timed(results, "flash_sale_rabbitmq", flash_sale.run, services, 1200,
                                              flash_sale.ROUNDS, burst.RABBITMQ_URL)
            # In a process of its own: bench.app was imported here with the Redis broker, and
            # its workers on RabbitMQ never answered this process's pings (not ready after 90 s).
            sc["burst_rabbitmq"] = timed(results, "burst_rabbitmq", burst.run_elsewhere, burst_tasks,
                                         burst.RABBITMQ_URL)
        else:
            log(f"no RabbitMQ at {burst.RABBITMQ_URL}: its burst and flash sale are skipped")
        sc["tls"] = timed(results, "tls", tls.run, services, driver, quick)
    finally:
        # This process's own ZooKeeper clients (the enqueue scenario's guards) go first: closed
        # at exit, after the servers, they retried a server that was gone.
        close_clients()
        log("stopping ZooKeeper and Redis")
        services.close()
    results["loadavg"] = [load_start, os.getloadavg()[0]]
    results["elapsed_s"] = round(time.monotonic() - started, 1)
    results["targets"] = report.targets(results)
    report.write(results, out)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run (< 2 min): small samples, short caps")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--burst", type=int, default=None, metavar="N",
                        help=f"tasks in the burst on one key, scenarios 10 and 12 (default {burst.DEFAULT_TASKS}; "
                             "the issue's figure, 100000, adds about 45 minutes on a 2-core machine)")
    args = parser.parse_args(argv)
    if args.burst is not None and args.burst < 1:
        parser.error(f"--burst takes a positive number of tasks, got {args.burst}")
    from support.console import install_interrupt_handlers

    install_interrupt_handlers()  # Ctrl-C / SIGTERM unwind through the cleanup above
    results = run(args.quick, args.out, args.burst)
    missed = [t for t in results["targets"] if t["met"] is False]
    print((args.out / "latest.md").read_text())
    log(f"wrote {args.out}/latest.json, latest.md and {len(results['plots'])} plots in {results['elapsed_s']:.0f}s; "
        f"{len(results['targets']) - len(missed)} of {len(results['targets'])} targets met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
