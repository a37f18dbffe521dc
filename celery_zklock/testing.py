"""Real ZooKeeper servers for tests, and the opt-in pytest plugin that offers them.

Why this exists: a lock library cannot be tested against a fake coordinator — the
behaviours that matter (session expiry, leader loss, ghost nodes, watch delivery) only
happen in the real server.  The servers live in :mod:`celery_zklock.testing_servers`
(standalone and 3-node ensemble, started from the local installation), TLS material in
:mod:`celery_zklock.testing_tls`, port and ``ruok`` probes in
:mod:`celery_zklock.testing_probes`; all are importable from here, as before.

This module is an opt-in pytest plugin offering the fixtures ``zk_server`` (session scoped
standalone server), ``zk_ensemble`` (fresh 3-node ensemble) and ``zk_client`` (a started
``KazooClient`` on ``zk_server``), so users of celery-zklock can test their own locked
tasks against the real thing.  Enable it in the top-level ``conftest.py``::

    pytest_plugins = ["celery_zklock.testing"]

It is not registered as a ``pytest11`` entry point (kazoo ships ``kazoo.testing`` the same
way): installing the library must not add fixtures to every pytest run of every project.
Imports only the standard library, pytest when present and kazoo (in ``zk_client``) --
never redis or other test-only packages.

Test servers run with a short ``tickTime`` (200 ms by default) so the negotiated session
timeout may be as low as 0.4 s: fault tests expire sessions in about a second.
"""

from __future__ import annotations

from typing import Iterator

from .testing_probes import four_letter_word, free_port, is_reachable
from .testing_servers import ZooKeeperEnsemble, ZooKeeperNotInstalled, ZooKeeperServer, zookeeper_classpath
from .testing_tls import TlsMaterial

__all__ = [
    "TlsMaterial",
    "ZooKeeperNotInstalled",
    "ZooKeeperServer",
    "ZooKeeperEnsemble",
    "zookeeper_classpath",
    "free_port",
    "four_letter_word",
    "is_reachable",
]


# ---------------------------------------------------------------------------------------
# pytest plugin
# ---------------------------------------------------------------------------------------
try:
    import pytest
except ImportError:  # pragma: no cover - the plugin is optional at run time
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def zk_server() -> Iterator[ZooKeeperServer]:
        """A standalone ZooKeeper for the whole test session (tickTime 200 ms)."""
        try:
            server = ZooKeeperServer().start()
        except ZooKeeperNotInstalled as exc:
            pytest.fail(str(exc), pytrace=False)
        yield server
        server.close()

    @pytest.fixture
    def zk_ensemble() -> Iterator[ZooKeeperEnsemble]:
        """A fresh 3-node ensemble; members may be stopped, restarted and paused."""
        try:
            ens = ZooKeeperEnsemble().start()
        except ZooKeeperNotInstalled as exc:
            pytest.fail(str(exc), pytrace=False)
        yield ens
        ens.close()

    @pytest.fixture
    def zk_client(zk_server: ZooKeeperServer):
        """A started ``KazooClient`` connected to ``zk_server``; stopped after the test."""
        from kazoo.client import KazooClient

        client = KazooClient(hosts=zk_server.hosts, timeout=4.0)
        client.start(timeout=15)
        yield client
        client.stop()
        client.close()
