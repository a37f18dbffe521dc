"""What the benchmark runs on: its own ZooKeeper and Redis, real ``celery worker``
processes, and the probes that read their state (progress log, RSS, znode count).

Why private services: numbers are only comparable when every contender meets the same
freshly started servers, and a benchmark must never touch (or be disturbed by) a Redis or
ZooKeeper someone else uses -- so both are started here on free loopback ports, in their
own session (a terminal Ctrl-C reaches the runner first, which then stops the workers
before the services they use), and stopped at the end.

ZooKeeper runs as a user would run it: ``tickTime`` 2000 ms (so kazoo's default 10 s
session is granted as asked -- the worker-loss scenario depends on it) and fsync on.
Only the container sweep is faster than ZooKeeper's 60 s default (1 s), so that the
znode count taken after a run reflects what the server will clean up, without waiting a
minute.

Workers are started and stopped with :class:`support.workers.Procs`, shared with the
examples and the tests (own session per worker; SIGTERM, then SIGKILL of that worker's
process group only).
"""

from __future__ import annotations

import os
import sys
import time
import uuid

from support.workers import children_of

_T0 = time.monotonic()
CONTAINER_CHECK_MS = 1000


def log(msg: str) -> None:
    """A progress line on stderr, stamped with seconds since the run started."""
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


