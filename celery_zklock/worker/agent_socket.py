"""The agent's socket: where it listens, and messages framed as lines on a Unix stream socket.

A Unix socket private to the worker (a directory only this user can enter) is what makes
worker loss fast: when a pool process dies, the kernel closes its end, and the agent releases
what that process held at once — no pid polling, no reaper process.  What travels on it:
:mod:`celery_zklock.worker.agent_protocol`.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import threading

from .agent_protocol import ProtocolError, decode, encode

logger = logging.getLogger("celery_zklock.worker")

#: Environment variable that tells pool processes where their worker's agent listens.
ENV = "CELERY_ZKLOCK_AGENT"

#: The agent's private directory: its name's start, its socket's name, and beside the socket
#: the record (process_records) of the worker's main process that made it, so that a later
#: start tells a dead worker's directory from a live one's (the agent removes it as it exits).
AGENT_DIR_PREFIX, SOCKET, OWNER = "zklock-agent-", "agent.sock", "owner"


def socket_path() -> str:
    """A fresh socket path in a private directory (mode 0700), short enough for AF_UNIX."""
    return os.path.join(tempfile.mkdtemp(prefix=AGENT_DIR_PREFIX), SOCKET)


class LineReader:
    """Split a byte stream into messages.  A line that is no message is logged and skipped:
    one bad line must not take a process's link to the agent down."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list:
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        messages = []
        for line in lines:
            if not line:
                continue
            try:
                messages.append(decode(line))
            except ProtocolError as exc:
                logger.error("celery-zklock: a line on the lock agent's socket is no message of its protocol, "
                             "skipped: %s", exc)
        return messages


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

    def send(self, message) -> bool:
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

    def receive(self, block: bool = True) -> list | None:
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
