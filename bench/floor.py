"""The floor under a lock on distinct keys: what ZooKeeper, kazoo and a message between two
processes cost per task before any code of ours runs.

Why: on this 2-core machine every process shares the CPUs, and both plain Celery and
ours run CPU-bound in scenario 1, so the distinct-key ratio against plain Celery is the
ratio of CPU per task.  A lock that joins its key with a create (in one multi with the
key's container) and leaves it with a delete cannot cost less than what ZooKeeper spends
on those two requests plus what a kazoo client spends sending them and reading the
replies; a lock kept by a process beside the pool (the lock agent) also pays for at
least three messages per task (wait, granted, release).  This runs exactly those
requests from a bare kazoo client, pipelined as the agent pipelines them, and a
ping-pong of one-line JSON messages over a Unix socket, in processes of their own, and
reports their CPU per task; :func:`ceilings` turns them into the best ratio any code of
ours could reach, beside the measured one.

What those numbers leave out is what the design's hops cost inside loaded Celery workers:
:mod:`bench.design_floor` measures that.

Run alone: ``.venv/bin/python -m bench.floor`` (starts its own ZooKeeper).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Requests in flight at once: the overhead scenario's 2 workers x ``-c 2`` keep about
#: four tasks' locks going at a time.
WINDOW = 4

#: The fewest messages a task's lock takes between the worker's processes and its agent:
#: main -> agent ``wait``, agent -> main ``granted``, pool -> agent ``release``.
MIN_MESSAGES = 3


def _cpu() -> float:
    """This process's CPU seconds, all threads (kazoo's included), at nanosecond resolution
    (``os.times`` counts 10 ms ticks: too coarse for a message's few microseconds)."""
    return time.process_time()


def kazoo_loop(hosts: str, tasks: int, window: int = WINDOW) -> dict:
    """In this process: ``tasks`` keys, each joined by a multi (its container and an
    ephemeral sequential node) and left by a delete, ``window`` at a time.  The multi is
    the agent's own wire format for a new key (:func:`create_in_new_containers_async`,
    serialised by kazoo); everything else is kazoo's."""
    from kazoo.client import KazooClient

    from celery_zklock.engine import kazoo_compat

    client = KazooClient(hosts=hosts)
    client.start(timeout=30)
    root = f"/bench-floor-{uuid.uuid4().hex[:8]}"
    client.ensure_path(root)
    started = iter(range(tasks))
    left = [tasks]
    all_done = threading.Event()

    def join(i: int) -> None:  # as the agent: each reply's callback sends the next request
        key = f"{root}/k{i}"
        made = kazoo_compat.create_in_new_containers_async(client, [(key, f"{key}/_c_x-lock-", b"", None, None)])
        made.rawlink(leave)

    def leave(made) -> None:
        (_container, (node, _stat)), = made.get()
        client.delete_async(node).rawlink(next_one)

    def next_one(deleted) -> None:
        deleted.get()
        left[0] -= 1
        i = next(started, None)
        if i is not None:
            join(i)
        elif left[0] == 0:
            all_done.set()

    try:
        cpu0, t0 = _cpu(), time.monotonic()
        for _ in range(window):
            join(next(started))
        all_done.wait(600)
        cpu, wall = _cpu() - cpu0, time.monotonic() - t0
    finally:
        client.stop()
        client.close()
    return {"tasks": tasks, "client_cpu_ms_per_task": round(cpu * 1000 / tasks, 3),
            "wall_ms_per_task": round(wall * 1000 / tasks, 3)}


def message_loop(count: int) -> dict:
    """In this process and a child: ``count`` one-line JSON messages each way over a Unix
    socket pair, each sent with one ``sendall`` and read with one ``recv`` after a wake-up
    (as the agent link frames them).  CPU per message, both ends together."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # the echoing end
        a.close()
        try:
            cpu0 = _cpu()
            for _ in range(count):
                data = b.recv(65536)
                msg = json.loads(data)
                b.sendall(json.dumps({"op": "granted", "id": msg["id"]}, separators=(",", ":")).encode() + b"\n")
            cpu = _cpu() - cpu0
            b.recv(16)  # the parent's "done": its last reply is read, nothing else in flight
            b.sendall(json.dumps({"cpu": cpu}).encode() + b"\n")
        finally:
            os._exit(0)
    b.close()
    cpu0 = _cpu()
    for i in range(count):
        a.sendall(json.dumps({"op": "wait", "id": f"{uuid.UUID(int=i)}", "paths": ["/k"]},
                             separators=(",", ":")).encode() + b"\n")
        json.loads(a.recv(65536))
    mine = _cpu() - cpu0
    a.sendall(b"done\n")
    buf = b""
    while not buf.endswith(b"\n"):
        buf += a.recv(65536)
    os.waitpid(pid, 0)
    theirs = json.loads(buf)["cpu"]
    return {"messages": 2 * count, "cpu_ms_per_message": round((mine + theirs) * 1000 / (2 * count), 4)}


def measure(services, tasks: int = 2000, messages: int = 4000) -> dict:
    """Both loops in fresh processes; ZooKeeper's CPU and requests read around the kazoo one."""
    from .infra import cpu_seconds

    env = {**os.environ, "PYTHONPATH": ROOT}
    zk_cpu0, zk_req0 = cpu_seconds(services.zk.proc.pid), float(services.mntr()["zk_packets_received"])
    out = subprocess.run([sys.executable, "-m", "bench.floor", "kazoo", services.zk_hosts, str(tasks)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    kazoo = json.loads(out.stdout.strip().splitlines()[-1])
    # The emptied containers are ZooKeeper's to sweep, once a sweep interval has passed: a
    # delete each, part of a key's cost (in scenario 1 the next burst's window pays for it).
    services.settled_znode_count()
    zk_cpu, zk_req = cpu_seconds(services.zk.proc.pid) - zk_cpu0, float(services.mntr()["zk_packets_received"]) - zk_req0
    out = subprocess.run([sys.executable, "-m", "bench.floor", "messages", str(messages)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)
    msgs = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        **kazoo,
        "zookeeper_cpu_ms_per_task": round(zk_cpu * 1000 / tasks, 3),
        "zk_requests_per_task": round(zk_req / tasks, 2),  # pings and the connect included
        **msgs,
        "min_messages": MIN_MESSAGES,
    }


def ceilings(plain: dict, floor: dict) -> dict:
    """The best distinct-key ratio against plain Celery, with plain's CPU per task ``P``
    (workers, ZooKeeper, Redis, publisher: scenario 1's columns): ``P / (P + ZooKeeper +
    kazoo)``, and with the fewest messages between the worker's processes added."""
    p = sum(plain[k] for k in ("cpu_workers_ms_per_task", "cpu_zookeeper_ms_per_task",
                               "cpu_redis_ms_per_task", "cpu_publisher_ms_per_task"))
    zk_kazoo = floor["zookeeper_cpu_ms_per_task"] + floor["client_cpu_ms_per_task"]
    msgs = floor["min_messages"] * floor["cpu_ms_per_message"]
    return {"plain_cpu_ms_per_task": round(p, 3),
            "ceiling_zookeeper_kazoo": round(p / (p + zk_kazoo), 3),
            "ceiling_with_messages": round(p / (p + zk_kazoo + msgs), 3)}


def main(argv: list[str]) -> int:
    if argv[:1] == ["kazoo"]:
        print(json.dumps(kazoo_loop(argv[1], int(argv[2]))))
        return 0
    if argv[:1] == ["messages"]:
        print(json.dumps(message_loop(int(argv[1]))))
        return 0
    from .infra import Services

    services = Services().start()
    try:
        print(json.dumps(measure(services), indent=1))
    finally:
        services.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
