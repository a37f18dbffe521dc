"""What a worker says (issue 36 items 4 and 5), through real workers: one INFO line at start
(hosts, root, session timeout, waiting mode, the agent's pid), one at warm shutdown (the
waiting tasks returned to the broker), and a refusal to start in one line, no traceback, no
flood of kazoo retries — for a bad ``lock_key`` and for an unreachable ZooKeeper, in the
worker and in ``celery zklock`` commands."""

from __future__ import annotations

import importlib
import os
import re
import socket
import subprocess
import sys
import uuid

import pytest

from support.workers import ROOT, Worker
from tests.lockedapp import started
from tests.lockutil import worker_env
from tests.polling import wait_until


@pytest.fixture(scope="module")
def env(redis_server, zk_server):
    yield worker_env(redis_server, zk_server, "celery-zklock-says")


@pytest.fixture(scope="module")
def mod(env):
    import tests.apps.locked as m

    return importlib.reload(m)


def _dead_hosts() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_worker_says_at_start_what_it_locks_and_at_warm_shutdown_what_went_back(env, mod):
    # A queue of its own, emptied at the end: the waiting tasks it returns to the broker must
    # not be run by a later module's workers (the Redis server is the session's).
    queue = f"says-{uuid.uuid4().hex[:6]}"
    w = Worker(env, "says", concurrency=1, extra=["-Q", queue]).start(mod.app)
    try:
        agent = w.agent_pid()
        line = next(x for x in w.log().splitlines() if "locked task(s); ZooKeeper" in x)
        assert "INFO" in line and f"ZooKeeper {env['TEST_ZK_HOSTS']} reachable, root {env['TEST_ZK_ROOT']}" in line
        assert "session timeout 4s" in line and f"zklock_wait_in='worker' (the lock agent, pid {agent})" in line
        key = f"says-{uuid.uuid4().hex[:6]}"
        holder = mod.hold.apply_async((key, 4000, key), queue=queue)  # tagged with its key: a tag of its own
        wait_until(lambda: started(mod, key), 30, "the holder to hold the lock")  # then the waiters behind it
        waiters = [mod.hold.apply_async((key, 10, i), queue=queue) for i in range(1, 4)]
        wait_until(lambda: _held(w) >= 1, 15, "a waiting task held by the worker")
    finally:
        w.stop()
    found = re.findall(r"INFO.*celery-zklock: stopping: (\d+) waiting task\(s\) went back to the broker", w.log())
    try:
        assert len(found) == 1 and int(found[0]) >= 1, w.log()[-3000:]
        assert len(waiters) == 3 and holder.get(timeout=30) is not None
    finally:
        with mod.app.connection() as conn:
            conn.default_channel.client.delete(queue)


def _held(w) -> int:
    """Requests the worker holds for their locks, as `celery inspect`-like control replies say."""
    from tests.apps.locked import app

    replies = app.control.broadcast("zklock_waiting", reply=True, timeout=1.0, destination=[f"says@{socket.gethostname()}"])
    return sum(len(rows) for reply in replies or [] for by_path in reply.values() if isinstance(by_path, dict)
               for rows in by_path.values())


def test_a_bad_lock_key_stops_the_worker_with_one_line(env):
    w = Worker(env, "badkey", app="tests.apps.bad_key")
    w.start()
    try:
        assert w.proc.wait(60) != 0
        log = w.log()
    finally:
        w.stop()
    assert ("celery-zklock: configuration error: task tests.apps.bad_key.ship: lock_key 'order:{order}' names "
            "{order}, which is not a parameter of the task (parameters: order_id)") in log
    assert "Traceback" not in log, log


def test_an_unreachable_zookeeper_is_one_line_in_the_worker_and_the_cli(env):
    dead = _dead_hosts()
    w = Worker({**env, "TEST_ZK_HOSTS": dead}, "says-nozk")
    w.start()
    try:
        assert w.proc.wait(60) != 0
        log = w.log()
    finally:
        w.stop()
    assert re.search(rf"ZooKeeper at {dead} unreachable after \d+ attempt\(s\) in [\d.]+ s: Connection dropped: .*"
                     r"Connection refused", log), log
    assert "Connection dropped" not in log.replace("s: Connection dropped", "") and "Traceback" not in log, log
    cli = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.locked", "zklock", "status"],
                         env={**os.environ, **env, "TEST_ZK_HOSTS": dead, "PYTHONPATH": ROOT}, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode != 0 and f"ZooKeeper at {dead} unreachable after" in cli.stderr
    out = cli.stdout + cli.stderr
    assert out.count("Connection dropped") == 1 and "Traceback" not in out, out
