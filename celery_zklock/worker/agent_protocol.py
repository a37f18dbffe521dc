"""The wire between a worker's lock agent and its main and pool processes.

Why a module of its own: three processes speak it — the agent
(:mod:`celery_zklock.worker.agent`), the worker's main process (:mod:`celery_zklock.worker.worker_queue`)
and each pool process (:mod:`celery_zklock.worker.agent_client`) — and each message must mean the
same thing to all.  Messages are JSON objects, one per line, over a Unix stream socket
private to the worker (a directory only this user can enter).  A Unix socket is what makes
worker loss fast: when a pool process dies, the kernel closes its end, and the agent
releases what that process held at once — no pid polling, no reaper process.

Requests (``op``) and the agent's answers:

* main -> agent ``wait`` {id, seq, task, paths, max_holders, timeout, identity, early, watched,
  and for a task that reads (``lock_mode``) read, readers: the paths it reads, and how many
  read nodes of ours a path may have (the pool's size)}:
  queue for the lock; answered later by ``granted`` {id, queued, carry}, ``timeout`` or
  ``unavailable`` {id, error}, after ``queued`` {id, position} if it has to wait and
  ``watched`` (the main process reads it: events, LOCK_WAITING, metrics, or its prefetch
  window for a request it does not know waits).  With ``early``, also ``next`` {id, hold,
  ours} when only holders are ahead of it (``hold``: how long locks on its path, or of its
  task, have been held on average, or null; ``ours``: the holder is a request of this
  worker's whose release passes the node on, rather than another contender's node in
  ZooKeeper).  A grant made on a young proof of every node (the lease) has ``carry``
  {proof, session_timeout, waited, tokens}: the main process puts it in the request it hands
  to the pool (:data:`CARRIED`), and the pool process starts on it while the proof is younger
  than the lease window, claiming with ``carried``;
* main -> agent ``cancel`` {id, why, in_pool}: ``revoked`` or ``shutdown`` — stop waiting
  (a request the main process already handed to the pool as next in line, ``in_pool``,
  gets that verdict instead if still undecided, and the main process hears ``revoked``
  {id} back);
* main -> agent ``finished`` {ids, seqs}: the pool is done with these requests (one message
  per turn of the main process's event loop): let go of any grant nobody claimed.  ``seqs``
  name the deliveries (the ``seq`` of their ``wait``): a task id can wait again (a retry
  with no countdown) once its first delivery let go, and the first's end must not end it;
* main -> agent ``dropped`` {ids, seqs}: Celery dropped these handed-over requests unrun
  (its close at a broker reconnection or shutdown; their messages come back from the
  broker): let go of each one no pool process claims (a carried grant once it can no
  longer be started on);
* main -> agent ``fence`` {id, path, seq, token}: a tick of the elected beat reached the worker:
  may its body run?  Answered by ``fenced`` {id, verdict: run/duplicate/stale, or null with
  error when ZooKeeper did not answer} (:mod:`celery_zklock.engine.tick_fence`);
* agent -> main ``bypass`` {id}: a request whose task id already waits or runs through the
  agent (a retry published by a body still holding its lock, a redelivery): hand it to
  the pool marked :data:`BYPASSED`; it locks in-process there, never claiming by its id;
* pool -> agent ``claim`` {id}: "I run this request"; answered by ``claimed`` {id,
  verdict: granted/timeout/unavailable/revoked/shutdown/unknown, tokens, nodes, holders,
  error, and for a grant held, lost, reason and the agent's negotiated session_timeout}, or first by ``claimed`` {verdict: pending} for a request next in line, whose
  verdict follows when decided; from then on the lock belongs to that connection.
  ``unknown`` (no such request, or one neither decided nor next in line) makes the pool
  process lock in-process;
* pool -> agent ``claim`` {id, carried: true}: "I run this request on the grant it brought":
  not answered while the lock is held as that grant said; otherwise ``state`` (suspended,
  lost, or lost because this agent does not hold that grant).  A plain ``claim`` after it
  (the grant aged before it was sent) is answered with the verdict;
* pool -> agent ``unclaim`` {id}: the claim's answer did not come in time (a busy agent)
  and the pool process locks in-process instead: the agent lets go of that request's
  locks, however it was answered meanwhile (no answer);
* pool -> agent ``release`` {id}: answered by ``released`` {id, proven, reason};
* agent -> pool ``state`` {id, held, reason}: the lock became unsafe (suspended), safe
  again, or lost;
* agent -> everyone ``ping`` every :data:`HEARTBEAT` seconds: silence means the agent is
  frozen or gone, and a pool process then stops trusting the locks it holds through it.
"""

from __future__ import annotations

import enum
import json
import os
import socket
import tempfile
import threading

