"""Waiting outside the pool: the worker's main process queues locked requests in the agent.

Why here and not in the task: a locked task that waits inside a prefork child takes a
pool slot for as long as it waits, so one hot key starves every other key on the worker.
Instead, when a locked request arrives, the main process asks the worker's lock agent
(:mod:`celery_zklock.worker.agent`, one ZooKeeper session per worker) to queue for its lock and
keeps the request aside — unacknowledged, outside the prefetch window
(``qos.increment_eventually``, as Celery does for ETA tasks) — and hands it to the pool
only once the agent has decided: granted, timed out or unavailable.  The pool process
then claims that verdict (:mod:`celery_zklock.worker.agent_lock`) and runs the body, or applies
the timeout/unavailable policy exactly as an in-pool wait would.

One exception, bounded: a request the agent says is *next in line* (only holders ahead),
on a key whose locks are held briefly, may go to a pool process before its grant and wait
there for the release (see :func:`hand_over_early`), so a hot key's chain does not pay a
dispatch and a wait for a free process at every handoff.

The request handler is wrapped in a consumer bootstep (``c.on_task_request``), so ETA,
countdown and rate-limited requests pass through it too.  The main process talks to the
agent through the event loop (the hub): no thread ever runs in the forking parent.
Pools: prefork and solo.  threads/gevent/eventlet pools keep waiting in the pool, where
a waiting task costs a thread or a greenlet, not a process.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

from celery import bootsteps
from celery.utils.log import get_logger
from celery.worker import state as worker_state
from celery.worker.control import inspect_command

from ..engine import guards

from .. import metrics
from ..config import ZkSettings, to_wire
from ..engine.identity import Identity
from ..options import is_locked_task
from ..states import LOCK_WAITING
from .agent_link import ENV, HANDOFF_MAX_WAIT, HEARTBEAT, LineReader, encode, socket_path

logger = get_logger("celery_zklock.worker")

#: Pools whose processes must not wait (a waiting task there costs a whole process).
PROCESS_POOLS = ("prefork", "solo")

#: Requests one worker holds aside for their locks beyond its prefetch window (unacknowledged;
#: a few KB of memory each).  Why a bound: a burst of 100,000 on one key must stay in the
#: broker, not in one worker, where a crash would leave it to the broker's visibility timeout
#: (Redis: 1 hour).  Beyond it, held requests count against the prefetch window, and the
#: worker takes new messages only as grants free the window.
MAX_HELD = 5000

_agent: "AgentProcess | None" = None
_step: "WaitOutsidePool | None" = None


class AgentProcess:
    """The exec'd agent process, started before the pool forks, restarted if it dies."""

    def __init__(self, settings: ZkSettings) -> None:
        self.settings = settings
        self.path = socket_path()
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery_zklock.worker.agent", self.path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
        )
        self.proc.stdin.write((json.dumps(to_wire(self.settings)) + "\n").encode())  # may hold credentials: never argv
        self.proc.stdin.close()
        deadline = time.monotonic() + self.settings.connect_timeout + 5.0
        line = b""
        while time.monotonic() < deadline and not line.endswith(b"\n"):
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(self.proc.stdout.fileno(), 64)
            if not chunk:
                break
            line += chunk
        if line.strip() != b"READY":
            self.kill()
            raise SystemExit(
                f"celery-zklock: the lock agent did not start (cannot reach ZooKeeper at "
                f"zklock_hosts={self.settings.hosts!r}?); locked tasks would otherwise run unprotected."
            )
        self.proc.stdout.close()
        os.environ[ENV] = self.path  # pool processes forked from now on find their agent

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def start_agent(worker, settings: ZkSettings) -> bool:
    """At ``worker_init`` (before the pool forks): start the agent for process pools."""
    global _agent
    pool = getattr(getattr(worker, "pool_cls", None), "__module__", "") or ""
    if settings.wait_in != "worker" or not pool.endswith(PROCESS_POOLS):
        os.environ.pop(ENV, None)
        return False
    _agent = AgentProcess(settings)
    _agent.start()
    return True


