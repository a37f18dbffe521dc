"""The design's floor inside loaded Celery workers: the design's chain and nothing else in it
(:mod:`bench.skeleton_app`), beside plain Celery and ZkLockedTask in the same two workers
(``make bench`` scenario 14).

Why apart from :mod:`bench.floor`: that module's bare-client floor is what scenario 1
(:mod:`bench.celery_scenarios`) reports beside its ratios, and this one drives workers with
that module's driver, so keeping both in one file made the two import each other.

Run alone: ``.venv/bin/python -m bench.design_floor [TASKS] [PASSES]``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import uuid

#: Keys of the hot workload: the flash sale's five SKUs, each task holding 1 ms.
HOT_KEYS, HOT_MS = 5, 1.0


def design(services, tasks: int = 500, passes: int = 4) -> dict:
    """The design's floor in real workers (:mod:`bench.skeleton_app`), in the same two
    workers as plain Celery and ZkLockedTask, order alternating pass by pass, CPU per task
    by process role (the skeleton's one agent counted as the workers' agents):

    * ``distinct``: ``tasks`` trivial tasks on distinct keys per contender (scenario 1's
      workload), the skeleton joining and leaving each key in ZooKeeper;
    * ``hot``: ``tasks`` tasks holding 1 ms on five keys (the flash sale's shape), the
      skeleton queueing them in its agent only (a local handoff: no ZooKeeper request).
    """
    from .celery_scenarios import Driver, bursts
    from .infra import CostMeter, Workers

    driver = Driver(services.env())  # sets the environment bench.app reads at import
    from . import skeleton_app  # registers the skeleton's tasks with the driver too

    agent, path = skeleton_app.start_agent(services.zk_hosts, f"/bench-skeleton-{uuid.uuid4().hex[:8]}")
    try:
        workers = Workers({**services.env(), skeleton_app.SOCK_ENV: path}, count=2, concurrency=2,
                          app_module="bench.skeleton_app").start(driver.app, connection=driver.connection)
    except BaseException:
        agent.kill()
        raise
    workloads = {"distinct": (["plain", "skeleton", "skeleton_main", "zklock"], "trivial", 0.0, lambda tag, p, i: f"{tag}-{i}"),
                 "hot": (["plain", "skeleton_local", "skeleton_local_full", "zklock"], "hold", HOT_MS, lambda tag, p, i: f"{tag}-{i % HOT_KEYS}")}
    labels = {**skeleton_app.bench_app.CONTENDERS, **skeleton_app.bench_app.EXTRA}
    out: dict = {"tasks_per_pass": tasks, "passes": passes, "hot_keys": HOT_KEYS, "hot_ms": HOT_MS}
    try:
        driver.contenders = ["plain", "skeleton", "skeleton_main", "skeleton_local", "skeleton_local_full", "zklock"]
        driver.warm_up(40)
        for workload, (names, kind, ms, key_of) in workloads.items():
            meters = {c: CostMeter(services, workers, agents=[agent.pid] if c.startswith("skeleton") else ())
                      for c in names}
            rows = bursts(driver, names, tasks, passes, meters.__getitem__, key_of,
                          f"the design's floor, {workload} keys,", kind, ms)
            out[workload] = {c: {"label": labels[c], **row} for c, row in rows.items()}
    finally:
        workers.stop()
        agent.kill()
        agent.wait()
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    from .infra import Services

    services = Services().start()
    try:
        print(json.dumps(design(services, *(int(a) for a in argv[:2])), indent=1))
    finally:
        services.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
