"""The lock agent: one process per worker that waits for locks so that pool processes do not.

Why a process of its own, exec'd rather than forked: the worker's main process forks pool
children, and a kazoo client's threads alive in a forking process can be copied
mid-operation (kazoo #554/#519/#628); the pool processes must not wait either — a waiting
task in a prefork child takes a slot that other keys need.  So the agent holds the
worker's only ZooKeeper session, queues for every locked request the main process
receives (the event-driven engine: no thread per waiter), and hands each lock to the pool
process that claims it.  Protocol: :mod:`celery_zklock.worker.agent_link`.

Run by the worker (:mod:`celery_zklock.worker.worker_queue`) as ``python -m celery_zklock.worker.agent
SOCKET`` with the settings as JSON on stdin (they may carry credentials: never argv).
It exits once the worker's main process and every pool process that holds a lock
through it have gone; closing its session deletes whatever it still had.

Its parts, one job each, all mixed into :class:`Agent` (which holds their state):
:mod:`~celery_zklock.worker.agent_server` (socket, event thread, heartbeat, peers leaving),
:mod:`~celery_zklock.worker.agent_requests` (each request's locks, up to its verdict),
:mod:`~celery_zklock.worker.agent_claims` (pool processes claiming, lock states, releases),
:mod:`~celery_zklock.worker.agent_guards` (enqueue guards) and, per key,
:mod:`~celery_zklock.worker.cohort`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading

from kazoo.protocol.states import KazooState

from ..config import ZkSettings, from_wire
from ..engine import clock
from ..engine.client import connect
from ..engine.session import monitor_for
from .agent_claims import ClaimDesk
from .agent_guards import EnqueueGuards
from .agent_link import Connection
from .agent_requests import RequestBook, Wait
from .agent_server import AgentServer
from .cohort import Cohort

logger = logging.getLogger("celery_zklock.worker.agent")


class Agent(AgentServer, RequestBook, ClaimDesk, EnqueueGuards):
    """Serves the worker's processes; every decision runs on one event thread (:meth:`post`)."""

    def __init__(self, settings: ZkSettings, path: str, client=None) -> None:
        self.settings = settings
        self.path = path
        self.client = connect(settings) if client is None else client  # the simulator passes its own
        self.monitor = monitor_for(self.client)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.progress = clock.monotonic()  # when the event thread last finished an event
        self.peers_guard = threading.Lock()
        self.peers: set[Connection] = set()
        self.waits: dict[str, Wait] = {}
        self.claimed: set[Wait] = set()  # granted and claimed: their states are pushed
        self.cohorts: dict[tuple[str, int], Cohort] = {}
        self.main: Connection | None = None
        self.main_seen = False
        self.stopped = threading.Event()
        self.parent = os.getppid()
        # Mean time a lock was held (grant to release), per lock path and per task name:
        # how long a request next in line would idle in a pool process if handed over.
        self.hold_by_path: dict[str, float] = {}
        self.hold_by_task: dict[str, float] = {}
        self.guard_jobs: queue.SimpleQueue | None = None


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s: %(levelname)s/zklock-agent] %(message)s")
    path = sys.argv[1]
    settings = from_wire(json.loads(sys.stdin.readline()))
    agent = Agent(settings, path)

    def on_state(state: str) -> None:
        if state == KazooState.LOST and not agent.stopped.is_set():
            logger.warning("zklock agent: ZooKeeper session lost; locks held through it are lost")

    agent.client.add_listener(on_state)
    agent.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
