"""celery-zklock for pytest-celery: a ZooKeeper node beside the broker and backend, and
worker containers with celery-zklock pointed at it.

Load it in your ``conftest.py``::

    pytest_plugins = ("celery_zklock.contrib.pytest_celery",)

Images: ``python -m celery_zklock.contrib.pytest_celery.images`` builds the defaults from the
Dockerfiles shipped here (see the README, "Testing your own locked tasks with pytest-celery").
"""
try:
    import pytest_celery  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "celery_zklock.contrib.pytest_celery needs pytest-celery: pip install 'celery-zklock[pytest-celery]'"
    ) from exc

from celery_zklock.contrib.pytest_celery.api import ZooKeeperCluster, ZooKeeperTestNode
from celery_zklock.contrib.pytest_celery.container import ZooKeeperContainer, ZooKeeperMemberContainer
from celery_zklock.contrib.pytest_celery.fixtures import *  # noqa: F401,F403  (the plugin's fixtures)
from celery_zklock.contrib.pytest_celery.worker import ZkLockWorkerContainer

__all__ = [
    "ZooKeeperCluster",
    "ZooKeeperContainer",
    "ZooKeeperMemberContainer",
    "ZooKeeperTestNode",
    "ZkLockWorkerContainer",
]
