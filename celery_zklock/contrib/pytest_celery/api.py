"""The ZooKeeper node and ensemble of a pytest-celery setup, with the faults a lock test needs
(kill, pause, stop, restart) and a wait for the server to serve again."""
from __future__ import annotations

import time

from pytest_celery.api.base import CeleryTestCluster, CeleryTestNode

from celery_zklock.contrib.pytest_celery import defaults
from celery_zklock.testing import four_letter_word

SERVING_MODES = ("standalone", "leader", "follower")


class ZooKeeperTestNode(CeleryTestNode):
    """A ZooKeeper server in the setup. Workers reach it at ``hosts``; the test process at
    ``host_hosts`` (re-read after a restart: Docker may publish another host port)."""

    @property
    def hosts(self) -> str:
        return self.container.hosts

    @property
    def host_hosts(self) -> str:
        self.container.reload()
        return self.container.host_hosts

    def worker_env(self) -> dict:
        """Environment that points a worker container's ``zklock_hosts`` at this server."""
        return {defaults.ZKLOCK_HOSTS_ENV: self.hosts}

    @property
    def _docker(self):
        # pytest-docker-tools' wrapper has no pause/stop/start: the docker SDK container has.
        return self.container._container

    def mode(self) -> str | None:
        """``standalone``, ``leader`` or ``follower`` while serving, else None."""
        try:
            host, port = self.host_hosts.rsplit(":", 1)
            reply = four_letter_word(host, int(port), "srvr")
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return None
        for line in reply.splitlines():
            if line.startswith("Mode: "):
                mode = line.split(": ", 1)[1].strip()
                return mode if mode in SERVING_MODES else None
        return None

    def wait_serving(self, timeout: float = 60.0) -> str:
        """Block until the server serves clients again; return its mode."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mode = self.mode()
            if mode:
                return mode
            time.sleep(0.2)
        raise TimeoutError(f"ZooKeeper {self.name()} did not serve within {timeout:.0f}s:\n{self.logs()[-2000:]}")

    def pause(self) -> None:
        """Freeze the server (SIGSTOP to its processes): sockets stay open, nothing answers,
        which is what a hung or partitioned server looks like to a client."""
        self._docker.pause()
        self.container.reload()

    def unpause(self) -> None:
        self._docker.unpause()
        self.container.reload()

    def stop(self, timeout: int = 10) -> None:
        self._docker.stop(timeout=timeout)
        self.container.reload()

    def start(self, wait: bool = True) -> None:
        self._docker.start()
        self.container.reload()
        if wait:
            self.wait_serving()

    def restart(self, reload_container: bool = True, force: bool = False, wait: bool = True) -> None:
        super().restart(reload_container=reload_container, force=force)
        if wait:
            self.wait_serving()


class ZooKeeperCluster(CeleryTestCluster):
    """Several ZooKeeper servers of one ensemble: ``hosts`` is the connect string workers use."""

    def _set_nodes(self, *nodes, node_cls=ZooKeeperTestNode):
        return super()._set_nodes(*nodes, node_cls=node_cls)

    @property
    def hosts(self) -> str:
        return ",".join(node.hosts for node in self)

    @property
    def host_hosts(self) -> str:
        return ",".join(node.host_hosts for node in self)

    def worker_env(self) -> dict:
        return {defaults.ZKLOCK_HOSTS_ENV: self.hosts}

    def leader(self) -> ZooKeeperTestNode | None:
        return next((node for node in self if node.mode() == "leader"), None)

    def wait_serving(self, timeout: float = 90.0) -> None:
        for node in self:
            node.wait_serving(timeout)
