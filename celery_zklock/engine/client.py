"""One KazooClient per process: created lazily, pid-checked, handler matched to the pool.

Why: kazoo clients own threads and a socket and do not survive ``fork`` (celery#3129,
kazoo#554), so a client made in the prefork parent must never be used by a child.  We key
the client on the pid and create it on first use in each process.  ``worker_process_init``
is not relied on (it never fires for threads/gevent pools, eager mode or direct calls, and
must not block); shutdown signals stop the client so our ephemeral nodes go at once
instead of after the session timeout.

Logging is the standard library's here, not ``celery.utils.log``: the worker-loss reaper
imports this module in a fresh interpreter on the critical path of a lock handoff, and
importing Celery would cost it ~0.2 s.  Celery's handlers still receive our records.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import select
import sys
import threading
import time
from typing import Any, Iterable

from kazoo.client import KazooClient
from kazoo.handlers.threading import AsyncResult, SequentialThreadingHandler
from kazoo.retry import KazooRetry

from ..config import ZkSettings
from ..errors import LockUnavailable
from ..security import acl_provider, auth_problem, client_kwargs, tls_diagnosis
from . import kazoo_compat

logger = logging.getLogger("celery_zklock.worker")

_lock = threading.Lock()
_clients: dict[tuple, KazooClient] = {}


def _handler():
    """gevent/eventlet pools monkey-patch the process: use the matching kazoo handler.

    Only looked up when the library is already imported: a patched process has imported
    it, and importing gevent in every prefork child just to learn it is unused costs time
    and memory.
    """
    if "gevent" in sys.modules:
        from gevent import monkey

        if monkey.is_module_patched("socket"):
            from kazoo.handlers.gevent import SequentialGeventHandler

            return SequentialGeventHandler()
    if "eventlet" in sys.modules:
        import eventlet.patcher

        if eventlet.patcher.is_monkey_patched("socket"):
            from kazoo.handlers.eventlet import SequentialEventletHandler

            return SequentialEventletHandler()
    return PollingThreadingHandler()


class PollingThreadingHandler(SequentialThreadingHandler):
    """kazoo's threading handler with a cheaper ``select``.

    Why: kazoo's own ``select`` builds, registers and closes a fresh epoll selector on every
    call (four syscalls and a pile of Python objects), and its connection thread calls it
    about three times per reply: profiling a locked task showed half of that thread's CPU
    there.  ``poll`` needs one syscall, no file descriptor of its own and has no
    ``FD_SETSIZE`` limit, so the semantics kazoo wanted from selectors are kept.
    """

    def select(self, rlist: Iterable[Any], wlist: Iterable[Any], xlist: Iterable[Any],
               timeout: float | None = None) -> tuple[list[Any], list[Any], list[Any]]:
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be non-negative")
        poller = select.poll()
        readers: dict[int, list] = {}
        writers: dict[int, list] = {}
        for objs, mapping in ((rlist, readers), (wlist, writers)):
            for obj in objs:
                mapping.setdefault(_fileno(obj), []).append(obj)
        for fd in readers.keys() | writers.keys():
            poller.register(fd, (_READ if fd in readers else 0) | (select.POLLOUT if fd in writers else 0))
        ready = poller.poll(None if timeout is None else math.ceil(timeout * 1000))
        r: list = []
        w: list = []
        for fd, events in ready:
            if events & ~select.POLLOUT:  # readable, or an error/hang-up a read will report
                r.extend(readers.get(fd, ()))
            if events & ~_READ:
                w.extend(writers.get(fd, ()))
        return r, w, []


_READ = select.POLLIN | select.POLLPRI


class _Posting:
    """Stands in for a handler's work queue: what kazoo puts runs where ``post`` sends it."""

    def __init__(self, post) -> None:
        self.post = post

    def put(self, func) -> None:
        self.post(func)