class Services:
    """A private ZooKeeper (fsync on, tickTime 2 s) and Redis on free loopback ports."""

    def __init__(self) -> None:
        self.run_id = uuid.uuid4().hex[:8]
        self.zk = None
        self.redis = None

    def start(self) -> "Services":
        from celery_zklock.testing import ZooKeeperServer
        from support.redis_server import RedisServer

        self.zk = ZooKeeperServer(tick_ms=2000, fsync=True, container_check_ms=CONTAINER_CHECK_MS)
        self.zk.start(timeout=60, new_session=True)
        self.redis = RedisServer()
        self.redis.start(new_session=True)
        return self

    @property
    def zk_hosts(self) -> str:
        return self.zk.hosts

    @property
    def redis_url(self) -> str:
        return self.redis.url

    def endpoints(self) -> dict:
        """What lock_bench's child processes need to connect."""
        return {"zk_hosts": self.zk_hosts, "redis_port": self.redis.port}

    def env(self) -> dict[str, str]:
        """Environment of the runner's Celery app and of the worker subprocesses."""
        return {"BENCH_REDIS_URL": self.redis_url, "BENCH_ZK_HOSTS": self.zk_hosts,
                "BENCH_ZK_ROOT": f"/bench-celery-{self.run_id}"}

    def mntr(self) -> dict[str, str]:
        from celery_zklock.testing import four_letter_word

        out = four_letter_word("127.0.0.1", self.zk.client_port, "mntr", timeout=5)
        return dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)

    def znode_count(self) -> int:
        return int(self.mntr()["zk_znode_count"])

    def reset_server_stats(self) -> None:
        """``srst``: zero ZooKeeper's latency and fsync statistics (and its packet counters)."""
        from celery_zklock.testing import four_letter_word

        four_letter_word("127.0.0.1", self.zk.client_port, "srst", timeout=5)

    def server_stats(self) -> dict[str, float]:
        """ZooKeeper's own view since the last :meth:`reset_server_stats`: fsync time and
        write (update) latency -- request in to reply out, in the server -- in ms (its
        clock has 1 ms resolution).  Slow writes are stalls no client-side lock can hide."""
        m = self.mntr()
        return {
            "fsyncs": int(m["zk_cnt_fsynctime"]),
            "fsync_avg_ms": float(m["zk_avg_fsynctime"]),
            "fsync_max_ms": float(m["zk_max_fsynctime"]),
            "updates": int(m["zk_cnt_updatelatency"]),
            "update_latency_avg_ms": float(m["zk_avg_updatelatency"]),
            "update_latency_p99_ms": float(m["zk_p99_updatelatency"]),
            "update_latency_max_ms": float(m["zk_max_updatelatency"]),
        }

    def settled_znode_count(self, timeout: float = 6.0) -> int:
        """The znode count once container parents emptied by the last run are swept.

        Waits for the count to stay the same over two sweep intervals (or ``timeout``).
        """
        deadline = time.monotonic() + timeout
        last, stable_since = self.znode_count(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = self.znode_count()
            if now != last:
                last, stable_since = now, time.monotonic()
            elif time.monotonic() - stable_since >= 2 * CONTAINER_CHECK_MS / 1000:
                break
        return last

    def machine(self) -> dict:
        """Machine and server facts recorded with every result."""
        import platform

        from celery_zklock.testing import four_letter_word

        srvr = four_letter_word("127.0.0.1", self.zk.client_port, "srvr", timeout=5)
        version = next((ln.split(":", 1)[1].strip() for ln in srvr.splitlines() if ln.startswith("Zookeeper version")),
                       None)
        return {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "zookeeper_version": version,
            "zookeeper_fsync": self.zk.fsync,
            "zookeeper_tick_ms": self.zk.tick_ms,
            "zookeeper_container_check_ms": CONTAINER_CHECK_MS,
            "redis_version": self.redis_version(),
            "versions": package_versions(),
            "source": source_state(),
        }

    def redis_version(self) -> str | None:
        import redis

        client = redis.Redis.from_url(self.redis_url)
        try:
            return client.info("server").get("redis_version")
        finally:
            client.close()

    def close(self) -> None:
        for server in (self.redis, self.zk):
            if server is not None:
                server.close()


def source_state() -> dict:
    """The commit measured, and whether the library had uncommitted changes."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "--short", "HEAD") or None,
            "library_uncommitted_changes": bool(git("status", "--porcelain", "--", "celery_zklock"))}


def package_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("celery", "kombu", "kazoo", "redis", "celery-zklock", "celery_once", "celery-singleton",
                 "python-redis-lock"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


# ------------------------------------------------------------------ workers
class Workers:
    """``count`` real prefork ``celery worker`` processes (``-c 2``) running ``app_module``
    (bench.app, or a module that adds a scenario's contenders to it)."""

    def __init__(self, env: dict[str, str], count: int = 2, concurrency: int = 2, app_module: str = "bench.app") -> None:
        from support.workers import Procs

        self.procs = Procs(env, tag=uuid.uuid4().hex[:6])
        self.app_module = app_module
        self.count = count
        self.concurrency = concurrency
        self.items = []

    def start(self, app, timeout: float = 90.0, connection=None) -> "Workers":
        from support.workers import wait_ready

        self.items = [self.procs.worker(self.app_module, f"bench{i}", self.concurrency) for i in range(self.count)]
        try:
            wait_ready(app, self.items, timeout, connection)
        except BaseException:
            # Never leave them behind: workers of a failed start kept consuming the shared
            # RabbitMQ queue and took the next run's burst (it then never finished).
            self.procs.stop_all(timeout=5)
            raise
        return self

    def pids(self) -> dict[int, list[int]]:
        """Worker parent pid -> its pool children's pids."""
        return {w.pid: children_of(w.pid) for w in self.items}

    def rss_kib(self) -> dict[str, int]:
        """RSS of every worker process: ``"parent <pid>"`` / ``"child <pid>"`` -> KiB."""
        out = {}
        for parent, children in self.pids().items():
            out[f"parent {parent}"] = rss_kib(parent)
            for c in children:
                out[f"child {c}"] = rss_kib(c)
        return {k: v for k, v in out.items() if v is not None}

    def stop(self, timeout: float = 20.0) -> None:
        self.procs.stop_all(timeout)


class CostMeter:
    """CPU seconds used by the worker processes (in all, and by role: each worker's main
    process, its lock agent, its pool processes), ZooKeeper, Redis and this (publishing)
    process, requests ZooKeeper received, and the worker processes' context switches by
    role, between two snapshots.

    Why: on a small machine throughput is bound by CPU shared between the workers and the
    servers, so "where the time goes" per task explains a throughput ratio -- and the
    reject-style peers lock in the publisher, which only this process's CPU shows.
    """

    def __init__(self, services: Services, workers: Workers, agents: tuple | list = ()) -> None:
        self.services, self.workers = services, workers
        self.agents = list(agents)  # lock agents outside the workers (bench.skeleton_app's), counted as theirs

    def snapshot(self) -> dict[str, float]:
        roles = {"worker_main": 0.0, "worker_agent": 0.0, "worker_pool": 0.0}
        switches = {f"switches_{role}": 0.0 for role in roles}
        for worker in self.workers.items:
            agent = worker.agent_pid()
            roles["worker_main"] += cpu_seconds(worker.pid)
            switches["switches_worker_main"] += context_switches(worker.pid)
            for child in worker.child_pids():
                role = "worker_agent" if child == agent else "worker_pool"
                roles[role] += cpu_seconds(child)
                switches[f"switches_{role}"] += context_switches(child)
        for pid in self.agents:
            roles["worker_agent"] += cpu_seconds(pid)
            switches["switches_worker_agent"] += context_switches(pid)
        own = os.times()
        return {
            "workers": sum(roles.values()),
            **roles,
            **switches,
            "zookeeper": cpu_seconds(self.services.zk.proc.pid),
            "redis": cpu_seconds(self.services.redis.proc.pid),
            "publisher": own.user + own.system,
            "zk_requests": float(self.services.mntr()["zk_packets_received"]),
        }

    @staticmethod
    def per_task(before: dict[str, float], after: dict[str, float], tasks: int) -> dict[str, float]:
        """CPU ms per task by process group, ZooKeeper requests and context switches per task."""
        out = {f"cpu_{k}_ms_per_task": round((after[k] - before[k]) * 1000 / tasks, 3) for k in before
               if k != "zk_requests" and not k.startswith("switches_")}
        out.update({f"{k}_per_task": round((after[k] - before[k]) / tasks, 1) for k in before if k.startswith("switches_")})
        out["zk_requests_per_task"] = round((after["zk_requests"] - before["zk_requests"]) / tasks, 2)
        return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of all a process's threads so far (0 if it
    is gone): each wake-up of a thread that slept on a socket, a pipe or a lock is one."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        total += int(line.split()[1])
        except OSError:
            continue
    return total


def rss_kib(pid: int | str = "self", field: str = "VmRSS") -> int | None:
    """A process's resident set size (or ``VmHWM``, its peak) in KiB; None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
