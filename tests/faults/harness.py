"""Services, workers, partitions and the workload plumbing of the fault scenarios.

Why one module: every scenario needs the same things — a 3-node ZooKeeper ensemble, a
broker Redis, a separate Redis for the fenced store (it must survive broker restarts),
real ``celery worker`` processes on queues of their own (so a fault hits the worker the
scenario means), a way to cut a worker off from ZooKeeper, and, at the end, the final state
of every task plus the lock nodes left behind, handed to the independent checker.
Everything binds to 127.0.0.1; every process is stopped by the pid or process group we
started.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kombu import pools

from celery_zklock.cli import local_waiters
from celery_zklock.keys import key_path
from celery_zklock.testing import ZooKeeperEnsemble
from support.redis_server import RedisServer
from support.workers import Worker
from tests.faults import app as faults_app
from tests.faults.checker import FINAL_STATES, Report, check
from tests.polling import wait_until  # noqa: F401  (the fault tests import it from here)

SESSION = 3.0  # zklock_session_timeout of the workers (the servers' tickTime of 200 ms allows 0.4 .. 4 s)


class Cluster:
    """The services one test module shares: ensemble, broker Redis, store Redis."""

    def __init__(self) -> None:
        self.ensemble = ZooKeeperEnsemble(size=3, tick_ms=200)
        self.broker = RedisServer()
        self.store_server = RedisServer()
        self._zk: KazooClient | None = None

    def start(self) -> "Cluster":
        self.ensemble.start()
        self.broker.start()
        self.store_server.start()
        return self

    def close(self) -> None:
        if self._zk is not None:
            try:
                self._zk.stop()
                self._zk.close()
            except Exception:
                pass
        self.ensemble.close()
        self.broker.close()
        self.store_server.close()

    @property
    def store_url(self) -> str:
        return f"redis://127.0.0.1:{self.store_server.port}/0"

    def env(self, root: str, **overrides: str) -> dict[str, str]:
        """The ``FAULTS_*`` variables for workers (and the test process) of one scenario."""
        values = {
            "FAULTS_BROKER": self.broker.url,
            "FAULTS_STORE": self.store_url,
            "FAULTS_ZK_HOSTS": self.ensemble.hosts,
            "FAULTS_ZK_ROOT": root,
            "FAULTS_SESSION": str(SESSION),
            # The scenario's shared queue (not "celery"): a short visibility timeout restores
            # every old unacknowledged message to its queue, and an earlier scenario's (its
            # worker was killed) must not run in this one.
            "FAULTS_QUEUE": root.strip("/"),
        }
        values.update(overrides)
        return values

    def zk(self) -> KazooClient:
        """The test's own observer client on the ensemble (reconnects by itself)."""
        if self._zk is None:
            self._zk = KazooClient(hosts=self.ensemble.hosts, timeout=4.0,
                                   connection_retry={"max_tries": -1, "delay": 0.05, "max_delay": 0.3})
            self._zk.start(timeout=30)
        return self._zk

    def heal(self) -> None:
        """Bring every member back (resume paused, restart stopped) and wait for a quorum
        of all three, so the next scenario starts from a healthy ensemble."""
        for m in self.ensemble.members:
            if m.proc is None or m.proc.poll() is not None:
                m.proc = None
                m.start(wait=False)
            else:
                m.resume()
        for m in self.ensemble.members:
            m.wait_serving(60)
        # All three in the quorum, not just two of them: a member that served a moment and
        # then exited (its election port taken, ZooKeeper exits with 14) would leave the next
        # scenario's leader kill without a quorum.
        self.ensemble.wait_quorum(60, followers=len(self.ensemble.members) - 1)
        wait_until(lambda: self.zk().connected, 30, what="the observer client to reconnect")

    def kill_leader(self) -> tuple[float, float]:
        """SIGKILL the ensemble's leader, wait for the others to elect a new one, then
        restart the old leader (it rejoins as a follower).  Returns (wall time of the
        kill, seconds until the remaining members had a quorum again)."""
        leader = self.ensemble.leader()
        killed = time.time()
        leader.kill()
        self.ensemble.wait_quorum()
        elected = time.time() - killed
        leader.start()
        return killed, elected

    def healthy(self) -> bool:
        modes = [m.mode() for m in self.ensemble.members]
        return modes.count("leader") == 1 and modes.count("follower") == 2

    def redis_restart(self, down_for: float = 0.0) -> float:
        """Restart the broker the way an operator does (``SHUTDOWN SAVE``, then start, after
        ``down_for`` seconds): the queued and unacknowledged messages survive in the RDB
        file.  Returns the seconds the broker was down."""
        import redis

        down = time.monotonic()
        try:
            redis.Redis(port=self.broker.port).shutdown(save=True)
        except redis.exceptions.ConnectionError:
            pass  # the server closes the connection as it exits
        self.broker.proc.wait(20)
        self.broker.proc = None
        time.sleep(down_for)  # the outage under test: the broker stays down this long
        self.broker.start()
        # The test process's pooled broker connections died with the server: drop them,
        # or the next control ping (a later scenario's worker start) gets one of them.
        pools.reset()
        faults_app.app._pool = None
        faults_app.app.amqp._producer_pool = None
        return time.monotonic() - down


