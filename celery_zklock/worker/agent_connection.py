"""The worker's main process's connection to its lock agent, run in Celery's event loop.

Why an object of its own: what the consumer step does with a request does not depend on how
the link to the agent is kept — the socket read by the hub (no thread in the forking parent),
sends that never block, the agent's liveness, and its restart when it dies (with backoff
while ZooKeeper is unreachable; the process itself: :mod:`celery_zklock.worker.agent_supervisor`).
The step owns the connection, sends through :meth:`AgentConnection.send`, and hears what the
agent says through :class:`AgentAnswers`.  The messages: :mod:`celery_zklock.worker.agent_protocol`.
"""

from __future__ import annotations

import math
import os
import select
import socket
import time
from typing import Any, Protocol

from celery.utils.log import get_logger

from ..engine.session import session_margin
from .agent_protocol import (
    HEARTBEAT,
    Bypass,
    Decided,
    FenceAnswer,
    Finished,
    Hello,
    LineReader,
    Next,
    PeerRole,
    Queued,
    encode,
)
from .agent_supervisor import AgentProcess, NotStarted

logger = get_logger("celery_zklock.worker")


def not_listening(since_last_check: float) -> bool:
    """Did the liveness check (every ``2 * HEARTBEAT``) come so late that this process itself
    was not running?  Then no silence of the agent's was observed."""
    return since_last_check > max(1.0, 8 * HEARTBEAT)


class AgentAnswers(Protocol):
    """What the consumer step does with what its agent says, and with the agent's restarts."""

    def decided(self, answer: Decided) -> None: ...
    def bypassed(self, answer: Bypass) -> None: ...
    def next_in_line(self, answer: Next) -> None: ...
    def queued(self, answer: Queued) -> None: ...
    def fenced(self, answer: FenceAnswer) -> None: ...

    def agent_lost(self) -> None:
        """The agent died (or was killed as frozen): its session, and every node, went with it."""

    def agent_unavailable(self, why: NotStarted) -> None:
        """It could not be started again (ZooKeeper unreachable): nothing waits in it."""

    def agent_started(self) -> None:
        """A new agent answers: what waited in the old one queues again."""


