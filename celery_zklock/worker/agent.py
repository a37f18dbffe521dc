"""The lock agent: one process per worker that waits for locks so that pool processes do not.

Why a process of its own, exec'd rather than forked: the worker's main process forks pool
children, and a kazoo client's threads alive in a forking process can be copied
mid-operation (kazoo #554/#519/#628); the pool processes must not wait either — a waiting
task in a prefork child takes a slot that other keys need.  So the agent holds the
worker's only ZooKeeper session, queues for every locked request the main process
receives (the event-driven engine: no thread per waiter), and hands each lock to the pool
process that claims it.  Protocol: :mod:`celery_zklock.worker.agent_link`.

Run by the worker (:mod:`celery_zklock.worker.worker_queue`) as ``python -m celery_zklock.worker.agent
SOCKET`` with the settings as JSON on stdin (they may carry credentials: never argv).
It exits once the worker's main process and every pool process that holds a lock
through it have gone; closing its session deletes whatever it still had.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from kazoo.protocol.states import KazooState

from ..config import ZkSettings, from_wire
from ..engine import guards
from ..engine.client import connect, disconnect
from ..engine.internals import State
from ..engine.lock import contenders
from ..engine.session import DELETED, LEASED, WRITTEN, monitor_for
from .agent_link import HANDOFF_MAX_WAIT, HEARTBEAT, Connection
from .cohort import Cohort

logger = logging.getLogger("celery_zklock.worker.agent")

#: Outcomes of a release that prove the lock was held to the end.
PROOFS = (DELETED, WRITTEN, LEASED)

#: The agent's event thread is stuck (not merely busy) when work waits and none has been
#: done for this long; its heartbeats then stop, and the worker restarts it.
STUCK_AFTER = 1.0


@dataclass(eq=False)
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
    guard: dict | None = None  # its enqueue guard (lock_enqueue): ended or moved when decided
    guard_moved: bool = False  # the guard's start is done (or under way) for its grant
    claimer: Connection | None = None
    holds: dict = field(default_factory=dict)  # path -> (cohort, slot, token), in order taken
    current: Cohort | None = None  # the cohort whose local queue it waits in
    expired: bool = False  # its deadline passed; a fresh node's first answer decides
    verdict: dict | None = None  # what a claim is told once decided
    shown_held: bool | None = None  # the last state pushed to the claimer
    next_sent: bool = False  # told the main process it is next in line (claimable undecided)
    queued: bool = False  # had to wait behind another holder (its key is contended)
    timer: list | None = None
    granted_at: float | None = None
    started: float = field(default_factory=time.monotonic)
    done: bool = False  # released or cancelled


class Agent:
    """Serves the worker's processes; every decision runs on one event thread (:meth:`post`)."""

    def __init__(self, settings: ZkSettings, path: str) -> None:
        self.settings = settings
        self.path = path
        self.client = connect(settings)
        self.monitor = monitor_for(self.client)
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.progress = time.monotonic()  # when the event thread last finished an event
        self.peers_guard = threading.Lock()
        self.peers: set[Connection] = set()
        self.waits: dict[str, Wait] = {}
        self.claimed: set[Wait] = set()  # granted and claimed: their states are pushed
        self.cohorts: dict[tuple[str, int], Cohort] = {}
        self.main: Connection | None = None
        self.main_seen = False
        self.stopped = threading.Event()
        self.parent = os.getppid()
        # Mean time a lock was held (grant to release), per lock path and per task name:
        # how long a request next in line would idle in a pool process if handed over.
        self.hold_by_path: dict[str, float] = {}
        self.hold_by_task: dict[str, float] = {}
        self.guard_jobs: queue.SimpleQueue | None = None

    # ------------------------------------------------------------------ threads
    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event thread: ZooKeeper callbacks and peer messages only
        enqueue, so no lock orders between the agent and the engine's attempts exist."""
        self.events.put((fn, args))

    def _loop(self) -> None:
        while not self.stopped.is_set():
            fn, args = self.events.get()
            if fn is None:
                return
            try:
                fn(*args)
            except Exception:  # one bad event must not take the agent down
                logger.exception("zklock agent: %s failed", getattr(fn, "__name__", fn))
            self.progress = time.monotonic()

    def serve(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        os.chmod(self.path, 0o600)
        server.listen(128)
        for target, name in ((self._loop, "events"), (self._heartbeat, "heartbeat")):
            threading.Thread(target=target, name=f"zklock-agent-{name}", daemon=True).start()
        threading.Thread(target=self._accept, args=(server,), name="zklock-agent-accept", daemon=True).start()
        print("READY", flush=True)  # the worker waits for this line before forking its pool
        self.stopped.wait()
        self.events.put((None, ()))
        server.close()
        disconnect(self.client)

    def _accept(self, server: socket.socket) -> None:
        while not self.stopped.is_set():
            try:
                sock, _ = server.accept()
            except OSError:
                return
            peer = Connection(sock)
            with self.peers_guard:
                self.peers.add(peer)
            threading.Thread(target=self._read, args=(peer,), name="zklock-agent-peer", daemon=True).start()

    def _read(self, peer: Connection) -> None:
        while True:
            messages = peer.receive()
            if messages is None:
                return self.post(self._gone, peer)
            for message in messages:
                self.post(self._handle, peer, message)

    def _heartbeat(self) -> None:
        """Ping everyone while the event thread makes progress (busy is fine, stuck is not),
        and let it push lock states to claimers and retry stalled keys."""
        while not self.stopped.wait(HEARTBEAT):
            if os.getppid() != self.parent and self.main is None and not self._claimed():
                self.stopped.set()  # the worker died, and no process of it holds a lock
                return
            if self.events.qsize() and time.monotonic() - self.progress > STUCK_AFTER:
                continue  # stuck: silence tells the worker to restart us
            with self.peers_guard:
                peers = list(self.peers)
            for peer in peers:
                peer.send({"op": "ping"})
            self.post(self._tick)

    def _tick(self) -> None:
        for wait in list(self.claimed):
            self._push_state(wait)
        for cohort in list(self.cohorts.values()):
            if cohort.queue and not any(s.holder is not None for s in cohort.slots):
                cohort.pump()  # a node suspended while free: granted once verified again
            self._tidy(cohort)

    # ------------------------------------------------------------------ requests
    def _handle(self, peer: Connection, msg: dict) -> None:
        op = msg.get("op")
        if op == "hello":
            if msg.get("role") == "main":
                self.main, self.main_seen = peer, True
        elif op == "wait":
            self._wait(peer, msg)
        elif op == "cancel":
            self._cancel(msg["id"], msg.get("why") or "finished", bool(msg.get("in_pool")))
        elif op == "claim":
            self._claim(peer, msg["id"])
        elif op == "release":
            self._release(peer, msg["id"])
        elif op == "unguard":
            self._guard_op(guards.release, msg["paths"], msg["id"], int(msg.get("retries") or 0))

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
            guard=guards.guarded(msg.get("guard") and {guards.HEADER: msg.get("guard")}),
        )
        old = self.waits.get(wait.id)
        if old is not None and not old.done:
            # The same task id while we still wait for, or hold, its lock: a retry the body
            # published while holding it, or a redelivery.  The running one keeps its lock;
            # this one runs in-process (its claim will say "unknown"), still protected.
            peer.send({"op": "bypass", "id": wait.id})
            return
        self.waits[wait.id] = wait
        if wait.deadline is not None:
            wait.timer = self.monitor.timers.call_at(wait.deadline, self.post, self._deadline, wait)
        self._take_next(wait)

    def _take_next(self, wait: Wait) -> None:
        """Join the next path's local queue (canonical order) or, with all taken, grant."""
        if wait.done:
            return
        if len(wait.holds) == len(wait.paths):
            self.monitor.timers.cancel(wait.timer)
            return self._decide(wait, {"verdict": "granted", "tokens": self._tokens(wait), "nodes": self._nodes(wait)})
        path = wait.paths[len(wait.holds)]
        cohort = self.cohorts.get((path, wait.max_holders))
        if cohort is None:
            cohort = self.cohorts[(path, wait.max_holders)] = Cohort(self, path, wait.max_holders)
        wait.current = cohort
        cohort.join(wait)

    # The cohort's callbacks (on the event thread).
    def on_granted(self, wait: Wait, cohort: Cohort, slot, token: int) -> None:
        wait.holds[cohort.path] = (cohort, slot, token)
        wait.current = None
        self._take_next(wait)

    def on_failed(self, wait: Wait, exc: BaseException) -> None:
        wait.current = None
        self._let_go(wait)
        self._decide(wait, {"verdict": "unavailable", "error": str(exc)})

    def on_timed_out(self, wait: Wait, path: str) -> None:
        """Free what it took, then say who holds the key (read off this thread)."""
        wait.current = None
        self._let_go(wait)
        self.client.handler.spawn(self._holders_then_decide, wait, path)

    def on_queued(self, wait: Wait, position: int) -> None:
        if not wait.queued:
            wait.queued = True
            wait.owner.send({"op": "queued", "id": wait.id, "position": position})

    def on_next(self, wait: Wait) -> None:
        """Every path but the last is held and only a holder is ahead of it on the last: the
        main process may hand it to the pool now, so the release that grants it reaches a
        pool process already claiming (no dispatch, no wait for a free slot)."""
        if (not wait.early or wait.done or wait.verdict is not None or wait.next_sent
                or len(wait.holds) != len(wait.paths) - 1):
            return
        expected = self._expected_hold(wait)
        if expected is not None and expected > HANDOFF_MAX_WAIT:
            return
        wait.next_sent = True
        wait.owner.send({"op": "next", "id": wait.id, "hold": expected})

    def on_slot_lost(self, wait: Wait) -> None:
        self._push_state(wait)

    def _deadline(self, wait: Wait) -> None:
        if wait.done or wait.verdict is not None or wait.current is None:
            return
        if wait.current.expire(wait):
            self.on_timed_out(wait, wait.current.path)

    def _holders_then_decide(self, wait: Wait, path: str) -> None:
        try:
            holders = [c.identifier for c in contenders(self.client, path, wait.max_holders) if c.holder]
        except Exception:
            holders = []
        self.post(self._decide, wait, {"verdict": "timeout", "holders": holders})

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
        if wait.done or wait.verdict is not None:
            return
        self.monitor.timers.cancel(wait.timer)
        if verdict["verdict"] == "granted" and wait.guard is not None and not wait.guard_moved:
            # Its enqueue guard ends (or becomes ours) before its body can start: a publish
            # after the start is then never deduped into a run that began without it.
            wait.guard_moved = True
            guard = wait.guard
            self._guard_op(guards.start, guard["paths"], wait.id, int(guard.get("retries") or 0), guard["until"],
                           after=lambda: self._decide(wait, verdict))
            return
        wait.verdict = {"op": "claimed", "id": wait.id, "waited": round(time.monotonic() - wait.started, 6), **verdict}
        if verdict["verdict"] == "granted":
            wait.granted_at = time.monotonic()
        self._guard_decided(wait, verdict["verdict"])
        answer = {"op": verdict["verdict"], "id": wait.id}  # granted/timeout/unavailable/revoked/shutdown
        if wait.queued:
            answer["queued"] = True
        if verdict["verdict"] == "unavailable":
            answer["error"] = verdict["error"]
        wait.owner.send(answer)
        if wait.claimer is not None:
            self._send_verdict(wait)
            if verdict["verdict"] != "granted":
                self._forget(wait)

    # ------------------------------------------------------------------ enqueue guards
    def _guard_op(self, fn, *args, after=None) -> None:
        """A guard's blocking ZooKeeper calls, off the event thread and in order on one
        thread of their own (a task's end must not overtake its start); ``after`` then runs
        on the event thread, whatever the outcome."""
        if self.guard_jobs is None:
            self.guard_jobs = queue.SimpleQueue()
            threading.Thread(target=self._guard_loop, name="zklock-agent-guards", daemon=True).start()
        self.guard_jobs.put((fn, args, after))

    def _guard_loop(self) -> None:
        while True:
            fn, args, after = self.guard_jobs.get()
            try:
                fn(self.client, *args)
            except Exception as exc:  # the message's expires still bounds the guard
                logger.warning("zklock agent: enqueue guard of %s not updated (%r)", args[1], exc)
            if after is not None:
                self.post(after)

    def _guard_decided(self, wait: Wait, verdict: str) -> None:
        """Its lock is decided: granted, the guard ends (``start``) or becomes an ephemeral
        node of our session (``finish``); not to run, it ends.  ``shutdown`` leaves it: the
        message goes back to the broker, still queued."""
        guard = wait.guard
        if guard is None or verdict == "shutdown":
            return
        retries = int(guard.get("retries") or 0)
        if verdict == "granted":  # moved by _decide already
            if guard["until"] != "finish":
                wait.guard = None
        else:
            wait.guard = None
            self._guard_op(guards.release, guard["paths"], wait.id, retries)

    def _guard_finished(self, wait: Wait) -> None:
        """A granted request ran (or its process died): its running guard goes."""
        guard, wait.guard = wait.guard, None
        if guard is not None and wait.verdict is not None and wait.verdict.get("verdict") == "granted":
            self._guard_op(guards.release, guard["paths"], wait.id, int(guard.get("retries") or 0))

    def _claim(self, peer: Connection, request_id: str) -> None:
        """Hand a decided request, or one next in line, to the pool process that runs it.

        A next-in-line claimer is told ``pending`` and gets the verdict the moment it is
        decided.  Other undecided requests are not claimable: the claimer would run
        in-process and could queue behind our own node."""
        wait = self.waits.get(request_id)
        if (wait is None or wait.done or wait.claimer is not None
                or (wait.verdict is None and not wait.next_sent)):
            peer.send({"op": "claimed", "id": request_id, "verdict": "unknown"})
            return
        wait.claimer = peer
        self.claimed.add(wait)
        if wait.verdict is None:
            peer.send({"op": "claimed", "id": request_id, "verdict": "pending"})
            return
        self._send_verdict(wait)
        if wait.verdict["verdict"] != "granted":
            self._forget(wait)

    def _release(self, peer: Connection, request_id: str) -> None:
        """Let go of a claimed request's locks; the answer says whether each one was proven
        held to the end (the delete, or the local handoff's write, found our node).
        Answered from those replies: no thread waits."""
        wait = self.waits.get(request_id)
        if wait is None or wait.claimer is not peer or wait.done:
            peer.send({"op": "released", "id": request_id, "proven": False, "reason": "not held through the agent"})
            return
        self._learn_hold(wait)
        self._guard_finished(wait)
        reason = self._lost_reason(wait)
        outcomes = self._let_go(wait)
        self._forget(wait)
        pending = [p for p in outcomes if not isinstance(p, str)]
        left = [len(pending)]

        def answer() -> None:
            proven = all(_outcome(p) in PROOFS for p in outcomes)
            why = reason or (None if proven else "lock node was already gone at release")
            peer.send({"op": "released", "id": request_id, "proven": proven, "reason": why})

        def one_done(_result) -> None:
            left[0] -= 1
            if left[0] == 0:
                answer()

        if not pending:
            return answer()
        for p in pending:
            p.rawlink(lambda result: self.post(one_done, result))

    def _let_go(self, wait: Wait) -> list:
        """Leave the local queue and let go of every path taken (the next of ours may get
        it at once); the release proof per path, newest first."""
        if wait.current is not None:
            cohort, wait.current = wait.current, None
            cohort.leave(wait)
            self._tidy(cohort)
        outcomes = []
        for cohort, _slot, _token in reversed(list(wait.holds.values())):
            outcomes.append(cohort.release(wait))
            self._tidy(cohort)
        wait.holds.clear()
        return outcomes

    def _tidy(self, cohort: Cohort) -> None:
        if cohort.idle and self.cohorts.get((cohort.path, cohort.max_holders)) is cohort:
            del self.cohorts[(cohort.path, cohort.max_holders)]

    def _cancel(self, request_id: str, why: str = "finished", in_pool: bool = False) -> None:
        """Stop waiting for a request: ``revoked`` or ``shutdown`` by the main process, or
        ``finished`` by the pool without claiming (a grant nobody claimed is let go).

        A request the main process handed to the pool while next in line (``in_pool``) and
        still undecided is given the verdict ``why`` instead: its pool process, claiming or
        about to, must not run it.  Decided, it runs (or ran) as granted: its own release
        lets go."""
        wait = self.waits.get(request_id)
        if wait is None or wait.done or (wait.claimer is not None and wait.verdict is not None):
            return
        if in_pool and wait.verdict is not None:
            return
        if why == "revoked":
            self._guard_decided(wait, "revoked")
        if not in_pool:
            if wait.claimer is None:
                self._drop(wait)
            return
        self._let_go(wait)
        self._decide(wait, {"verdict": why})

    def _drop(self, wait: Wait) -> None:
        """Stop waiting for, or let go of, a request nobody runs."""
        self._forget(wait)
        self._let_go(wait)

    def _forget(self, wait: Wait) -> None:
        wait.done = True
        self.claimed.discard(wait)
        self.monitor.timers.cancel(wait.timer)
        if self.waits.get(wait.id) is wait:
            del self.waits[wait.id]

    # ------------------------------------------------------------------ lock state
    @staticmethod
    def _tokens(wait: Wait) -> dict[str, int]:
        return {path: token for path, (_c, _s, token) in wait.holds.items()}

    @staticmethod
    def _nodes(wait: Wait) -> dict[str, str]:
        return {path: slot.node_path for path, (_c, slot, _t) in wait.holds.items()}

    @staticmethod
    def _lost_reason(wait: Wait) -> str | None:
        for _c, slot, _t in wait.holds.values():
            if slot.attempt.lost_reason:
                return slot.attempt.lost_reason
            if slot.lost:
                return "lock lost"
        return None

    def _state(self, wait: Wait) -> dict:
        """Whether the request's locks are safe to hold right now, as a claimer is told."""
        slots = [slot for _c, slot, _t in wait.holds.values()]
        held = bool(slots) and all(s.held for s in slots)
        lost = any(s.lost or s.attempt.state is State.LOST for s in slots)
        reason = self._lost_reason(wait)
        if not held and reason is None:
            suspended = any(s.attempt.state is State.HELD_SUSPENDED for s in slots)
            reason = "ZooKeeper connection suspended" if suspended else "not held"
        return {"held": held, "lost": lost, "reason": reason}

    def _push_state(self, wait: Wait) -> None:
        if (wait.claimer is None or wait.done or wait.verdict is None
                or wait.verdict.get("verdict") != "granted"):
            return
        state = self._state(wait)
        if wait.shown_held == state["held"] and not state["lost"]:
            return
        wait.shown_held = state["held"]
        wait.claimer.send({"op": "state", "id": wait.id, **state})

    def _send_verdict(self, wait: Wait) -> None:
        """Tell the claimer its verdict; a grant carries the locks' state *now*: a request
        granted before ZooKeeper became unreachable may be claimed only later (no free pool
        process until then), and its body must not start on the old grant alone."""
        message = wait.verdict
        if message["verdict"] == "granted":
            state = self._state(wait)
            wait.shown_held = state["held"]
            message = {**message, **state}
        wait.claimer.send(message)

    # ------------------------------------------------------------------ peers leaving
    def _claimed(self) -> bool:
        return bool(self.claimed)

    def _gone(self, peer: Connection) -> None:
        """A process closed its end (exited, or was killed): free what it held at once."""
        with self.peers_guard:
            self.peers.discard(peer)
        if peer is self.main:
            self.main = None
        for wait in [w for w in self.waits.values() if not w.done]:
            if wait.claimer is peer:
                self._guard_finished(wait)
                self._drop(wait)
                logger.warning("zklock agent: released the lock of request %s: its pool process is gone", wait.id)
            elif wait.owner is peer and wait.claimer is None:
                self._drop(wait)
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
