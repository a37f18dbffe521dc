"""The worker's main process keeps its lock agent alive: starts it, links to it, restarts it.

Why apart from the consumer step (:mod:`celery_zklock.worker.worker_queue`): what the step
does with a request does not depend on how the agent is kept alive, and this part has its
own failure rules — the agent is exec'd before the pool forks and must answer ``READY``
(else the worker does not start: locked tasks would run unprotected); a silent agent is
killed; a dead one is restarted, with backoff while ZooKeeper is unreachable, and the
requests held aside queue again.  The link runs in the hub (the event loop): no thread in
the forking parent.  The messages: :mod:`celery_zklock.worker.agent_protocol`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

from celery.utils.log import get_logger

from ..config import ZkSettings, to_wire
from ..engine.session import session_margin
from ..process_records import process_record, record_alive
from .agent_protocol import AGENT_DIR_PREFIX, ENV, HEARTBEAT, OWNER, SOCKET, LineReader, Verdict, encode, socket_path

logger = get_logger("celery_zklock.worker")

#: Pools whose processes must not wait (a waiting task there costs a whole process).
PROCESS_POOLS = ("prefork", "solo")

_agent: "AgentProcess | None" = None

#: A directory from before owner records: removed only if its socket still refuses, the
#: same socket, this many seconds after it first did (its worker may be restarting its agent).
RECHECK = 0.3
_at_exit: list = []  # leave_nothing_behind, once registered with atexit


def not_listening(since_last_check: float) -> bool:
    """Did the liveness check (every ``2 * HEARTBEAT``) come so late that this process itself
    was not running?  Then no silence of the agent's was observed."""
    return since_last_check > max(1.0, 8 * HEARTBEAT)


class AgentProcess:
    """The exec'd agent process, started before the pool forks, restarted if it dies."""

    def __init__(self, settings: ZkSettings, loglevel: int = logging.WARNING) -> None:
        self.settings = settings
        self.loglevel = loglevel  # the worker's (-l): the agent's lines are the worker's too
        self.path = socket_path()
        self.maker = os.getpid()  # only this process removes the directory (never a pool process)
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._own_directory()
        if os.path.exists(self.path):
            os.unlink(self.path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery_zklock.worker.agent", self.path, str(self.loglevel)],
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

    def _own_directory(self) -> None:
        """The socket's directory, private to us, with our owner record: made again if something
        removed it meanwhile (the path stays: pool processes forked earlier know only it)."""
        folder = os.path.dirname(self.path)
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise SystemExit(f"celery-zklock: {folder} (the lock agent's directory) is not this worker's own "
                                 "private directory any more; the agent cannot listen there") from None
        with open(os.path.join(folder, OWNER), "w") as f:
            f.write(process_record())

    def remove_directory(self) -> None:
        """Remove the socket, the owner record and the directory (the worker stops)."""
        if os.getpid() == self.maker:
            _remove(os.path.dirname(self.path))

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
    sweep()
    _agent = AgentProcess(settings, _level_of(worker))
    if not _at_exit:
        _at_exit.append(atexit.register(leave_nothing_behind))  # a cold stop sends no worker_shutdown
    _agent.start()
    return True


def leave_nothing_behind() -> None:
    """The worker stops (warm: ``worker_shutdown``; cold, or a start that failed: at exit):
    remove its agent's socket and directory.  The agent may still run until this process has
    gone (its listening socket stays open; nobody connects any more), and then exits."""
    if _agent is not None:
        _agent.remove_directory()


def _listening(path: str) -> bool:
    """Does a process accept connections on the Unix socket ``path``?  When in doubt, yes."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # a full backlog (EAGAIN), no permission: someone may be there
        return True
    finally:
        probe.close()
    return True


def _stale(folder: str):
    """What a start may remove of ``folder``: "dead" (its worker's main process is gone and
    nothing listens on its socket), ("legacy", its socket's identity) (no owner record: from
    before them; its socket refuses), or None (alive, being made, or not a directory a worker made)."""
    try:
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        entries = set(os.listdir(folder))
    except OSError:
        return None
    if not entries or not entries <= {SOCKET, OWNER}:
        return None  # just made (empty), or holding what no worker puts there
    sock = None
    if SOCKET in entries:
        try:
            sock = os.lstat(os.path.join(folder, SOCKET))
        except FileNotFoundError:
            pass
        except OSError:
            return None
        if sock is not None and not stat.S_ISSOCK(sock.st_mode):
            return None
    if OWNER in entries:
        try:
            with open(os.path.join(folder, OWNER)) as f:
                record = f.read()
        except OSError:
            return None
        if record_alive(record):
            return None  # its worker lives (restarting its agent, perhaps)
        if sock is not None and _listening(os.path.join(folder, SOCKET)):
            return None  # the agent outlives its worker while pool processes hold locks through it
        return "dead"
    if sock is None or _listening(os.path.join(folder, SOCKET)):
        return None
    return ("legacy", sock.st_ino, sock.st_ctime_ns)  # an inode number alone is soon reused


def _remove(folder: str) -> None:
    for name in (SOCKET, OWNER):
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
        except OSError:
            return
    try:
        os.rmdir(folder)
    except OSError:
        pass


def sweep() -> list[str]:
    """At a worker's start: remove the agent directories that workers killed outright (main
    process and agent: neither could) left in the temporary directory.  Only directories named
    as ours, of this user, holding only a socket and an owner record, whose worker is gone and
    on whose socket nothing listens: never a live worker's (others may run on this host)."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(AGENT_DIR_PREFIX)]
    except OSError:
        return []
    removed, legacy = [], []
    for name in names:
        folder = os.path.join(root, name)
        verdict = _stale(folder)
        if verdict == "dead":
            _remove(folder)
            removed.append(folder)
        elif verdict is not None:
            legacy.append((folder, verdict))
    if legacy:
        time.sleep(RECHECK)
        for folder, verdict in legacy:
            if _stale(folder) == verdict:
                _remove(folder)
                removed.append(folder)
    if removed:
        logger.info("celery-zklock: removed %d lock agent directory(ies) of workers that were killed", len(removed))
    return removed


