"""Defaults of the pytest-celery ZooKeeper vendor: image tags, ports, environment.

The image tags are the ones ``images/`` builds (see the README); override the
``default_zookeeper_image`` / ``default_zklock_worker_image`` fixtures to use others, e.g. the
official ``zookeeper:3.9``, which reads the same ``ZOO_*`` variables.
"""
import os

CELERY_ZOOKEEPER = "celery_zookeeper"
DEFAULT_ZOOKEEPER = "default_zookeeper"
ZOOKEEPER_IMAGE = "celery-zklock/zookeeper:3.8"
ZOOKEEPER_CLIENT_PORT = "2181/tcp"
# Host side of every port on loopback only: a test ZooKeeper is nobody else's business.
ZOOKEEPER_PORTS = {ZOOKEEPER_CLIENT_PORT: ("127.0.0.1", None)}
# tickTime 200 ms: the server grants sessions of 0.4-4 s, so a worker-loss or pause test
# waits seconds, not the 4-40 s of the default 2 s tick.
ZOOKEEPER_ENV = {"ZOO_TICK_TIME": "200"}
ZOOKEEPER_CONTAINER_TIMEOUT = 60
ZOOKEEPER_READY_PROMPT = "zookeeper: serving"

WORKER_IMAGE = "celery-zklock/worker:latest"
# The worker's app module reads this: inside the setup's network ZooKeeper has another
# address than the one the test process uses.
ZKLOCK_HOSTS_ENV = "ZKLOCK_HOSTS"

IMAGES_DIR = os.path.join(os.path.dirname(__file__), "images")