class WaitOutsidePool(bootsteps.StartStopStep):
    """Consumer step: hold locked requests in the main process until the agent decides."""

    label = "zklock wait outside the pool"

    def __init__(self, c, **kwargs):
        super().__init__(c, **kwargs)
        global _step
        self.c = c
        self.inner = c.on_task_request
        self.held: dict[str, object] = {}  # waiting for a verdict, here
        self.early: dict[str, object] = {}  # handed to the pool while next in line
        self.next_up: dict[str, float] = {}  # held ids next in line awaiting a slot -> expected wait
        self.revoking: set[str] = set()  # early ids whose revocation was sent to the agent
        self.counted_waiting: set[str] = set()  # held ids in the zklock_waiting gauge
        self.sock: socket.socket | None = None
        self.reader = LineReader()
        self.last_ping = time.monotonic()
        self.timers: list = []
        self.restart_delay = 0.0  # backoff of the agent's restart while ZooKeeper is unreachable
        self.counted: set[str] = set()  # held ids that raised the prefetch window
        self.paths: dict[str, tuple[list[str], float]] = {}  # held id -> its lock paths, since
        self.active = _agent is not None and getattr(c, "hub", None) is not None
        self.handoff_slots = _handoff_slots(c, _agent.settings) if self.active else 0
        if self.active:
            c.on_task_request = self.on_request
            _step = self

    # ------------------------------------------------------------------ link to the agent
    def start(self, c):
        """Connect to the agent once; (re)arm the checks at every consumer start (a broker
        reconnection stops and starts the consumer's steps, the agent link stays)."""
        if not self.active:
            return
        if self.sock is None:
            self._connect()
        if not self.timers:
            self.timers = [c.hub.call_repeatedly(0.1, self._check_revoked),
                           c.hub.call_repeatedly(HEARTBEAT * 2, self._check_agent)]

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        sock.connect(_agent.path)
        self.sock = sock
        self.reader = LineReader()
        self.last_ping = time.monotonic()
        self._send({"op": "hello", "role": "main", "pid": os.getpid()})
        self.c.hub.add_reader(sock.fileno(), self._readable)

    def _send(self, message: dict) -> None:
        if self.sock is None:
            return  # no agent (being restarted): nothing of ours waits in it
        try:
            self.sock.sendall(encode(message))
        except OSError:
            pass  # the agent is gone: the reader sees it and restarts it

    def _readable(self) -> None:
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            return self._agent_gone()
        self.last_ping = time.monotonic()
        for msg in self.reader.feed(data):
            op = msg.get("op")
            if op in ("granted", "timeout", "unavailable", "bypass"):
                # Only a grant that had to queue jumps the pool's queue: its key is
                # contended, and tasks behind it wait for its release.
                self._hand_over(msg["id"], first=op == "granted" and bool(msg.get("queued")))
                if msg["id"] in self.early:
                    self._early_done(msg["id"])  # decided: it no longer waits in its slot
            elif op == "next":
                self._next_in_line(msg["id"], msg.get("hold"))
            elif op == "revoked":
                self._revoked_in_pool(msg["id"])
                self._early_done(msg["id"])
            elif op == "queued":
                self._queued(msg["id"], msg.get("position"))

    def _agent_gone(self) -> None:
        """The agent died (or was killed as frozen): restart it and queue again.

        Its session ended with it, so its nodes are gone (at once, or at the session
        timeout if it could not close); requests we held queue again at the back.
        """
        self.c.hub.remove(self.sock.fileno())
        self.sock.close()
        self.sock = None
        logger.error("celery-zklock: the lock agent is gone; restarting it (%d request(s) waiting)", len(self.held))
        _agent.kill()
        # Requests in the pool next in line lost their nodes with the agent: their claims
        # now find no verdict, and they lock in-process.
        for request_id in self.early:
            self.paths.pop(request_id, None)
        self.early.clear()
        self.next_up.clear()
        self._restart_agent()

    def _restart_agent(self) -> None:
        """Start the agent again; if ZooKeeper cannot be reached, the worker stays up.

        Without an agent, requests go to the pool as they are, where each locks in-process
        and, ZooKeeper being unreachable, follows ``on_lock_unavailable`` (retry or fail:
        never unprotected); the start is retried with backoff (1 s doubling to 30 s)."""
        try:
            _agent.start()
        except SystemExit as exc:
            delay = self.restart_delay = min(30.0, self.restart_delay * 2) if self.restart_delay else 1.0
            logger.error("%s; %d waiting request(s) follow on_lock_unavailable in the pool; trying again in %.0fs",
                         exc, len(self.held), delay)
            for request_id in list(self.held):
                self._hand_over(request_id)
            self.c.hub.call_later(delay, self._restart_agent)
            return
        self.restart_delay = 0.0
        self._connect()
        for req in list(self.held.values()):
            self._submit(req)

    def _check_agent(self) -> None:
        if self.sock is not None and select.select([self.sock], [], [], 0)[0]:
            self._readable()  # pings may be waiting behind a long task (solo pool)
        silent = time.monotonic() - self.last_ping
        if self.sock is not None and silent > max(2.0, _agent.settings.session_timeout / 3) and _agent.alive:
            logger.error("celery-zklock: the lock agent has been silent for %.1fs; killing it", silent)
            _agent.kill()  # its socket closes: _readable sees the end and restarts it

    # ------------------------------------------------------------------ requests
    def on_request(self, req) -> None:
        task = req.task
        if self.sock is None or task.acks_late or not req.id or req.id in self.held or not is_locked_task(task):
            return self.inner(req)
        self.held[req.id] = req
        if len(self.counted) < MAX_HELD:
            # A waiting request must not use up the prefetch window (as Celery does for ETA
            # tasks) -- up to MAX_HELD of them; beyond, each held request takes a place in
            # the window, so the worker stops taking messages until grants free some.
            self.counted.add(req.id)
            self.c.qos.increment_eventually()
        if not self._submit(req):
            self._hand_over(req.id)  # bad key values and the like: the pool reports them

    def _submit(self, req) -> bool:
        task = req.task
        try:
            opts = task.lock_options()
            paths = task.lock_paths(tuple(req.args or ()), dict(req.kwargs or {}), opts)
        except Exception:
            return False
        retries = (req.request_dict or {}).get("retries") or 0
        self.paths.setdefault(req.id, (paths, time.time()))
        identity = Identity.of_this_process(task_id=req.id, retries=retries, task=task.name, worker=req.hostname,
                                            holders=task.lock_max_holders if task.lock_max_holders > 1 else None)
        self._send({"op": "wait", "id": req.id, "paths": paths, "max_holders": task.lock_max_holders,
                    "timeout": opts.timeout, "identity": str(identity), "task": task.name,
                    "early": self._slots() > 0, "guard": guards.guarded(req)})
        return True

    def _hand_over(self, request_id: str, first: bool = False) -> None:
        self.next_up.pop(request_id, None)
        req = self.held.pop(request_id, None)
        if req is None:
            return
        self._not_waiting(request_id, req)
        self.inner(req)
        if first:
            _run_next(self.c, req)

    def _next_in_line(self, request_id: str, hold: float | None) -> None:
        """The agent says only holders are ahead of this request: if its wait is expected
        to be short and a handoff slot is free, hand it to the pool now (at the head of
        its queue), where it claims and waits for the release; the grant then reaches a
        process already running it."""
        req = self.held.get(request_id)
        if req is None:
            return
        when = hand_over_early(hold, len(self.early), self._slots())
        if when == "later":
            self.next_up[request_id] = hold  # a slot may free up before its grant
        elif when == "now":
            self.early[request_id] = req
            self._hand_over(request_id, first=True)

    def _slots(self) -> int:
        """Handoff slots, never all of the pool: a process must stay for the holders
        themselves, or next-in-line requests parked in every process would wait for
        grants that no free process can run (a deadlock until their lock timeouts)."""
        processes = _processes(self.c)
        return max(0, min(self.handoff_slots, processes - 1))

    def _early_done(self, request_id: str) -> None:
        self.early.pop(request_id, None)
        self.paths.pop(request_id, None)
        self.revoking.discard(request_id)
        while self.next_up and len(self.early) < self._slots():
            waiting = next(iter(self.next_up))
            self._next_in_line(waiting, self.next_up.pop(waiting))

    def waiting(self) -> dict[str, list[dict]]:
        """{lock path: requests this worker holds aside for it, in arrival order}: with lock
        cohorting they wait in memory, not in ZooKeeper (``celery zklock status`` asks)."""
        out: dict[str, list[dict]] = {}
        now = time.time()
        for request_id, req in [*self.held.items(), *self.early.items()]:
            paths, since = self.paths.get(request_id, ([], now))
            for path in paths:
                out.setdefault(path, []).append({"task_id": request_id, "task": req.task.name, "worker": req.hostname,
                                                 "pid": os.getpid(), "for_s": round(now - since, 3)})
        return out

    def _not_waiting(self, request_id: str, req) -> None:
        """It no longer waits here: out of the prefetch accounting, the listing (unless it
        waits on, next in line, in a pool process), the gauge."""
        if request_id not in self.early:
            self.paths.pop(request_id, None)
        if request_id in self.counted:
            self.counted.discard(request_id)
            self.c.qos.decrement_eventually()
        if request_id in self.counted_waiting:
            self.counted_waiting.discard(request_id)
            metrics.record("waited", req.task)

    def _revoked_in_pool(self, request_id: str) -> None:
        """The agent gave up the node of a request revoked while next in line in the pool:
        record it as Celery records a revoked request (state, event, signal); the pool
        process, told ``revoked``, does not run it."""
        req = self.early.get(request_id)
        if req is not None:
            req.revoked()

    def _queued(self, request_id: str, position) -> None:
        req = self.held.get(request_id)
        if req is None:
            return
        key = req.task.lock_keys(tuple(req.args or ()), dict(req.kwargs or {}))
        label = key[0] if len(key) == 1 else key
        if request_id not in self.counted_waiting:
            self.counted_waiting.add(request_id)
            metrics.record("waiting", req.task)
        try:
            req.send_event("task-lock-waiting", key=label, position=position)
            if not req.task.ignore_result:
                req.task.backend.store_result(req.id, {"key": label, "position": position}, LOCK_WAITING)
        except Exception as exc:  # monitoring only
            logger.warning("could not record that task %s waits for lock %s: %r", req.id, label, exc)

    def _check_revoked(self) -> None:
        """A revoked waiting request: its node goes at once and it never reaches the pool."""
        for request_id in [i for i in self.held if i in worker_state.revoked]:
            req = self.held.pop(request_id)
            self.next_up.pop(request_id, None)
            self._not_waiting(request_id, req)
            self._send({"op": "cancel", "id": request_id, "why": "revoked"})
            req.revoked()  # acknowledges, stores REVOKED, sends the event and signal
        for request_id in [i for i in self.early if i in worker_state.revoked and i not in self.revoking]:
            self.revoking.add(request_id)  # the agent answers "revoked" unless already granted
            self._send({"op": "cancel", "id": request_id, "why": "revoked", "in_pool": True})

    def request_finished(self, request_id: str) -> None:
        """The pool is done with a request: free a grant it never claimed (no-op otherwise)."""
        if self.sock is not None:
            self._send({"op": "cancel", "id": request_id, "why": "finished"})
        if request_id in self.early:
            self._early_done(request_id)  # finished undecided: it never claimed (or was bypassed)

    def stop(self, c):
        """Warm shutdown: waiting requests go back to the broker; their nodes are deleted."""
        for tref in self.timers:
            tref.cancel()
        self.timers = []
        for request_id, req in list(self.held.items()):
            self._send({"op": "cancel", "id": request_id, "why": "shutdown"})
            self._not_waiting(request_id, req)
            try:
                req.reject(requeue=True)
            except Exception as exc:
                logger.warning("could not return waiting task %s to the broker: %r", request_id, exc)
        self.held.clear()
        self.counted.clear()
        self.paths.clear()
        self.next_up.clear()
        for request_id in self.early:
            # In the pool, next in line: unless granted meanwhile, its process is told
            # "shutdown" and publishes it back to the broker instead of running it.
            self._send({"op": "cancel", "id": request_id, "why": "shutdown", "in_pool": True})

    shutdown = stop