def _level_of(worker) -> int:
    """The worker's ``-l`` as a number (Celery keeps it as given: a name or a number)."""
    level = getattr(worker, "loglevel", None)
    if isinstance(level, str):
        level = logging.getLevelName(level.upper())
    return level if isinstance(level, int) else logging.WARNING


def running() -> AgentProcess | None:
    """This worker's agent, if :func:`start_agent` started one."""
    return _agent


class Outbox:
    """The main process's bytes for the agent, written as its socket takes them.

    Why: ``sendall`` in Celery's event loop blocked it whenever the agent was slow to read,
    and an agent restart that re-sent thousands of held requests deadlocked the worker: the
    loop blocked sending while the new agent blocked answering, unread (neither then read,
    dispatched, reaped or shut down).  A send that timed out part way also left half a line
    that the next message was glued to.  Here a send never blocks and never splits a
    message: what the socket does not take waits, in order, and the hub writes it when the
    socket is writable (through a duplicate of its descriptor: kombu's epoll keeps one
    registration per descriptor, the reader's)."""

    def __init__(self, sock: socket.socket, hub) -> None:
        self.sock = sock
        self.hub = hub
        self.data = bytearray()
        self.wfd: int | None = None  # the duplicate registered for writing while data waits

    def send(self, data: bytes) -> None:
        backlog = bool(self.data)
        self.data += data
        if not backlog:
            self._write()

    def _write(self) -> None:
        try:
            sent = self.sock.send(self.data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # the agent is gone: the reader sees it and restarts it
            self.data.clear()
            sent = 0
        del self.data[:sent]
        if self.data and self.wfd is None:
            self.wfd = os.dup(self.sock.fileno())
            self.hub.add_writer(self.wfd, self._write)
        elif not self.data and self.wfd is not None:
            self._unwatch()

    def _unwatch(self) -> None:
        self.hub.remove_writer(self.wfd)
        os.close(self.wfd)
        self.wfd = None

    @property
    def pending(self) -> int:
        return len(self.data)

    def register(self, hub) -> None:
        """The event loop (re)starts with a reset hub (a broker reconnection): watch again."""
        self.hub = hub
        if self.wfd is not None:
            hub.add_writer(self.wfd, self._write)

    def drain(self, timeout: float) -> bool:
        """At shutdown, when the hub no longer turns: write what waits, for up to ``timeout``
        seconds; True if all went.  (The agent also lets go of whatever a main process that
        is gone left waiting.)"""
        deadline = time.monotonic() + timeout
        while self.data:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [self.sock], [], left)[1]:
                return False
            self._write()
        return True

    def close(self) -> None:
        self.data.clear()
        if self.wfd is not None:
            self._unwatch()


