"""Shared fixtures.  ZooKeeper fixtures (zk_server, zk_ensemble, zk_client) come from the
celery_zklock.testing pytest plugin, opted into below exactly as a user of the library
does; Redis is a throwaway server on a free port (support.redis_server)."""

import pytest

# Opt-in (the package registers no pytest11 entry point).  pytest accepts
# ``pytest_plugins`` only in a top-level conftest: this file, not tests/faults/conftest.py.
pytest_plugins = ["celery_zklock.testing", "celery_zklock.contrib.pytest_celery"]


@pytest.fixture(scope="session")
def redis_server():
    # Imported here, not at the top: support.redis_server imports celery_zklock.testing, and
    # importing the plugin before pytest registers it above defeats its assert rewriting.
    from support.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    import redis

    r = redis.Redis(port=redis_server.port)
    r.flushall()
    yield r
    r.close()
