"""Plumbing for running the examples end to end: services, worker/beat processes, report.

* :class:`Services` uses the ZooKeeper and Redis configured by ``ZKLOCK_HOSTS`` /
  ``REDIS_URL`` when they are reachable (then under a unique znode root, a unique Redis key
  prefix and a separate Redis DB), and otherwise starts local throwaway ones on free
  loopback ports (:class:`celery_zklock.testing.ZooKeeperServer`,
  :class:`celery_zklock.redis_server.RedisServer`).  ``close()`` stops what it started and
  removes what it wrote on shared servers.
* :class:`Procs` starts ``celery worker`` / ``celery beat`` subprocesses, each in its own
  session, remembers their pids and stops exactly those (SIGTERM, then SIGKILL of that
  process group after a grace period).
* :class:`Report` collects metric rows and invariant checks and prints the results table.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit, urlunsplit

import redis

from .common import DEFAULT_REDIS_URL, DEFAULT_ZK_HOSTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_T0 = time.monotonic()

#: Set by the SIGINT/SIGTERM handler.  Libraries on the way (kombu, redis-py, celery's result
#: consumer) may catch a KeyboardInterrupt raised inside them; every wait loop here checks
#: this flag too, so an interrupt is never lost.
STOP = threading.Event()


def say(msg: str) -> None:
    """A progress line, stamped with seconds since the program started."""
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def _on_interrupt(signum, frame):
    STOP.set()
    raise KeyboardInterrupt


def install_interrupt_handlers() -> None:
    """Ctrl-C and SIGTERM both unwind into the callers' ``finally`` blocks (the cleanup)."""
    signal.signal(signal.SIGINT, _on_interrupt)
    signal.signal(signal.SIGTERM, _on_interrupt)


def check_stop() -> None:
    if STOP.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def _own_session():
    """Start server processes in a session of their own while this block runs.

    ``ZooKeeperServer`` and ``RedisServer`` start their process in our process group, where
    the terminal's Ctrl-C would kill them at once, before the workers that use them have
    shut down (a worker whose broker vanished hangs in its warm shutdown).  In their own
    session they get no terminal signal and :meth:`Services.close` stops them last.  Only
    the main thread starts processes while this is in effect.
    """
    real = subprocess.Popen

    class _Popen(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    subprocess.Popen = _Popen  # type: ignore[misc]
    try:
        yield
    finally:
        subprocess.Popen = real  # type: ignore[misc]


# --------------------------------------------------------------------------- services
def redis_reachable(url: str, timeout: float = 1.0) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.exceptions.RedisError, OSError, ValueError):
        return False


def with_db(url: str, db: int) -> str:
    """``url`` with its database number replaced by ``db``."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def url_db(url: str) -> int:
    path = urlsplit(url).path.strip("/")
    return int(path) if path.isdigit() else 0


@dataclass
class Endpoints:
    """Where the examples' apps connect (exported to workers as environment variables)."""

    redis_url: str
    zk_hosts: str
    zk_root: str
    prefix: str
    notes: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {
            "REDIS_URL": self.redis_url,
            "ZKLOCK_HOSTS": self.zk_hosts,
            "ZKLOCK_ROOT": self.zk_root,
            "ZKLOCK_DEMO_PREFIX": self.prefix,
        }