class EventLoopHandler(PollingThreadingHandler):
    """A threading handler whose completions and watch callbacks run on the caller's own
    event thread (``post(fn)`` must queue ``fn()`` there), in the order kazoo's connection
    thread dispatches them; kazoo's two callback threads are not started.

    Why: the lock agent runs every decision on one event thread anyway, so each reply
    crossed two threads (kazoo's completion thread, then the agent's), a wake-up each.
    The rule it brings: that thread must never block on a result (kazoo chains even a
    plain ``create`` through a completion callback, which would queue behind the wait).
    Such a wait raises at once instead of freezing the thread: ``loop_thread`` is set by
    the owner when its loop starts.
    """

    def __init__(self, post) -> None:
        super().__init__()
        self.callback_queue = self.completion_queue = _Posting(post)
        self.loop_thread: int | None = None

    def start(self) -> None:
        with self._state_change:
            self._running = True

    def stop(self) -> None:
        with self._state_change:
            self._running = False

    def async_result(self):
        return _LoopResult(self)


class _LoopResult(AsyncResult):
    """kazoo's result, refusing a blocking wait on the event thread (see EventLoopHandler)."""

    def _refuse_on_loop(self, block: bool, timeout) -> None:
        if (block and timeout != 0 and not self.ready() and self._handler.running
                and threading.get_ident() == self._handler.loop_thread):
            raise RuntimeError("a blocking ZooKeeper call on the event thread would wait for itself: "
                               "use the *_async call and a callback")

    def get(self, block=True, timeout=None):
        self._refuse_on_loop(block, timeout)
        return super().get(block, timeout)

    def wait(self, timeout=None):
        self._refuse_on_loop(True, timeout)
        return super().wait(timeout)


def _fileno(obj) -> int:
    fd = obj if isinstance(obj, int) else obj.fileno()
    if fd < 0:
        raise ValueError(f"invalid file descriptor {fd} (closed socket?)")
    return fd


def new_client(settings: ZkSettings, handler=None) -> KazooClient:
    """An unstarted KazooClient for ``settings`` (hosts, session timeout, credentials).

    The one place clients are configured, so the worker's tasks, the worker-start check,
    the reaper and the CLI all connect the same way.  Reconnection retries forever with a
    short cap: a task waiting for its lock must see the ensemble again as soon as it is
    back, and the session timeout — not a retry budget — bounds how long a lock survives.
    """
    client = KazooClient(
        hosts=settings.hosts,
        timeout=settings.session_timeout,
        handler=handler or _handler(),
        auth_data=list(settings.auth_secret) if settings.auth_secret else None,
        connection_retry=KazooRetry(max_tries=-1, delay=0.1, max_delay=1.0),
        **client_kwargs(settings),
    )
    client.zklock_acl_provider = acl_provider(settings)  # read by kazoo_compat.acl_for
    return client


class RetrySummary(logging.Filter):
    """Counts and holds back kazoo's per-attempt connection warnings ("Connection dropped:
    ... Connection refused", one every retry) while installed on the ``kazoo.client`` logger,
    so that an unreachable ensemble is reported in one line, not a flood."""

    NOISE = ("Connection dropped", "Connection time-out", "Transition to CONNECTING", "Failed connecting to Zookeeper",
             "Cannot resolve")

    def __init__(self) -> None:
        super().__init__()
        self.attempts = 0
        self.last = ""
        self.started = time.monotonic()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING or not isinstance(record.msg, str) or not record.msg.startswith(self.NOISE):
            return True
        if record.msg.startswith(("Connection dropped", "Connection time-out", "Cannot resolve")):
            self.attempts += 1
            self.last = record.getMessage()
        return False

    def line(self, hosts: str) -> str:
        return (f"ZooKeeper at {hosts} unreachable after {self.attempts} attempt(s) in "
                f"{time.monotonic() - self.started:.1f} s: {self.last or 'no answer'}")


class OutageLog(logging.Filter):
    """One WARNING when this process loses ZooKeeper and one INFO when it is back, with how
    long and how many attempts failed, instead of kazoo's lines at every attempt (about two a
    second per process through an outage).  Installed on the ``kazoo.client`` logger once a
    client of this process has connected (a failed first connect says it in its error)."""

    ATTEMPT = ("Connection dropped", "Connection time-out", "Cannot resolve")
    NOISE = (*ATTEMPT, "Transition to CONNECTING", "Zookeeper connection lost", "Connecting to ", "Closing connection to")
    BACK = "Zookeeper connection established"

    def __init__(self, say: logging.Logger, clock=time.monotonic) -> None:
        super().__init__()
        self.say, self.clock = say, clock
        self.since: float | None = None  # when the outage began (this process's clock)
        self.attempts = 0

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        if record.levelno > logging.WARNING:
            return True
        if msg.startswith(self.ATTEMPT):
            if self.since is None:
                self.since, self.attempts = self.clock(), 0
                self.say.warning("celery-zklock: ZooKeeper unreachable (%s); reconnecting, and saying so once it is "
                                 "back", record.getMessage())
            self.attempts += 1
            return False
        if msg.startswith(self.BACK) and self.since is not None:
            self.say.info("celery-zklock: ZooKeeper reachable again after %.1f s (%d attempt(s) failed)",
                          self.clock() - self.since, max(self.attempts - 1, 0))
            self.since = None
            return False
        return not (self.since is not None and msg.startswith(self.NOISE))


