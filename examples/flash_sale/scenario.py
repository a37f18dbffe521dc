"""Run the flash sale end to end: open the sale, fire a burst of ``buy`` tasks at two
prefork workers, wait for every order, then check the invariants and measure the waits.

Invariants (each a row of the report):

* orders accepted == initial stock, per SKU (every SKU is oversubscribed);
* final stock is 0 and never went below 0 (the script's lowest stock, no negative write);
* fenced-write rejections == 0 (no stale holder ever wrote) in a healthy run;
* per SKU, bodies never overlapped in time, and tokens increase strictly in write order;
* every task succeeded and each order ran exactly once.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import Counter, defaultdict
from itertools import pairwise

from examples.runtime import Report, ms, percentile, run_standalone, wait_until
from support.console import check_stop, say
from support.workers import Procs, wait_ready

NAME = "flash_sale"
APP = "examples.flash_sale.app"
SKU_SHARE = (0.2, 0.3, 0.4, 0.5, 0.6)  # stock as a share of each SKU's demand


def default_stock(orders: int, skus: int = 5) -> dict[str, int]:
    demand = plan_demand(orders, skus)
    return {sku: max(1, int(n * SKU_SHARE[i % len(SKU_SHARE)])) for i, (sku, n) in enumerate(demand.items())}


def plan_demand(orders: int, skus: int = 5) -> dict[str, int]:
    base, extra = divmod(orders, skus)
    return {f"sku-{i + 1}": base + (1 if i < extra else 0) for i in range(skus)}


def order_plan(orders: int, skus: int = 5, seed: int = 7) -> list[str]:
    plan = [sku for sku, n in plan_demand(orders, skus).items() for _ in range(n)]
    random.Random(seed).shuffle(plan)
    return plan


def run(report: Report, procs: Procs | None, orders: int = 1200, skus: int = 5, workers: int = 2,
        concurrency: int = 3, work_ms: float = 1.0, timeout: float = 120.0) -> Report:
    """Run the sale.  ``procs=None`` uses workers that are already running (docker compose)."""
    from examples.flash_sale import app as m

    stock = default_stock(orders, skus)
    plan = order_plan(orders, skus)
    m.set_stock(stock)

    if procs is not None:
        say(f"{NAME}: starting {workers} prefork workers (-c {concurrency} each)")
        ws = [procs.worker(APP, f"flash{i + 1}", concurrency) for i in range(workers)]
        wait_ready(m.app, ws)
    say(f"{NAME}: {len(stock)} SKUs, stock {sum(stock.values())} ({', '.join(f'{k}={v}' for k, v in stock.items())}); "
        f"sending a burst of {orders} buy tasks")

    r = m.store.r
    t0 = time.time()
    results = []
    with m.app.producer_or_acquire() as producer:
        for i, sku in enumerate(plan):
            if i % 100 == 0:
                check_stop()
            results.append(m.buy.apply_async((sku, f"order-{i}"), {"work_ms": work_ms}, producer=producer,
                                             headers={"enqueued_at": time.time()}))
    sent = time.time() - t0
    say(f"{NAME}: {orders} tasks enqueued in {sent:.2f}s; waiting for the workers")

    def progress():
        done = r.llen(m.observations_key())
        accepted = sum(r.llen(m.orders_key(s)) for s in stock)
        say(f"{NAME}: {done}/{orders} orders processed, {accepted} accepted")

    finished = wait_until(lambda: r.llen(m.observations_key()) >= orders, timeout, progress=progress)
    # Every task's final state (a crash after the body, or a duplicate run, would show here).
    states = Counter()
    deadline = time.monotonic() + 30
    for res in results:
        while res.state not in ("SUCCESS", "FAILURE", "REVOKED") and time.monotonic() < deadline:
            time.sleep(0.05)
        states[res.state] += 1
    total = time.time() - t0

    obs = [json.loads(x) for x in r.lrange(m.observations_key(), 0, -1)]
    if not obs:
        report.check(NAME, "orders processed", f"0/{orders}", False)
        return report
    last_end = max(o["end"] for o in obs)
    outcomes = Counter(o["outcome"] for o in obs)
    final = {s: int(r.get(m.stock_key(s)) or 0) for s in stock}
    accepted_per_sku = {s: r.llen(m.orders_key(s)) for s in stock}
    stats = {s: {k.decode(): int(v) for k, v in r.hgetall(m.stats_key(s)).items()} for s in stock}
    fenced = sum(st.get("fenced_rejections", 0) for st in stats.values())
    negative = sum(st.get("negative_rejections", 0) for st in stats.values())
    lowest = min(st.get("lowest_stock", stock[s]) for s, st in stats.items())

    overlaps, token_order_ok = 0, True
    by_sku = defaultdict(list)
    for o in obs:
        by_sku[o["sku"]].append(o)
    for s, rows in by_sku.items():
        rows.sort(key=lambda o: o["start"])
        overlaps += sum(1 for a, b in pairwise(rows) if b["start"] < a["end"])
        written = [int(x.decode().rsplit("@", 1)[1]) for x in r.lrange(m.orders_key(s), 0, -1)]
        token_order_ok &= all(a < b for a, b in pairwise(written))
        token_order_ok &= len({o["token"] for o in rows}) == len(rows)
    ran_once = len({o["order"] for o in obs}) == len(obs) == orders

    waits = [o["lock_wait"] for o in obs]
    e2s = [o["enqueue_to_start"] for o in obs if o["enqueue_to_start"] is not None]
    retries = sum(o["retries"] for o in obs)

    setup = f"{len(stock)} SKUs" + (f", {workers} workers x {concurrency} procs" if procs is not None else "")
    report.metric(NAME, "orders sent", f"{orders} ({setup})")
    report.check(NAME, "orders processed, each exactly once", f"{len(obs)}/{orders}", finished and ran_once)
    report.check(NAME, "task states", ", ".join(f"{k} {v}" for k, v in sorted(states.items())),
                 states.get("SUCCESS", 0) == orders)
    report.check(NAME, "orders accepted == initial stock", f"{outcomes['accepted']} == {sum(stock.values())}",
                 outcomes["accepted"] == sum(stock.values()) and accepted_per_sku == stock)
    report.metric(NAME, "orders refused (sold out)", outcomes["sold_out"])
    report.check(NAME, "final stock (all SKUs)", sum(final.values()), all(v == 0 for v in final.values()))
    report.check(NAME, "stock never negative (lowest seen)", lowest, lowest >= 0 and negative == 0)
    report.check(NAME, "fenced-write rejections (stale token)", fenced, fenced == 0)
    report.check(NAME, "per-SKU runs overlapping", overlaps, overlaps == 0)
    report.check(NAME, "tokens strictly increasing per SKU", "yes" if token_order_ok else "no", token_order_ok)
    report.metric(NAME, "lock retries", retries)
    report.metric(NAME, "lock wait p50 / p99 / max", f"{ms(percentile(waits, 50))} / {ms(percentile(waits, 99))} / "
                                                      f"{ms(max(waits))}")
    report.metric(NAME, "enqueue->start p50 / p99", f"{ms(percentile(e2s, 50))} / {ms(percentile(e2s, 99))}")
    report.metric(NAME, "total time (first send -> last order)", f"{last_end - t0:.2f} s "
                                                                  f"({orders / max(last_end - t0, 1e-9):.0f} orders/s)")
    report.figure(NAME, "orders_per_s", round(orders / max(last_end - t0, 1e-9), 1))
    report.figure(NAME, "enqueue_s", round(sent, 3))
    report.figure(NAME, "enqueue_to_start_p50_s", round(percentile(e2s, 50), 4))
    report.figure(NAME, "enqueue_to_start_p99_s", round(percentile(e2s, 99), 4))
    report.figure(NAME, "lock_wait_p50_s", round(percentile(waits, 50), 4))
    report.figure(NAME, "lock_retries", retries)
    workers_seen = Counter(o["worker"].split("@")[0] for o in obs)
    report.check(NAME, "orders run by each worker", ", ".join(f"{k.split('-')[0]}: {v}" for k, v in sorted(workers_seen.items())),
                 procs is None or len(workers_seen) == workers)
    say(f"{NAME}: done in {total:.1f}s: {outcomes['accepted']} accepted, {outcomes['sold_out']} sold out, "
        f"{fenced} fenced rejections")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.flash_sale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--orders", type=int, default=1200)
    parser.add_argument("--skus", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--no-spawn", action="store_true",
                        help="use workers that are already running (REDIS_URL/ZKLOCK_HOSTS from the environment)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures and failed checks as JSON")
    args = parser.parse_args(argv)
    return run_standalone(lambda report, procs: run(report, procs, args.orders, args.skus, concurrency=args.concurrency),
                          spawn=not args.no_spawn, json_out=args.json)


if __name__ == "__main__":
    sys.exit(main())
