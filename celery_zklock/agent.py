"""The lock agent: one process per worker that waits for locks so that pool processes do not.

Why a process of its own, exec'd rather than forked: the worker's main process forks pool
children, and a kazoo client's threads alive in a forking process can be copied
mid-operation (kazoo #554/#519/#628); the pool processes must not wait either — a waiting
task in a prefork child takes a slot that other keys need.  So the agent holds the
worker's only ZooKeeper session, queues for every locked request the main process
receives (the event-driven engine: no thread per waiter), and hands each lock to the pool
process that claims it.  Protocol: :mod:`celery_zklock.agent_link`.

Run by the worker (:mod:`celery_zklock.worker_queue`) as ``python -m celery_zklock.agent
SOCKET`` with the settings as JSON on stdin (they may carry credentials: never argv).
It exits once the worker's main process and every pool process that holds a lock
through it have gone; closing its session deletes whatever it still had.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from kazoo.protocol.states import KazooState

from .agent_link import HANDOFF_MAX_WAIT, HEARTBEAT, Connection
from .client import connect, disconnect
from .config import ZkSettings, from_wire
from .internals import LockInternals, State
from .lock import contenders
from .session import DELETED

logger = logging.getLogger("celery_zklock.agent")


@dataclass
class Wait:
    """One request's locks: taken in canonical order, all or nothing."""

    id: str
    task: str
    paths: list[str]
    max_holders: int
    deadline: float | None
    identity: bytes
    owner: Connection
    early: bool = False  # the main process may hand it to the pool once it is next in line
    claimer: Connection | None = None
    attempts: list = field(default_factory=list)
    verdict: dict | None = None  # what a claim is told once decided
    shown_held: bool | None = None  # the last state pushed to the claimer
    next_sent: bool = False  # told the main process it is next in line (claimable undecided)
    queued: bool = False  # had to queue behind another contender (its key is contended)
    granted_at: float | None = None
    started: float = field(default_factory=time.monotonic)
    done: bool = False  # released or cancelled


