"""A claim answered after the pool process stopped waiting for it (issue 35, finding 4).

Why: a pool process waits ``_CLAIM_TIMEOUT`` for the agent's verdict, then locks in process.
When a busy agent answered later, it handed the grant to a claimer that had gone on
without it, and nothing let it go: the pool process queued in process behind the agent's
node for its own request, and ``finished`` does not release a claimed request.  The key
stayed blocked for every worker until that pool process exited.

Agent-level, against a real ZooKeeper: the agent runs here (its socket, event thread and
heartbeat), the main process is a socket, and the pool side is the production
:func:`celery_zklock.worker.agent_client.claim`; the agent is made busy for longer than the
claim's timeout by an event that sleeps on its event thread.
"""

from __future__ import annotations

import select
import socket
import threading
import time
import uuid

import pytest

from celery_zklock import FairLock
from celery_zklock.config import ZkSettings
from celery_zklock.worker import agent_client
from celery_zklock.worker.agent import Agent
from celery_zklock.worker.agent_protocol import ENV, Connection


def start_agent(settings: ZkSettings, path: str) -> Agent:
    """An agent serving on ``path`` from threads of this process (stop: ``agent.stopped.set()``)."""
    agent = Agent(settings, path)
    threading.Thread(target=agent.serve, daemon=True).start()
    deadline = time.monotonic() + 10
    while not _accepts(path):  # the path exists from bind(), a moment before listen()
        assert time.monotonic() < deadline, "the agent did not listen"
        time.sleep(0.01)
    return agent


def _accepts(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


@pytest.fixture
def agent(zk_server, tmp_path):
    agent = start_agent(ZkSettings(hosts=zk_server.hosts), str(tmp_path / "agent.sock"))
    yield agent
    agent.stopped.set()


def _answer(conn: Connection, op: str, request_id: str, timeout: float | None = None) -> dict | None:
    """The agent's next ``op`` for ``request_id``; with ``timeout``, None if none comes by then."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([conn.sock], [], [], left)[0]:
                return None
        messages = conn.receive()
        assert messages is not None, "the agent went away"
        for msg in messages:
            if msg.get("op") == op and msg.get("id") == request_id:
                return msg


def test_a_late_claim_reply_does_not_leave_the_key_blocked(agent, zk_client, monkeypatch):
    key = f"/late-claim/{uuid.uuid4().hex[:8]}"
    zk_client.ensure_path("/late-claim")
    main = Connection.open(agent.path)
    main.send({"op": "hello", "role": "main"})
    main.send({"op": "wait", "id": "r1", "paths": [key], "timeout": None, "identity": "r1"})
    _answer(main, "granted", "r1")

    agent.post(time.sleep, 1.5)  # a busy agent: the claim is answered after its timeout
    monkeypatch.setenv(ENV, agent.path)
    monkeypatch.setattr(agent_client, "_link", None)
    assert agent_client.claim("r1", 0.5) is None  # the pool process goes on to lock in process

    mine = FairLock(zk_client, key)  # as the pool process's in-process lock does
    started = time.monotonic()
    assert mine.acquire(timeout=5), "the key stayed blocked by the abandoned claim"
    assert time.monotonic() - started < 3
    mine.release()

    main.send({"op": "finished", "ids": ["r1"]})
    other = FairLock(zk_client, key)  # and any other worker gets it too
    assert other.acquire(timeout=5)
    other.release()
    deadline = time.monotonic() + 5
    while "r1" in agent.requests.waits or agent.requests.cohorts:
        assert time.monotonic() < deadline, "the agent kept the abandoned request"
        time.sleep(0.02)
    main.close()