def hand_over_early(expected_wait: float | None, early: int, slots: int,
                    max_wait: float = HANDOFF_MAX_WAIT) -> str:
    """Hand a next-in-line request to the pool ``"now"``, ``"later"`` (when a handoff slot
    frees), or ``"no"`` (it waits here for its grant, like any other).

    Why these rules: a pool process given a next-in-line request idles until the holder
    releases, so it is worth it only when that wait is known to be short (a hot chain of
    short tasks, where it saves the dispatch and the wait for a free slot at every
    handoff) and only in a bounded number of processes: a long holder, or a task not seen
    yet, never parks a pool process.
    """
    if slots <= 0 or expected_wait is None or expected_wait > max_wait:
        return "no"
    return "now" if early < slots else "later"


def unguard(job: dict) -> bool:
    """Ask the lock agent to end the enqueue guard of a request this worker discarded unrun
    (revoked, expired); False when no agent can (then a helper process does)."""
    step = _step
    if step is None or step.sock is None:
        return False
    step._send({"op": "unguard", **job})
    return True


def _handoff_slots(c, settings: ZkSettings) -> int:
    """How many pool processes may wait for a lock their task is next in line for: the
    setting, or half the pool (rounded down: a -c 1 pool never parks its one process).
    The solo pool's one process must never wait: none there."""
    if not (getattr(type(c.pool), "__module__", "") or "").endswith("prefork"):
        return 0
    if settings.handoff_slots is not None:
        return settings.handoff_slots
    return _processes(c) // 2


