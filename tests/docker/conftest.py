"""Container tests through pytest-celery, with celery_zklock.contrib.pytest_celery as a user
loads it (tests/conftest.py): a ZooKeeper container, Redis broker and backend containers
and two worker containers on one Docker network.

The images come from scripts/docker-setup.sh: ``make test`` runs it first; run by hand, this
folder runs it itself before its first test.  Without them, or without a Docker engine,
every test here is skipped with one line saying why.
"""
from __future__ import annotations

import atexit
import functools
import os
import subprocess
import sys

import pytest
import pytest_docker_tools.wrappers.container as _ptd_container
from celery import Celery
from pytest_celery import (
    CeleryBackendCluster,
    CeleryBrokerCluster,
    CeleryTestSetup,
    CeleryTestWorker,
    CeleryWorkerCluster,
    RedisTestBackend,
    RedisTestBroker,
)
from pytest_celery.vendors.worker.defaults import DEFAULT_WORKER_CONTAINER_TIMEOUT, DEFAULT_WORKER_VOLUME
from pytest_docker_tools import container, fxtr

from celery_zklock.contrib.pytest_celery import ZkLockWorkerContainer, defaults

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETUP_SCRIPT = os.path.join(ROOT, "scripts", "docker-setup.sh")
STATE_DIR = os.path.join(ROOT, "build", "docker")  # the script's pid file and "unavailable" line
REDIS_IMAGE = "celery-zklock/redis:7"
EXAMPLES_IMAGE = "celery-zklock-examples:local"


def bring_images_up_to_date() -> None:
    """Run scripts/docker-setup.sh unless ``make test`` just did (ZKLOCK_DOCKER_READY=1).

    Why: the worker image installs the library as it was when the image was built, so a
    hand-run of this folder after a change would test the old code.  The script rebuilds
    only what changed (about 2 s when nothing did).  An engine it had to start is stopped
    when the tests end, as ``make test`` does."""
    if os.environ.get("ZKLOCK_DOCKER_READY") == "1":
        return
    pidfile = os.path.join(STATE_DIR, "dockerd.pid")
    engine_started_before = os.path.exists(pidfile)
    subprocess.run(["bash", SETUP_SCRIPT], env={**os.environ, "PY": sys.executable}, stdout=2, check=False)
    if not engine_started_before and os.path.exists(pidfile):
        atexit.register(subprocess.run, ["bash", SETUP_SCRIPT, "stop"], check=False)


def docker_problem() -> str | None:
    """Why the docker tests cannot run here, or None."""
    marker = os.path.join(STATE_DIR, "unavailable")
    if os.path.exists(marker):
        with open(marker) as f:
            return f.read().strip()
    try:
        subprocess.run(["docker", "info"], check=True, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return "docker tests skipped: no Docker engine answers (`make test` runs scripts/docker-setup.sh, which starts one)"
    for image in (defaults.ZOOKEEPER_IMAGE, defaults.WORKER_IMAGE, REDIS_IMAGE, EXAMPLES_IMAGE):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode:
            return f"docker tests skipped: image {image} is missing (run scripts/docker-setup.sh)"
    return None


@functools.cache
def docker_problem_after_setup() -> str | None:
    bring_images_up_to_date()
    return docker_problem()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Set-up and check before this folder's first test, not at import: a run that selects
    none of them (``pytest -k other``) pays nothing, and ``pytest tests/docker`` on a machine
    without Docker skips instead of failing to load this conftest.  A skip raised here is
    reported at this line, so ``-ra`` folds all of them into one line."""
    problem = docker_problem_after_setup()
    if problem:
        pytest.skip(problem)


# pytest-docker-tools takes a /.dockerenv for "the tests run in a container" and then hands
# out container IPs with container ports, which pytest-celery's Redis turns into
# localhost:6379: the machine's own Redis.  This sandbox has a /.dockerenv, but the engine
# runs in the tests' own network namespace, so the published loopback ports are the right
# addresses.
_ptd_container.tests_inside_container = lambda: False

# Sessions of 4 s (the test ZooKeeper's tickTime is 200 ms): a dead worker's lock is freed,
# and a paused server costs the lock, within seconds.
SESSION_TIMEOUT = 4.0


class LockedSetup(CeleryTestSetup):
    @classmethod
    def update_app_config(cls, app: Celery) -> None:
        app.conf.zklock_session_timeout = SESSION_TIMEOUT
        app.conf.worker_prefetch_multiplier = 1


@pytest.fixture
def celery_setup_cls() -> type[CeleryTestSetup]:
    return LockedSetup


# Redis from the image scripts/docker-setup.sh builds (no registry here), on loopback.
@pytest.fixture
def default_redis_broker_image() -> str:
    return REDIS_IMAGE


@pytest.fixture
def default_redis_backend_image() -> str:
    return REDIS_IMAGE


@pytest.fixture
def default_redis_broker_ports() -> dict:
    return {"6379/tcp": ("127.0.0.1", None)}


@pytest.fixture
def default_redis_backend_ports() -> dict:
    return {"6379/tcp": ("127.0.0.1", None)}


# Only Redis: pytest-celery would also parametrize over RabbitMQ.
@pytest.fixture
def celery_broker_cluster(celery_redis_broker: RedisTestBroker) -> CeleryBrokerCluster:
    cluster = CeleryBrokerCluster(celery_redis_broker)
    yield cluster
    cluster.teardown()


@pytest.fixture
def celery_backend_cluster(celery_redis_backend: RedisTestBackend) -> CeleryBackendCluster:
    cluster = CeleryBackendCluster(celery_redis_backend)
    yield cluster
    cluster.teardown()


@pytest.fixture
def default_worker_tasks(default_worker_tasks: set) -> set:
    from tests.docker import tasks

    return {*default_worker_tasks, tasks}


@pytest.fixture
def default_worker_command(default_worker_container_cls: type[ZkLockWorkerContainer]) -> list[str]:
    return default_worker_container_cls.command("-c", "2", "-E")


# A second worker container: same image, app and tasks, its own hostname.
second_worker_container = container(
    image="{default_zklock_worker_image}",
    environment=fxtr("default_worker_env"),
    network="{default_pytest_celery_network.name}",
    volumes={"{default_worker_volume.name}": DEFAULT_WORKER_VOLUME},
    wrapper_class=ZkLockWorkerContainer,
    timeout=DEFAULT_WORKER_CONTAINER_TIMEOUT,
    command=fxtr("default_worker_command"),
)


@pytest.fixture
def second_worker(second_worker_container: ZkLockWorkerContainer, default_worker_app: Celery) -> CeleryTestWorker:
    worker = CeleryTestWorker(second_worker_container, app=default_worker_app)
    yield worker
    worker.teardown()


@pytest.fixture
def celery_worker_cluster(celery_worker: CeleryTestWorker, second_worker: CeleryTestWorker) -> CeleryWorkerCluster:
    cluster = CeleryWorkerCluster(celery_worker, second_worker)
    yield cluster
    cluster.teardown()
