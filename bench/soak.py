"""``make soak``: two workers under a steady load and a fault every 20-60 s, for 40 minutes.

``.venv/bin/python -m bench.soak [--minutes 40] [--seed N] [--broker redis|rabbitmq]``

What runs (all on loopback, all started and stopped here):

* a private ZooKeeper (tickTime 500 ms, so a 6 s session is granted) behind a proxy
  (``tests.tcpproxy.TcpProxy``) the scheduler can pause, and a private Redis (results,
  the run records, and the broker with ``--broker redis``); with ``--broker rabbitmq`` the
  machine's RabbitMQ at 127.0.0.1:5672, on a queue of this run's own (deleted at the end);
* two prefork workers (``-c 2``) of :mod:`bench.soak_app`, whose locked task ``hold``
  records every run of its body (task id, tag, pid, fencing token) in Redis;
* a publisher at 40 tasks/s over 50 keys (Zipf-skewed: the hottest key gets about a
  fifth, so requests do wait aside for their lock), bodies of 40 ms;
* a fault scheduler (seeded): every 20-60 s one of -- SIGKILL a pool process, SIGKILL a
  lock agent, SIGKILL a whole worker's process group (and start it again), SIGSTOP a
  worker's process group for 2-9 s, restart ZooKeeper, pause the ZooKeeper proxy (a
  silent partition: connections stay open, nothing passes) for 2-8 s.

Then publishing and faults stop, the run drains (up to ``--drain`` seconds) and reports:
published, ran once, ran twice (each listed), never ran (each classified by the rule that
explains it, or "unexplained"), throughput per half-minute (min/median, half-minutes with
zero runs), mutual exclusion (bodies of one key that overlapped), and the fault log.

Exit status 1 on any task that ran twice, any unexplained loss, or a stall (a half-minute
with no run while tasks waited); 0 otherwise.  Worker logs and the report are kept in
``--logdir`` (default: a new ``/tmp/zklock-soak-*`` directory); the report is also written
to ``--out`` (default ``bench/results/soak.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from itertools import pairwise

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672//"
FAULTS = ("kill_pool", "kill_agent", "kill_worker", "stop_worker", "restart_zk", "pause_proxy")
SESSION = 6.0
BIN = 30.0
_T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[soak {time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


class Incarnation:
    """One start of one worker node: its process, log, and (if we killed it) when."""

    def __init__(self, node: str, n: int, worker) -> None:
        self.node, self.n, self.worker = node, n, worker
        self.started = time.time()
        self.killed: float | None = None
        self.pid = worker.proc.pid

    @property
    def label(self) -> str:
        return f"{self.node}#{self.n}"


class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.rng = random.Random(args.seed + 1)  # targets; fault_loop draws kinds and times
        self.logdir = args.logdir or tempfile.mkdtemp(prefix="zklock-soak-")
        os.makedirs(self.logdir, exist_ok=True)
        self.queue = f"soak-{uuid.uuid4().hex[:8]}"
        self.stop_publishing = threading.Event()
        self.published: list[tuple[int, str, str, float]] = []  # tag, id, key, at
        self.publish_errors: list[tuple[int, float, str]] = []
        self.faults: list[dict] = []
        self.incarnations: list[Incarnation] = []
        self.current: dict[str, Incarnation] = {}
        self.stopped_groups: set[int] = set()
        self.zk = self.redis = self.proxy = None
        self.t_start = 0.0
        self.interrupted = False

    # ------------------------------------------------------------------ services
    def start_services(self) -> None:
        from celery_zklock.testing import ZooKeeperServer
        from support.redis_server import RedisServer
        from tests.tcpproxy import TcpProxy

        self.zk = ZooKeeperServer(tick_ms=500)
        self.zk.start(timeout=60, new_session=True)
        self.redis = RedisServer()
        self.redis.start(new_session=True)
        self.proxy = TcpProxy.to(self.zk.hosts)
        broker = self.redis.url if self.args.broker == "redis" else RABBIT_URL
        self.env = {"TEST_REDIS_URL": self.redis.url, "TEST_BROKER_URL": broker, "TEST_ZK_HOSTS": self.proxy.hosts,
                    "TEST_ZK_ROOT": f"/soak-{uuid.uuid4().hex[:8]}", "TEST_ZK_SESSION": str(SESSION)}
        os.environ.update(self.env)
        import redis

        import bench.soak_app as app_mod

        self.mod = app_mod
        self.r = redis.Redis.from_url(self.redis.url)
        say(f"ZooKeeper {self.zk.hosts} (proxy {self.proxy.hosts}), Redis {self.redis.url}, broker {broker}, "
            f"queue {self.queue}, logs {self.logdir}")

    def close(self) -> None:
        for pid in list(self.stopped_groups):
            try:
                os.killpg(pid, signal.SIGCONT)
            except OSError:
                pass
        for inc in self.current.values():
            try:
                inc.worker.stop(timeout=30)
            except Exception as exc:  # never leave one behind
                say(f"stopping {inc.label}: {exc!r}")
        if self.args.broker == "rabbitmq":
            try:
                from kombu import Connection

                with Connection(RABBIT_URL) as conn, conn.channel() as ch:
                    ch.queue_delete(self.queue)
            except Exception:
                pass
        for s in (self.proxy, self.redis, self.zk):
            if s is not None:
                try:
                    s.close()
                except Exception:
                    pass

    # ------------------------------------------------------------------ workers
    def start_worker(self, node: str) -> Incarnation:
        from support.workers import Worker

        n = sum(1 for i in self.incarnations if i.node == node) + 1
        w = Worker(self.env, node, concurrency=self.args.concurrency, app="bench.soak_app",
                   extra=["-Q", self.queue])
        w.log_path = os.path.join(self.logdir, f"{node}.{n}.log")
        w.start()
        inc = Incarnation(node, n, w)
        self.incarnations.append(inc)
        self.current[node] = inc
        return inc

    def wait_ready(self, inc: Incarnation, timeout: float = 60) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in inc.worker.log_tail(200000):
                return True
            if not inc.worker.alive():
                return False
            time.sleep(0.2)
        return False

    def pool_pids(self, inc: Incarnation) -> list[int]:
        return [p for p in inc.worker.child_pids() if b"celery_zklock" not in _cmdline(p)]

    # ------------------------------------------------------------------ publisher
    def publisher(self, t_start: float, t_end: float) -> None:
        from kombu import Connection

        rng = random.Random(self.args.seed * 7919 + 1)
        keys = [f"s{k}" for k in range(self.args.keys)]
        weights = [1.0 / (k + 1) for k in range(self.args.keys)]
        task = self.mod.hold
        conn = Connection(self.env["TEST_BROKER_URL"])
        i = 0
        while not self.stop_publishing.is_set():
            due = t_start + i / self.args.rate
            now = time.time()
            if due >= t_end:
                break
            if due > now:
                time.sleep(due - now)
            key = rng.choices(keys, weights)[0]
            try:
                res = task.apply_async((key, self.args.ms, i), queue=self.queue, connection=conn, retry=True,
                                       retry_policy={"max_retries": 5, "interval_start": 0.2, "interval_step": 0.5})
                self.published.append((i, res.id, key, time.time()))
            except Exception as exc:
                self.publish_errors.append((i, time.time(), repr(exc)[:200]))
                try:
                    conn.close()
                except Exception:
                    pass
                conn = Connection(self.env["TEST_BROKER_URL"])
            i += 1
        conn.close()

    # ------------------------------------------------------------------ faults
    def fault(self, kind: str) -> dict:
        node = self.rng.choice(sorted(self.current))
        inc = self.current[node]
        ev: dict = {"at": time.time(), "kind": kind}
        if kind == "kill_pool":
            pids = self.pool_pids(inc)
            if not pids:
                ev["note"] = f"{inc.label}: no pool process"
                return ev
            pid = self.rng.choice(pids)
            os.kill(pid, signal.SIGKILL)
            ev.update(target=inc.label, pid=pid)
        elif kind == "kill_agent":
            pid = inc.worker.agent_pid()
            if pid is None:
                ev["note"] = f"{inc.label}: no agent"
                return ev
            os.kill(pid, signal.SIGKILL)
            ev.update(target=inc.label, pid=pid)
        elif kind == "kill_worker":
            inc.killed = time.time()  # first: the watchdog must not take it for an exit of its own
            try:
                os.killpg(inc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                inc.worker.proc.wait(10)
            except Exception:
                pass
            time.sleep(self.rng.uniform(0.5, 3.0))
            new = self.start_worker(node)
            ev.update(target=inc.label, pid=inc.pid, restarted=new.label, new_pid=new.pid)
        elif kind == "stop_worker":
            secs = round(self.rng.uniform(2.0, 9.0), 1)
            self.stopped_groups.add(inc.pid)
            os.killpg(inc.pid, signal.SIGSTOP)
            time.sleep(secs)
            os.killpg(inc.pid, signal.SIGCONT)
            self.stopped_groups.discard(inc.pid)
            ev.update(target=inc.label, pid=inc.pid, secs=secs)
        elif kind == "restart_zk":
            t = time.monotonic()
            self.zk.restart()
            ev.update(target="zookeeper", took=round(time.monotonic() - t, 1))
        elif kind == "pause_proxy":
            secs = round(self.rng.uniform(2.0, 8.0), 1)
            self.proxy.blackhole(True)
            time.sleep(secs)
            self.proxy.blackhole(False)
            ev.update(target="zookeeper proxy", secs=secs)
        ev["end"] = time.time()
        return ev

    def fault_loop(self, t_end: float) -> None:
        frng = random.Random(self.args.seed)
        while True:
            wait = frng.uniform(self.args.fault_min, self.args.fault_max)
            if time.time() + wait >= t_end - 5:
                return
            if self.stop_publishing.wait(wait):
                return
            kind = frng.choice(self.args.fault_kinds)
            try:
                ev = self.fault(kind)
            except Exception as exc:
                ev = {"at": time.time(), "kind": kind, "error": repr(exc)}
            self.faults.append(ev)
            say(f"fault {len(self.faults)}: {_fault_text(ev, self.t_start)}")

    # ------------------------------------------------------------------ records
    def runs(self) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange("soak:runs", 0, -1)]

    def arrivals(self) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange("soak:arrivals", 0, -1)]

    def watchdog(self) -> None:
        """A worker that exited without our kill is a finding: log it and start it again."""
        for node, inc in list(self.current.items()):
            if inc.killed is None and not inc.worker.alive():
                self.faults.append({"at": time.time(), "kind": "UNEXPECTED_EXIT", "target": inc.label,
                                    "note": f"exit {inc.worker.proc.returncode}"})
                say(f"FINDING: {inc.label} exited by itself (code {inc.worker.proc.returncode}); restarting")
                inc.killed = time.time()
                self.start_worker(node)

    # ------------------------------------------------------------------ the run
    def run(self) -> int:
        a = self.args
        self.start_services()
        for node in ("soak1", "soak2"):
            self.start_worker(node)
        for inc in list(self.current.values()):
            if not self.wait_ready(inc):
                raise RuntimeError(f"{inc.label} did not start:\n{inc.worker.log_tail()}")
        self.t_start = time.time()
        t_end = self.t_start + a.minutes * 60
        say(f"publishing {a.rate}/s over {a.keys} keys for {a.minutes} min, bodies {a.ms} ms, seed {a.seed}")
        pub = threading.Thread(target=self.publisher, args=(self.t_start, t_end), daemon=True)
        flt = threading.Thread(target=self.fault_loop, args=(t_end,), daemon=True)
        pub.start()
        flt.start()
        last_note = 0.0
        while pub.is_alive():
            time.sleep(1.0)
            if flt.is_alive() is False or not self.stopped_groups:
                self.watchdog()
            if time.time() - last_note >= 30:
                last_note = time.time()
                n_runs = self.r.llen("soak:runs")
                say(f"published {len(self.published)}, runs {n_runs}, backlog {len(self.published) - n_runs}, "
                    f"faults {len(self.faults)}, publish errors {len(self.publish_errors)}")
        self.stop_publishing.set()
        flt.join()
        self.t_pub_end = time.time()
        say(f"publishing done: {len(self.published)} published; draining (up to {a.drain:.0f} s)")
        ids = {p[1] for p in self.published}
        drain_start = time.time()
        last_count, last_change = -1, time.time()
        while time.time() - drain_start < a.drain:
            self.watchdog()
            done = {r["id"] for r in self.runs()} & ids
            if len(done) >= len(ids):
                break
            if len(done) != last_count:
                last_count, last_change = len(done), time.time()
            elif time.time() - last_change > min(60.0, a.drain):
                break
            time.sleep(2.0)
        time.sleep(3.0)  # a late second run shows by now
        self.t_drain_end = time.time()
        return self.report()

    # ------------------------------------------------------------------ analysis
    def received_index(self) -> dict[str, list[tuple[str, float]]]:
        """task id -> [(incarnation label, received at)] from every worker log."""
        pat = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): INFO/MainProcess\] Task bench\.soak_app\.hold\[([0-9a-f-]{36})\] received")
        out: dict = defaultdict(list)
        for inc in self.incarnations:
            try:
                with open(inc.worker.log_path, errors="replace") as f:
                    for line in f:
                        m = pat.match(line)
                        if m:
                            at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
                            out[m.group(3)].append((inc.label, at))
            except OSError:
                pass
        return out

    def broker_location(self, ids: set[str]) -> dict[str, str]:
        """Where each of ``ids`` is in the broker now: 'queue', 'unacked (due back at +Ns)' or absent."""
        out: dict = {}
        if self.args.broker == "redis":
            for raw in self.r.lrange(self.queue, 0, -1):
                tid = json.loads(raw)["headers"]["id"]
                if tid in ids:
                    out[tid] = "still in the queue"
            scores = dict(self.r.zrange("unacked_index", 0, -1, withscores=True))
            for tag, raw in (self.r.hgetall("unacked") or {}).items():
                tid = json.loads(raw)[0]["headers"]["id"]
                if tid in ids:
                    due = scores.get(tag, 0.0) + 3600 - time.time()
                    out[tid] = f"in Redis's unacked set, due back in {due:.0f} s"
        else:
            try:
                from kombu import Connection

                with Connection(RABBIT_URL) as conn, conn.channel() as ch:
                    n = ch.queue_declare(self.queue, passive=True).message_count
                if n:
                    out["*"] = f"{n} message(s) still in the RabbitMQ queue"
            except Exception as exc:
                out["*"] = f"queue check failed: {exc!r}"
        return out

    def classify_lost(self, tid: str, received: list, arrivals: dict, state, where: str | None,
                      published_at: float) -> tuple[str, bool]:
        """(rule, explained) for a task whose body never ran."""
        st, res = state
        if st == "FAILURE" and "WorkerLostError" in res:
            return ("acknowledged in a pool process that was SIGKILLed (WorkerLostError; acks early: at most once, "
                    "as plain Celery)", True)
        if st in ("FAILURE", "SKIPPED", "REVOKED"):
            return (f"ended by a lock policy without running: {st} {res}", True)
        if where:
            last = received[-1] if received else None
            inc = next((i for i in self.incarnations if last and i.label == last[0]), None)
            if inc and inc.killed and "unacked" in where and 0 <= inc.killed - last[1] <= 1.5:
                return (f"{where}: received by {inc.label} {inc.killed - last[1]:.2f} s before its SIGKILL, not yet "
                        "leased (documented: the visibility timeout applies)", True)
            return (f"{where} (last received by {last[0] if last else 'nobody'})", False)
        if not received:
            killed = [i for i in self.incarnations if i.killed and 0 <= i.killed - published_at <= 2.0]
            if killed and self.args.broker == "redis":
                return (f"never received by any worker, not in the broker; published {killed[0].killed - published_at:.2f} s "
                        f"before {killed[0].label}'s SIGKILL: popped from the queue (BRPOP) by the killed worker before "
                        "kombu wrote it to its unacked set (kombu's Redis delivery window, as plain Celery; not in "
                        "docs/failure-semantics.md)", True)
            return ("never received by any worker, not in the broker", False)
        last_label, last_at = received[-1]
        inc = next(i for i in self.incarnations if i.label == last_label)
        if inc.killed is not None and last_at <= inc.killed:
            started = tid in arrivals
            how = "running when killed (its body had started)" if started else "handed to a pool process (acknowledged)"
            return (f"acknowledged in worker {inc.label}, whose process group was SIGKILLed: {how} "
                    "(acks early: at most once, as plain Celery)", True)
        return (f"last received by {last_label} at +{last_at - self.t_start:.1f} s; not in the broker, no state "
                f"({st})", False)

    def report(self) -> int:
        a = self.args
        from celery.result import AsyncResult

        runs = self.runs()
        arrivals = {x["id"]: x for x in self.arrivals()}
        pub_ids = {p[1]: p for p in self.published}
        by_id: dict = defaultdict(list)
        for r in runs:
            by_id[r["id"]].append(r)
        once = [t for t in pub_ids if len(by_id.get(t, [])) == 1]
        twice = [t for t in pub_ids if len(by_id.get(t, [])) > 1]
        never = [t for t in pub_ids if t not in by_id]
        foreign = [t for t in by_id if t not in pub_ids]
        received = self.received_index()
        where = self.broker_location(set(never))
        lost_rows, unexplained = [], 0
        for tid in never:
            res = AsyncResult(tid, app=self.mod.app)
            try:
                state = (res.state, repr(res.result)[:160] if res.state not in ("PENDING", "SUCCESS") else "")
            except Exception as exc:
                state = ("?", repr(exc)[:160])
            rule, ok = self.classify_lost(tid, received.get(tid, []), arrivals, state, where.get(tid) or where.get("*"),
                                          pub_ids[tid][3])
            unexplained += not ok
            lost_rows.append((pub_ids[tid][0], tid, pub_ids[tid][2], rule, ok, received.get(tid, [])))

        # throughput per half-minute over the publishing window, and the drain
        ends = sorted(r["end"] for r in runs)
        gone = {row[1] for row in lost_rows if row[4]}  # explained losses never wait
        pub_times = sorted(p[3] for p in self.published if p[1] not in gone)
        bins = []
        t = self.t_start
        while t < self.t_drain_end:
            hi = min(t + BIN, self.t_drain_end)
            n = sum(1 for e in ends if t <= e < hi)
            waiting = sum(1 for p in pub_times if p < hi) - sum(1 for e in ends if e < t)
            bins.append((t - self.t_start, hi - t, n, waiting, t + BIN <= self.t_pub_end + 0.5))
            t += BIN
        pub_bins = [b[2] for b in bins if b[4] and b[1] >= BIN - 0.01]
        stalls = [b for b in bins if b[2] == 0 and b[3] > 0]

        # mutual exclusion: bodies of one key that overlapped
        per_key: dict = defaultdict(list)
        for r in runs:
            per_key[r["key"]].append(r)
        overlaps = []
        for key, rows in per_key.items():
            rows.sort(key=lambda r: r["start"])
            for prev, cur in pairwise(rows):
                if cur["start"] < prev["end"] - 0.001:
                    overlaps.append((key, prev, cur))
        not_held = [r for r in runs if not r.get("held", True)]
        retried = [r for r in runs if r.get("retries")]

        fail = bool(twice) or unexplained > 0 or bool(stalls)
        ran_for = (self.t_pub_end - self.t_start) / 60
        L = [f"# Soak: {a.minutes:g} min, broker {a.broker}, seed {a.seed}"
             + (f" (interrupted after {ran_for:.1f} min)" if self.interrupted else ""), "",
             f"`{' '.join(sys.argv) if sys.argv else 'python -m bench.soak'}`  ",
             f"2 workers -c {a.concurrency} (`bench.soak_app`), {a.rate:g} tasks/s over {a.keys} keys (Zipf), bodies "
             f"{a.ms} ms, ZooKeeper session {SESSION:g} s, a fault every {a.fault_min:g}-{a.fault_max:g} s; "
             f"logs `{self.logdir}`.", "",
             "| figure | value |", "| --- | --- |",
             f"| published | {len(self.published)} (publish errors: {len(self.publish_errors)}) |",
             f"| ran once | {len(once)} |",
             f"| ran twice | {len(twice)} |",
             f"| never ran | {len(never)} ({len(never) - unexplained} explained by a rule, {unexplained} unexplained) |",
             f"| runs of unpublished ids | {len(foreign)} |",
             f"| runs after a lock retry (retries > 0) | {len(retried)} |",
             f"| bodies that ended with the lock not held (`is_held()` False) | {len(not_held)} |",
             f"| bodies of one key that overlapped | {len(overlaps)} |",
             f"| runs per half-minute while publishing (expected {a.rate * BIN:.0f}) | min {min(pub_bins) if pub_bins else '-'}, "
             f"median {statistics.median(pub_bins) if pub_bins else '-'}, max {max(pub_bins) if pub_bins else '-'} "
             f"({len(pub_bins)} half-minutes) |",
             f"| half-minutes with zero runs while tasks waited (stalls) | {len(stalls)} |",
             f"| half-minutes with fewer runs than half the publish rate while tasks waited | "
             f"{sum(1 for b in bins if b[2] < a.rate * b[1] / 2 and b[3] > 0)} |",
             f"| drain | {self.t_drain_end - self.t_pub_end:.0f} s after publishing stopped |",
             f"| faults | {len(self.faults)}: " + ", ".join(f"{k} {sum(1 for f in self.faults if f['kind'] == k)}"
                                                          for k in sorted({f['kind'] for f in self.faults})) + " |",
             f"| result | {'FAIL' if fail else 'PASS'} |", ""]
        if twice:
            L += ["## Ran twice", ""]
            for tid in twice[:200]:
                p = pub_ids[tid]
                L.append(f"- tag {p[0]} id `{tid}` key {p[2]}: runs " + "; ".join(
                    f"pid {r['pid']} at +{r['start'] - self.t_start:.2f} s token {r['token']} held {r.get('held')}"
                    for r in by_id[tid]) + "; received by " + ", ".join(
                    f"{lab} at +{at - self.t_start:.2f} s" for lab, at in received.get(tid, [])))
            L.append("")
        if lost_rows:
            L += ["## Never ran", ""]
            by_rule: dict = defaultdict(int)
            for row in lost_rows:
                by_rule[("" if row[4] else "UNEXPLAINED: ") + re.sub(r"\d+(\.\d+)? s|soak\d#\d+", "#", row[3])[:150]] += 1
            L += [f"- {n} x {rule}" for rule, n in sorted(by_rule.items(), key=lambda x: -x[1])] + [""]
            shown = sorted(lost_rows)[:200]
            if len(lost_rows) > len(shown):
                L.append(f"(the first {len(shown)} of {len(lost_rows)}:)")
            for tag, tid, key, rule, ok, rec in shown:
                L.append(f"- tag {tag} id `{tid}` key {key}: {'' if ok else '**UNEXPLAINED** '}{rule}; received: "
                         + (", ".join(f"{lab} at +{at - self.t_start:.2f} s" for lab, at in rec) or "never"))
            L.append("")
        if overlaps:
            L += ["## Overlapping bodies of one key", ""]
            for key, prev, cur in overlaps[:50]:
                L.append(f"- key {key}: `{prev['id']}` (pid {prev['pid']}, +{prev['start'] - self.t_start:.2f}..+"
                         f"{prev['end'] - self.t_start:.2f} s, token {prev['token']}, held {prev.get('held')}) and `{cur['id']}` "
                         f"(pid {cur['pid']}, from +{cur['start'] - self.t_start:.2f} s, token {cur['token']}, held {cur.get('held')}); "
                         f"nearest fault: {self._nearest_fault(cur['start'])}")
            L.append("")
        if stalls:
            L += ["## Stalls", ""] + [f"- +{b[0]:.0f} s..+{b[0] + b[1]:.0f} s: 0 runs, {b[3]} waiting" for b in stalls] + [""]
        L += ["## Runs per half-minute", "", " ".join(f"{b[2]}" + ("" if b[4] else "d") for b in bins),
              "", "(`d`: after publishing stopped)", "", "## Fault log", ""]
        L += [f"{i + 1}. {_fault_text(f, self.t_start)}" for i, f in enumerate(self.faults)]
        if self.publish_errors:
            L += ["", "## Publish errors", ""] + [f"- tag {i} at +{at - self.t_start:.1f} s: {e}" for i, at, e in self.publish_errors[:20]]
        text = "\n".join(L) + "\n"
        print(text)
        for path in {os.path.join(self.logdir, "report.md"), a.out}:
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text)
        return 1 if fail else 0

    def _nearest_fault(self, at: float) -> str:
        if not self.faults:
            return "none"
        f = min(self.faults, key=lambda f: abs(f["at"] - at))
        return f"{f['kind']} {f.get('target', '')} at +{f['at'] - self.t_start:.1f} s"


def _fault_text(ev: dict, t0: float) -> str:
    extra = ", ".join(f"{k} {v}" for k, v in ev.items() if k not in ("at", "kind", "end"))
    return f"+{ev['at'] - t0:.1f} s {ev['kind']}" + (f" ({extra})" if extra else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Two workers, a steady load and a fault every 20-60 s (make soak).")
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=None, help="default: random (printed)")
    ap.add_argument("--broker", choices=("redis", "rabbitmq"), default="redis")
    ap.add_argument("--rate", type=float, default=40.0, help="tasks published per second")
    ap.add_argument("--keys", type=int, default=50)
    ap.add_argument("--ms", type=int, default=40, help="body duration")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--fault-min", type=float, default=20.0)
    ap.add_argument("--fault-max", type=float, default=60.0)
    ap.add_argument("--faults", dest="fault_kinds", default=",".join(FAULTS),
                    help="comma-separated subset of " + ",".join(FAULTS))
    ap.add_argument("--drain", type=float, default=150.0, help="max seconds to wait for the backlog after publishing")
    ap.add_argument("--logdir", default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "soak.md"))
    args = ap.parse_args(argv)
    args.fault_kinds = [k for k in args.fault_kinds.split(",") if k]
    bad = set(args.fault_kinds) - set(FAULTS)
    if bad:
        ap.error(f"unknown fault(s): {', '.join(sorted(bad))}")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    if args.broker == "rabbitmq":
        try:
            socket.create_connection(("127.0.0.1", 5672), timeout=1).close()
        except OSError:
            ap.error("no RabbitMQ at 127.0.0.1:5672")
    soak = Soak(args)

    def on_signal(signum, frame):
        # The first SIGTERM/SIGINT ends publishing and faults early: the run drains (at most
        # 60 s) and reports on what it did; a second one stops at once, without a report.
        if soak.interrupted or not soak.t_start:
            raise KeyboardInterrupt
        soak.interrupted = True
        args.drain = min(args.drain, 60.0)
        soak.stop_publishing.set()
        say("interrupted: publishing and faults stop; draining, then the report (again to abort)")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return soak.run()
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        soak.stop_publishing.set()
        soak.close()


if __name__ == "__main__":
    sys.exit(main())
