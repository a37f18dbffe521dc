"""`celery zklock` sub-command (entry point celery.commands) against a real ZooKeeper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from celery_zklock import FairLock
from celery_zklock.keys import key_path
from support.workers import ROOT


def run_cli(zk_server, root, *args):
    env = {**os.environ, "PYTHONPATH": ROOT, "TEST_ZK_HOSTS": zk_server.hosts, "TEST_ZK_ROOT": root}
    return subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.locked", "zklock", *args],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_status_shows_holder_and_waiter(zk_server, zk_client):
    root = f"/cli-{uuid.uuid4().hex[:6]}"
    path = key_path(root, "sku/7")
    holder = FairLock(zk_client, path, identifier='{"task":"buy","pid":1}')
    holder.acquire()
    try:
        out = run_cli(zk_server, root, "status", "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert list(report) == [path]
        assert report[path][0]["holder"] is True and json.loads(report[path][0]["owner"])["task"] == "buy"
        text = run_cli(zk_server, root, "status", "sku/7")
        assert "HOLDS" in text.stdout and path in text.stdout
    finally:
        holder.release()
    assert "no locks held" in run_cli(zk_server, root, "status").stdout


def test_path_prints_the_znode(zk_server):
    out = run_cli(zk_server, "/r", "path", "order:1/ü")
    assert out.stdout.strip() == "/r/order:1%2F%C3%BC"
