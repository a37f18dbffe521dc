"""Fixtures of the fault suite: one cluster (3-node ZooKeeper ensemble, broker Redis, store
Redis) shared by the whole package, and a fresh :class:`~tests.faults.harness.Scenario` per
test, after which the ensemble is healed — so no test depends on another's faults."""

from __future__ import annotations

import hashlib
import re

import pytest

from tests.faults.harness import Cluster, Scenario


@pytest.fixture(scope="package")
def cluster():
    c = Cluster().start()
    yield c
    c.close()


@pytest.fixture
def scenario(cluster, request):
    cluster.heal()
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.removeprefix("test_").lower()).strip("-")
    if len(name) > 24:  # parametrized runs must not share a name (their workers' queues)
        name = f"{name[:19]}-{hashlib.sha1(name.encode()).hexdigest()[:4]}"
    s = Scenario(cluster, name)
    yield s
    s.close()
    cluster.heal()