class AgentSupervisor:
    """The consumer step's link to the agent (the base class of
    :class:`~celery_zklock.worker.worker_queue.WaitOutsidePool`, which holds the state and
    handles what the agent says)."""

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        sock.connect(_agent.path)
        sock.setblocking(False)  # nothing here may block Celery's event loop (_send)
        self.sock = sock
        self.outbox = Outbox(sock, self.c.hub)
        self.reader = LineReader()
        # Listening from now: a first check after a stop of the whole worker, before any
        # check ran, must see the gap (a SIGSTOP right after start killed a healthy agent).
        self.last_check = self.last_ping = time.monotonic()
        self._send({"op": "hello", "role": "main", "pid": os.getpid()})
        self.c.hub.add_reader(sock.fileno(), self._readable)

    def _send(self, message: dict) -> None:
        if self.sock is None:
            return  # no agent (being restarted): nothing of ours waits in it
        self.outbox.send(encode(message))

    def _readable(self) -> None:
        if self.sock is None:
            return
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return  # nothing yet (the liveness check reads too)
        except OSError:
            data = b""
        if not data:
            return self._agent_gone()
        self.last_ping = time.monotonic()
        for msg in self.reader.feed(data):
            op = msg.get("op")
            if not self._current(msg.get("id"), msg.get("seq")):
                continue  # about a delivery that is gone (swept back to the broker and delivered again)
            if op in (Verdict.GRANTED, Verdict.TIMEOUT, Verdict.UNAVAILABLE, "bypass"):
                # Only a grant that had to queue jumps the pool's queue: its key is
                # contended, and tasks behind it wait for its release.
                self._hand_over(msg["id"], first=op == Verdict.GRANTED and bool(msg.get("queued")),
                                carry=msg.get("carry"), bypassed=op == "bypass")
                if msg["id"] in self.early:
                    self._early_done(msg["id"])  # decided: it no longer waits in its slot
            elif op == "next":
                self._next_in_line(msg["id"], msg.get("hold"), msg.get("ours", True))
            elif op == Verdict.REVOKED:
                self._revoked_in_pool(msg["id"])
                self._early_done(msg["id"])
            elif op == "queued":
                self._queued(msg["id"], msg.get("position"))
            elif op == "fenced":
                self._fenced(msg["id"], msg.get("verdict"), msg.get("error"))

    def _agent_gone(self) -> None:
        """The agent died (or was killed as frozen): restart it and queue again.

        Its session ended with it, so its nodes are gone (at once, or at the session
        timeout if it could not close); requests we held queue again at the back.
        """
        self.c.hub.remove(self.sock.fileno())
        self.outbox.close()
        self.sock.close()
        self.sock = None
        logger.error("celery-zklock: the lock agent is gone; restarting it (%d request(s) waiting)", len(self.aside))
        _agent.kill()
        # Requests in the pool next in line lost their nodes with the agent: their claims
        # now find no verdict, and they lock in-process.
        for request_id in self.early:
            self._untrack(request_id)
        self.early.clear()
        self.next_up.clear()
        self._restart_agent()

    def _restart_agent(self) -> None:
        """Start the agent again; if ZooKeeper cannot be reached, the worker stays up.

        Without an agent, requests go to the pool as they are, where each locks in-process
        and, ZooKeeper being unreachable, follows ``on_lock_unavailable`` (retry or fail:
        never unprotected); the start is retried with backoff (1 s doubling to 30 s)."""
        if self.sock is not None:
            return  # connected meanwhile (a consumer restart started it): one agent only
        try:
            _agent.start()
        except SystemExit as exc:
            delay = self.restart_delay = min(30.0, self.restart_delay * 2) if self.restart_delay else 1.0
            logger.error("%s; %d waiting request(s) follow on_lock_unavailable in the pool; trying again in %.0fs",
                         exc, len(self.aside), delay)
            for request_id in list(self.aside):
                self._hand_over(request_id)
            self.c.hub.call_later(delay, self._restart_agent)
            return
        self.restart_delay = 0.0
        self._connect()
        for req in list(self.aside.values()):
            self._submit(req)

    def _check_agent(self) -> None:
        if self.sock is not None and select.select([self.sock], [], [], 0)[0]:
            self._readable()  # pings may be waiting behind a long task (solo pool)
        now = time.monotonic()
        if not_listening(now - self.last_check):
            # This process itself did not run (the whole worker SIGSTOPped, a swap storm, a
            # long task in a solo pool): the agent's silence was not heard, not proven.  It
            # is judged from now on (before: a worker resumed after a stop killed its agent).
            self.last_ping = now
        self.last_check = now
        silent = now - self.last_ping
        if self.sock is not None and silent > max(2.0, session_margin(_agent.settings.session_timeout)) and _agent.alive:
            logger.error("celery-zklock: the lock agent has been silent for %.1fs; killing it", silent)
            _agent.kill()  # its socket closes: _readable sees the end and restarts it