class FaultWorker(Worker):
    """A ``celery worker`` of the faults app consuming its own queue (plus the scenario's shared one)."""

    def __init__(self, env: dict, name: str, concurrency: int = 2, queues: str | None = None) -> None:
        super().__init__(env, name, concurrency=concurrency, app="tests.faults.app",
                         extra=["-Q", queues or f"{env.get('FAULTS_QUEUE', 'celery')},{name}"])
        self.queue = name  # send here to reach this worker and no other

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker and its pool children (its own process group)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)


def task_pid(store, task_id: str, timeout: float = 30.0) -> int:
    """The pid of the pool process running ``task_id`` (the body records it first thing)."""
    raw = wait_until(lambda: store.redis.hget("faults:running", task_id), timeout, what=f"task {task_id} to start")
    return int(raw)


# ----------------------------------------------------------------------------- partitions
class _Pipe:
    """One proxied connection: two pumps that forward bytes, or swallow them while blocked."""

    def __init__(self, owner: "Blackhole", client: socket.socket) -> None:
        self.owner, self.client = owner, client
        self.server = socket.create_connection(("127.0.0.1", owner.target_port), timeout=5)
        self.server.settimeout(None)
        for src, dst in ((client, self.server), (self.server, client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not self.owner.blocked:
                    dst.sendall(data)
        except OSError:
            pass
        self.close()

    def close(self) -> None:
        for s in (self.client, self.server):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.owner.forget(self)


class Blackhole:
    """A loopback proxy to one ZooKeeper member that can drop all traffic *silently*.

    Unlike closing the connection, a blackhole gives the client no signal at all: kazoo
    only notices after 2/3 of the session timeout without a reply, the hardest case for a
    lock that must declare itself lost before the server lets someone else in.  New
    connections made while blocked are accepted and left unanswered.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.blocked = False
        self._pipes: set[_Pipe] = set()
        self._parked: list[socket.socket] = []
        self._guard = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._guard:
                if self.blocked:
                    self._parked.append(sock)
                    continue
            self._open(sock)

    def _open(self, sock: socket.socket) -> None:
        try:
            pipe = _Pipe(self, sock)
        except OSError:
            sock.close()
            return
        with self._guard:
            self._pipes.add(pipe)

    def forget(self, pipe: _Pipe) -> None:
        with self._guard:
            self._pipes.discard(pipe)

    def block(self) -> None:
        with self._guard:
            self.blocked = True

    def heal(self) -> None:
        """Stop dropping.  Connections that lost bytes are closed (their streams are
        corrupt); parked ones are forwarded, as a network that comes back would."""
        with self._guard:
            self.blocked = False
            pipes, self._pipes = list(self._pipes), set()
            parked, self._parked = self._parked, []
        for p in pipes:
            p.close()
        for s in parked:
            self._open(s)

    def close(self) -> None:
        self._listener.close()
        self.heal()
        with self._guard:
            pipes = list(self._pipes)
        for p in pipes:
            p.close()


class Partition:
    """One blackhole per ensemble member: a worker given :attr:`hosts` can be cut off
    from the whole ensemble while everything else keeps talking to it."""

    def __init__(self, ensemble: ZooKeeperEnsemble) -> None:
        self.holes = [Blackhole(m.client_port) for m in ensemble.members]

    @property
    def hosts(self) -> str:
        return ",".join(f"127.0.0.1:{h.port}" for h in self.holes)

    def cut(self) -> None:
        for h in self.holes:
            h.block()

    def heal(self) -> None:
        for h in self.holes:
            h.heal()

    def close(self) -> None:
        for h in self.holes:
            h.close()


# ----------------------------------------------------------------------------- workload
@dataclass
class Scenario:
    """One scenario's znode root, env, workers and submitted tasks; judged by :meth:`verify`."""

    cluster: Cluster
    name: str

    def __post_init__(self) -> None:
        self.root = f"/faults-{self.name}-{uuid.uuid4().hex[:6]}"
        self.env = self.cluster.env(self.root)
        faults_app.configure(self.env)
        self.app = faults_app.app
        self.store = faults_app.STORE
        self.store.reset()
        self.workers: list[FaultWorker] = []
        self.submitted: list[str] = []

    def worker(self, name: str, concurrency: int = 2, wait: bool = True, queues: str | None = None,
               **env: str) -> FaultWorker:
        """Start a worker (consuming ``celery`` and its own queue unless ``queues`` is given)
        with this scenario's env plus ``env``."""
        w = FaultWorker({**self.env, **env}, f"{self.name}-{name}", concurrency=concurrency, queues=queues)
        self.workers.append(w)
        w.start(self.app if wait else None, timeout=60)
        return w

    def send(self, task, key: str, ms: float = 50, tail_ms: float = 0, queue: str | None = None, **options):
        """Submit one task run of the workload; returns its AsyncResult."""
        result = task.apply_async((key, ms, tail_ms), queue=queue, **options)
        self.submitted.append(result.id)
        return result

    def outcomes(self, timeout: float, skip=frozenset()) -> dict[str, tuple[str, str | None]]:
        """Final (state, failure reason) of every submitted task, waiting up to ``timeout``
        (not for those in ``skip``)."""
        deadline = time.monotonic() + timeout
        found: dict[str, tuple[str, str | None]] = {}
        while True:
            for tid in self.submitted:
                if tid in found or tid in skip:
                    continue
                res = self.app.AsyncResult(tid)
                state = res.state
                if state in FINAL_STATES:
                    reason = type(res.result).__name__ if state == "FAILURE" else None
                    found[tid] = (state, reason)
            if len(found) + len(set(skip) & set(self.submitted)) >= len(self.submitted) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for tid in self.submitted:
            found.setdefault(tid, (self.app.AsyncResult(tid).state, None))
        return found

    def lock_nodes(self) -> list[str]:
        """Every lock node under this scenario's root right now."""
        zk = self.cluster.zk()
        out = []
        try:
            keys = zk.get_children(self.root)
        except NoNodeError:
            return []
        for k in keys:
            try:
                out += [f"{self.root}/{k}/{c}" for c in zk.get_children(f"{self.root}/{k}")]
            except NoNodeError:
                continue
        return out

    def leftovers(self, timeout: float) -> list[str]:
        """Lock nodes still present ``timeout`` s after the workload ended (a dead
        session's nodes may take up to the session timeout to go).  What the last look saw:
        a second read after a look that found none could count a node made since, by a
        broker's serial re-run that has just started (CI: a rerun's fresh node reported as
        left behind)."""
        seen: list[str] = []

        def gone() -> bool:
            seen[:] = self.lock_nodes()
            return not seen

        try:
            wait_until(gone, timeout, what="lock nodes to go")
        except AssertionError:
            pass
        return list(seen)

    def verify(self, allowed=(), timeout: float = 90.0, cleanup_timeout: float = SESSION + 3,
               reruns: bool = False, acked_lost=()) -> Report:
        """Run the checker over this scenario's history; fail the test on any violation.
        ``acked_lost``: see :func:`tests.faults.checker.check` (not waited for)."""
        lost = set(acked_lost)
        outcomes = self.outcomes(timeout, skip=lost)
        report = check(self.store.events(), outcomes, allowed=allowed, leftovers=self.leftovers(cleanup_timeout),
                       reruns=reruns, acked_lost=lost)
        assert report.ok, report.explain() + self.logs()
        return report

    def logs(self) -> str:
        return "".join(f"\n--- worker {w.name} log tail ---\n{w.log()[-3000:]}" for w in self.workers)

    def events(self, task_id: str, op: str | None = None) -> list[dict]:
        return [e for e in self.store.events() if e["task"] == task_id and (op is None or e["op"] == op)]

    def first(self, task_ids, op: str = "begin") -> dict | None:
        """The earliest ``op`` event of any of ``task_ids`` (e.g. who took over first)."""
        ids = set(task_ids)
        return next((e for e in self.store.events() if e["task"] in ids and e["op"] == op), None)

    def path(self, key: str) -> str:
        return key_path(self.root, key)

    def contenders(self, key: str, need: int | None = None) -> int:
        """Holders and waiters of ``key`` right now: its lock nodes, and the requests workers
        hold for it in memory (lock cohorting: one node per worker per key).  With ``need``,
        the nodes alone answer when there are that many: asking the workers is a broadcast
        that takes its whole 1 s timeout, and a poll that slow can miss a workload of a few
        seconds altogether (tasks waiting in their pool process each have a node)."""
        try:
            nodes = len(self.cluster.zk().get_children(self.path(key)))
        except NoNodeError:
            nodes = 0
        if need is not None and nodes >= need:
            return nodes
        return nodes + len(local_waiters(self.app).get(self.path(key), []))

    def wait_contenders(self, key: str, n: int, timeout: float = 30.0) -> None:
        wait_until(lambda: self.contenders(key, need=n) >= n, timeout, what=f"{n} contenders on {key!r}")

    def close(self) -> None:
        """Stop the workers (all at once) and drop the test process's result subscriptions
        while the broker is still up: an AsyncResult kept alive by a failure's traceback
        would otherwise try to unsubscribe at exit, from a dead Redis, for a minute."""
        for w in self.workers:
            w.signal_group(signal.SIGCONT)
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            w.stop(timeout=10)
        consumer = getattr(self.app.backend, "result_consumer", None)
        for tid in self.submitted:
            try:
                consumer.cancel_for(tid)
            except Exception:
                pass


def record(scenario: str, **figures) -> None:
    """Print a scenario's figures (and append them to ``$FAULTS_FIGURES`` when set): the
    numbers tests/faults/README.md reports come from these lines."""
    line = json.dumps({"scenario": scenario, **figures}, default=str)
    print(f"FAULTS-FIGURES {line}")
    path = os.environ.get("FAULTS_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")
