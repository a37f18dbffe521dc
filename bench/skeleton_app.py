"""The floor of this design: a lock agent beside the pool doing nothing but the design's
fewest steps per task, run in real workers against plain Celery and ZkLockedTask.

Why: issue 39 asks, for a missed target, for "the floor of this design on this machine".
:mod:`bench.floor` measures what ZooKeeper and a bare kazoo client cost per key, and one
message between two processes; what it cannot show is what the design's hops cost inside
a loaded Celery worker, where each message wakes a process that shares two cores with the
broker, ZooKeeper and the publisher.  This builds the design with nothing else in it:

* the worker's main process holds each request of a ``bench.skeleton.*`` task aside and
  sends ``wait`` to its agent (a consumer step wrapping ``on_task_request``, the hook
  :mod:`celery_zklock.worker.wait_outside_pool` uses), and hands the request to the pool on
  ``granted``;
* the agent (its own process, one for both workers) joins the key with the one multi
  ours sends for a new key (container + ephemeral sequential node, from a stock kazoo
  client) and answers ``granted`` from kazoo's completion thread; or, for a hot key, queues
  the request in its memory and grants it when the holder before it releases (the floor
  of a local handoff: no ZooKeeper request, no fairness bound, one process's queue);
* the pool process runs the body, then sends ``release`` and blocks for ``released``: the
  agent deletes the node and answers on the delete's reply (the proof ours waits for).

Four messages per task between three processes, and two ZooKeeper requests (distinct keys)
or none (hot keys); no queue order, lease, claim, cohort bound, event, signal, metric,
guard, timeout, loss or fault handling.  ``bench.skeleton_local_full.*`` adds the two
messages ours sends on a hot key beyond those four: the pool process's one-way ``claim``
as its body starts, and the ``next`` notice to the main process for the first request
behind the holder (six messages: ours' whole chain on a carried grant, with no logic).
``bench.skeleton_main.*`` is another design's floor, for comparison: no agent, the worker's
main process joining and leaving the key itself (:class:`InMain`).  It is not a
lock (nothing checks an order, nothing survives a fault): only the cost floor of the
design's chain, with real Celery around it.

Measured by :func:`bench.design_floor.design` (``.venv/bin/python -m bench.design_floor``), which
runs it beside plain Celery and ZkLockedTask in the same workers.
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import threading

from celery import Task, bootsteps

from . import app as bench_app

#: Where the workers' main and pool processes find the skeleton agent.
SOCK_ENV = "BENCH_SKELETON_SOCK"
PREFIX = "bench.skeleton"  # bench.skeleton.* joins ZooKeeper, bench.skeleton_local.* only queues here
MAIN = "bench.skeleton_main."  # joins ZooKeeper from the worker's main process: no agent, no message
LOCAL = "bench.skeleton_local"  # bench.skeleton_local.* and bench.skeleton_local_full.*
FULL = "bench.skeleton_local_full."  # also ours' claim and next-in-line notice: six messages


def _line(message: dict) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


# ------------------------------------------------------------------ the agent process
def agent_main(path: str, hosts: str, root: str) -> int:
    """Accept the main and pool processes' connections; ``wait`` joins the key (one multi),
    ``release`` leaves it (one delete); each answer goes out from kazoo's completion
    thread, the reply's own thread, with no further hop.  A ``local`` wait queues in this
    process only (a hot key's local handoff, with no ZooKeeper request at all, and no
    exclusion between workers: a floor, not a lock)."""
    from kazoo.client import KazooClient

    from celery_zklock.engine import kazoo_compat

    client = KazooClient(hosts=hosts)
    client.start(timeout=30)
    client.ensure_path(root)
    nodes: dict[str, str] = {}
    send_guard = threading.Lock()

    def send(conn: socket.socket, message: dict) -> None:
        with send_guard:
            try:
                conn.sendall(_line(message))
            except OSError:
                pass

    holders: dict[str, str] = {}  # local key -> the request holding it
    queues: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    local: dict[str, str] = {}  # local request -> its key
    full: set[str] = set()  # requests of the full chain (claim and next-in-line notice too)

    def on_wait(conn: socket.socket, msg: dict) -> None:
        key = f"{root}/{msg['key']}"
        if msg.get("local"):
            local[msg["id"]] = key
            if msg.get("full"):
                full.add(msg["id"])
            if key in holders:
                queues[key].append((conn, msg["id"]))
                if msg.get("full") and len(queues[key]) == 1:
                    send(conn, {"op": "next", "id": msg["id"]})  # ours: the next in line's notice
                return
            holders[key] = msg["id"]
            return send(conn, {"op": "granted", "id": msg["id"]})

        def joined(made) -> None:
            (_container, (node, _stat)), = made.get()
            nodes[msg["id"]] = node
            send(conn, {"op": "granted", "id": msg["id"]})

        kazoo_compat.create_in_new_containers_async(client, [(key, f"{key}/_c_x-lock-", b"", None, None)]).rawlink(joined)

    def on_claim(conn: socket.socket, msg: dict) -> None:
        """The six-message chain's claim: one-way, as ours on a carried grant."""

    def on_release(conn: socket.socket, msg: dict) -> None:
        full.discard(msg["id"])
        key = local.pop(msg["id"], None)
        if key is not None:
            if queues[key]:
                owner, holders[key] = queues[key].popleft()
                send(owner, {"op": "granted", "id": holders[key]})
                if queues[key] and queues[key][0][1] in full:
                    send(queues[key][0][0], {"op": "next", "id": queues[key][0][1]})
            else:
                del holders[key], queues[key]
            return send(conn, {"op": "released", "id": msg["id"], "proven": True})
        node = nodes.pop(msg["id"], None)
        if node is None:
            return send(conn, {"op": "released", "id": msg["id"], "proven": False})

        def deleted(result) -> None:
            result.get()
            send(conn, {"op": "released", "id": msg["id"], "proven": True})

        client.delete_async(node).rawlink(deleted)

    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    buffers: dict[socket.socket, bytes] = {}
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    try:
        while True:
            for skey, _ in sel.select():
                sock = skey.fileobj
                if sock is server:
                    conn, _ = server.accept()
                    buffers[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                data = sock.recv(65536)
                if not data:
                    sel.unregister(sock)
                    buffers.pop(sock, None)
                    sock.close()
                    continue
                *lines, buffers[sock] = (buffers[sock] + data).split(b"\n")
                for line in lines:
                    msg = json.loads(line)
                    {"wait": on_wait, "claim": on_claim}.get(msg["op"], on_release)(sock, msg)
    finally:
        client.stop()
        client.close()


def start_agent(hosts: str, root: str) -> tuple[subprocess.Popen, str]:
    """The agent, and the socket path the workers find it at (:data:`SOCK_ENV`).  One for
    all workers: its queues then exclude across them, as ZooKeeper would (the hot
    workload's floor is a lock, not two)."""
    path = os.path.join(tempfile.mkdtemp(prefix="skeleton-"), "agent.sock")
    proc = subprocess.Popen([sys.executable, "-m", "bench.skeleton_app", path, hosts, root], stdout=subprocess.PIPE,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if proc.stdout.readline().strip() != b"READY":
        proc.kill()
        raise RuntimeError("the skeleton agent did not start")
    return proc, path


# ------------------------------------------------------------------ the main process
class Gate(bootsteps.StartStopStep):
    """Hold a skeleton task's request aside until its agent says ``granted``."""

    label = "skeleton gate"

    def __init__(self, c, **kwargs) -> None:
        super().__init__(c, **kwargs)
        self.c, self.inner, self.aside, self.buffer = c, c.on_task_request, {}, b""
        self.sock: socket.socket | None = None
        c.on_task_request = self.on_request

    def start(self, c) -> None:
        if self.sock is None and os.environ.get(SOCK_ENV):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.connect(os.environ[SOCK_ENV])
            c.hub.add_reader(self.sock.fileno(), self._readable)

    def on_request(self, req) -> None:
        if self.sock is None or not req.task.name.startswith(PREFIX):
            return self.inner(req)
        if req.task.name.startswith(MAIN):
            return _in_main.join(self.c, req, self.inner)
        self.aside[req.id] = req
        self.sock.sendall(_line({"op": "wait", "id": req.id, "key": f"k:{(req.args or [None])[0]}",
                                 "local": req.task.name.startswith(LOCAL), "full": req.task.name.startswith(FULL)}))

    def _readable(self) -> None:
        *lines, self.buffer = (self.buffer + self.sock.recv(65536)).split(b"\n")
        for line in lines:
            msg = json.loads(line)
            if msg["op"] == "granted":
                self.inner(self.aside.pop(msg["id"]))


bench_app.app.steps["consumer"].add(Gate)


class InMain:
    """Another design's floor, for comparison: the worker's main process joins the key
    itself (a kazoo client of its own, the same multi), hands the request to the pool on
    the reply, and leaves the key with a delete when the pool's own result message comes
    back (Celery's ``on_success``/``on_failure`` of the request, in the main process).
    No agent and no message of ours between processes: kazoo's two threads and one pipe
    wake-up of the event loop per grant.  Not a lock either (nothing checks a claim, a
    lease, a loss, or the body's end against the node), and nobody waits for the delete's
    reply, where the agent chain's pool process waits for it: that flatters this design."""

    def __init__(self) -> None:
        self.client = None
        self.ready: collections.deque = collections.deque()
        self.nodes: dict[str, str] = {}

    def _start(self, c) -> None:
        from kazoo.client import KazooClient

        self.client = KazooClient(hosts=os.environ["BENCH_ZK_HOSTS"])
        self.client.start(timeout=30)
        self.root = os.environ["BENCH_ZK_ROOT"] + "/skeleton-main"
        self.client.ensure_path(self.root)
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        c.hub.add_reader(self.rfd, self._drain)

    def join(self, c, req, grant) -> None:
        from celery_zklock.engine import kazoo_compat

        if self.client is None:
            self._start(c)
        key = f"{self.root}/k:{(req.args or [None])[0]}"

        def joined(made) -> None:  # kazoo's completion thread: to the event loop by the pipe
            (_container, (node, _stat)), = made.get()
            self.nodes[req.id] = node
            self.ready.append((grant, req))
            os.write(self.wfd, b"x")

        request = [(key, f"{key}/_c_x-lock-", b"", None, None)]
        kazoo_compat.create_in_new_containers_async(self.client, request).rawlink(joined)

    def _drain(self) -> None:
        try:
            os.read(self.rfd, 65536)
        except BlockingIOError:
            pass
        while self.ready:
            grant, req = self.ready.popleft()
            grant(req)

    def leave(self, task_id: str) -> None:
        node = self.nodes.pop(task_id, None)
        if node is not None:
            self.client.delete_async(node)


_in_main = InMain()


def _leave_when_ready():
    """Leave the key when the pool's result reaches the main process: Celery's fast request
    class calls ``task_ready`` there for every finished request (its ``on_success`` calls no
    base class's), bound as a default argument of ``create_request_cls``, so that default is
    the hook; one dict lookup for other tasks."""
    from celery.worker import request as request_module

    make = request_module.create_request_cls
    names = make.__code__.co_varnames[:make.__code__.co_argcount]
    defaults = list(make.__defaults__)
    at = len(defaults) - (len(names) - names.index("task_ready"))
    ready = defaults[at]

    def task_ready(request, *args, **kwargs):
        _in_main.leave(request.id)
        return ready(request, *args, **kwargs)

    defaults[at] = task_ready
    make.__defaults__ = tuple(defaults)
    request_module.task_ready = task_ready  # the base class's paths (a failure, a revoke)


_leave_when_ready()


# ------------------------------------------------------------------ the pool process
_link: dict[int, socket.socket] = {}


def _sock() -> socket.socket:
    sock = _link.get(os.getpid())
    if sock is None:
        _link.clear()
        sock = _link[os.getpid()] = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(os.environ[SOCK_ENV])
    return sock


def _claim(task_id: str) -> None:
    _sock().sendall(_line({"op": "claim", "id": task_id}))


def _release(task_id: str) -> bool:
    sock = _sock()
    sock.sendall(_line({"op": "release", "id": task_id}))
    buffer = b""
    while not buffer.endswith(b"\n"):
        buffer += sock.recv(65536)
    return json.loads(buffer)["proven"]


class SkeletonTask(Task):
    """The body, then the release and its proof, as ZkLockedTask's wrapper ends."""

    abstract = True

    def __call__(self, *args, **kwargs):
        if self.name.startswith(FULL):
            _claim(self.request.id)
        try:
            return self.run(*args, **kwargs)
        finally:
            if not _release(self.request.id):
                raise RuntimeError("released without proof")


class SkeletonMainTask(Task):
    """The body only, as plain Celery runs it (no ``__call__`` of its own): the main process
    joined the key and leaves it on the result."""

    abstract = True


bench_app.add_contender("skeleton", "the design's chain (ZooKeeper)", SkeletonTask, {})
bench_app.add_contender("skeleton_local", "the design's chain (agent's queue)", SkeletonTask, {})
bench_app.add_contender("skeleton_main", "another design's chain: the lock in the main process (ZooKeeper)",
                        SkeletonMainTask, {})
bench_app.add_contender("skeleton_local_full", "the design's six messages (agent's queue)", SkeletonTask, {})
app = bench_app.app  # what ``celery -A bench.skeleton_app`` loads


def main(argv: list[str]) -> int:
    return agent_main(*argv[:3])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
