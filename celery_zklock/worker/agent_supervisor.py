"""The worker's lock agent as a process: started, killed, started again; and its directory.

Why apart from the consumer step (:mod:`celery_zklock.worker.wait_outside_pool`) and its
connection (:mod:`celery_zklock.worker.agent_connection`): the process has its own failure
rules — the agent is exec'd before the pool forks and must answer ``READY`` (else the worker
does not start: locked tasks would run unprotected); a dead one is started again, with
backoff while ZooKeeper is unreachable; and the private directory of its socket is swept
when workers were killed outright.
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
from dataclasses import dataclass

from celery.utils.log import get_logger

from ..config import ZkSettings, to_wire
from ..process_records import process_record, record_alive
from .agent_protocol import AGENT_DIR_PREFIX, ENV, OWNER, SOCKET, socket_path

logger = get_logger("celery_zklock.worker")

#: Pools whose processes must not wait (a waiting task there costs a whole process).
PROCESS_POOLS = ("prefork", "solo")

_agent: "AgentProcess | None" = None

#: A directory from before owner records: removed only if its socket still refuses, the
#: same socket, this many seconds after it first did (its worker may be restarting its agent).
RECHECK = 0.3
_at_exit: list = []  # leave_nothing_behind, once registered with atexit


@dataclass(frozen=True)
class NotStarted:
    """The agent could not be started again: why, and the seconds until the next try."""

    why: SystemExit
    retry_in: float


class AgentProcess:
    """The exec'd agent process, started before the pool forks, restarted if it dies."""

    def __init__(self, settings: ZkSettings, loglevel: int = logging.WARNING) -> None:
        self.settings = settings
        self.loglevel = loglevel  # the worker's (-l): the agent's lines are the worker's too
        self.path = socket_path()
        self.maker = os.getpid()  # only this process removes the directory (never a pool process)
        self.proc: subprocess.Popen[bytes] | None = None
        self.backoff = 0.0  # seconds before the next start, while starts fail (ZooKeeper unreachable)

    def start_again(self) -> NotStarted | None:
        """Start the agent again after it died; None once it answers ``READY``.  If ZooKeeper
        cannot be reached, the worker stays up: without an agent, requests go to the pool as
        they are, where each locks in-process and follows ``on_lock_unavailable`` (retry or
        fail: never unprotected), and the start is tried again after a backoff (1 s doubling
        to 30 s)."""
        try:
            self.start()
        except SystemExit as exc:
            self.backoff = min(30.0, self.backoff * 2) if self.backoff else 1.0
            return NotStarted(exc, self.backoff)
        self.backoff = 0.0
        return None

    def start(self) -> None:
        self._own_directory()
        if os.path.exists(self.path):
            os.unlink(self.path)
        proc = self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery_zklock.worker.agent", self.path, str(self.loglevel)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
        )
        stdin, stdout = proc.stdin, proc.stdout
        assert stdin is not None and stdout is not None  # both PIPE
        stdin.write((json.dumps(to_wire(self.settings)) + "\n").encode())  # may hold credentials: never argv
        stdin.close()
        deadline = time.monotonic() + self.settings.connect_timeout + 5.0
        line = b""
        while time.monotonic() < deadline and not line.endswith(b"\n"):
            ready, _, _ = select.select([stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(stdout.fileno(), 64)
            if not chunk:
                break
            line += chunk
        if line.strip() != b"READY":
            self.kill()
            raise SystemExit(
                f"celery-zklock: the lock agent did not start (cannot reach ZooKeeper at "
                f"zklock_hosts={self.settings.hosts!r}?); locked tasks would otherwise run unprotected."
            )
        stdout.close()
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