class Agent:
    def __init__(self, settings: ZkSettings, path: str) -> None:
        self.settings = settings
        self.path = path
        self.client = connect(settings)
        self.guard = threading.RLock()
        self.waits: dict[str, Wait] = {}
        self.peers: set[Connection] = set()
        self.main: Connection | None = None
        self.main_seen = False
        self.stopped = threading.Event()
        self.parent = os.getppid()
        # Mean time a lock was held (grant to release), per lock path and per task name:
        # how long a request next in line would idle in a pool process if handed over.
        self.hold_by_path: dict[str, float] = {}
        self.hold_by_task: dict[str, float] = {}

    # ------------------------------------------------------------------ serving
    def serve(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        os.chmod(self.path, 0o600)
        server.listen(128)
        print("READY", flush=True)  # the worker waits for this line before forking its pool
        threading.Thread(target=self._heartbeat, name="zklock-agent-heartbeat", daemon=True).start()
        threading.Thread(target=self._accept, args=(server,), name="zklock-agent-accept", daemon=True).start()
        self.stopped.wait()
        server.close()
        disconnect(self.client)

    def _accept(self, server: socket.socket) -> None:
        while not self.stopped.is_set():
            try:
                sock, _ = server.accept()
            except OSError:
                return
            peer = Connection(sock)
            with self.guard:
                self.peers.add(peer)
            threading.Thread(target=self._read, args=(peer,), name="zklock-agent-peer", daemon=True).start()

    def _read(self, peer: Connection) -> None:
        while True:
            messages = peer.receive()
            if messages is None:
                return self._gone(peer)
            for message in messages:
                try:
                    self._handle(peer, message)
                except Exception:  # a bad message must not take the agent down
                    logger.exception("zklock agent: cannot handle %r", message)

    def _heartbeat(self) -> None:
        """Ping everyone, and tell claimers when their lock stops or starts being safe."""
        while not self.stopped.wait(HEARTBEAT):
            if os.getppid() != self.parent and self.main is None and not self._claimed():
                self.stopped.set()  # the worker died, and no process of it holds a lock
                return
            with self.guard:
                peers = list(self.peers)
                claimed = [w for w in self.waits.values() if w.claimer is not None and not w.done]
            for peer in peers:
                peer.send({"op": "ping"})
            for wait in claimed:
                self._push_state(wait)

    # ------------------------------------------------------------------ requests
    def _handle(self, peer: Connection, msg: dict) -> None:
        op = msg.get("op")
        if op == "hello":
            if msg.get("role") == "main":
                with self.guard:
                    self.main, self.main_seen = peer, True
        elif op == "wait":
            self._wait(peer, msg)
        elif op == "cancel":
            self._cancel(msg["id"], msg.get("why") or "finished", bool(msg.get("in_pool")))
        elif op == "claim":
            self._claim(peer, msg["id"])
        elif op == "release":
            self._release(peer, msg["id"])

    def _wait(self, peer: Connection, msg: dict) -> None:
        timeout = msg.get("timeout")
        wait = Wait(
            id=msg["id"],
            task=str(msg.get("task") or ""),
            paths=sorted(set(msg["paths"])),
            max_holders=int(msg.get("max_holders") or 1),
            deadline=None if timeout is None else time.monotonic() + float(timeout),
            identity=str(msg.get("identity") or "").encode(),
            owner=peer,
            early=bool(msg.get("early")),
        )
        with self.guard:
            old = self.waits.get(wait.id)
            if old is None or old.done:
                self.waits[wait.id] = wait
        if old is not None and not old.done:
            # The same task id while we still wait for, or hold, its lock: a retry the body
            # published while holding it, or a redelivery.  The running one keeps its lock;
            # this one runs in-process (its claim will say "unknown"), still protected.
            peer.send({"op": "bypass", "id": wait.id})
            return
        self._take_next(wait)

    def _take_next(self, wait: Wait) -> None:
        """Take the next path (canonical order) or, with all taken, grant."""
        with self.guard:
            if wait.done:
                return
            index = len(wait.attempts)
            if index == len(wait.paths):
                return self._decide(wait, {"verdict": "granted", "tokens": self._tokens(wait), "nodes": self._nodes(wait)})

            internals = LockInternals(
                self.client, wait.paths[index], wait.max_holders, wait.identity,
                on_lost=lambda: self._lost(wait),
            )
            last = index == len(wait.paths) - 1
            # Watching for "next in line" costs one more look at the queue per handoff:
            # only for requests that may be handed over early (short holds, or not known).
            expected = self._expected_hold(wait)
            early = wait.early and last and (expected is None or expected <= HANDOFF_MAX_WAIT)
            attempt = internals.attempt(
                wait.deadline, on_wait=lambda pos: self._queued(wait, pos),
                on_next=(lambda: self._next(wait)) if early else None,
            )
            wait.attempts.append(attempt)
        attempt.result.rawlink(lambda result: self._taken(wait, result))

    def _taken(self, wait: Wait, result) -> None:
        try:
            held = result.get()
        except Exception as exc:
            self._release_attempts(wait)
            return self._decide(wait, {"verdict": "unavailable", "error": str(exc)})
        if held:
            return self._take_next(wait)
        # Timed out (or cancelled): free what we took, then say who holds it (off this thread).
        failed = wait.attempts[-1].lk.path if wait.attempts else None
        self._release_attempts(wait)
        if wait.done:
            return
        self.client.handler.spawn(self._timed_out, wait, failed)

    def _timed_out(self, wait: Wait, path: str | None) -> None:
        try:
            holders = [c.identifier for c in contenders(self.client, path, wait.max_holders) if c.holder] if path else []
        except Exception:
            holders = []
        self._decide(wait, {"verdict": "timeout", "holders": holders})

    def _queued(self, wait: Wait, position: int) -> None:
        wait.queued = True
        wait.owner.send({"op": "queued", "id": wait.id, "position": position})

    def _next(self, wait: Wait) -> None:
        """Every path but the last is held and the last has only holders ahead: the main
        process may hand the request to the pool now, so that the release that grants it
        reaches a pool process already claiming (no dispatch, no wait for a free slot)."""
        with self.guard:
            if wait.done or wait.verdict is not None or wait.next_sent:
                return
            wait.next_sent = True
        wait.owner.send({"op": "next", "id": wait.id, "hold": self._expected_hold(wait)})

    def _expected_hold(self, wait: Wait) -> float | None:
        held = self.hold_by_path.get(wait.paths[-1])
        return held if held is not None else self.hold_by_task.get(wait.task)

    def _learn_hold(self, wait: Wait) -> None:
        if wait.granted_at is None:
            return
        held = time.monotonic() - wait.granted_at
        for table, key in ((self.hold_by_path, wait.paths[-1]), (self.hold_by_task, wait.task)):
            if len(table) > 10_000:
                table.clear()  # bounded: many one-off keys must not grow the agent
            mean = table.get(key)
            table[key] = held if mean is None else mean + 0.3 * (held - mean)

    def _decide(self, wait: Wait, verdict: dict) -> None:
        with self.guard:
            if wait.done or wait.verdict is not None:
                return
            wait.verdict = {"op": "claimed", "id": wait.id, "waited": round(time.monotonic() - wait.started, 6), **verdict}
            if verdict["verdict"] == "granted":
                wait.granted_at = time.monotonic()
            claimer = wait.claimer
        answer = {"op": verdict["verdict"], "id": wait.id}  # granted/timeout/unavailable/revoked/shutdown
        if wait.queued:
            answer["queued"] = True
        if verdict["verdict"] == "unavailable":
            answer["error"] = verdict["error"]
        wait.owner.send(answer)
        if claimer is not None:
            claimer.send(wait.verdict)
            if verdict["verdict"] != "granted":
                self._forget(wait)

    def _claim(self, peer: Connection, request_id: str) -> None:
        """Hand a decided request, or one next in line, to the pool process that runs it.

        A next-in-line claimer is told ``pending`` and gets the verdict the moment it is
        decided.  Other undecided requests are not claimable: the claimer would run
        in-process and could queue behind our own node."""
        with self.guard:
            wait = self.waits.get(request_id)
            if (wait is None or wait.done or wait.claimer is not None
                    or (wait.verdict is None and not wait.next_sent)):
                peer.send({"op": "claimed", "id": request_id, "verdict": "unknown"})
                return
            wait.claimer = peer
            verdict = wait.verdict
        if verdict is None:
            peer.send({"op": "claimed", "id": request_id, "verdict": "pending"})
            return
        peer.send(verdict)
        if verdict["verdict"] != "granted":
            self._forget(wait)

    def _release(self, peer: Connection, request_id: str) -> None:
        """Let go of a claimed request's locks; the answer says whether each delete proved
        the lock held to the end.  Answered from the deletes' replies: no thread waits."""
        with self.guard:
            wait = self.waits.get(request_id)
            if wait is None or wait.claimer is not peer or wait.done:
                peer.send({"op": "released", "id": request_id, "proven": False, "reason": "not held through the agent"})
                return
            wait.done = True
            self.waits.pop(request_id, None)
            self._learn_hold(wait)
        reason = next((a.lost_reason for a in wait.attempts if a.lost_reason), None)
        outcomes = self._release_attempts(wait)
        pending = [p for _, p in outcomes if p is not None and not isinstance(p, str)]
        left = [len(pending)]
        guard = threading.Lock()

        def answer() -> None:
            proven = all(held and _outcome(p) == DELETED for held, p in outcomes)
            why = reason or (None if proven else "lock node was already gone at release")
            peer.send({"op": "released", "id": request_id, "proven": proven, "reason": why})

        def one_done(_result) -> None:
            with guard:
                left[0] -= 1
                last = left[0] == 0
            if last:
                answer()

        if not pending:
            return answer()
        for p in pending:
            p.rawlink(one_done)

    def _release_attempts(self, wait: Wait) -> list:
        """Let go of every path taken: ``(was_held, outcome)`` per path (see Attempt.release)."""
        return [attempt.release() for attempt in reversed(wait.attempts)]

    def _cancel(self, request_id: str, why: str = "finished", in_pool: bool = False) -> None:
        """Stop waiting for a request: ``revoked`` or ``shutdown`` by the main process, or
        ``finished`` by the pool without claiming (a grant nobody claimed is let go).

        A request the main process handed to the pool while next in line (``in_pool``) and
        still undecided is given the verdict ``why`` instead: its pool process, claiming or
        about to, must not run it.  Decided, it runs (or ran) as granted: its own release
        lets go."""
        with self.guard:
            wait = self.waits.get(request_id)
            if wait is None or (wait.claimer is not None and wait.verdict is not None):
                return
            if in_pool and wait.verdict is not None:
                return
        if not in_pool:
            if wait.claimer is None:
                self._drop(wait)
            return
        for attempt in wait.attempts:
            attempt.cancel()
        self._release_attempts(wait)
        self._decide(wait, {"verdict": why})

    def _drop(self, wait: Wait) -> None:
        """Stop waiting for, or let go of, a request nobody runs."""
        self._forget(wait)
        for attempt in wait.attempts:
            attempt.cancel()
        self._release_attempts(wait)

    def _forget(self, wait: Wait) -> None:
        with self.guard:
            wait.done = True
            if self.waits.get(wait.id) is wait:
                del self.waits[wait.id]

    # ------------------------------------------------------------------ lock state
    @staticmethod
    def _tokens(wait: Wait) -> dict[str, int]:
        return {a.lk.path: a.token for a in wait.attempts}

    @staticmethod
    def _nodes(wait: Wait) -> dict[str, str]:
        return {a.lk.path: f"{a.lk.path}/{a.node}" for a in wait.attempts}

    def _lost(self, wait: Wait) -> None:
        self._push_state(wait)

    def _push_state(self, wait: Wait) -> None:
        states = [a.state for a in wait.attempts]
        held = bool(states) and all(s is State.HELD for s in states)
        reason = next((a.lost_reason for a in wait.attempts if a.lost_reason), None)
        if not held and reason is None:
            reason = "ZooKeeper connection suspended" if State.HELD_SUSPENDED in states else "not held"
        with self.guard:
            claimer = wait.claimer
            if claimer is None or wait.done or wait.verdict is None or wait.verdict.get("verdict") != "granted":
                return
            lost = State.LOST in states
            if wait.shown_held == held and not lost:
                return
            wait.shown_held = held
        claimer.send({"op": "state", "id": wait.id, "held": held, "lost": lost, "reason": reason})

    # ------------------------------------------------------------------ peers leaving
    def _claimed(self) -> bool:
        with self.guard:
            return any(w.claimer is not None and not w.done for w in self.waits.values())

    def _gone(self, peer: Connection) -> None:
        """A process closed its end (exited, or was killed): free what it held at once."""
        with self.guard:
            self.peers.discard(peer)
            claimed = [w for w in self.waits.values() if w.claimer is peer and not w.done]
            unclaimed = [w for w in self.waits.values() if w.owner is peer and w.claimer is None and not w.done]
            if peer is self.main:
                self.main = None
        for wait in claimed:
            with self.guard:
                wait.done = True
                self.waits.pop(wait.id, None)
            self._release_attempts(wait)
            logger.warning("zklock agent: released the lock of request %s: its pool process is gone", wait.id)
        for wait in unclaimed:
            self._drop(wait)
        with self.guard:
            if self.main_seen and self.main is None and not self._claimed():
                self.stopped.set()


def _outcome(pending):
    """A release outcome: the delete's result once ready, or the string/None given."""
    if pending is None or isinstance(pending, str):
        return pending
    try:
        return pending.get(timeout=0)
    except Exception:
        return None


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s: %(levelname)s/zklock-agent] %(message)s")
    path = sys.argv[1]
    settings = from_wire(json.loads(sys.stdin.readline()))
    agent = Agent(settings, path)

    def on_state(state: str) -> None:
        if state == KazooState.LOST and not agent.stopped.is_set():
            logger.warning("zklock agent: ZooKeeper session lost; locks held through it are lost")

    agent.client.add_listener(on_state)
    agent.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
