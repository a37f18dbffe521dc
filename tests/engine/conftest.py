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


@pytest.fixture(scope="session")
def curator_classpath(tmp_path_factory):
    """CuratorHolder compiled once per session (skips without a JDK or Curator's jars)."""
    from tests.curator import compile_holder

    return compile_holder(str(tmp_path_factory.mktemp("curator-classes")))


@pytest.fixture
def curators(curator_classpath, zk_server):
    """Starts Curator JVMs on the test's ZooKeeper: ``curators(path, lock="mutex"|"rw")``;
    all told to quit at the test's end (their ephemeral nodes go with their sessions)."""
    from tests.curator import Curator

    started = []

    def start(path: str, lock: str = "mutex") -> Curator:
        started.append(Curator(curator_classpath, zk_server.hosts, path, lock))
        return started[-1]

    yield start
    for cur in started:
        cur.close()
