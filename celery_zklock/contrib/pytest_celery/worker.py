"""The worker container: pytest-celery's built-in worker, on an image with celery-zklock,
pointed at the setup's ZooKeeper."""
from __future__ import annotations

from types import ModuleType

from pytest_celery.vendors.worker.container import CeleryWorkerContainer

from celery_zklock.contrib.pytest_celery import defaults

ZOOKEEPER_CONFIG = "celery_zookeeper_config"  # key of celery_worker_cluster_config


class ZkLockWorkerContainer(CeleryWorkerContainer):
    """Subclass it to change the image, the command (``-c``, ``-P``) or the app template."""

    @classmethod
    def image(cls) -> str:
        return defaults.WORKER_IMAGE

    @classmethod
    def app_module(cls) -> ModuleType:
        from celery_zklock.contrib.pytest_celery import worker_app

        return worker_app

    @classmethod
    def initial_env(cls, celery_worker_cluster_config: dict, initial: dict | None = None) -> dict:
        env = super().initial_env(celery_worker_cluster_config, initial)
        zookeeper = celery_worker_cluster_config.get(ZOOKEEPER_CONFIG)
        if zookeeper:
            env[defaults.ZKLOCK_HOSTS_ENV] = zookeeper["zklock_hosts"]
        return env