#: Environment variable that tells pool processes where their worker's agent listens.
ENV = "CELERY_ZKLOCK_AGENT"

#: The ``delivery_info`` field in which a grant travels with its task from the main process
#: to the pool process (``granted``'s ``carry``).
CARRIED = "zklock_grant"

#: The ``delivery_info`` field that marks a delivery whose task id the agent knows by another
#: delivery (one held aside already, or told ``bypass``): its pool process must not claim the
#: agent's request for that id, which is the other delivery's (both would run on its grant),
#: and locks in-process instead.
BYPASSED = "zklock_bypassed"

#: Seconds between the agent's heartbeats.
HEARTBEAT = 0.2

#: A request next in line is handed to a pool process before its grant only if locks on
#: its path (or of its task) have been held at most this long on average (seconds): that
#: process idles until the holder releases.
HANDOFF_MAX_WAIT = 0.5


class Verdict(str, enum.Enum):
    """A request's one verdict: the ``op`` of the agent's answer to the main process, and the
    ``verdict`` of a claim's answer.  The value is the wire encoding (JSON strings)."""

    GRANTED = "granted"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    REVOKED = "revoked"
    SHUTDOWN = "shutdown"


class ClaimAnswer(str, enum.Enum):
    """A claim's answer when no verdict can be told (yet), in place of one."""

    PENDING = "pending"  # next in line: the verdict follows when decided
    UNKNOWN = "unknown"  # nothing to claim: the pool process locks in-process


class Cancel(str, enum.Enum):
    """Why the main process stops waiting for a request (``cancel`` and ``finished``)."""

    REVOKED = "revoked"
    SHUTDOWN = "shutdown"
    FINISHED = "finished"  # the pool is done with it without claiming it


#: The agent's private directory: its name's start, its socket's name, and beside the socket
#: the record (process_records) of the worker's main process that made it, so that a later
#: start tells a dead worker's directory from a live one's (the agent removes it as it exits).
AGENT_DIR_PREFIX, SOCKET, OWNER = "zklock-agent-", "agent.sock", "owner"


def socket_path() -> str:
    """A fresh socket path in a private directory (mode 0700), short enough for AF_UNIX."""
    return os.path.join(tempfile.mkdtemp(prefix=AGENT_DIR_PREFIX), SOCKET)


def encode(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class LineReader:
    """Split a byte stream into decoded JSON messages."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[dict]:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]


class Connection:
    """A connection with a thread-safe ``send`` (used by agent and pool processes).

    A pool process's sends block (it waits for the answer anyway).  The agent's never do:
    made with ``on_backlog``, what the peer's socket cannot take now waits in an outbox, and
    ``on_backlog()`` asks the agent's event loop to :meth:`flush` it when the socket is
    writable.  Why: an agent blocked on a peer that is itself blocked sending to it (the
    worker's main process re-sending its backlog after an agent restart) stalled both for
    good, and with them every key they queued for."""

    def __init__(self, sock: socket.socket, on_backlog=None) -> None:
        self.sock = sock
        self._send_guard = threading.Lock()
        self._reader = LineReader()
        self.closed = False
        self._on_backlog = on_backlog
        self._outbox = bytearray()  # bytes the peer's socket did not take yet (with on_backlog)

    @classmethod
    def open(cls, path: str, timeout: float = 5.0) -> "Connection":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(path)
        sock.settimeout(None)
        return cls(sock)

    def send(self, message: dict) -> bool:
        """Send one message; False once the other side is gone."""
        data = encode(message)
        with self._send_guard:
            if self.closed:
                return False
            if self._on_backlog is not None:
                return self._queue(data)
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                self.closed = True
                return False

    def _queue(self, data: bytes) -> bool:
        """Non-blocking send, under the guard: what does not fit waits in the outbox, whose
        order a later send never jumps."""
        backlog = bool(self._outbox)
        self._outbox += data
        if not backlog:
            self._write()
            if self._outbox:
                self._on_backlog()
        return not self.closed

    def _write(self) -> None:
        try:
            sent = self.sock.send(self._outbox, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.closed = True  # the reader sees the end and lets go of what it held
            self._outbox.clear()
            return
        del self._outbox[:sent]

    def flush(self) -> bool:
        """The socket is writable: send what waits; True once nothing does."""
        with self._send_guard:
            if self._outbox and not self.closed:
                self._write()
            return not self._outbox

    @property
    def pending(self) -> int:
        """Bytes waiting in the outbox."""
        return len(self._outbox)

    def receive(self, block: bool = True) -> list[dict] | None:
        """The next messages (blocking for them, or ``[]`` when none are there yet with
        ``block=False``); None at end of stream."""
        try:
            data = self.sock.recv(65536) if block else self.sock.recv(65536, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            data = b""
        if not data:
            self.closed = True
            return None
        return self._reader.feed(data)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass
