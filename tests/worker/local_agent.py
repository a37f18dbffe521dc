"""A worker's lock agent run from threads of this test process, and the sockets a test talks
to it through (as the main process and pool processes do).  Agent-level tests use it against a
real ZooKeeper: the agent's socket, event thread and heartbeat are the real ones.  The
``agent`` fixture (one on the test's ZooKeeper) is in tests/worker/conftest.py."""

from __future__ import annotations

import select
import socket
import threading
import time

from celery_zklock.config import ZkSettings
from celery_zklock.worker.agent import Agent
from celery_zklock.worker.agent_protocol import Connection, Decided, Verdict
from tests.polling import wait_until


def start_agent(settings: ZkSettings, path: str) -> Agent:
    """An agent serving on ``path`` from threads of this process (stop: ``agent.stopped.set()``)."""
    agent = Agent(settings, path)
    threading.Thread(target=agent.serve, daemon=True).start()
    # The path exists from bind(), a moment before listen(): wait until it accepts.
    wait_until(lambda: accepts(path), 10, what="the agent to listen")
    return agent


def accepts(path: str) -> bool:
    """Whether a Unix socket at ``path`` accepts a connection now."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def answer(conn: Connection, kind, request_id: str, timeout: float | None = None):
    """The agent's next message of ``kind`` (a message class, or a :class:`Verdict`: that
    verdict's :class:`Decided`) for ``request_id``; with ``timeout``, None if none comes by then."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([conn.sock], [], [], left)[0]:
                return None
        messages = conn.receive()
        assert messages is not None, "the agent went away"
        for msg in messages:
            if getattr(msg, "id", None) != request_id:
                continue
            if msg.verdict is kind if isinstance(kind, Verdict) and isinstance(msg, Decided) else type(msg) is kind:
                return msg
