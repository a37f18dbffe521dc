"""Scenario: a burst of tasks on one key, waiting in the worker (lock cohorting) vs in the pool.

Why: a flash sale sends its whole burst at one hot key.  Before lock cohorting, waiting in
the worker put every waiting task into ZooKeeper as a znode, and every join and grant read
the key's whole children list, so a 20,000-task burst grew ZooKeeper's work with the square
of the backlog and killed it.  This scenario sends the burst at 2 workers x ``prefork -c 3``
in each mode on the same services, and checks, besides the speed:

* every task ran exactly once, never two at once, with strictly increasing fencing tokens;
* the key's children, sampled every 20 ms from another session, never exceeded two per
  worker (one node, plus one while a node is handed on);
* ZooKeeper's znode count and resident memory over the run.

``python -m bench.burst --tasks 20000`` runs it alone (it starts its own ZooKeeper and
Redis); ``make bench`` runs it with the default size.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from itertools import pairwise

from celery_zklock.config import SETTINGS

from .infra import Services, Workers, log, rss_kib

#: Tasks in ``make bench``'s burst: 20,000 keeps the full run near 20 minutes on 2 cores;
#: ``make bench BURST=100000`` runs the issue's figure (``bench/results/burst_100k.md``:
#: throughput, children and ZooKeeper's memory did not get worse with the larger backlog).
DEFAULT_TASKS = 20000


#: The longest run of grants to one worker while another waits: zklock_cohort_handoffs'
#: default (the bench's workers keep it) plus the hold in progress.
STREAK_BOUND = SETTINGS["zklock_cohort_handoffs"].default + 1


class _Sampler:
    """The key's children, ZooKeeper's znode count and RSS, every ``every`` seconds."""

    def __init__(self, services: Services, path: str, every: float = 0.02) -> None:
        from kazoo.client import KazooClient

        self.services, self.path, self.every = services, path, every
        self.zk = KazooClient(hosts=services.zk_hosts)
        self.zk.start(timeout=10)
        self.children: list[int] = []
        self.children_at: list[float] = []  # time.time() of each children sample
        self.znodes: list[int] = []
        self.rss_kib: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from kazoo.exceptions import NoNodeError

        tick = 0
        while not self._stop.wait(self.every):
            try:
                self.children.append(len(self.zk.get_children(self.path)))
            except NoNodeError:
                self.children.append(0)
            self.children_at.append(time.time())
            tick += 1
            if tick % 25 == 0:  # every half second: the server-wide figures
                self.znodes.append(self.services.znode_count())
                rss = rss_kib(self.services.zk.proc.pid)
                if rss:
                    self.rss_kib.append(rss)

    def __enter__(self) -> "_Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.zk.stop()
        self.zk.close()


#: RabbitMQ, Celery's first-choice broker, where the machine has one (held-aside requests
#: raise the channel's prefetch there, as ETA tasks do).
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


def rabbitmq_reachable(url: str = RABBITMQ_URL) -> bool:
    from kombu import Connection

    try:
        with Connection(url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:
        return False


def _one(services: Services, mode: str, tasks: int, workers: int, concurrency: int,
         broker_url: str | None = None) -> dict:
    from .celery_scenarios import Driver

    root = f"/bench-burst-{mode}-{uuid.uuid4().hex[:6]}"
    contender = "plain" if mode == "plain" else "zklock"
    env = {**services.env(), "BENCH_ZK_WAIT_IN": "worker" if mode == "plain" else mode, "BENCH_ZK_ROOT": root}
    if broker_url:
        env["BENCH_BROKER_URL"] = broker_url
    driver = Driver(env)
    pool = Workers(env, count=workers, concurrency=concurrency)
    pool.start(driver.app, connection=driver.connection)  # the ping goes to the workers' broker
    try:
        tag = driver.new_tag("burst")
        key = f"burst-{tag}"
        from celery_zklock.keys import key_path

        with _Sampler(services, key_path(root, f"k:{key}")) as sampler:
            t0 = time.time()
            ids = [driver.publish(contender, key, tag) for _ in range(tasks)]
            published = time.time() - t0
            rows = driver.records(tag, tasks, timeout=max(600.0, tasks / 20))
        ended = max(r["done"] for r in rows)
    finally:
        pool.stop()
    rows.sort(key=lambda r: r["start"])
    overlaps = sum(1 for a, b in pairwise(rows) if b["start"] < a["end"])
    tokens = [r["token"] or 0 for r in rows]
    share = _worker_share(rows)
    if share.get("longest_streak") and share["longest_streak"] > STREAK_BOUND:
        # Children under the key while the longest streak ran: only our node (1) means the
        # other worker had none queued then, and the streak bound did not apply.
        begin = rows[share["longest_streak_at_grant"]]["start"]
        end = rows[share["longest_streak_at_grant"] + share["longest_streak"] - 1]["end"]
        share["children_during_longest_streak"] = [
            n for n, at in zip(sampler.children, sampler.children_at, strict=True) if begin - 0.02 <= at <= end + 0.02]
    once = len({r["id"] for r in rows}) == len(rows) == tasks and set(ids) == {r["id"] for r in rows}
    return {
        "mode": mode,
        "label": LABELS[mode],
        "tasks": tasks,
        "ran_exactly_once": once,
        "overlaps": overlaps,
        "tokens_strictly_increasing": all(a < b for a, b in pairwise(tokens)),
        "tasks_per_s": round(tasks / (ended - t0), 1),
        "publish_s": round(published, 2),
        "total_s": round(ended - t0, 2),
        "children_max": max(sampler.children, default=0),
        "children_samples": len(sampler.children),
        "znodes_max": max(sampler.znodes, default=0),
        "zookeeper_rss_mib_max": round(max(sampler.rss_kib, default=0) / 1024, 1),
        "workers": workers,
        "concurrency": concurrency,
        **share,
    }


LABELS = {"worker": "wait in the worker (lock cohorting)", "pool": "wait in the pool",
          "plain": "plain Celery, no lock (overlaps: the unsafe ceiling)"}


def _worker_share(rows: list[dict]) -> dict:
    """Fairness across workers: each worker's share of the grants while every worker still
    had tasks of the burst to run (until the first worker's last start), and the longest
    run of consecutive grants to one worker (cohorting bounds it by zklock_cohort_handoffs
    + 1 while another worker waits)."""
    hosts = sorted({r.get("host") or str(r["pid"]) for r in rows})
    if len(hosts) < 2:
        return {"grant_share_min": None, "grant_share_max": None, "longest_streak": None}
    host = [r.get("host") or str(r["pid"]) for r in rows]
    last = {h: max(i for i, x in enumerate(host) if x == h) for h in hosts}
    both = host[: min(last.values()) + 1]
    shares = [both.count(h) / len(both) for h in hosts]
    streaks, first = [], 0  # (length, index of its first grant)
    for i in range(1, len(both) + 1):
        if i == len(both) or both[i] != both[first]:
            streaks.append((i - first, first))
            first = i
    longest, at = max(streaks)
    t0 = rows[0]["start"]
    return {"grant_share_min": round(min(shares), 3), "grant_share_max": round(max(shares), 3),
            "grants_while_all_waited": len(both), "longest_streak": longest,
            # Where it was: a streak past the bound means the other worker had no node queued
            # then (e.g. its requests had not arrived yet), which these figures help tell.
            "longest_streak_at_grant": at, "longest_streak_at_s": round(rows[at]["start"] - t0, 3),
            "streaks_over_bound": sum(1 for n, _ in streaks if n > STREAK_BOUND)}


def run(services: Services, tasks: int = DEFAULT_TASKS, workers: int = 2, concurrency: int = 3,
        broker_url: str | None = None, modes_run: tuple[str, ...] = ("worker", "pool")) -> dict:
    modes = {}
    broker = "RabbitMQ" if broker_url and broker_url.startswith("amqp") else "Redis"
    for mode in modes_run:
        log(f"  burst of {tasks} tasks on one key ({broker} broker), waiting in the {mode}")
        modes[mode] = _one(services, mode, tasks, workers, concurrency, broker_url)
        log(f"    {json.dumps(modes[mode])}")
    def ratio(a: str, b: str):
        return round(modes[a]["tasks_per_s"] / modes[b]["tasks_per_s"], 2) if {a, b} <= set(modes) else None

    return {"tasks": tasks, "broker": broker, "modes": modes, "worker_vs_pool": ratio("worker", "pool"),
            "worker_vs_plain": ratio("worker", "plain")}


def run_elsewhere(tasks: int, broker_url: str) -> dict:
    """:func:`run` in a new ``python -m bench.burst`` process (its own services and imports)."""
    import subprocess

    out = subprocess.run([sys.executable, "-m", "bench.burst", "--tasks", str(tasks), "--broker", broker_url],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    return json.loads(out[out.index("{"):])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=DEFAULT_TASKS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=3)
    parser.add_argument("--broker", default=None, help=f"broker URL (default: the bench's Redis; e.g. {RABBITMQ_URL})")
    parser.add_argument("--modes", default="worker,pool",
                        help="where tasks wait, comma-separated: worker, pool, plain (no lock; the ceiling). "
                             "Default worker,pool: both, and their ratio")
    args = parser.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - set(LABELS):
        parser.error(f"--modes takes {', '.join(LABELS)} (comma-separated), got {args.modes!r}")
    services = Services().start()
    try:
        result = run(services, args.tasks, args.workers, args.concurrency, args.broker, modes)
    finally:
        services.close()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
