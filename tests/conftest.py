"""Shared fixtures.  ZooKeeper fixtures (zk_server, zk_ensemble, zk_client) come from the
celery_zklock.testing pytest plugin; Redis is a throwaway server on a free port."""

import pytest

from celery_zklock.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    import redis

    r = redis.Redis(port=redis_server.port)
    r.flushall()
    yield r
    r.close()
