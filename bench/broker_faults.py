"""Broker faults with requests waiting: celery-zklock beside plain Celery, in one run.

``.venv/bin/python -m bench.broker_faults [--repeats 3] [--only redis|rabbitmq]``

Prints a markdown table and writes it to ``bench/results/broker_faults.md``.  For each
broker (Redis, and RabbitMQ at 127.0.0.1:5672 if it answers) and each contender -- a
locked task (``tests.apps.locked.hold``: waits aside in the worker for its lock) and the
same body as a stock Celery task (``bench.plain_app.plain_hold``: a worker without
celery_zklock, the tasks wait in the broker and the prefetch window) -- it measures:

* **twice after a long wait** (Redis only): one worker -c 2, 120 tasks of 100 ms on one
  key, ``visibility_timeout`` 8 s with kombu's sweep every second: bodies that ran twice.
* **stranded after a whole-worker SIGKILL**: two workers -c 2, 150 tasks of 40 ms on one
  key, one worker's process group SIGKILLed once it holds 20 aside (plain: 2 s in); how
  many had not run 10, 30 and 60 s after the kill, when the last ran (capped at 90 s; the
  run stops early once nothing ran for 15 s and every missing task is provably parked:
  acknowledged, or in Redis's unacked set due back after the cap), and how many never ran
  because the killed worker had acknowledged them.
* **lost / twice after repeated reconnects**: one worker -c 2, 430 tasks of 50 ms on 3
  keys, the broker out of reach for 3 s twice, 3 s apart (``tests.brokerproxy``).

Services: a private ZooKeeper (tickTime 200 ms, session 4 s) and Redis on free loopback
ports; RabbitMQ is the machine's, with a queue of its own per run (deleted after).  Logs
of every worker are kept under ``/tmp/zklock-broker-faults-<run>/``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "broker_faults.md")
RABBIT = ("127.0.0.1", 5672)
RABBIT_URL = "amqp://guest:guest@127.0.0.1:5672//"
CAP = 90.0
_T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[broker_faults {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def rabbit_up() -> bool:
    try:
        socket.create_connection(RABBIT, timeout=1).close()
        return True
    except OSError:
        return False


class Bench:
    def __init__(self, logdir: str) -> None:
        from celery_zklock.testing import ZooKeeperServer
        from support.redis_server import RedisServer

        self.logdir = logdir
        self.zk = ZooKeeperServer().start(timeout=60, new_session=True)
        self.redis = RedisServer().start(new_session=True)
        os.environ.update({"TEST_REDIS_URL": self.redis.url, "TEST_ZK_HOSTS": self.zk.hosts,
                           "TEST_ZK_ROOT": "/bench-broker-faults", "TEST_ZK_SESSION": "4"})
        os.environ.pop("TEST_BROKER_URL", None)
        os.environ.pop("TEST_VISIBILITY", None)
        import redis

        import bench.plain_app as plain
        import tests.apps.locked as locked

        self.apps = {"zklock": locked, "plain": plain}
        self.r = redis.Redis.from_url(self.redis.url)
        self.seq = 0

    def close(self) -> None:
        self.redis.close()
        self.zk.close()

    # ------------------------------------------------------------------ plumbing
    def task(self, kind: str):
        m = self.apps[kind]
        return m.hold if kind == "zklock" else m.plain_hold

    def app(self, kind: str):
        return self.apps[kind].app

    def fresh(self) -> None:
        self.r.flushall()

    def worker(self, kind: str, name: str, broker_url: str, queue: str, concurrency: int = 2, extra_env=None):
        from support.workers import Worker

        self.seq += 1
        env = {"TEST_REDIS_URL": self.redis.url, "TEST_BROKER_URL": broker_url, "TEST_ZK_HOSTS": self.zk.hosts,
               "TEST_ZK_ROOT": f"/bench-{uuid.uuid4().hex[:8]}", "TEST_ZK_SESSION": "4", **(extra_env or {})}
        name = f"{name}-{self.seq}-{uuid.uuid4().hex[:4]}"
        app = "tests.apps.locked" if kind == "zklock" else "bench.plain_app"
        w = Worker(env, name, concurrency=concurrency, app=app, extra=["-Q", queue, "-E"])
        w.log_path = os.path.join(self.logdir, f"{name}.log")
        w.start()
        deadline = time.monotonic() + 40
        while " ready." not in w.log_tail(100000):
            if not w.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start:\n{w.log_tail()}")
            time.sleep(0.1)
        return w

    def history(self) -> list[dict]:
        return [json.loads(x) for x in self.r.lrange("history", 0, -1)]

    def runs(self) -> dict:
        out: dict = {}
        for row in self.history():
            out[row["tag"]] = out.get(row["tag"], 0) + 1
        return out

    def arrivals(self) -> set:
        return {json.loads(x)["tag"] for x in self.r.lrange("arrivals", 0, -1)}

    def where(self, broker: str, queue: str, conn, ids: dict) -> dict:
        """Where each missing task's message is: ``queue`` (ready), ``unacked`` (Redis: with
        the time it is due back) or nowhere (acknowledged)."""
        out: dict = {"queue": 0, "unacked": [], "queue_ids": set(), "unacked_ids": set()}
        if broker == "redis":
            for raw in self.r.lrange(queue, 0, -1):
                out["queue_ids"].add(json.loads(raw)["headers"]["id"])
            scores = dict(self.r.zrange("unacked_index", 0, -1, withscores=True))
            for tag, raw in (self.r.hgetall("unacked") or {}).items():
                msg = json.loads(raw)[0]
                out["unacked_ids"].add(msg["headers"]["id"])
                out["unacked"].append(scores.get(tag, 0.0))
        else:
            with conn.channel() as ch:
                out["queue"] = ch.queue_declare(queue, passive=True).message_count
        return out

    def publish(self, kind: str, broker: str, queue: str, conn, n: int, keys: list[str], ms: int) -> dict:
        t = self.task(kind)
        ids = {}
        for i in range(n):
            ids[i] = t.apply_async((keys[i % len(keys)], ms, i), queue=queue, connection=conn).id
        return ids

    def broker_urls(self, broker: str, proxy_port: int | None = None) -> tuple[str, str]:
        if broker == "redis":
            port = self.redis.port
            return (f"redis://127.0.0.1:{proxy_port or port}/0", f"redis://127.0.0.1:{port}/0")
        return (f"amqp://guest:guest@127.0.0.1:{proxy_port or RABBIT[1]}//", RABBIT_URL)

    def drop_queue(self, broker: str, conn, queue: str) -> None:
        if broker == "rabbitmq":
            try:
                with conn.channel() as ch:
                    ch.queue_delete(queue)
            except Exception:
                pass

    def waiting_aside(self, kind: str, w, conn) -> int:
        node = f"{w.name}@{os.uname().nodename}"
        try:
            replies = self.app(kind).control.inspect(destination=[node], timeout=1.0, connection=conn)._request(
                "zklock_waiting") or {}
        except Exception:
            return 0
        return sum(len(v) for reply in replies.values() for v in reply.values())

    @staticmethod
    def held_from_log(w) -> int:
        """Requests the worker received and did not finish (its log; when inspect does not answer)."""
        text = w.log_tail(10_000_000)
        return text.count("] received") - text.count("] succeeded")

    # ------------------------------------------------------------------ scenarios
    def long_wait(self, kind: str) -> dict:
        """Redis, visibility 8 s: 120 tasks of 100 ms on one key through one worker -c 2."""
        from kombu import Connection

        self.fresh()
        n, queue = 120, f"vis-{uuid.uuid4().hex[:8]}"
        url, direct = self.broker_urls("redis")
        w = self.worker(kind, "vis", url, queue, extra_env={"TEST_VISIBILITY": "8"})
        try:
            with Connection(direct) as conn:
                self.publish(kind, "redis", queue, conn, n, [f"vis-{uuid.uuid4().hex[:6]}"], 100)
                deadline = time.monotonic() + 120
                while len(self.runs()) < n and time.monotonic() < deadline:
                    time.sleep(0.5)
                time.sleep(10.0)  # a copy swept back late runs by now
                runs = self.runs()
                return {"twice": sum(1 for c in runs.values() if c > 1), "never": n - len(runs)}
        finally:
            w.stop(timeout=30)

    def killed_worker(self, kind: str, broker: str) -> dict:
        from kombu import Connection

        self.fresh()
        n, queue = 150, f"kill-{uuid.uuid4().hex[:8]}"
        url, direct = self.broker_urls(broker)
        with Connection(direct) as conn:
            a = self.worker(kind, "killa", url, queue)
            b = self.worker(kind, "killb", url, queue)
            try:
                ids = self.publish(kind, broker, queue, conn, n, [f"kill-{uuid.uuid4().hex[:6]}"], 40)
                published = time.monotonic()
                held = 0
                if kind == "zklock":
                    while time.monotonic() - published < 20:
                        held = self.waiting_aside(kind, a, conn) or self.held_from_log(a)
                        if held >= 20:
                            break
                        time.sleep(0.1)
                else:  # 2 s in, or once 20 ran (150 bodies of 40 ms on 4 pool processes take 1.5 s)
                    while time.monotonic() - published < 2.0 and len(self.runs()) < 20:
                        time.sleep(0.02)
                ran_before = len(self.runs())
                os.killpg(a.proc.pid, signal.SIGKILL)
                killed, killed_wall = time.monotonic(), time.time()
                a.proc.wait(10)
                marks: dict = {}
                last_change, count = time.monotonic(), len(self.runs())
                early = None
                while time.monotonic() - killed < CAP:
                    time.sleep(0.25)
                    runs = self.runs()
                    el = time.monotonic() - killed
                    for m in (10, 30, 60):
                        if m not in marks and el >= m:
                            marks[m] = n - len(runs)
                    if len(runs) != count:
                        count, last_change = len(runs), time.monotonic()
                    if len(runs) >= n:
                        break
                    if time.monotonic() - last_change >= 15 and el >= 12:
                        loc = self.where(broker, queue, conn, ids)
                        missing = {ids[t] for t in set(range(n)) - set(runs)}
                        due_after_cap = all(s + 3600 > killed_wall + CAP for s in loc["unacked"]) if loc["unacked"] else True
                        if not (missing & loc["queue_ids"]) and not loc["queue"] and due_after_cap:
                            early = el
                            break
                runs = self.runs()
                missing = set(range(n)) - set(runs)
                for m in (10, 30, 60):
                    marks.setdefault(m, len(missing))
                loc = self.where(broker, queue, conn, ids)
                miss_ids = {ids[t] for t in missing}
                stranded = len(miss_ids & loc["unacked_ids"]) + len(miss_ids & loc["queue_ids"]) + loc["queue"]
                acked = len(missing) - stranded
                starts = [r["end"] for r in self.history()]
                # when the last task that did run ran (a stranded one would come later: "> 90 s")
                last = (max(starts) - killed_wall) if starts and not stranded else None
                started_killed = len((self.arrivals() - set(runs)))
                detail = []
                for t in sorted(missing):
                    tid = ids[t]
                    place = "unacked" if tid in loc["unacked_ids"] else "queue" if tid in loc["queue_ids"] else "nowhere"
                    got = [ln[:24] for w in (a, b) for ln in open(w.log_path, errors="replace") if tid in ln and "received" in ln]
                    detail.append(f"tag {t} id {tid} {place} received {got} kill at "
                                  f"{time.strftime('%H:%M:%S', time.localtime(killed_wall))}.{int(killed_wall % 1 * 1000):03d}")
                log(f"  never ran: {detail}")
                return {"held": held, "ran_before": ran_before, "m10": marks[10], "m30": marks[30], "m60": marks[60],
                        "last": last, "never": len(missing), "stranded": stranded, "acked": acked,
                        "killed_mid_run": started_killed, "twice": sum(1 for c in runs.values() if c > 1),
                        "early": early}
            finally:
                a.stop(timeout=5)
                b.stop(timeout=30)
                self.drop_queue(broker, conn, queue)

    def outages(self, kind: str, broker: str) -> dict:
        from kombu import Connection

        from tests.brokerproxy import BrokerProxy

        self.fresh()
        n, queue = 430, f"cut-{uuid.uuid4().hex[:8]}"
        target = self.redis.port if broker == "redis" else RABBIT[1]
        with BrokerProxy(target) as proxy:
            url, direct = self.broker_urls(broker, proxy.port)
            with Connection(direct) as conn:
                w = self.worker(kind, "cut", url, queue)
                try:
                    keys = [f"cut{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
                    ids = self.publish(kind, broker, queue, conn, n, keys, 50)
                    time.sleep(1.5)
                    cuts = [time.time()]
                    before = proxy.accepted
                    proxy.outage(3.0)
                    deadline = time.monotonic() + 30
                    time.sleep(3.0)
                    while proxy.accepted == before and time.monotonic() < deadline:
                        time.sleep(0.1)
                    time.sleep(3.0)
                    cuts.append(time.time())
                    proxy.outage(3.0)
                    second = time.monotonic()
                    last_change, count = time.monotonic(), len(self.runs())
                    while time.monotonic() - second < 60:
                        time.sleep(0.5)
                        runs = self.runs()
                        if len(runs) >= n:
                            break
                        if len(runs) != count:
                            count, last_change = len(runs), time.monotonic()
                        elif time.monotonic() - last_change >= 15:
                            break
                    time.sleep(2.0)
                    runs = self.runs()
                    missing = set(range(n)) - set(runs)
                    loc = self.where(broker, queue, conn, ids)
                    miss_ids = {ids[t] for t in missing}
                    stranded = len(miss_ids & loc["unacked_ids"]) + len(miss_ids & loc["queue_ids"]) + loc["queue"]
                    first: dict = {}
                    for r in self.history():
                        first[r["tag"]] = min(first.get(r["tag"], r["start"]), r["start"])
                    twice = [t for t, c in runs.items() if c > 1]
                    at_cut = [t for t in twice if any(abs(first[t] - c) < 0.3 for c in cuts)]
                    return {"never": len(missing), "stranded": stranded, "acked": len(missing) - stranded,
                            "twice": len(twice), "twice_at_cut": len(at_cut),
                            "crashed": "no" if w.alive() else f"yes ({_why(w)})"}
                finally:
                    w.stop(timeout=30)
                    self.drop_queue(broker, conn, queue)


    def stalled_cut(self, kind: str, broker: str) -> dict:
        """The broker connection stalls 1.5 s while tasks run (acknowledgements wait in the
        proxy), then is out of reach 2 s: the acknowledgements sent as pool processes took
        tasks are lost, and the broker delivers those tasks again (Redis at visibility 8 s)."""
        from kombu import Connection

        from tests.brokerproxy import BrokerProxy

        self.fresh()
        n, queue = 300, f"stall-{uuid.uuid4().hex[:8]}"
        target = self.redis.port if broker == "redis" else RABBIT[1]
        extra = {"TEST_VISIBILITY": "8"} if broker == "redis" else {}
        with BrokerProxy(target) as proxy:
            url, direct = self.broker_urls(broker, proxy.port)
            with Connection(direct, transport_options={"visibility_timeout": 8.0} if extra else {}) as conn:
                w = self.worker(kind, "stall", url, queue, extra_env=extra)
                try:
                    keys = [f"st{i}-{uuid.uuid4().hex[:6]}" for i in range(3)]
                    self.publish(kind, broker, queue, conn, n, keys, 30)
                    deadline = time.monotonic() + 30
                    while len(self.runs()) < 20 and time.monotonic() < deadline:
                        time.sleep(0.1)
                    proxy.stall()
                    time.sleep(1.5)
                    proxy.outage(2.0)
                    proxy.resume()
                    last_change, count, start = time.monotonic(), len(self.runs()), time.monotonic()
                    while time.monotonic() - start < 60:
                        time.sleep(0.5)
                        runs = self.runs()
                        if len(runs) != count:
                            count, last_change = len(runs), time.monotonic()
                        elif time.monotonic() - last_change >= 15:
                            break
                    runs = self.runs()
                    text = w.log_tail(10_000_000)
                    return {"never": n - len(runs), "twice": sum(1 for c in runs.values() if c > 1),
                            "copies": text.count("this is a redelivered copy): not running it again")}
                finally:
                    w.stop(timeout=30)
                    self.drop_queue(broker, conn, queue)


def _why(w) -> str:
    """The worker's last CRITICAL line (why it exited), shortened."""
    try:
        with open(w.log_path, errors="replace") as f:
            lines = [ln for ln in f if "CRITICAL" in ln]
    except OSError:
        return "?"
    return lines[-1].split("] ", 1)[-1].strip()[:90].replace("|", "/") if lines else f"exit {w.proc.returncode}"


