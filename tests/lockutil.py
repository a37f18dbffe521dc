"""Helpers shared by lock tests: hold-interval recording and an overlap checker."""

from __future__ import annotations

import contextlib
import importlib
import itertools
import os


def overlapping(intervals, max_holders: int = 1):
    """Return a point in time where more than ``max_holders`` intervals overlap, else None.

    ``intervals`` are (start, end) pairs; a sweep over sorted endpoints counts live holds.
    Ends sort before starts at the same instant (a release then an acquire is not overlap).
    """
    events = sorted(itertools.chain(((s, 1) for s, _ in intervals), ((e, -1) for _, e in intervals)),
                    key=lambda ev: (ev[0], ev[1]))
    live = 0
    for t, delta in events:
        live += delta
        if live > max_holders:
            return t
    return None


def write_overlaps(spans):
    """Read/write holds that broke exclusion: (write, other) pairs where a write's hold
    overlaps any other hold; [] when none did.  ``spans`` are ``(side, start, end, ...)``
    tuples, ``side`` "read" or "write", and anything after ``end`` is for the message."""
    return [(a, b) for i, a in enumerate(spans) if a[0] == "write"
            for j, b in enumerate(spans) if i != j and b[1] < a[2] and a[1] < b[2]]


def side_of(i: int, j: int) -> str:
    """The side the ``j``-th hold of thread ``i`` takes in a read/write mix: a third write."""
    return "write" if (i + j) % 3 == 0 else "read"


def hold_for(lock, seconds: float) -> tuple[float, float]:
    """Acquire ``lock`` (anything with acquire/release), hold it ``seconds``, release it:
    the hold's ``(start, end)`` on time.monotonic()."""
    import time

    assert lock.acquire(timeout=60)
    start = time.monotonic()
    time.sleep(seconds)
    end = time.monotonic()
    assert lock.release() is not False
    return start, end


def in_threads(work, threads: int, timeout: float = 90.0) -> None:
    """``work(i)`` in ``threads`` threads at once; the first error any raised is raised here."""
    import threading

    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # surfaced in the caller's thread
            errors.append(exc)

    started = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for t in started:
        t.start()
    for t in started:
        t.join(timeout)
    if errors:
        raise errors[0]


def reads_shared(spans, one: str | None = None, other: str | None = None) -> bool:
    """Did two reads overlap (with ``one``/``other``: a read labelled ``one`` and one labelled
    ``other``, the label being a span's fourth field)?"""
    reads = [s for s in spans if s[0] == "read"]
    return any(a is not b and b[1] < a[2] and a[1] < b[2] and (one is None or (a[3], b[3]) == (one, other))
               for a in reads for b in reads)


def children(zk, path):
    """Children of a lock parent; [] when the container is absent (it comes and goes)."""
    from kazoo.exceptions import NoNodeError

    try:
        return zk.get_children(path)
    except NoNodeError:
        return []


def watching(client, node: str) -> bool:
    """Whether ``client`` has a data watch set on ``node`` (kazoo registers a watcher once the
    server's reply to the watching read is in, so the server has it then)."""
    return bool(client._data_watchers.get(node))


@contextlib.contextmanager
def locked_app(env: dict[str, str]):
    """The real-worker tests' app (``tests.apps.locked``) configured by ``env``
    (``TEST_*`` variables, as its workers see them), restored afterwards: the next test
    module reloads it with its own."""
    import tests.apps.locked as module

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield importlib.reload(module)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        importlib.reload(module)


def worker_refuses(env: dict[str, str], name: str, app: str = "tests.apps.locked") -> str:
    """Start a worker (of ``app``) that must refuse to start; its log (for the reason)."""
    from support.workers import Worker

    worker = Worker(env, name, concurrency=1, app=app)
    worker.start()
    try:
        assert worker.proc.wait(60) != 0, "the worker started"
        return worker.log()
    finally:
        worker.stop()


def worker_env(redis_server, zk_server, prefix: str = "celery-zklock") -> dict[str, str]:
    """The environment a real-worker test module shares with its workers (a root of its
    own, session timeout 4 s), also set in this process for the test apps' import."""
    import os
    import uuid

    values = {
        "TEST_REDIS_URL": redis_server.url,
        "TEST_ZK_HOSTS": zk_server.hosts,
        "TEST_ZK_ROOT": f"/{prefix}-{uuid.uuid4().hex[:8]}",
        "TEST_ZK_SESSION": "4",
    }
    os.environ.update(values)
    return values