def _processes(c) -> int:
    """The pool's current size (it changes with --autoscale)."""
    pool = getattr(c.pool, "_pool", None)
    live = getattr(pool, "_processes", None)
    return int(live if isinstance(live, int) and live > 0 else getattr(c.pool, "limit", None) or 1)


def _run_next(c, req) -> None:
    """A request that holds its lock, or is next in line for it, goes to the head of the
    worker's queue for a pool process.

    Why: with every pool process busy, prefork queues requests in the main process in
    arrival order — in the worker's semaphore (``LaxBoundedSemaphore``, one permit per
    process) and then in the pool's outbound buffer; a granted request queued behind
    them would hold its key's lock while it waits for a slot, and every task queued on
    that key would wait with it.  Running it first keeps a hot key's chain moving.  This
    touches kombu's and Celery's prefork internals (``_waiting``,
    ``AsynPool.outbound_buffer``, ``Request._apply_result``) defensively: when they are
    not there, the request simply keeps its place.
    """
    waiting = getattr(getattr(c.controller, "semaphore", None), "_waiting", None)
    if waiting:
        entry = waiting[-1]
        if isinstance(entry, tuple) and len(entry) == 3 and entry[1][:1] == (req,):
            waiting.appendleft(waiting.pop())
            return
    buffer = getattr(getattr(c.pool, "_pool", None), "outbound_buffer", None)
    ref = getattr(req, "_apply_result", None)
    job = ref() if callable(ref) else None
    if job is not None and buffer and buffer[-1] is job:
        buffer.appendleft(buffer.pop())


@inspect_command()
def zklock_waiting(state, **kwargs) -> dict:
    """Remote control: the requests this worker holds aside for their locks, per lock path."""
    return _step.waiting() if _step is not None and _step.active else {}


def request_finished(request_id: str) -> None:
    if _step is not None:
        _step.request_finished(request_id)


def waits_in_agent(task) -> bool:
    """Does this worker queue ``task``'s requests in the agent (so the agent frees its lock
    when a pool process dies)?"""
    return _step is not None and _step.sock is not None and not task.acks_late
