"""Fixtures of the worker's agent-level tests (tests/worker/local_agent.py)."""

import pytest

from celery_zklock.config import ZkSettings
from tests.worker.local_agent import start_agent


@pytest.fixture
def agent(zk_server, tmp_path):
    """A lock agent serving from this process on the test's ZooKeeper."""
    agent = start_agent(ZkSettings(hosts=zk_server.hosts), str(tmp_path / "agent.sock"))
    yield agent
    agent.stopped.set()
