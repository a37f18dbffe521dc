"""The pytest-celery vendor's pure parts, without Docker: the image build command, the
worker's environment wiring, the worker app template as pytest-celery fills it in, and the
Dockerfiles shipped in the wheel.  tests/docker/ runs the real containers."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from celery import Celery

from celery_zklock.contrib.pytest_celery import ZkLockWorkerContainer, defaults
from celery_zklock.contrib.pytest_celery.images import build_command
from celery_zklock.contrib.pytest_celery.worker import ZOOKEEPER_CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("name, base, network, packages, expected", [
    ("zookeeper", None, None, None, ["docker", "build", "-t", "T", "CTX"]),
    ("zookeeper", "deb:12", "host", "ignored", ["docker", "build", "-t", "T", "--build-arg", "BASE=deb:12",
                                                "--network", "host", "CTX"]),
    ("worker", None, None, "a b", ["docker", "build", "-t", "T", "--build-arg", "PACKAGES=a b", "CTX"]),
    ("worker", "deb:12", None, None, ["docker", "build", "-t", "T", "--build-arg", "BASE=deb:12", "CTX"]),
    ("redis", None, "host", None, ["docker", "build", "-t", "T", "--network", "host", "CTX"]),
])
def test_build_command(name, base, network, packages, expected):
    assert build_command(name, "CTX", "T", base, network, packages) == expected


CLUSTER = {
    "celery_broker_cluster_config": {"urls": ["redis://broker/0"]},
    "celery_backend_cluster_config": {"urls": ["redis://backend/0"]},
}


@pytest.mark.parametrize("zookeeper, hosts", [
    ({"zklock_hosts": "zk:2181"}, "zk:2181"),
    ({"zklock_hosts": "a:2181,b:2181,c:2181"}, "a:2181,b:2181,c:2181"),
    (None, None),
])
def test_worker_env_points_at_the_setups_zookeeper(zookeeper, hosts):
    config = dict(CLUSTER, **({ZOOKEEPER_CONFIG: zookeeper} if zookeeper else {}))
    env = ZkLockWorkerContainer.initial_env(config)
    assert env.get(defaults.ZKLOCK_HOSTS_ENV) == hosts
    assert env["CELERY_BROKER_URL"] == "redis://broker/0" and env["CELERY_RESULT_BACKEND"] == "redis://backend/0"


def test_worker_app_template_as_pytest_celery_fills_it(tmp_path):
    """pytest-celery rewrites three marker lines of the template; the result must import the
    tasks, apply the test's configuration, and let the container's ZKLOCK_HOSTS win."""
    from tests.docker import tasks

    app = Celery("zklock_test_app")
    app.conf.zklock_hosts = "127.0.0.1:32768"  # the test process's address
    app.conf.zklock_session_timeout = 4.0
    content = ZkLockWorkerContainer.initial_content(worker_tasks={tasks}, worker_app=app)
    source = content["app.py"].decode()
    assert "from tests.docker.tasks import *" in source and "imports = None" not in source
    for name, data in content.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    probe = ("import app; c = app.app.conf; "
             "print(c.zklock_hosts, c.zklock_session_timeout, 'tests.docker.tasks.hold' in app.app.tasks)")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", defaults.ZKLOCK_HOSTS_ENV: "zk-node:2181"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-3:] == ["zk-node:2181", "4.0", "True"]


def test_wheel_ships_the_dockerfiles(tmp_path):
    """A user builds the images from the installed package: the wheel must hold them."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                           str(tmp_path), ROOT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = tmp_path.glob("celery_zklock-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    base = "celery_zklock/contrib/pytest_celery/images/"
    for name in ("zookeeper/Dockerfile", "zookeeper/entrypoint.sh", "worker/Dockerfile", "worker/wheels/README",
                 "redis/Dockerfile"):
        assert base + name in names, name
    assert not any(n.startswith(("tests/", "support/", "examples/")) for n in names)
