"""Waiting outside the pool: the worker's main process queues locked requests in the agent.

Why here and not in the task: a locked task that waits inside a prefork child takes a
pool slot for as long as it waits, so one hot key starves every other key on the worker.
Instead, when a locked request arrives, the main process asks the worker's lock agent
(:mod:`celery_zklock.agent`, one ZooKeeper session per worker) to queue for its lock and
keeps the request aside — unacknowledged, outside the prefetch window
(``qos.increment_eventually``, as Celery does for ETA tasks) — and hands it to the pool
only once the agent has decided: granted, timed out or unavailable.  The pool process
then claims that verdict (:mod:`celery_zklock.agent_lock`) and runs the body, or applies
the timeout/unavailable policy exactly as an in-pool wait would.

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

from .agent_link import ENV, HEARTBEAT, LineReader, encode, socket_path
from .config import ZkSettings
from .identity import Identity
from .options import is_locked_task
from .states import LOCK_WAITING

logger = get_logger("celery_zklock.worker")

#: Pools whose processes must not wait (a waiting task there costs a whole process).
PROCESS_POOLS = ("prefork", "solo")

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
            [sys.executable, "-m", "celery_zklock.agent", self.path],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
        )
        settings = dict(self.settings.__dict__)
        self.proc.stdin.write((json.dumps(settings) + "\n").encode())  # may hold credentials: never argv
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
        self.held: dict[str, object] = {}
        self.sock: socket.socket | None = None
        self.reader = LineReader()
        self.last_ping = time.monotonic()
        self.timers: list = []
        self.active = _agent is not None and getattr(c, "hub", None) is not None
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
                self._hand_over(msg["id"], first=op == "granted")
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
        _agent.start()
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
        self.c.qos.increment_eventually()  # a waiting request must not use up the prefetch window
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
        identity = Identity.of_this_process(task_id=req.id, retries=retries, task=task.name, worker=req.hostname)
        self._send({"op": "wait", "id": req.id, "paths": paths, "max_holders": task.lock_max_holders,
                    "timeout": opts.timeout, "identity": str(identity)})
        return True

    def _hand_over(self, request_id: str, first: bool = False) -> None:
        req = self.held.pop(request_id, None)
        if req is None:
            return
        self.c.qos.decrement_eventually()
        self.inner(req)
        if first:
            _run_next(self.c.pool, req)

    def _queued(self, request_id: str, position) -> None:
        req = self.held.get(request_id)
        if req is None:
            return
        key = req.task.lock_keys(tuple(req.args or ()), dict(req.kwargs or {}))
        label = key[0] if len(key) == 1 else key
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
            self._send({"op": "cancel", "id": request_id})
            self.c.qos.decrement_eventually()
            req.revoked()  # acknowledges, stores REVOKED, sends the event and signal

    def request_finished(self, request_id: str) -> None:
        """The pool is done with a request: free a grant it never claimed (no-op otherwise)."""
        if self.sock is not None:
            self._send({"op": "cancel", "id": request_id})

    def stop(self, c):
        """Warm shutdown: waiting requests go back to the broker; their nodes are deleted."""
        for tref in self.timers:
            tref.cancel()
        self.timers = []
        for request_id, req in list(self.held.items()):
            self._send({"op": "cancel", "id": request_id})
            try:
                req.reject(requeue=True)
            except Exception as exc:
                logger.warning("could not return waiting task %s to the broker: %r", request_id, exc)
        self.held.clear()

    shutdown = stop


def _run_next(pool, req) -> None:
    """A request that holds a lock goes to the head of the pool's queue.

    Why: with every pool process busy, prefork buffers requests in the main process in
    arrival order; a granted request queued behind them would hold its key's lock while
    it waits for a slot, and every task queued on that key would wait with it.  Running
    it first keeps a hot key's chain moving.  This touches Celery's prefork internals
    (``AsynPool.outbound_buffer``, ``Request._apply_result``) defensively: when they are
    not there, the request simply keeps its place.
    """
    buffer = getattr(getattr(pool, "_pool", None), "outbound_buffer", None)
    ref = getattr(req, "_apply_result", None)
    job = ref() if callable(ref) else None
    if job is not None and buffer and buffer[-1] is job:
        buffer.appendleft(buffer.pop())


def request_finished(request_id: str) -> None:
    if _step is not None:
        _step.request_finished(request_id)


def waits_in_agent(task) -> bool:
    """Does this worker queue ``task``'s requests in the agent (so the agent frees its lock
    when a pool process dies)?"""
    return _step is not None and _step.sock is not None and not task.acks_late