class Services:
    """Reuse reachable ZooKeeper/Redis, or start local ones; always namespace our data."""

    def __init__(self, zk_hosts: str | None = None, redis_url: str | None = None, tick_ms: int = 2000,
                 run_id: str | None = None) -> None:
        self.zk_hosts = zk_hosts or os.environ.get("ZKLOCK_HOSTS") or DEFAULT_ZK_HOSTS
        self.redis_url = redis_url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
        self.tick_ms = tick_ms
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.zk_server = None
        self.redis_server = None
        self.endpoints: Endpoints | None = None
        self._shared_zk = False
        self._shared_redis = False

    def start(self) -> Endpoints:
        from celery_zklock.testing import ZooKeeperServer, is_reachable

        notes = []
        if is_reachable(self.zk_hosts):
            self._shared_zk = True
            zk_hosts = self.zk_hosts
            notes.append(f"ZooKeeper: using the one at {zk_hosts}")
        else:
            say(f"no ZooKeeper answers at {self.zk_hosts}: starting a local one (tickTime {self.tick_ms} ms)")
            self.zk_server = ZooKeeperServer(tick_ms=self.tick_ms)  # assigned first: close() stops a half-started one
            with _own_session():
                self.zk_server.start(timeout=60)
            zk_hosts = self.zk_server.hosts
            notes.append(f"ZooKeeper: started locally on {zk_hosts} (pid {self.zk_server.proc.pid})")
        zk_root = f"/celery-zklock-demo-{self.run_id}"

        if redis_reachable(self.redis_url):
            self._shared_redis = True
            db = int(os.environ.get("ZKLOCK_DEMO_REDIS_DB", "15" if url_db(self.redis_url) != 15 else "14"))
            url = with_db(self.redis_url, db)
            if not redis_reachable(url):  # e.g. 'databases 1' on that server
                url, db = self.redis_url, url_db(self.redis_url)
            redis_url = url
            notes.append(f"Redis: using the one at {self.redis_url} (DB {db}, keys under the demo prefix)")
        else:
            from celery_zklock.redis_server import RedisServer

            say(f"no Redis answers at {self.redis_url}: starting a local one")
            self.redis_server = RedisServer()
            with _own_session():
                self.redis_server.start()
            redis_url = self.redis_server.url
            notes.append(f"Redis: started locally on 127.0.0.1:{self.redis_server.port} (pid {self.redis_server.proc.pid})")
        self.endpoints = Endpoints(redis_url, zk_hosts, zk_root, f"zklock-demo:{self.run_id}:", notes)
        return self.endpoints

    def close(self) -> None:
        ep = self.endpoints
        if ep is not None and self._shared_redis:
            try:  # our keys only: everything under the run's prefix
                client = redis.Redis.from_url(ep.redis_url, socket_timeout=5)
                keys = list(client.scan_iter(match=ep.prefix + "*", count=1000))
                for i in range(0, len(keys), 500):
                    client.delete(*keys[i:i + 500])
                client.close()
            except (redis.exceptions.RedisError, OSError):
                pass
        if ep is not None and self._shared_zk:
            try:
                from kazoo.client import KazooClient

                zk = KazooClient(hosts=ep.zk_hosts, timeout=10)
                zk.start(timeout=10)
                zk.delete(ep.zk_root, recursive=True)
                zk.stop()
                zk.close()
            except Exception:
                pass
        if self.redis_server is not None:
            self.redis_server.close()
            self.redis_server = None
        if self.zk_server is not None:
            self.zk_server.close()
            self.zk_server = None

    def __enter__(self) -> Endpoints:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- processes
