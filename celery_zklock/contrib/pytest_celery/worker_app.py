"""Template of the worker container's ``app.py`` (pytest-celery rewrites the three marked
lines with the test's task imports, app name and configuration).

Why not only the configuration: the test process and the workers reach ZooKeeper at
different addresses, so the container's ``ZKLOCK_HOSTS`` wins over the copied setting.
"""
from __future__ import annotations

import json
import os

from celery import Celery

imports = None

app = Celery("celery_test_app")
config = None

if config:
    app.config_from_object(config)
    print(f"Changed worker configuration: {json.dumps(config, indent=4, default=repr)}")

if os.environ.get("ZKLOCK_HOSTS"):
    app.conf.zklock_hosts = os.environ["ZKLOCK_HOSTS"]

if __name__ == "__main__":
    app.start()