# ---------------------------------------------------------------------- report
def _vals(rows: list[dict], key: str, fmt=str) -> str:
    return " / ".join(fmt(r[key]) for r in rows) if rows else "-"


def _secs(v) -> str:
    return "> 90 s" if v is None else "all before the kill" if v < 0 else f"{v:.1f} s"


STALLED = "broker stalled 1.5 s, then out of reach 2 s (1 worker -c 2, 300 x 30 ms, 3 keys)"


def table(results: dict, repeats: int, meta: list[str]) -> str:
    lines = [
        "# Broker faults with requests waiting: celery-zklock beside plain Celery",
        "",
        f"`python -m bench.broker_faults` ({repeats} run(s) per cell, values per run separated by `/`).",
        "celery-zklock: `tests.apps.locked.hold` (waits aside in the worker for its lock, message unacknowledged);",
        "plain Celery: `bench.plain_app.plain_hold`, the same body in a worker without celery_zklock",
        "(prefetch multiplier 1, acks early: tasks wait in the broker and the prefetch window).",
        "ZooKeeper session timeout 4 s.",
        "",
        "| broker | fault | measure | celery-zklock | plain Celery |",
        "| --- | --- | --- | --- | --- |",
    ]

    def row(broker, fault, measure, key, fmt=str):
        z = results.get((broker, fault, "zklock"), [])
        p = results.get((broker, fault, "plain"), [])
        if z or p:
            lines.append(f"| {broker} | {fault} | {measure} | {_vals(z, key, fmt)} | {_vals(p, key, fmt)} |")

    row("Redis", "long wait (visibility 8 s; 1 worker -c 2, 120 x 100 ms, 1 key)", "ran twice", "twice")
    row("Redis", "long wait (visibility 8 s; 1 worker -c 2, 120 x 100 ms, 1 key)", "never ran", "never")
    for broker in ("Redis", "RabbitMQ"):
        f = "whole worker SIGKILLed (2 workers -c 2, 150 x 40 ms, 1 key)"
        row(broker, f, "held aside / ran before the kill", "held", lambda v: str(v))
        row(broker, f, "not run 10 s after the kill", "m10")
        row(broker, f, "not run 30 s after", "m30")
        row(broker, f, "not run 60 s after", "m60")
        row(broker, f, "last ran (after the kill)", "last", _secs)
        row(broker, f, "never ran: acknowledged in the killed worker", "acked")
        row(broker, f, "never ran: stranded in the broker (unacked)", "stranded")
        row(broker, f, "of them killed mid-run", "killed_mid_run")
        row(broker, f, "ran twice", "twice")
        f = "broker out of reach 3 s, twice, 3 s apart (1 worker -c 2, 430 x 50 ms, 3 keys)"
        row(broker, f, "worker exited", "crashed")
        row(broker, f, "never ran", "never")
        row(broker, f, "of them stranded in the broker (unacked)", "stranded")
        row(broker, f, "ran twice", "twice")
        row(broker, f, "of them began within 0.3 s of a cut", "twice_at_cut")
        f = STALLED
        row(broker, f, "ran twice", "twice")
        row(broker, f, "redelivered copies recognised, not run", "copies")
        row(broker, f, "never ran", "never")
    lines += ["", *meta, ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=("redis", "rabbitmq"))
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    logdir = tempfile.mkdtemp(prefix="zklock-broker-faults-")
    log(f"worker logs in {logdir}")
    brokers = [b for b in ("redis", "rabbitmq") if args.only in (None, b)]
    if "rabbitmq" in brokers and not rabbit_up():
        log("no RabbitMQ at 127.0.0.1:5672: its rows are skipped")
        brokers.remove("rabbitmq")
    def on_term(signum, frame):  # stop our workers and servers as on Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    bench = Bench(logdir)
    results: dict = {}
    started = time.time()
    try:
        for rep in range(args.repeats):
            for broker in brokers:
                name = "Redis" if broker == "redis" else "RabbitMQ"
                for kind in ("zklock", "plain"):
                    if broker == "redis":
                        res = bench.long_wait(kind)
                        log(f"run {rep + 1} {name} long wait {kind}: {res}")
                        results.setdefault((name, "long wait (visibility 8 s; 1 worker -c 2, 120 x 100 ms, 1 key)", kind), []).append(res)
                    res = bench.killed_worker(kind, broker)
                    res["held"] = f"{res['held']}/{res['ran_before']}" if kind == "zklock" else f"-/{res['ran_before']}"
                    log(f"run {rep + 1} {name} worker SIGKILL {kind}: {res}")
                    results.setdefault((name, "whole worker SIGKILLed (2 workers -c 2, 150 x 40 ms, 1 key)", kind), []).append(res)
                    res = bench.stalled_cut(kind, broker)
                    log(f"run {rep + 1} {name} stalled cut {kind}: {res}")
                    results.setdefault((name, STALLED, kind), []).append(res)
                    res = bench.outages(kind, broker)
                    log(f"run {rep + 1} {name} outages {kind}: {res}")
                    results.setdefault((name, "broker out of reach 3 s, twice, 3 s apart (1 worker -c 2, 430 x 50 ms, 3 keys)", kind), []).append(res)
    finally:
        bench.close()
    import celery
    import kombu

    meta = [f"Run {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}, {time.time() - started:.0f} s, "
            f"Celery {celery.__version__}, kombu {kombu.__version__}, Python {sys.version.split()[0]}, "
            f"{os.cpu_count()} CPUs. Worker logs: `{logdir}`.",
            "",
            "A kill run stops waiting early (shown as `> 90 s`) once nothing ran for 15 s and every task not run",
            "is provably parked: acknowledged by the killed worker, or in Redis's unacked set due back only after",
            "its visibility timeout (1 h). \"Acknowledged in the killed worker\": not run, not in the queue nor",
            "in the unacked set (Celery acknowledges an acks-early task as a pool process takes it)."]
    text = table(results, args.repeats, meta)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
