"""The ZooKeeper container, in pytest-celery's vendor layout (a ``CeleryTestContainer``)."""
from __future__ import annotations

from kazoo.client import KazooClient
from pytest_celery.api.container import CeleryTestContainer
from pytest_docker_tools.exceptions import ContainerFailed

from celery_zklock.contrib.pytest_celery import defaults


class ZooKeeperContainer(CeleryTestContainer):
    """One ZooKeeper server. ``hosts`` is its address inside the setup's Docker network (for
    worker containers); ``host_hosts`` is the address the test process itself uses."""

    @property
    def client(self) -> KazooClient:
        """A new, unstarted kazoo client on the host side; the caller starts and stops it."""
        return KazooClient(hosts=self.host_hosts)

    @property
    def celeryconfig(self) -> dict:
        return {"zklock_hosts": self.hosts, "host_zklock_hosts": self.host_hosts, "hostname": self.hostname}

    @property
    def hostname(self) -> str:
        return self.attrs["Config"]["Hostname"]

    @property
    def hosts(self) -> str:
        return f"{self.hostname}:2181"

    @property
    def host_hosts(self) -> str:
        ip, port = self.get_addr(defaults.ZOOKEEPER_CLIENT_PORT)
        return f"{ip if ip not in ('', '0.0.0.0') else '127.0.0.1'}:{port}"

    @property
    def ready_prompt(self) -> str | None:
        return defaults.ZOOKEEPER_READY_PROMPT

    @classmethod
    def version(cls) -> str:
        return cls.image().split(":")[-1]

    @classmethod
    def image(cls) -> str:
        return defaults.ZOOKEEPER_IMAGE

    @classmethod
    def ports(cls) -> dict:
        return dict(defaults.ZOOKEEPER_PORTS)

    @classmethod
    def initial_env(cls) -> dict:
        return dict(defaults.ZOOKEEPER_ENV)


class ZooKeeperMemberContainer(ZooKeeperContainer):
    """A server of an ensemble: ready once running.  It opens its client port only once a
    quorum has formed, and the members start one after another: waiting for the port here
    would keep the next member from starting (and the election backs off meanwhile)."""

    @property
    def ready_prompt(self) -> None:
        return None

    def ready(self) -> bool:
        self._container.reload()
        if self.status == "exited":
            raise ContainerFailed(self, f"ZooKeeper member {self.name} exited:\n{self.logs()[-2000:]}")
        networks = self._container.attrs["NetworkSettings"]["Networks"]
        return self.status == "running" and all(n["IPAddress"] for n in networks.values())