_outage_log: OutageLog | None = None


def _report_outages() -> None:
    """Install :class:`OutageLog` in this process, once."""
    global _outage_log
    if _outage_log is None:
        _outage_log = OutageLog(logger)
        logging.getLogger("kazoo.client").addFilter(_outage_log)


def connect(settings: ZkSettings, handler=None, summarize_retries: bool = False) -> KazooClient:
    """A started client for ``settings``, or :class:`LockUnavailable` saying what to fix.

    The one place a connection is opened: the worker's tasks, the worker-start check, the
    reaper and the CLI all fail with the same message naming ``zklock_hosts``.
    ``summarize_retries`` (the worker-start probe, ``celery zklock`` commands): kazoo's
    per-attempt warnings are held back while this call connects, and a failure says how
    many attempts failed and how; kazoo's logging is untouched before and after.
    """
    client = new_client(settings, handler=handler)
    summary = RetrySummary() if summarize_retries else None
    kazoo_log = logging.getLogger("kazoo.client")
    if summary is not None:
        kazoo_log.addFilter(summary)
    try:
        try:
            client.start(timeout=settings.connect_timeout)
        except Exception as exc:
            disconnect(client)  # with the filter still on: the attempts it stops stay quiet
            why = tls_diagnosis(settings)  # a TLS failure says which setting and file to fix
            what = summary.line(settings.hosts) if summary is not None and summary.attempts else f"{type(exc).__name__}: {exc}"
            raise LockUnavailable(
                f"cannot reach ZooKeeper at zklock_hosts={settings.hosts!r} within {settings.connect_timeout}s "
                f"({what}); " + (why or "start the ensemble or fix zklock_hosts")
            ) from exc
    finally:
        if summary is not None:
            kazoo_log.removeFilter(summary)
    why = auth_problem(client, settings)
    if why:
        disconnect(client)
        raise LockUnavailable(f"connected to ZooKeeper at zklock_hosts={settings.hosts!r}, but {why}")
    _report_outages()
    return client


def disconnect(client: KazooClient) -> None:
    """Stop and close ``client``; closing the session deletes its ephemeral nodes at once."""
    try:
        client.stop()
        client.close()
    except Exception:  # pragma: no cover - best effort at shutdown
        pass


def get_client(settings: ZkSettings) -> KazooClient:
    """This process's started client for ``settings``; raises LockUnavailable."""
    key = (os.getpid(), settings.hosts, settings.session_timeout, settings.auth_secret, settings.use_ssl,
           settings.sasl_options, settings.acl)
    client = _clients.get(key)
    if client is not None and not kazoo_compat.closed_for_good(client):
        return client
    with _lock:
        client = _clients.get(key)
        if client is not None and not kazoo_compat.closed_for_good(client):
            return client
        if client is not None:
            logger.warning("zklock: the ZooKeeper client of this process stopped connecting for good (its "
                           "authentication failed, or its connection retries ran out): connecting a new one")
            disconnect(_clients.pop(key))
        for stale in [k for k in _clients if k[0] != os.getpid()]:
            _clients.pop(stale)  # inherited through fork: never touch its threads/socket
        client = _clients[key] = connect(settings, handler=_handler())
        logger.debug("zklock: connected to %s (pid %s)", settings.hosts, os.getpid())
        return client


def close_clients() -> None:
    """Stop this process's clients: closing the session deletes its ephemeral nodes now."""
    with _lock:
        mine = [k for k in _clients if k[0] == os.getpid()]
        for k in mine:
            disconnect(_clients.pop(k))


atexit.register(close_clients)