class AgentConnection:
    """The agent's socket in the hub: what is sent (:class:`Outbox`), what is read, the
    agent's liveness (:meth:`check`) and its restart."""

    def __init__(self, process: AgentProcess | None, answers: AgentAnswers) -> None:
        self.process = process  # None: no agent (the step is inactive), never opened
        self.answers = answers
        self.hub: Any = None  # kombu's Hub, Celery's event loop
        # The open connection: its socket, and what waits to be written to it (None: no agent
        # to send to, being restarted).
        self.outbox: Outbox | None = None
        self.reader = LineReader()
        # Listening from now: a first check after a stop of the whole worker, before any
        # check ran, must see the gap (a SIGSTOP right after start killed a healthy agent).
        self.last_check = self.last_ping = time.monotonic()
        # An agent this silent is killed as frozen (inf: no agent, never opened).
        self.silence_limit = math.inf if process is None else max(2.0, session_margin(process.settings.session_timeout))
        self.finished: list[tuple[str, int]] = []  # (id, seq) done in the pool, told at the next loop turn

    @property
    def connected(self) -> bool:
        """Is there an agent to send to (not while it is being restarted)?"""
        return self.outbox is not None

    @property
    def sock(self) -> socket.socket | None:
        """The agent's socket, while connected."""
        return None if self.outbox is None else self.outbox.sock

    @property
    def _agent(self) -> AgentProcess:
        """The agent's process: only a step that has one opens the connection."""
        if self.process is None:
            raise RuntimeError("no lock agent to connect to")
        return self.process

    def open(self, hub) -> None:
        """Connect once (a broker reconnection restarts the consumer, not this link)."""
        if self.outbox is not None:
            return
        try:
            self._connect(hub)
        except OSError as exc:
            # No agent to connect to: it died and its restart waits for ZooKeeper.  Raising
            # here would restart the consumer over and over, and the hub that retries the
            # agent would never run: start it from here instead (or schedule the retry).
            logger.error("celery-zklock: no lock agent to connect to (%r); starting it again", exc)
            self._agent.kill()
            self.hub = hub
            self._restart()

    def _connect(self, hub) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5.0)
        sock.connect(self._agent.path)
        sock.setblocking(False)  # nothing here may block Celery's event loop (send)
        self.hub = hub
        self.outbox = Outbox(sock, hub)
        self.reader = LineReader()
        self.last_check = self.last_ping = time.monotonic()
        self.send(Hello(PeerRole.MAIN, os.getpid()))
        hub.add_reader(sock.fileno(), self._readable)

    def register(self, hub) -> None:
        """Read the agent through the hub again: a broker reconnection resets the hub, which
        forgets every reader, and the event loop calls this each time it (re)starts.
        Without it the agent's grants were read only by the 0.4 s liveness check."""
        outbox = self.outbox
        if outbox is not None:
            self.hub = hub
            hub.add_reader(outbox.sock.fileno(), self._readable)
            outbox.register(hub)

    # ------------------------------------------------------------------ sending
    def send(self, message: Any) -> None:
        if self.outbox is None:
            return  # no agent (being restarted): nothing of ours waits in it
        self.outbox.send(encode(message))

    def finish(self, request_id: str, seq: int) -> None:
        """The pool is done with this delivery: told in one :class:`Finished` per turn of the
        event loop, not one per request."""
        if self.outbox is None:
            return
        if not self.finished:
            self.hub.call_soon(self.send_finished)
        self.finished.append((request_id, seq))

    def send_finished(self) -> None:
        done, self.finished = self.finished, []
        if done:
            self.send(Finished(tuple(i for i, _ in done), tuple(n for _, n in done)))

    def drain(self, timeout: float) -> bool:
        """At shutdown, when the hub no longer turns: write what waits (True if all went)."""
        return self.outbox is None or self.outbox.drain(timeout)

    # ------------------------------------------------------------------ reading
    def _readable(self) -> None:
        outbox = self.outbox
        if outbox is None:
            return
        try:
            data = outbox.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return  # nothing yet (the liveness check reads too)
        except OSError:
            data = b""
        if not data:
            return self._gone(outbox)
        self.last_ping = time.monotonic()
        for msg in self.reader.feed(data):
            match msg:
                case Decided():
                    self.answers.decided(msg)
                case Bypass():
                    self.answers.bypassed(msg)
                case Next():
                    self.answers.next_in_line(msg)
                case Queued():
                    self.answers.queued(msg)
                case FenceAnswer():
                    self.answers.fenced(msg)
                # Ping: heard (last_ping) is all it says

    # ------------------------------------------------------------------ the agent's life
    def check(self) -> None:
        """Every 2 heartbeats: an agent silent for a third of its session (at least 2 s) is
        killed (frozen), and its end restarts it."""
        if self.outbox is not None and select.select([self.outbox.sock], [], [], 0)[0]:
            self._readable()  # pings may be waiting behind a long task (solo pool)
        now = time.monotonic()
        if not_listening(now - self.last_check):
            # This process itself did not run (the whole worker SIGSTOPped, a swap storm, a
            # long task in a solo pool): the agent's silence was not heard, not proven.  It
            # is judged from now on (before: a worker resumed after a stop killed its agent).
            self.last_ping = now
        self.last_check = now
        silent = self.silence()
        if self.outbox is not None and silent > self.silence_limit and self._agent.alive:
            logger.error("celery-zklock: the lock agent has been silent for %.1fs; killing it", silent)
            self._agent.kill()  # its socket closes: _readable sees the end and restarts it

    def silence(self) -> float:
        """Seconds since the agent was last heard."""
        return time.monotonic() - self.last_ping

    def _gone(self, outbox: Outbox) -> None:
        """The agent died (or was killed as frozen): restart it and queue again.

        Its session ended with it, so its nodes are gone (at once, or at the session
        timeout if it could not close); requests we held queue again at the back.
        """
        self.hub.remove(outbox.sock.fileno())
        outbox.close()
        outbox.sock.close()
        self.outbox = None
        self.answers.agent_lost()
        self._agent.kill()
        self._restart()

    def _restart(self) -> None:
        """Start the agent again; if ZooKeeper cannot be reached, the worker stays up and the
        start is tried again later (:meth:`AgentProcess.start_again`)."""
        if self.outbox is not None:
            return  # connected meanwhile (a consumer restart started it): one agent only
        failed = self._agent.start_again()
        if failed is not None:
            self.answers.agent_unavailable(failed)
            self.hub.call_later(failed.retry_in, self._restart)
            return
        self._connect(self.hub)
        self.answers.agent_started()


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
        wfd = self.wfd
        if wfd is not None:
            self.hub.remove_writer(wfd)
            os.close(wfd)
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
