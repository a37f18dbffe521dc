"""ZooKeeper and Redis for ``make demo`` and the examples: reuse reachable ones, or start
local throwaway ones on free loopback ports.

:class:`Services` uses the ZooKeeper and Redis configured by ``ZKLOCK_HOSTS`` /
``REDIS_URL`` when they are reachable (then under a unique znode root, a unique Redis key
prefix and a separate Redis DB), and otherwise starts local ones
(:class:`celery_zklock.testing.ZooKeeperServer`, :class:`support.redis_server.RedisServer`)
in a session of their own: the terminal's Ctrl-C must not kill them before the workers
that use them have shut down (a worker whose broker vanished hangs in its warm shutdown);
:meth:`Services.close` stops them last.  ``close()`` also removes what the run wrote on
shared servers.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import redis

from support.console import say

__all__ = ["DEFAULT_REDIS_URL", "DEFAULT_ZK_HOSTS", "Endpoints", "Services", "redis_reachable", "with_db", "url_db"]

#: Where the servers are looked for when neither the arguments nor the environment say
#: (the same defaults as the example apps, ``examples/common.py``).
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_ZK_HOSTS = "127.0.0.1:2181"


def redis_reachable(url: str, timeout: float = 1.0) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.exceptions.RedisError, OSError, ValueError):
        return False


def with_db(url: str, db: int) -> str:
    """``url`` with its database number replaced by ``db``."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def url_db(url: str) -> int:
    path = urlsplit(url).path.strip("/")
    return int(path) if path.isdigit() else 0


@dataclass
class Endpoints:
    """Where the examples' apps connect (exported to workers as environment variables)."""

    redis_url: str
    zk_hosts: str
    zk_root: str
    prefix: str
    notes: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        return {
            "REDIS_URL": self.redis_url,
            "ZKLOCK_HOSTS": self.zk_hosts,
            "ZKLOCK_ROOT": self.zk_root,
            "ZKLOCK_DEMO_PREFIX": self.prefix,
        }


class Services:
    """Reuse reachable ZooKeeper/Redis, or start local ones; always namespace our data."""

    def __init__(self, zk_hosts: str | None = None, redis_url: str | None = None, tick_ms: int = 2000,
                 run_id: str | None = None) -> None:
        self.zk_hosts = zk_hosts or os.environ.get("ZKLOCK_HOSTS") or DEFAULT_ZK_HOSTS
        self.redis_url = redis_url or os.environ.get("REDIS_URL") or DEFAULT_REDIS_URL
        self.tick_ms = tick_ms
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.zk_server = None
        self.redis_server = None
        self.endpoints: Endpoints | None = None
        self._shared_zk = False
        self._shared_redis = False

    def start(self) -> Endpoints:
        from celery_zklock.testing import ZooKeeperServer, is_reachable

        notes = []
        if is_reachable(self.zk_hosts):
            self._shared_zk = True
            zk_hosts = self.zk_hosts
            notes.append(f"ZooKeeper: using the one at {zk_hosts}")
        else:
            say(f"no ZooKeeper answers at {self.zk_hosts}: starting a local one (tickTime {self.tick_ms} ms)")
            self.zk_server = ZooKeeperServer(tick_ms=self.tick_ms)  # assigned first: close() stops a half-started one
            self.zk_server.start(timeout=60, new_session=True)
            zk_hosts = self.zk_server.hosts
            notes.append(f"ZooKeeper: started locally on {zk_hosts} (pid {self.zk_server.proc.pid})")
        zk_root = f"/celery-zklock-demo-{self.run_id}"

        if redis_reachable(self.redis_url):
            self._shared_redis = True
            db = int(os.environ.get("ZKLOCK_DEMO_REDIS_DB", "15" if url_db(self.redis_url) != 15 else "14"))
            url = with_db(self.redis_url, db)
            if not redis_reachable(url):  # e.g. 'databases 1' on that server
                url, db = self.redis_url, url_db(self.redis_url)
            redis_url = url
            notes.append(f"Redis: using the one at {self.redis_url} (DB {db}, keys under the demo prefix)")
        else:
            from support.redis_server import RedisServer

            say(f"no Redis answers at {self.redis_url}: starting a local one")
            self.redis_server = RedisServer()
            self.redis_server.start(new_session=True)
            redis_url = self.redis_server.url
            notes.append(f"Redis: started locally on 127.0.0.1:{self.redis_server.port} (pid {self.redis_server.proc.pid})")
        self.endpoints = Endpoints(redis_url, zk_hosts, zk_root, f"zklock-demo:{self.run_id}:", notes)
        return self.endpoints

    def close(self) -> None:
        ep = self.endpoints
        if ep is not None and self._shared_redis:
            try:  # our keys only: everything under the run's prefix
                client = redis.Redis.from_url(ep.redis_url, socket_timeout=5)
                keys = list(client.scan_iter(match=ep.prefix + "*", count=1000))
                for i in range(0, len(keys), 500):
                    client.delete(*keys[i:i + 500])
                client.close()
            except (redis.exceptions.RedisError, OSError):
                pass
        if ep is not None and self._shared_zk:
            try:
                from kazoo.client import KazooClient

                zk = KazooClient(hosts=ep.zk_hosts, timeout=10)
                zk.start(timeout=10)
                zk.delete(ep.zk_root, recursive=True)
                zk.stop()
                zk.close()
            except Exception:
                pass
        if self.redis_server is not None:
            self.redis_server.close()
            self.redis_server = None
        if self.zk_server is not None:
            self.zk_server.close()
            self.zk_server = None

    def __enter__(self) -> Endpoints:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
