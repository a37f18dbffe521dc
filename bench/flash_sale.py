"""Scenario: the flash-sale demo's workload, waiting in the worker vs in the pool vs no lock.

Why the demo itself, run as a subprocess: it is the workload users see (``make demo``):
1,200 ``buy`` orders on 5 SKUs fired in one burst at 2 workers x ``prefork -c 3``, every
order on a hot key.  Its invariants (stock never oversold, no overlap, tokens increasing)
must hold in both modes; a run whose checks fail is reported as such, not as a number.
Both modes run on the benchmark's ZooKeeper and Redis, alternating, ``rounds`` times each;
the figures are medians.

``orders/s`` counts from the first order sent to the last order done, as the demo prints
it, so it includes the burst's publishing (``enqueue_s``), which shares the machine's
CPUs with the workers.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

from .infra import Services, log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one(services: Services, mode: str, orders: int, broker_url: str | None = None) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, "ZKLOCK_HOSTS": services.zk_hosts, "REDIS_URL": services.redis_url,
           "ZKLOCK_WAIT_IN": "worker" if mode == "plain" else mode, "PYTHONPATH": ROOT,
           "FLASH_SALE_UNLOCKED": "1" if mode == "plain" else "0", "BROKER_URL": broker_url or ""}
    try:
        proc = subprocess.run([sys.executable, "-m", "examples.flash_sale", "--orders", str(orders), "--json", out],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        with open(out) as f:
            result = json.load(f)
    finally:
        os.unlink(out)
    if mode == "plain":  # no lock: it oversells by design; only its speed is of interest
        return result["figures"]["flash_sale"]
    if proc.returncode != 0 or not result["ok"]:
        raise RuntimeError(f"flash sale ({mode}) failed its checks: {result.get('failures')}\n{proc.stdout[-3000:]}")
    return result["figures"]["flash_sale"]


#: Rounds per mode in a full run; the figures are their medians.  Three: the VM's speed swings
#: within a minute (two rounds of one run once gave 471 and 303 orders/s), and a median of
#: two is their mean.
ROUNDS = 3


def run(services: Services, orders: int = 1200, rounds: int = ROUNDS, broker_url: str | None = None) -> dict:
    runs: dict[str, list[dict]] = {"worker": [], "pool": [], "plain": []}
    for r in range(rounds):
        for mode in ("worker", "pool", "plain") if r % 2 == 0 else ("plain", "pool", "worker"):
            log(f"  flash sale, waiting in the {mode}: {orders} orders, round {r + 1}/{rounds}")
            runs[mode].append(_one(services, mode, orders, broker_url))
    modes = {}
    for mode, rows in runs.items():
        modes[mode] = {
            "label": "no lock (oversells)" if mode == "plain" else f"wait in the {mode}",
            **{k: round(statistics.median(row[k] for row in rows), 4) for k in rows[0]},
            "orders_per_s_runs": [row["orders_per_s"] for row in rows],
        }
    return {"orders": orders, "skus": 5, "rounds": rounds, "modes": modes,
            "broker": "RabbitMQ" if broker_url and broker_url.startswith("amqp") else "Redis",
            "worker_vs_pool": round(modes["worker"]["orders_per_s"] / modes["pool"]["orders_per_s"], 2),
            "worker_vs_plain": round(modes["worker"]["orders_per_s"] / modes["plain"]["orders_per_s"], 2)}
