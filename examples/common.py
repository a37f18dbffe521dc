"""What every example app shares: a Celery app configured from the environment, and a
Redis client for the example's own data under a key prefix.

Environment (the same names in ``make demo``, the tests and ``docker-compose.yml``):

* ``REDIS_URL`` (``redis://127.0.0.1:6379/0``): broker, result backend and example data;
* ``BROKER_URL`` (empty): another broker (``amqp://guest:guest@127.0.0.1:5672//`` for
  RabbitMQ); Redis stays the result backend and the data store;
* ``ZKLOCK_HOSTS`` (``127.0.0.1:2181``): the ZooKeeper connect string (``zklock_hosts``);
* ``ZKLOCK_ROOT`` (``/celery-zklock``): the znode under which lock keys live;
* ``ZKLOCK_DEMO_PREFIX`` (empty): a prefix for every Redis key (broker queues, results,
  example data), so that a demo run can share a Redis with other users.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_ZK_HOSTS = "127.0.0.1:2181"


def redis_url() -> str:
    return os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL


def key_prefix() -> str:
    return os.environ.get("ZKLOCK_DEMO_PREFIX", "")


def make_app(name: str) -> Celery:
    """A Celery app on Redis with the ``zklock_*`` settings taken from the environment.

    Each example gets its own default queue (``name``), so workers of one example never
    receive another's tasks even on a shared broker.
    """
    url = redis_url()
    app = Celery(name)
    app.conf.update(
        broker_url=os.environ.get("BROKER_URL") or url,
        result_backend=url,
        task_default_queue=name,
        zklock_hosts=os.environ.get("ZKLOCK_HOSTS") or DEFAULT_ZK_HOSTS,
        zklock_root=os.environ.get("ZKLOCK_ROOT") or "/celery-zklock",
        zklock_wait_in=os.environ.get("ZKLOCK_WAIT_IN") or "worker",
        zklock_handoff_slots=int(os.environ["ZKLOCK_HANDOFF_SLOTS"]) if os.environ.get("ZKLOCK_HANDOFF_SLOTS") else None,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=3600,
        worker_redirect_stdouts=False,
    )
    prefix = key_prefix()
    if prefix:
        # kombu prefixes queues, unacked/scheduled hashes and pub/sub channels; the Redis
        # result backend prefixes celery-task-meta-* keys.
        app.conf.broker_transport_options = {"global_keyprefix": prefix}
        app.conf.result_backend_transport_options = {"global_keyprefix": prefix}
    return app


class Store:
    """Lazily connected Redis client for an example's data keys (``prefix + name``).

    redis-py reconnects after ``fork`` (its pool checks the pid), so one module-level
    Store is safe in the prefork parent and its children.
    """

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._client: redis.Redis | None = None

    def key(self, *parts: object) -> str:
        return key_prefix() + ":".join([self.namespace, *map(str, parts)])

    @property
    def r(self) -> redis.Redis:
        if self._client is None:
            self._client = redis.Redis.from_url(redis_url(), socket_timeout=30, socket_connect_timeout=10)
        return self._client

    def reset(self) -> None:
        """Delete every data key of this namespace (not broker or result keys)."""
        pattern = self.key("*")
        keys = list(self.r.scan_iter(match=pattern, count=1000))
        for i in range(0, len(keys), 500):
            self.r.delete(*keys[i:i + 500])
