"""Fixtures of the engine's tests against a real ZooKeeper."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient


@pytest.fixture
def clients(zk_server):
    """Started kazoo clients, one session each, as many as the test asks for (``clients()``);
    all stopped at its end."""
    made = []

    def new() -> KazooClient:
        c = KazooClient(hosts=zk_server.hosts)
        c.start(timeout=10)
        made.append(c)
        return c

    yield new
    for c in made:
        c.stop()
        c.close()