class Proc:
    """One subprocess in its own session (so a Ctrl-C in the terminal reaches only us)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logdir: str) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = os.path.join(logdir, f"{name}.log")
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "Proc":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def wait_or_kill(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reap_group()

    def kill(self) -> None:
        """SIGKILL this process and the process group it leads (its pool children)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def _reap_group(self) -> None:
        # A worker's pool children are in its group; after a clean exit none should remain,
        # but never leave one behind if the parent exited without them.
        try:
            os.killpg(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""


class Procs:
    """The worker and beat processes started by an example run; stops exactly those."""

    def __init__(self, env: dict[str, str], logdir: str | None = None, tag: str | None = None) -> None:
        self.tag = tag or uuid.uuid4().hex[:6]  # node names are unique per run: name-tag@host
        self.env = {**os.environ, **env}
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        self._own_logdir = logdir is None
        self.logdir = logdir or tempfile.mkdtemp(prefix="zklock-demo-logs-")
        self.items: list[Proc] = []

    def remove_logs(self) -> None:
        """Delete the log directory if this object created it (call once all is well)."""
        if self._own_logdir:
            import shutil

            shutil.rmtree(self.logdir, ignore_errors=True)

    def spawn(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(name, argv, self.env, self.logdir).start()
        self.items.append(proc)
        return proc

    def worker(self, app_module: str, name: str, concurrency: int, loglevel: str = "warning",
               extra: list[str] | None = None) -> Proc:
        name = f"{name}-{self.tag}"
        argv = [sys.executable, "-m", "celery", "-A", app_module, "worker", "-P", "prefork", "-c", str(concurrency),
                "-n", f"{name}@%h", "--without-heartbeat", "--without-gossip", "--without-mingle",
                "-l", loglevel, *(extra or [])]
        return self.spawn(name, argv)

    def beat(self, app_module: str, name: str, loglevel: str = "info") -> Proc:
        schedule = os.path.join(self.logdir, f"{name}-schedule")
        argv = [sys.executable, "-m", "celery", "-A", app_module, "beat", "-s", schedule, "-l", loglevel,
                "--pidfile", os.path.join(self.logdir, f"{name}.pid")]
        return self.spawn(name, argv)

    def stop(self, items: list[Proc] | None = None, timeout: float = 20.0) -> None:
        """SIGTERM all (warm shutdown: running tasks finish), then wait; SIGKILL laggards."""
        items = list(self.items if items is None else items)
        for p in items:
            p.terminate()
        deadline = time.monotonic() + timeout
        for p in items:
            p.wait_or_kill(max(0.1, deadline - time.monotonic()))

    def stop_all(self, timeout: float = 20.0) -> None:
        self.stop(None, timeout)

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def wait_ready(app, workers: list[Proc], timeout: float = 60.0) -> None:
    """Block until every worker answers a broadcast ping (its consumer is running)."""
    host = os.uname().nodename
    pending = {f"{w.name}@{host}": w for w in workers}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        check_stop()
        for w in pending.values():
            if not w.alive():
                raise RuntimeError(f"{w.name} exited with {w.proc.returncode}:\n{w.log_tail()}")
        for reply in app.control.ping(destination=list(pending), timeout=0.5) or []:
            for name in reply:
                pending.pop(name, None)
    if pending:
        w = next(iter(pending.values()))
        raise TimeoutError(f"{', '.join(pending)} not ready after {timeout}s:\n{w.log_tail()}")


def wait_until(predicate, timeout: float, interval: float = 0.1, progress=None, every: float = 2.0) -> bool:
    """Poll ``predicate`` until true or ``timeout``; call ``progress()`` every ``every`` s."""
    deadline = time.monotonic() + timeout
    next_report = time.monotonic() + every
    while True:
        check_stop()
        if predicate():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if progress is not None and now >= next_report:
            progress()
            next_report = now + every
        time.sleep(interval)


# --------------------------------------------------------------------------- reporting
def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ms(seconds: float) -> str:
    return "n/a" if seconds != seconds else f"{seconds * 1000:.1f} ms"


@dataclass
class Row:
    example: str
    metric: str
    value: str
    ok: bool | None = None  # None: a measurement, not an invariant

    @property
    def status(self) -> str:
        return "" if self.ok is None else ("PASS" if self.ok else "FAIL")


class Report:
    def __init__(self) -> None:
        self.rows: list[Row] = []

    def metric(self, example: str, metric: str, value: object) -> None:
        self.rows.append(Row(example, metric, str(value)))

    def check(self, example: str, metric: str, value: object, ok: bool) -> bool:
        self.rows.append(Row(example, metric, str(value), bool(ok)))
        return bool(ok)

    def extend(self, other: "Report") -> None:
        self.rows.extend(other.rows)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.ok is False]

    @property
    def ok(self) -> bool:
        return not self.failures()

    def render(self) -> str:
        head = ("example", "metric", "value", "check")
        cells = [head] + [(r.example, r.metric, r.value, r.status) for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(4)]
        sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
        lines = [sep, "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |", sep.replace("-", "=")]
        previous = None
        for r in self.rows:
            if previous is not None and r.example != previous:
                lines.append(sep)
            previous = r.example
            vals = (r.example, r.metric, r.value, r.status)
            lines.append("| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |")
        lines.append(sep)
        return "\n".join(lines)


def run_standalone(run: Callable[["Report", "Procs | None"], object], spawn: bool = True) -> int:
    """Run one example on its own (``python -m examples.NAME``): services, processes, table.

    Why one helper: every example's command line must start (or reuse) ZooKeeper and
    Redis, stop exactly the processes it started, also on Ctrl-C, print the same table and
    keep the logs only when an invariant broke.  ``spawn=False`` runs against workers that
    are already up (``run`` then gets ``procs=None``).
    """
    install_interrupt_handlers()
    report = Report()
    procs = None
    if not spawn:
        run(report, None)
    else:
        services = Services()
        try:
            os.environ.update(services.start().env())
            procs = Procs(services.endpoints.env())
            run(report, procs)
        finally:
            if procs is not None:
                procs.stop_all()
            services.close()
    print(report.render())
    if procs is not None:
        if report.ok:
            procs.remove_logs()
        else:
            print(f"worker/beat logs kept in {procs.logdir}")
    return 0 if report.ok else 1
