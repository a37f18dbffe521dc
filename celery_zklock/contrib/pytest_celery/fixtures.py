"""Fixtures: a ZooKeeper node (or a 3-server ensemble) in the setup's network, and
pytest-celery's default worker replaced by one with celery-zklock pointed at it.

Every fixture follows pytest-celery's naming, so a test project overrides any of them the
way it overrides the built-in vendors' (``default_zookeeper_image``, ``default_worker_container_cls``...).
"""
# pytest fixtures take other fixtures as same-named arguments.
# ruff: noqa: F811
from __future__ import annotations

import uuid
from typing import Iterator

import pytest
from pytest_celery.vendors.worker.defaults import DEFAULT_WORKER_CONTAINER_TIMEOUT, DEFAULT_WORKER_VOLUME
from pytest_docker_tools import container, fxtr

from celery_zklock.contrib.pytest_celery import defaults
from celery_zklock.contrib.pytest_celery.api import ZooKeeperCluster, ZooKeeperTestNode
from celery_zklock.contrib.pytest_celery.container import ZooKeeperContainer, ZooKeeperMemberContainer
from celery_zklock.contrib.pytest_celery.worker import ZOOKEEPER_CONFIG, ZkLockWorkerContainer

ENSEMBLE_SIZE = 3

# --- the ZooKeeper node -------------------------------------------------------------------


@pytest.fixture
def celery_zookeeper(default_zookeeper: ZooKeeperContainer) -> Iterator[ZooKeeperTestNode]:
    """The ZooKeeper the setup's workers lock on (override to return ``celery_zookeeper_ensemble``)."""
    node = ZooKeeperTestNode(default_zookeeper)
    yield node
    node.teardown()


@pytest.fixture
def default_zookeeper_cls() -> type[ZooKeeperContainer]:
    return ZooKeeperContainer


default_zookeeper = container(
    image="{default_zookeeper_image}",
    ports=fxtr("default_zookeeper_ports"),
    environment=fxtr("default_zookeeper_env"),
    network="{default_pytest_celery_network.name}",
    wrapper_class=ZooKeeperContainer,
    timeout=defaults.ZOOKEEPER_CONTAINER_TIMEOUT,
)


@pytest.fixture
def default_zookeeper_image(default_zookeeper_cls: type[ZooKeeperContainer]) -> str:
    return default_zookeeper_cls.image()


@pytest.fixture
def default_zookeeper_env(default_zookeeper_cls: type[ZooKeeperContainer]) -> dict:
    return default_zookeeper_cls.initial_env()


@pytest.fixture
def default_zookeeper_ports(default_zookeeper_cls: type[ZooKeeperContainer]) -> dict:
    return default_zookeeper_cls.ports()


# --- a 3-server ensemble ------------------------------------------------------------------


@pytest.fixture
def zookeeper_ensemble_id() -> str:
    """Prefix of the members' container names: unique, since names are global to the engine."""
    return f"zklock-{uuid.uuid4().hex[:10]}"


def _ensemble_env(myid: int):
    @pytest.fixture
    def env(zookeeper_ensemble_id: str, default_zookeeper_env: dict) -> dict:
        servers = " ".join(
            f"server.{n}={zookeeper_ensemble_id}-zk{n}:2888:3888;2181" for n in range(1, ENSEMBLE_SIZE + 1)
        )
        return {**default_zookeeper_env, "ZOO_MY_ID": str(myid), "ZOO_SERVERS": servers,
                "ZOO_STANDALONE_ENABLED": "false"}

    return env


def _ensemble_member(myid: int):
    # Ready as soon as it runs: a member serves only once a quorum is up, and members start
    # one after another.  The ensemble fixture waits for all of them to serve.
    return container(
        name=f"{{zookeeper_ensemble_id}}-zk{myid}",
        image="{default_zookeeper_image}",
        ports=fxtr("default_zookeeper_ports"),
        environment=fxtr(f"zookeeper_ensemble_env_{myid}"),
        network="{default_pytest_celery_network.name}",
        wrapper_class=ZooKeeperMemberContainer,
        timeout=defaults.ZOOKEEPER_CONTAINER_TIMEOUT,
    )


zookeeper_ensemble_env_1 = _ensemble_env(1)
zookeeper_ensemble_env_2 = _ensemble_env(2)
zookeeper_ensemble_env_3 = _ensemble_env(3)
zookeeper_ensemble_member_1 = _ensemble_member(1)
zookeeper_ensemble_member_2 = _ensemble_member(2)
zookeeper_ensemble_member_3 = _ensemble_member(3)


@pytest.fixture
def celery_zookeeper_ensemble(
    zookeeper_ensemble_member_1: ZooKeeperMemberContainer,
    zookeeper_ensemble_member_2: ZooKeeperMemberContainer,
    zookeeper_ensemble_member_3: ZooKeeperMemberContainer,
) -> Iterator[ZooKeeperCluster]:
    """Three servers in one quorum, serving. To lock on it, override ``celery_zookeeper`` to
    return this fixture."""
    cluster = ZooKeeperCluster(zookeeper_ensemble_member_1, zookeeper_ensemble_member_2, zookeeper_ensemble_member_3)
    cluster.wait_serving()
    yield cluster
    cluster.teardown()


# --- wiring the setup to it ----------------------------------------------------------------


@pytest.fixture
def celery_worker_cluster_config(
    celery_broker_cluster_config: dict,
    celery_backend_cluster_config: dict,
    celery_zookeeper: ZooKeeperTestNode | ZooKeeperCluster,
) -> dict:
    """pytest-celery's, plus the ZooKeeper the worker containers connect to."""
    return {
        "celery_broker_cluster_config": celery_broker_cluster_config,
        "celery_backend_cluster_config": celery_backend_cluster_config,
        ZOOKEEPER_CONFIG: {"zklock_hosts": celery_zookeeper.hosts},
    }


@pytest.fixture
def celery_setup_config(celery_setup_cls, celery_worker_cluster_config: dict,
                        celery_zookeeper: ZooKeeperTestNode | ZooKeeperCluster) -> dict:
    """pytest-celery's, plus ``zklock_hosts`` as the test process reaches ZooKeeper, so that
    ``celery_setup.app`` can inspect locks (``celery zklock status``) and call tasks directly."""
    config = celery_setup_cls.config(celery_worker_cluster_config=celery_worker_cluster_config)
    config["zklock_hosts"] = celery_zookeeper.host_hosts
    return config


# --- the worker ----------------------------------------------------------------------------


@pytest.fixture
def default_worker_container_cls() -> type[ZkLockWorkerContainer]:
    return ZkLockWorkerContainer


@pytest.fixture(scope="session")
def default_worker_container_session_cls() -> type[ZkLockWorkerContainer]:
    return ZkLockWorkerContainer


@pytest.fixture
def default_zklock_worker_image(default_worker_container_cls: type[ZkLockWorkerContainer]) -> str:
    return default_worker_container_cls.image()


default_worker_container = container(
    image="{default_zklock_worker_image}",
    ports=fxtr("default_worker_ports"),
    environment=fxtr("default_worker_env"),
    network="{default_pytest_celery_network.name}",
    volumes={"{default_worker_volume.name}": DEFAULT_WORKER_VOLUME},
    wrapper_class=ZkLockWorkerContainer,
    timeout=DEFAULT_WORKER_CONTAINER_TIMEOUT,
    command=fxtr("default_worker_command"),
)
