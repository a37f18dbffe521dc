"""A hot key's handoff between two of a worker's tasks: what lies in the gap between one
holder's end and the next one's start (issue 39).

Why: on a key with a backlog the next holder is already parked in a pool process, and
every step from the release to its verdict is time the key stands idle.  Three steps were
there that need not be: a streak's first local handoff waited for a ZooKeeper write (no
young proof of the node yet), the agent told the main process of a grant before the pool
process that waits for it, and the pool process got its answer through a second thread.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
from types import SimpleNamespace

import pytest

from celery_zklock.engine.session import LEASED
from celery_zklock.worker import agent_client
from celery_zklock.worker.agent_protocol import (
    Carry,
    Claim,
    ClaimAnswer,
    Claimed,
    Connection,
    LockState,
    Released,
    Verdict,
)
from celery_zklock.worker.agent_requests import Requests, WaitRequest
from tests.polling import wait_until
from tests.worker.cohort_host import first_granted


def test_a_streaks_first_local_handoff_is_granted_on_a_lease(zk_client):
    """Once one of ours waits behind the holder, the node is written (a proof) while the
    holder holds: its release then hands the node on at once, with no write to wait for."""
    host, cohort, (first, second), slot = first_granted(zk_client, "/handoff-gap", "first", "second")
    assert slot.confirmed is None  # granted on the create's answer: no write to the node yet

    cohort.join(second)  # one of ours behind the holder: a local handoff will follow
    host.run(lambda: slot.confirmed is not None)

    assert cohort.release(first) is LEASED
    assert [g[0] for g in host.grants] == ["first", "second"]  # granted in the release itself
    assert host.grants[1][1] == host.grants[0][1] and host.grants[1][2] > host.grants[0][2]
    cohort.release(second)
    host.run(lambda: cohort.idle)


def test_a_grant_is_told_to_the_waiting_pool_process_before_the_main_process():
    order: list[str] = []
    loop = SimpleNamespace(client=None, settings=None, post=None,
                           monitor=SimpleNamespace(timers=SimpleNamespace(cancel=lambda _timer: None)))
    claims = SimpleNamespace(send_verdict=lambda wait: order.append("pool process"))
    guards = SimpleNamespace(decided=lambda wait, verdict: None)
    requests = Requests(loop, claims, guards)
    wait = WaitRequest(id="r1", task="t", paths=["/k"], max_holders=1, deadline=None, identity=b"",
                owner=SimpleNamespace(send=lambda message: order.append("main process")), early=True)
    wait.claimer = object()  # claimed while next in line: its pool process waits for this verdict

    requests._tell_verdict(wait, Claimed("r1", Verdict.GRANTED))
    assert order == ["pool process", "main process"]


class _FakeAgent:
    """An agent's end of a pool process's link: records the thread that reads each answer."""

    def __init__(self) -> None:
        self.path = os.path.join(tempfile.mkdtemp(prefix="zklock-test-"), "agent.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(1)
        self.peer: Connection | None = None
        self.ready = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        sock, _ = self.server.accept()
        self.peer = Connection(sock)
        self.peer.receive()  # hello
        self.ready.set()

    def answer(self, kind: type, **fields):
        """Read the next request and answer it with a message of ``kind``."""
        [request] = self.peer.receive()
        self.peer.send(kind(request.id, **fields))
        return request

    def close(self) -> None:
        self.peer.close()
        self.server.close()


def test_a_callers_answer_is_read_by_the_caller_and_the_reader_thread_resumes_after(monkeypatch):
    agent = _FakeAgent()
    link = agent_client.AgentClient(agent.path)
    agent.ready.wait(5)
    readers: list[tuple[str, int]] = []
    take = link._take

    def recording(messages):
        for m in messages or ():
            readers.append((m.op, threading.get_ident()))
        take(messages)

    monkeypatch.setattr(link, "_take", recording)
    try:
        threading.Thread(target=lambda: (agent.answer(Claimed, verdict=ClaimAnswer.PENDING),
                                         time.sleep(0.05),
                                         agent.peer.send(Claimed("r1", Verdict.GRANTED))),
                         daemon=True).start()
        reply = link.call(Claim("r1"), Claimed, 5.0, until=lambda r: r.verdict is not ClaimAnswer.PENDING)
        assert reply.verdict is Verdict.GRANTED
        assert {(op, tid == threading.get_ident()) for op, tid in readers} == {("claimed", True)}

        # Nobody calls now: the reader thread takes a state push for a lock held through the link.
        lock = agent_client.AgentLock(link, "r1", {"/k": 1}, grace=5.0, release_bound=5.0)
        agent.peer.send(LockState("r1", held=False, lost=True, reason="session expired"))
        assert wait_until(lambda: lock.lost_reason, 5.0, "the link's thread takes the push", 0.005) == "session expired"
        assert readers[-1][0] == "state" and readers[-1][1] != threading.get_ident()
    finally:
        agent.close()


def test_the_agent_gone_during_a_call_ends_it_and_loses_held_locks():
    agent = _FakeAgent()
    link = agent_client.AgentClient(agent.path)
    agent.ready.wait(5)
    held = agent_client.AgentLock(link, "held", {"/k": 1}, grace=5.0, release_bound=5.0)
    threading.Thread(target=lambda: (agent.peer.receive(), agent.close()), daemon=True).start()

    assert link.call(Claim("r2"), Claimed, 5.0) is None
    assert not link.alive
    assert held.lost_reason == "the worker's lock agent is gone" and not held.is_held()


def test_with_no_lock_held_the_link_is_still_drained_so_the_agents_sends_never_block(monkeypatch):
    """Between tasks nobody needs the agent's heartbeats (or a late answer), but unread they
    would fill the socket's buffers, and the agent's next send to this process would block its
    thread."""
    monkeypatch.setattr(agent_client, "IDLE_DRAIN", 0.05)
    agent = _FakeAgent()
    link = agent_client.AgentClient(agent.path)
    agent.ready.wait(5)
    ping = Released("late", proven=False, reason="x" * 1000)  # an answer nobody waits for, 1 KB
    sent = threading.Event()
    threading.Thread(target=lambda: ([agent.peer.send(ping) for _ in range(2_000)], sent.set()), daemon=True).start()
    try:
        assert sent.wait(20), "the agent's sends blocked: the link was not read while no lock was held"
        assert link.silent_for() < 5
    finally:
        agent.close()


def _voluntary_switches(thread: threading.Thread) -> int:
    with open(f"/proc/self/task/{thread.native_id}/status") as status:
        return int(status.read().split("voluntary_ctxt_switches:")[1].split()[0])


def _link_with_thread(path: str) -> tuple[agent_client.AgentClient, threading.Thread]:
    before = set(threading.enumerate())
    link = agent_client.AgentClient(path)
    [thread] = [t for t in set(threading.enumerate()) - before if t.name == "zklock-agent-link"]
    return link, thread


def test_the_links_thread_reads_on_a_clock_not_once_per_lock():
    """A task registers its lock and releases it; neither may wake the link's thread (each
    wake took the GIL from the body: half of a pool process's context switches on a hot key,
    issue 39).  It reads every POLL while locks are held, whatever their number."""
    agent = _FakeAgent()
    link, thread = _link_with_thread(agent.path)
    agent.ready.wait(5)

    def answer_releases() -> None:
        while True:
            messages = agent.peer.receive()
            if messages is None:
                return
            for m in messages:
                if m.op == "release":
                    agent.peer.send(Released(m.id, proven=True))

    threading.Thread(target=answer_releases, daemon=True).start()
    cycles = 300
    try:
        wait_until(lambda: link._dozing, 5, "the link's thread at rest (dozing: no lock held)")  # counted from there
        before, started = _voluntary_switches(thread), time.monotonic()
        for i in range(cycles):
            lock = agent_client.AgentLock(link, f"r{i}", {"/k": i + 1}, grace=5.0, release_bound=5.0)
            assert lock.release()
        wakes, elapsed = _voluntary_switches(thread) - before, time.monotonic() - started
        # The clock's wakes, and as many again for the GIL; the old reader woke twice per lock
        # (631 for 300 locks), so under any load that stretches the loop this still tells.
        assert wakes <= 2 * (elapsed / agent_client.POLL) + 10 and wakes < 1.5 * cycles, (wakes, elapsed)
    finally:
        agent.close()


def test_a_lock_registered_after_an_idle_spell_is_read_within_the_poll(monkeypatch):
    """With no lock held the link's thread sleeps IDLE_DRAIN; a lock registering wakes it,
    so a state push reaches the lock within POLL, not after the idle sleep."""
    monkeypatch.setattr(agent_client, "IDLE_DRAIN", 60.0)
    agent = _FakeAgent()
    link = agent_client.AgentClient(agent.path)
    agent.ready.wait(5)
    try:
        wait_until(lambda: link._dozing, 5, "the link's thread to doze (IDLE_DRAIN)")
        lock = agent_client.AgentLock(link, "r1", {"/k": 1}, grace=5.0, release_bound=5.0)
        agent.peer.send(LockState("r1", held=False, lost=True, reason="node deleted"))
        assert wait_until(lambda: lock.lost_reason, 5.0, "the link's thread takes the push", 0.005) == "node deleted"
        assert not lock.is_held()
    finally:
        agent.close()


class _KeepingLink(agent_client.AgentClient):
    """A link that says whether it keeps a push for a lock not registered (yet)."""

    def kept(self, lock_id: str) -> bool:
        return lock_id in self._early


class _PushAtRegistration(_KeepingLink):
    """A link whose agent pushes a state the moment a lock registers, and whose thread
    delivers it before the registering lock applies what was pushed for it earlier."""

    def __init__(self, agent: _FakeAgent, push: LockState) -> None:
        super().__init__(agent.path)
        self.agent, self.push = agent, push

    def register(self, lock):
        early = super().register(lock)
        self.agent.peer.send(self.push)
        wait_until(lambda: lock.suspended_reason == self.push.reason, 5, "the link's thread delivers the push", 0.005)
        return early


def test_a_state_pushed_before_registration_never_overrides_a_newer_one():
    """Pushes reach a lock in the order the agent sent them, whichever thread applies them.
    Here the agent says the lock is safe again before the lock registers (kept for it), then
    suspended as it registers (delivered by the link's thread at once): the lock must read
    suspended, as the agent last said, not held (before: the older push was applied last)."""
    agent = _FakeAgent()
    suspended = LockState("r1", held=False, reason="ZooKeeper connection suspended")
    link = _PushAtRegistration(agent, suspended)
    agent.ready.wait(5)
    try:
        agent.peer.send(LockState("r1", held=True))
        wait_until(lambda: link.kept("r1"), 5, "the push kept for r1 (nothing registered for it yet)", 0.005)
        answer = Claimed("r1", Verdict.GRANTED, tokens={"/k": 1}, held=False, reason="ZooKeeper connection lost")
        lock = agent_client.AgentLock(link, "r1", {"/k": 1}, grace=5.0, release_bound=5.0, state=answer)
        assert not lock.is_held() and lock.suspended_reason == "ZooKeeper connection suspended"
        assert not lock.confirmed(0.0)
    finally:
        agent.close()


@pytest.mark.parametrize("claim, read", [("answered", "before-the-claim"), ("answered", "while-the-claim-waits"),
                                         ("carried", "before-the-claim")])
def test_a_state_pushed_to_an_earlier_lock_of_the_same_id_is_not_applied_to_the_next(claim, read):
    """A retry keeps its task's id.  A state the agent pushed to the first run's lock as it
    let go is not the next claim's, whether the link read it before that claim was sent or
    while it waited for the answer, and whether the claim is answered or starts on a carried
    grant: the next lock reads as its claim's answer (or grant) says.  Before: suspended; its
    body waited a session timeout for a "held" that never came, then failed."""
    agent = _FakeAgent()
    link = _KeepingLink(agent.path)
    agent.ready.wait(5)
    stale = LockState("r1", held=False, reason="ZooKeeper connection suspended")
    try:
        first = agent_client.AgentLock(link, "r1", {"/k": 1}, grace=5.0, release_bound=5.0)
        first.abandon()
        agent.peer.receive()  # its release
        if read == "before-the-claim":
            agent.peer.send(stale)
            wait_until(lambda: link.kept("r1"), 5, "the stale push read and kept", 0.005)
        if claim == "carried":
            carry = Carry(proof=time.monotonic(), session_timeout=10.0, waited=0.0, tokens={"/k": 2})
            assert link.send(Claim("r1", carried=True))
            answer = carry.as_claimed("r1")
        else:
            def agent_answers() -> None:
                [request] = agent.peer.receive()
                if read == "while-the-claim-waits":
                    agent.peer.send(stale)  # still on its way when the claim went out
                agent.peer.send(Claimed(request.id, Verdict.GRANTED, tokens={"/k": 2}, held=True))

            answering = threading.Thread(target=agent_answers, daemon=True)
            answering.start()
            answer = link.call(Claim("r1"), Claimed, 5.0)
            answering.join(5)
        lock = agent_client.AgentLock(link, "r1", {"/k": 2}, grace=5.0, release_bound=5.0, state=answer)
        assert lock.is_held() and lock.suspended_reason is None and lock.confirmed(0.0)
    finally:
        agent.close()
