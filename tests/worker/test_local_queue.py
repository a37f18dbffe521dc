"""The cohort's local queue (issue 35, finding 5): FIFO, and leaving it costs no scan.

Why: a deque's ``remove``/``index`` scanned the backlog; thousands of requests leaving in one
event of the agent's one thread (its main process gone, a batch of ``finished``) cost
O(n^2) comparisons, and an agent that busy is killed as frozen (``STUCK_AFTER``).  The agent
test counts comparisons between requests (the deque's scans are nothing else) rather than
timing them: the machine is shared, a count is not.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
import uuid

import pytest

from celery_zklock.config import ZkSettings
from celery_zklock.worker.agent import STUCK_AFTER, Agent
from celery_zklock.worker.agent_protocol import Connection, Finished, Hello, PeerRole, Wait
from celery_zklock.worker.agent_requests import WaitRequest
from celery_zklock.worker.cohort import WaitQueue


class W:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


A, B, C, D = W("a"), W("b"), W("c"), W("d")


@pytest.mark.parametrize("ops, order, first, last", [
    ([("append", A), ("append", B), ("append", C)], [A, B, C], A, C),
    ([("append", A), ("append", B), ("remove", A)], [B], B, B),
    ([("append", A), ("append", B), ("remove", B)], [A], A, A),
    ([("append", A), ("append", B), ("append", C), ("remove", B)], [A, C], A, C),
    ([("append", A), ("append", B), ("appendleft", C)], [C, A, B], C, B),  # a reserved waiter put back
    ([("append", A), ("append", A)], [A], A, A),  # joined twice: one place, the first
    ([("append", A), ("remove", A), ("append", A)], [A], A, A),
    ([("remove", A)], [], None, None),
    ([], [], None, None),
])
def test_the_queue_keeps_arrival_order(ops, order, first, last):
    queue = WaitQueue()
    for op, wait in ops:
        getattr(queue, op)(wait)
    assert list(queue) == order and len(queue) == len(order) and bool(queue) == bool(order)
    assert queue.first() is first and queue.last() is last
    assert all(w in queue for w in order) and D not in queue


def test_remove_says_whether_it_was_queued():
    queue = WaitQueue()
    queue.append(A)
    assert queue.remove(A) is True and queue.remove(A) is False


@pytest.mark.parametrize("wait, k, within", [
    (A, 0, False), (A, 1, True), (B, 1, False), (B, 2, True), (C, 2, False), (C, 3, True), (C, 99, True),
    (D, 99, False),  # not queued
])
def test_within_the_first_k(wait, k, within):
    queue = WaitQueue()
    for w in (A, B, C):
        queue.append(w)
    assert queue.within(wait, k) is within


def _drain(sock: socket.socket) -> None:
    def run() -> None:
        try:
            while sock.recv(1 << 16):
                pass
        except OSError:
            pass
    threading.Thread(target=run, daemon=True).start()


def test_5000_requests_leaving_in_one_event_out_of_order_cost_no_scan(zk_server, tmp_path, monkeypatch):
    """One key, one holder, 4,999 requests behind it in the agent's local queue; the main
    process then says they finished, newest first, in one message (one event).  Before:
    12.5M comparisons (the deque's ``remove`` scanned from the front each time)."""
    compared = [0]

    def counted_eq(self, other):
        compared[0] += 1
        return self is other

    monkeypatch.setattr(WaitRequest, "__eq__", counted_eq)  # WaitRequest keeps identity's hash (eq=False)
    agent = Agent(dataclasses.replace(ZkSettings(), hosts=zk_server.hosts), str(tmp_path / "agent.sock"))
    ours, theirs = socket.socketpair()
    main = Connection(ours)
    _drain(theirs)

    def run_events() -> None:
        while agent.events.items:
            fn, args = agent.events.items.popleft()
            fn(*args)

    try:
        agent.handle(main, Hello(PeerRole.MAIN))
        path = f"/wait-queue/{uuid.uuid4().hex[:8]}"
        ids = [f"r{i}" for i in range(5000)]
        for request_id in ids:
            agent.handle(main, Wait(request_id, (path,), task="t", timeout=600, identity=request_id))
            deadline = time.monotonic() + 10
            while not agent.requests.waits["r0"].holds:
                assert time.monotonic() < deadline, "the first request was never granted"
                run_events()
                time.sleep(0.001)
        run_events()
        [cohort] = agent.requests.cohorts.values()
        assert len(cohort.queue) == 4999

        compared[0] = 0
        started = time.perf_counter()
        agent.handle(main, Finished(tuple(ids[::-1])))
        took = time.perf_counter() - started
        assert compared[0] < 5 * len(ids), f"{compared[0]} comparisons for {len(ids)} leaves"
        assert not agent.requests.waits and not cohort.queue
        # Wall time only as a backstop (a shared 2-core machine): linear work takes ~0.1 s.
        assert took < STUCK_AFTER, f"{took:.2f} s in one event: past STUCK_AFTER, killed as frozen"
        deadline = time.monotonic() + 10
        while agent.requests.cohorts:
            assert time.monotonic() < deadline, "the key's node was not released"
            run_events()
            time.sleep(0.01)
    finally:
        agent.client.stop()
        agent.client.close()
        main.close()
        theirs.close()
