"""EventLoopHandler against a real ZooKeeper: kazoo's completions and watches run where the
owner's ``post`` sends them (the lock agent's event thread), in reply order, and plain
replies need no event loop at all (the rule the agent's code keeps: docs/design.md,
"The agent's one thread")."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import EventType

from celery_zklock.engine.client import EventLoopHandler
from tests.polling import wait_until


class Loop:
    """A stand-in event thread: posts queue until the test drains them on its own thread."""

    def __init__(self) -> None:
        self.posted: list = []
        self.guard = threading.Lock()

    def post(self, fn) -> None:
        with self.guard:
            self.posted.append(fn)

    def drain(self, until, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            assert time.monotonic() < deadline, "posted events never came"
            with self.guard:
                batch, self.posted = self.posted, []
            for fn in batch:
                fn()
            time.sleep(0.001)  # the loop's idle turn


@pytest.fixture
def looped(zk_server):
    loop = Loop()
    client = KazooClient(hosts=zk_server.hosts, timeout=4.0, handler=EventLoopHandler(loop.post))
    client.start(timeout=15)
    client.handler.loop_thread = threading.get_ident()  # this test's thread drains the loop
    yield client, loop
    client.stop()
    client.close()


def test_completions_run_on_the_draining_thread_in_reply_order(looped, zk_client):
    client, loop = looped
    base = f"/elh/{uuid.uuid4().hex[:8]}"
    zk_client.ensure_path(base)
    ran: list[tuple[int, int]] = []
    for i in range(20):
        client.create_async(f"{base}/n-", b"", sequence=True).rawlink(
            lambda result, i=i: ran.append((i, threading.get_ident())))
    wait_until(lambda: len(loop.posted) == 20, 5, what="every reply in, each waiting for the loop")
    assert ran == []
    loop.drain(lambda: len(ran) == 20)
    assert [i for i, _ in ran] == list(range(20))  # ZooKeeper's reply order is the send order
    assert {thread for _, thread in ran} == {threading.get_ident()}
    assert not client.handler._workers  # kazoo's two callback threads were never started


def test_watch_events_are_posted_too(looped, zk_client):
    client, loop = looped
    path = f"/elh/{uuid.uuid4().hex[:8]}"
    zk_client.create(path, b"", makepath=True)
    seen = []
    got = client.get_async(path, watch=seen.append)  # a plain reply: set without the loop
    wait_until(got.ready, 5, interval=0.01, what="the read's reply")
    zk_client.delete(path)
    wait_until(lambda: loop.posted, 5, what="the watch event posted to the loop")
    assert seen == []
    loop.drain(lambda: bool(seen))
    assert seen[0].type == EventType.DELETED and seen[0].path == path


def test_a_blocking_call_on_the_loop_thread_raises_instead_of_waiting_for_itself(looped):
    """kazoo's ``create`` completes through a callback that the loop would run after the
    wait: a freeze of the agent's event thread, before this refusal."""
    client, loop = looped
    with pytest.raises(RuntimeError, match="would wait for itself"):
        client.create(f"/elh-{uuid.uuid4().hex[:8]}", b"")
    done = threading.Event()
    threading.Thread(target=lambda: (client.exists("/"), done.set()), daemon=True).start()
    assert done.wait(5)  # another thread still waits as usual


def test_a_stopped_client_runs_callbacks_at_once(zk_server):
    """kazoo calls a stopped handler's callbacks in place: nothing is left queued for a
    loop that has ended (the agent stops its client after its event thread)."""
    loop = Loop()
    handler = EventLoopHandler(loop.post)
    client = KazooClient(hosts=zk_server.hosts, timeout=4.0, handler=handler)
    client.start(timeout=15)
    client.stop()
    assert not handler.running
    done = []
    result = handler.async_result()
    result.rawlink(done.append)
    result.set(1)
    assert done == [result] and loop.posted == []
    client.close()
