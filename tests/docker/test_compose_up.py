"""docker-compose.yml run for real, with the locally built images (docker-compose.local.yml):
a 3-server ZooKeeper ensemble, Redis, two workers, beat and Flower; the flash sale's own
checks, and our task-lock-* events as Flower counts them."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import time
import urllib.request
import uuid

import pytest

from tests.compose_command import compose_cli
from tests.polling import wait_until

pytestmark = pytest.mark.docker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ["-f", os.path.join(ROOT, "docker-compose.yml"), "-f", os.path.join(ROOT, "docker-compose.local.yml")]
PORTS = ("ZK1_PORT", "ZK2_PORT", "ZK3_PORT", "REDIS_PORT", "FLOWER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def compose():
    """``docker compose -p <unique> ...`` with free host ports; ``down`` at the end."""
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker compose plugin or docker-compose")
    # Without COLUMNS (pytest-xdist sets 80 in its workers): `ps` then draws its table
    # unwrapped, one line per container, as it does whenever its output is piped.
    env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
           **{name: str(free_port()) for name in PORTS}}
    project = f"zklock{uuid.uuid4().hex[:8]}"

    def run(*args, timeout=300, check=True):
        done = subprocess.run([*cli, "-p", project, *FILES, *args], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=timeout)
        if check and done.returncode:
            logs = subprocess.run([*cli, "-p", project, *FILES, "logs", "--tail", "40"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120).stdout
            raise AssertionError(f"compose {' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n"
                                 f"{done.stderr[-3000:]}\n--- logs ---\n{logs[-6000:]}")
        return done

    run.env = env
    try:
        yield run
    finally:
        run("down", "--volumes", "--remove-orphans", "--timeout", "10", check=False, timeout=300)


def flower_metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def test_compose_cluster_runs_the_flash_sale(compose):
    started = time.monotonic()
    compose("up", "-d")
    up = time.monotonic() - started
    sale = compose("run", "--rm", "sale", timeout=600)
    print(f"compose: up -d {up:.0f}s; the sale:\n{sale.stdout[-2500:]}")
    assert re.search(r"orders accepted == initial stock", sale.stdout), sale.stdout
    ps = compose("ps").stdout
    for service in ("zk1", "zk2", "zk3", "redis", "worker1", "worker2", "beat", "flower"):
        assert re.search(rf"_{service}_1\s.*\bUp\b", ps), ps
    # Flower received our events: its Prometheus counter has a series per event type.
    port = int(compose.env["FLOWER_PORT"])

    def released_counted() -> str:
        metrics = flower_metrics(port)
        return metrics if 'type="task-lock-released"' in metrics else ""

    metrics = wait_until(released_counted, 60, interval=1, what="Flower to count task-lock-released events")
    counts, workers = {}, set()
    for m in re.finditer(r'flower_events_total\{([^}]*)\} ([0-9.e+]+)', metrics):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("task") == "examples.flash_sale.app.buy" and labels["type"].startswith("task-lock-"):
            counts[labels["type"]] = counts.get(labels["type"], 0) + float(m.group(2))
            workers.add(labels["worker"])
    print(f"Flower's task-lock-* event counts for buy, from {sorted(workers)}: {counts}")
    assert len(workers) == 2
    assert counts.get("task-lock-acquired", 0) >= 1200 and counts.get("task-lock-released", 0) >= 1200, counts
