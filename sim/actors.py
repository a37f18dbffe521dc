"""Who acts in a simulated run: workers (the real lock agent, with a modelled main process
and pool processes around it), foreign contenders on the same keys, and an operator.

The agent is :class:`celery_zklock.worker.agent.Agent`, unchanged: its event thread is a
simulated thread that runs :meth:`~celery_zklock.worker.agent.Agent.run_event`,
its ZooKeeper client a :class:`~sim.zk.SimClient`, its peers' sockets simulated links
carrying the same messages (:mod:`celery_zklock.worker.agent_protocol`).  The main process and
pool processes are models that speak that protocol as ``wait_outside_pool`` and ``agent_client``
do, and record what each pool process *believes* it holds: that is what the invariants
judge (:mod:`sim.checks`).
"""

from __future__ import annotations

import uuid
from collections import deque

from celery_zklock.config import load_settings
from celery_zklock.engine.internals import LockInternals, State
from celery_zklock.engine.kazoo_compat import on_ready
from celery_zklock.engine.znodes import NodeKind
from celery_zklock.worker.agent import Agent
from celery_zklock.worker.agent_client import starts_on_carried
from celery_zklock.worker.agent_protocol import (
    HEARTBEAT,
    Bypass,
    Cancel,
    Claim,
    ClaimAnswer,
    Claimed,
    Decided,
    Finished,
    Hello,
    LockState,
    Next,
    PeerRole,
    Ping,
    Release,
    Released,
    StopWaiting,
    Unclaim,
    Verdict,
    Wait,
)
from celery_zklock.worker.next_in_line import Early, hand_over_early

from .world import Proc, Thread, World
from .zk import SimClient

#: How long a pool process waits for a claim's first answer before it unclaims and locks
#: in-process (agent_client.claim's timeout in task.py).
CLAIM_TIMEOUT = 5.0
#: How long a pool process waits for a grant's lock to be confirmed safe before giving it back.
CONFIRM_TIMEOUT = 2.0
#: How long a pool process waits for a release's answer.
RELEASE_BOUND = 10.0


class Wire:
    """One direction of a Unix socket: FIFO, small random latency, delivered on ``thread``."""

    def __init__(self, world: World, name: str, deliver, proc: Proc) -> None:
        self.world = world
        self.name = name
        self.deliver = deliver
        self.proc = proc
        self.rng = world.rng(name)
        self.last = 0.0
        self.open = True

    def send(self, msg) -> None:
        if not self.open:
            return
        self.last = max(self.last, self.world.now + 0.00005 + 0.0005 * self.rng.random())
        self.world.at(self.last, self.name, self._arrive, msg, proc=self.proc)

    def _arrive(self, msg) -> None:
        if self.open:
            self.deliver(msg)


class AgentPeer:
    """What the agent holds for a connected process (``agent_protocol.Connection``'s ``send``)."""

    def __init__(self, wire: Wire, label: str) -> None:
        self.wire = wire
        self.label = label

    def send(self, msg) -> bool:
        self.wire.send(msg)
        return True

    def __repr__(self) -> str:
        return f"<peer {self.label}>"


class _Events:
    """The agent's event queue: a put runs the event on the agent's simulated event thread."""

    def __init__(self, agent: Agent, thread: Thread, checks) -> None:
        self.agent = agent
        self.thread = thread
        self.checks = checks

    def put(self, item) -> None:
        fn, args = item
        if fn is not None:
            self.thread.put(self._run, fn, args)

    def _run(self, fn, args) -> None:
        world = self.thread.world
        if world.full_trace is not None:
            shown = ", ".join(_brief(a) for a in args)
            world.log(f"{self.thread.proc.name}: {getattr(fn, '__qualname__', fn)}({shown})")
        self.agent.run_event(fn, args)
        self.checks.bookkeeping(self.agent)

    def qsize(self) -> int:
        return len(self.thread.items)


def _brief(value) -> str:
    if hasattr(value, "op"):  # a message
        shown = [f"{k}: {getattr(value, k)}" for k in ("id", "verdict", "why") if getattr(value, k, None) is not None]
        return f"{value.op} {{{', '.join(shown)}}}"
    ident = getattr(value, "id", None)
    if isinstance(ident, str):
        return ident
    node = getattr(getattr(value, "attempt", None), "node", None)
    if node is not None:
        return f"slot {node[-10:]}"
    return type(value).__name__


def _nodes(wait) -> dict:
    """The nodes of the grant the agent made for ``wait`` (None: it is gone), read for the checks."""
    verdict = wait.verdict if wait is not None else None
    return dict(verdict.nodes or {}) if verdict is not None else {}


class Worker:
    """A Celery worker: its lock agent (real), its main process and pool processes (models)."""

    def __init__(self, run, name: str, settings: dict, pools: int, main_class=None) -> None:
        self.run = run
        self.world: World = run.world
        self.name = name
        self.host = self.world.host(name)
        self.agent_proc = Proc(self.world, self.host, f"{name}.agent")
        self.client = SimClient(self.world, run.server, self.agent_proc, f"{name}.zk", settings.pop("_session", 4.0))
        self.settings = load_settings(settings)
        self.agent = Agent(self.settings, f"/sim/{name}.sock", client=self.client)
        self.agent.events = _Events(self.agent, Thread(self.agent_proc, "events"), run.checks)
        self.granted = []  # (time, wait id, path, token, node path, session): every grant the agent made
        original = self.agent.requests.on_granted

        def on_granted(wait, cohort, slot, token):
            run.checks.granted(self, wait, cohort, slot, token)
            return original(wait, cohort, slot, token)

        self.agent.requests.on_granted = on_granted
        self.pool_count = pools
        self.killed_at: float | None = None  # killed whole (a held-aside scenario's fault)
        self.stopping_at: float | None = None  # stopped warm (a held-aside scenario's fault)
        self.main = (main_class or MainProcess)(self)
        self.pools = [PoolProcess(self, i) for i in range(pools)]
        self.dead_pools: list = []
        self.client.on_send = self._sending
        self.exiting_pools = False  # the worker is shutting down: pool processes exit once idle
        self.long_share = 0.1  # bodies that run long enough to age the lease (the scenario may set it)
        self.long_holds = (0.06, 0.1, 0.3, 1.0)  # their lengths (s)
        self.busy_bodies = 0  # a "pool-busy" fault: this many next bodies run for busy_hold (s)
        self.busy_hold = 0.0
        self.stopped_at: float | None = None
        self.world.at(HEARTBEAT, f"{name}.heartbeat", self._heartbeat, proc=self.agent_proc)

    def _sending(self, op: tuple) -> None:
        ops = op[1] if op[0] == "multi" else [op]
        for one in ops:
            if one[0] == "delete":
                self.run.checks.deleting(self, one[1])

    def connect(self, actor, label: str) -> AgentPeer:
        """A process connects to the agent: a wire each way."""
        to_actor = Wire(self.world, f"{self.name}.agent->{label}", actor.receive, actor.proc)
        peer = AgentPeer(to_actor, label)
        actor.to_agent = Wire(self.world, f"{self.name}.{label}->agent",
                              lambda msg: self.agent.post(self.agent.handle, peer, msg), self.agent_proc)
        return peer

    def gone(self, actor) -> None:
        """A process's end of the socket closed: the agent hears it after what it sent."""
        peer = actor.peer
        self.world.at(actor.to_agent.last + 0.0001, f"{self.name}.{peer.label}->agent",
                      lambda: self.agent.post(self.agent.gone, peer), proc=self.agent_proc)
        peer.wire.open = False

    def _heartbeat(self) -> None:
        """Agent._heartbeat: ping every peer, and let the event thread tick."""
        if self.agent.stopped.is_set():
            return self._stopped()
        for peer in list(self.agent.peers):
            peer.send(Ping())
        self.agent.post(self.agent.tick)
        self.world.at(self.world.now + HEARTBEAT, f"{self.name}.heartbeat", self._heartbeat, proc=self.agent_proc)

    def _stopped(self) -> None:
        if self.stopped_at is None:
            self.stopped_at = self.world.now
            self.world.log(f"{self.name}: agent stopped")
            self.client.stop()  # serve() returns: disconnect, the session ends

    def poll_stopped(self) -> None:
        if self.agent.stopped.is_set() and self.stopped_at is None and not self.agent_proc.frozen():
            self._stopped()


class MainProcess:
    """The worker's main process (``wait_outside_pool``): asks the agent for each request's lock,
    hands decided (or next-in-line) requests to a free pool process, may revoke."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.world = worker.world
        self.proc = Proc(self.world, worker.host, f"{worker.name}.main")
        self.thread = Thread(self.proc, "loop")
        self.rng = self.world.rng(self.proc.name)
        self.peer = worker.connect(self, "main")
        worker.agent.peers.add(self.peer)
        self.to_agent.send(Hello(PeerRole.MAIN))
        self.requests: dict[str, dict] = {}
        self.backlog: deque = deque()  # decided or next in line, waiting for a free pool process
        self.early: set[str] = set()  # handed to the pool while next in line
        self.next_up: dict[str, object] = {}  # next in line, waiting for a handoff slot
        self.count = 0
        self.alive = True
        self.die_after_carry = False  # a fault: killed right after it hands over a carried grant

    def receive(self, msg) -> None:
        req = self.requests.get(getattr(msg, "id", None))
        if req is None:
            return
        if isinstance(msg, Decided):
            op = msg.verdict.value
            if self.world.full_trace is not None:
                self.world.log(f"{self.proc.name}: {op} {req['id']}")
            if req.get("dropped"):
                return  # revoked here before the agent's verdict crossed the cancel
            if req.get("verdict") is not None:
                self.worker.run.checks.fail(f"{self.proc.name}: a second verdict {op} for {req['id']}")
            req["verdict"] = op
            if msg.carry is not None:
                # The grant travels with the task (wait_outside_pool's hand-over); the nodes it
                # names are read from the agent, for the checks (the pool does not need them).
                wait = self.worker.agent.requests.waits.get(req["id"])
                req["carry"] = msg.carry
                req["nodes"] = _nodes(wait)
            self.next_up.pop(req["id"], None)
            self._dispatch(req, first=msg.verdict is Verdict.GRANTED and msg.queued)
        elif isinstance(msg, Next):
            if self.world.full_trace is not None:
                self.world.log(f"{self.proc.name}: next {req['id']}")
            self._next_in_line(req, msg.hold, msg.ours)
        elif isinstance(msg, Bypass):
            req["verdict"] = "bypass"
            req["done"] = True

    def may_park(self, ours: bool) -> bool:
        """next_in_line.may_park: nothing waits for a process; behind another contender's
        holders, two are free."""
        return not self.backlog and (ours or sum(1 for pool in self.worker.pools if pool.free()) >= 2)

    def slots(self) -> int:
        """next_in_line's handoff slots (NextInLine.slots): never the whole pool."""
        return max(0, min(len(self.worker.pools) // 2, len(self.worker.pools) - 1))

    def _next_in_line(self, req: dict, hold, ours: bool = True) -> None:
        if req["dispatched"] or req.get("verdict") is not None:
            return
        when = hand_over_early(hold, len(self.early), self.slots(), self.may_park(ours))
        if when is Early.LATER:
            self.next_up[req["id"]] = (hold, ours)
        elif when is Early.NOW:
            self.early.add(req["id"])
            self._dispatch(req, first=True)

    def submit(self, path: str, timeout, early: bool) -> None:
        if not self.alive:
            return
        self.count += 1
        rid = f"{self.worker.name}-{self.count}"
        self.requests[rid] = {"id": rid, "seq": self.count, "path": path, "verdict": None, "dispatched": False, "done": False,
                              "sent_at": self.world.now, "timeout": timeout}
        self.to_agent.send(Wait(rid, (path,), self.count, "t", 1, timeout, rid, early=early and self.slots() > 0))

    def revoke(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is None or req["done"] or req.get("verdict") is not None:
            return
        self.world.log(f"{self.proc.name}: revokes {rid}")
        in_pool = rid in self.early
        self.to_agent.send(StopWaiting(rid, Cancel.REVOKED, in_pool))
        if not in_pool:  # Celery drops it; only one handed to the pool hears back
            self.next_up.pop(rid, None)
            if req["dispatched"]:
                return
            req["verdict"], req["done"], req["dropped"] = "revoked", True, True

    def _dispatch(self, req: dict, first: bool = False) -> None:
        if req["dispatched"]:
            return
        req["dispatched"] = True
        if first:
            self.backlog.appendleft(req["id"])
        else:
            self.backlog.append(req["id"])
        self.feed()

    def feed(self) -> None:
        for pool in self.worker.pools:
            if not self.backlog:
                return
            if pool.free():
                req = self.requests[self.backlog.popleft()]
                if not req["done"]:
                    pool.dispatch(req)
                    if self.die_after_carry and req.get("carry") is not None:
                        self.world.log(f"fault: {self.proc.name} killed")
                        return self.die()

    def die(self) -> None:
        """Gone (SIGKILL, or the worker's exit): its socket closes; the agent hears it."""
        if self.alive:
            self.alive = False
            self.proc.alive = False
            self.worker.gone(self)

    def finished(self, req: dict) -> None:
        req["done"] = True
        self.to_agent.send(Finished((req["id"],), (req["seq"],)))
        self.early.discard(req["id"])
        for rid, (hold, ours) in list(self.next_up.items()):  # wait_outside_pool: parking the next in line
            if len(self.early) >= self.slots():
                break
            if not self.may_park(ours):
                continue
            del self.next_up[rid]
            self._next_in_line(self.requests[rid], hold, ours)
        self.thread.put(self.feed)


class PoolProcess:
    """A prefork child (``agent_client``): claims a request, believes it holds the lock while
    the agent says so and is not silent, holds, releases, or dies."""

    def __init__(self, worker: Worker, index: int, generation: int = 0) -> None:
        self.worker = worker
        self.world = worker.world
        self.index = index
        self.proc = Proc(self.world, worker.host, f"{worker.name}.pool{index}.{generation}")
        self.generation = generation
        self.rng = self.world.rng(self.proc.name)
        self.peer = worker.connect(self, f"pool{index}.{generation}")
        worker.agent.peers.add(self.peer)
        self.req: dict | None = None
        self.phase = "idle"  # idle/dispatched/claiming/pending/confirming/holding/releasing/inprocess
        self.held = False  # what the agent last said
        self.lost = False
        self.tokens: dict = {}
        self.nodes: dict = {}
        self.grace = 1.0
        self.last_heard = self.proc.monotonic()
        self.belief_since: float | None = None
        self.inprocess = None
        self.claim_no = 0
        self.gave_up: set[str] = set()  # requests whose answer it stopped waiting for

    def free(self) -> bool:
        return self.proc.alive and self.phase == "idle" and not self.worker.exiting_pools

    # ---------------------------------------------------------------- what it believes
    def belief(self):
        """(path, node path, token) while this process believes it holds a lock, else None."""
        if not self.proc.alive:
            return None
        if self.phase == "holding" and self.held and not self.lost:
            if self.proc.monotonic() - self.last_heard < self.grace:
                path = self.req["path"]
                return path, self.nodes.get(path), self.tokens.get(path)
        if self.phase == "inprocess" and self.inprocess is not None:
            return self.inprocess.belief()
        return None

    # ---------------------------------------------------------------- a request
    def dispatch(self, req: dict) -> None:
        """The main process hands it over: it reaches this process through the pool's pipe,
        after the process wakes (prefork's dispatch took 2-9 ms on a busy 2-core machine)."""
        self.req = req
        self.phase = "dispatched"
        delay = self.rng.uniform(0.0002, 0.01)
        self.world.at(self.world.now + delay, f"{self.proc.name}.dispatch", self.start, req, proc=self.proc)

    def start(self, req: dict) -> None:
        if self.req is not req or self.phase != "dispatched":
            return
        self.req = req
        self.phase = "claiming"
        self.held = self.lost = False
        self.claim_no += 1
        if req.get("on_start") is not None:  # the real main process: Celery's on_accepted (the ack)
            req["on_start"](self)
        if req.get("bypassed"):  # marked by the real main process: it locks in-process, never claims
            self.world.log(f"{self.proc.name}: {req['id']} bypassed: locks in-process")
            return self._lock_in_process()
        carry = req.pop("carry", None)  # taken off the request, as agent_client.carried_grant does
        if carry is not None and starts_on_carried(self._send, req["id"], carry):
            self.world.log(f"{self.proc.name}: starts {req['id']} on its carried grant")
            self.tokens, self.nodes = dict(carry.tokens), req.get("nodes") or {}
            self.held = True
            self.grace = carry.session_timeout / 3.0
            self.worker.run.checks.carried_start(self, self.nodes, self.tokens)
            return self._confirmed()
        self.world.log(f"{self.proc.name}: claims {req['id']}")
        self.to_agent.send(Claim(req["id"]))
        no = self.claim_no
        self.world.at(self.world.now + CLAIM_TIMEOUT, f"{self.proc.name}.claim-timeout", self._claim_timeout, no,
                      proc=self.proc)

    def _send(self, msg) -> bool:
        self.to_agent.send(msg)
        return True

    def _claim_timeout(self, no: int) -> None:
        if no != self.claim_no or self.phase not in ("claiming", "pending"):
            return
        if self.phase == "pending" and self.proc.monotonic() - self.last_heard < self.grace:
            return  # a pending claim waits while the agent is alive
        self.world.log(f"{self.proc.name}: no answer to its claim of {self.req['id']}: unclaims, locks in-process")
        self.gave_up.add(self.req["id"])
        self.to_agent.send(Unclaim(self.req["id"]))
        self._lock_in_process()

    def _lock_in_process(self) -> None:
        self.phase = "inprocess"
        self.inprocess = InProcessLock(self, self.req["path"])

    def receive(self, msg) -> None:
        self.last_heard = self.proc.monotonic()
        if isinstance(msg, Ping):
            return
        rid = msg.id
        if self.req is None or rid != self.req["id"]:
            if rid in self.gave_up:
                return  # a late answer to a call it stopped waiting for (agent_client ignores it)
            if isinstance(msg, (Released, Claimed)):
                self.worker.run.checks.fail(f"{self.proc.name}: {msg.op} for {rid}, which it is not working on")
            return
        if isinstance(msg, Claimed):
            self._claimed(msg)
        elif isinstance(msg, LockState):
            self.held = msg.held
            if msg.lost:
                self.lost = True
            self._note()
            if self.phase == "confirming" and (self.held or self.lost):
                self._confirmed()
        elif isinstance(msg, Released):
            if self.phase != "releasing":
                self.worker.run.checks.fail(f"{self.proc.name}: released {rid} while {self.phase}")
            self._done()

    def _claimed(self, msg: Claimed) -> None:
        verdict = msg.verdict
        if self.phase not in ("claiming", "pending"):
            if self.phase != "inprocess":
                self.worker.run.checks.fail(f"{self.proc.name}: claimed {verdict.value} for {self.req['id']} "
                                            f"while {self.phase}")
            return
        if verdict is ClaimAnswer.PENDING:
            self.phase = "pending"
            return
        if verdict is not Verdict.GRANTED:
            if verdict is ClaimAnswer.UNKNOWN:
                return self._lock_in_process()
            if verdict is Verdict.SHUTDOWN and self.req.get("on_shutdown") is not None:
                self.req["on_shutdown"](self, self.req)
            return self._done()
        self.tokens, self.nodes = msg.tokens or {}, msg.nodes or {}
        self.held, self.lost = msg.held, msg.lost
        self.grace = float(msg.session_timeout or 3.0) / 3.0
        if self.held and not self.lost:
            return self._confirmed()
        self.phase = "confirming"
        no = self.claim_no
        self.world.at(self.world.now + CONFIRM_TIMEOUT, f"{self.proc.name}.confirm", self._unconfirmed, no,
                      proc=self.proc)

    def _unconfirmed(self, no: int) -> None:
        if no == self.claim_no and self.phase == "confirming":
            self.world.log(f"{self.proc.name}: {self.req['id']} never confirmed safe: gives it back")
            self._release()

    def _confirmed(self) -> None:
        if self.lost:
            return self._release()
        self.phase = "holding"
        self._note()
        if self.req.get("on_body") is not None and self.req["on_body"](self) is False:
            return self._release()  # not run (a redelivered copy of a finished run): released at once
        # Mostly short bodies (a hot key's handoffs), now and then a long one (its lease ages).
        long = self.rng.random() < self.worker.long_share
        hold = self.rng.choice(self.worker.long_holds) if long else self.rng.choice((0.0, 0.001, 0.003, 0.01, 0.03))
        if self.worker.busy_bodies > 0:  # a "pool-busy" fault: every process of the worker busy for a while
            self.worker.busy_bodies -= 1
            hold = self.worker.busy_hold
        no = self.claim_no
        self.world.at(self.world.now + hold, f"{self.proc.name}.body", self._body_done, no, proc=self.proc)

    def _note(self) -> None:
        self.worker.run.checks.observe(self)

    def _body_done(self, no: int) -> None:
        if no == self.claim_no and self.phase == "holding":
            self._release()

    def _release(self) -> None:
        self.phase = "releasing"
        self._note()
        if self.req.get("body") is not None:
            self.req["body"].released_at = self.world.now
        self.to_agent.send(Release(self.req["id"]))
        no = self.claim_no
        self.world.at(self.world.now + RELEASE_BOUND, f"{self.proc.name}.release-bound", self._release_bound, no,
                      proc=self.proc)

    def _release_bound(self, no: int) -> None:
        if no == self.claim_no and self.phase == "releasing":
            self.gave_up.add(self.req["id"])
            self._done()

    def inprocess_done(self) -> None:
        self.inprocess = None
        self._done()

    def _done(self) -> None:
        req, self.req = self.req, None
        self.phase = "idle"
        self.held = False
        self._note()
        if req is not None and req.get("on_end") is not None:
            req["on_end"](self, req)  # the result stored, after the release
        if req is not None:
            self.worker.main.thread.put(self.worker.main.finished, req)
        if self.worker.exiting_pools:
            self.exit()

    def die(self) -> None:
        """SIGKILL: the socket closes; the agent frees what it held through it."""
        if not self.proc.alive:
            return
        self.world.log(f"{self.proc.name}: killed (holding {self.req['id'] if self.req else None})")
        req = self.req
        self.proc.alive = False
        self._note()
        if self.inprocess is not None:
            self.inprocess.die()
        self.worker.gone(self)
        if req is not None:
            self.worker.main.thread.put(self.worker.main.finished, req)
        self.worker.dead_pools.append(self)
        if not self.worker.exiting_pools:  # the pool starts a new process in its place
            replacement = PoolProcess(self.worker, self.index, self.generation + 1)
            self.worker.pools[self.index] = replacement
            self.worker.main.thread.put(self.worker.main.feed)

    def exit(self) -> None:
        if self.proc.alive and self.phase == "idle":
            self.proc.alive = False
            self.worker.gone(self)


class InProcessLock:
    """A pool process's own lock when it could not use the agent (``unclaim``, ``unknown``):
    the engine's event-driven lock on the process's own session, as ``FairLock`` takes it."""

    def __init__(self, pool: PoolProcess, path: str) -> None:
        self.pool = pool
        self.world = pool.world
        self.client = SimClient(self.world, pool.worker.run.server, pool.proc, f"{pool.proc.name}.zk", 4.0)
        self.attempt = None
        self.holding = False
        internals = LockInternals(self.client, path, 1, pool.req["id"])
        self.internals = internals
        self.attempt = internals.attempt(pool.proc.monotonic() + 10.0)
        self.path = path
        on_ready(self.attempt.result, lambda r: self.pool.proc and Thread(pool.proc, "inproc").put(self._decided, r))

    def _decided(self, result) -> None:
        try:
            held = result.get()
        except Exception:
            held = False
        if not held or not self.pool.proc.alive:
            return self._finish()
        self.holding = True
        self.pool.worker.run.checks.granted_peer(self.pool.proc.name, self.path, self.attempt, self.client)
        if self.pool.req.get("on_body") is not None and self.pool.req["on_body"](self.pool) is False:
            return self._finish()
        self.world.at(self.world.now + 0.05, f"{self.pool.proc.name}.inproc-body", self._finish, proc=self.pool.proc)

    def belief(self):
        if self.holding and self.attempt.state is State.HELD:
            return self.path, f"{self.path}/{self.attempt.node}", self.attempt.token
        return None

    def _finish(self) -> None:
        self.holding = False
        req = self.pool.req
        if req is not None and req.get("body") is not None and self.pool.inprocess is self:
            req["body"].released_at = self.world.now
        if self.attempt is not None:
            self.attempt.release()
        self.client.stop()
        if self.pool.proc.alive and self.pool.inprocess is self:
            self.pool.inprocess_done()

    def die(self) -> None:
        self.holding = False
        self.client.stop()


class Contender:
    """A foreign contender on the same keys: a Curator-style peer (the engine's own
    ``LockInternals``, as a library user of ``FairLock`` holds it) or a kazoo-style one (the
    same protocol under kazoo's node names, ``<uuid>__lock__<seq>``)."""

    shared = False  # its hold excludes everyone (the checks' Exclusion)

    def __init__(self, run, name: str, style: str, keys: list[str], session: float = 4.0) -> None:
        self.run = run
        self.world = run.world
        self.name = name
        self.style = style
        self.keys = keys
        self.proc = Proc(self.world, self.world.host(name), name)
        self.client = SimClient(self.world, run.server, self.proc, f"{name}.zk", session)
        self.rng = self.world.rng(name)
        self.thread = Thread(self.proc, "main")
        self.attempt = None
        self.path = None
        self.holding = False
        self.active = True
        self.world.at(self.rng.uniform(0.1, 1.0), f"{name}.next", self._next, proc=self.proc)

    def belief(self):
        if self.holding and self.attempt is not None and self.attempt.state is State.HELD:
            return self.path, f"{self.path}/{self.attempt.node}", self.attempt.token
        return None

    def _next(self) -> None:
        if not self.active or not self.proc.alive:
            return
        self.path = self.rng.choice(self.keys)
        internals = LockInternals(self.client, self.path, 1, self.name.encode())
        if self.style == "kazoo":
            internals.prefix = f"{uuid.uuid4().hex}__lock__"
        timeout = self.rng.choice((None, 0.0, 0.5, 2.0))
        deadline = None if timeout is None else self.proc.monotonic() + timeout
        self.attempt = attempt = internals.attempt(deadline)
        on_ready(attempt.result, lambda r: self.thread.put(self._decided, attempt, r))

    def _decided(self, attempt, result) -> None:
        if attempt is not self.attempt:
            return
        try:
            held = result.get()
        except Exception:
            held = False
        if held:
            self.holding = True
            self.run.checks.granted_peer(self.name, self.path, attempt, self.client)
            hold = self.rng.choice((0.001, 0.01, 0.1, 0.5))
            self.world.at(self.world.now + hold, f"{self.name}.release", self._release, attempt, proc=self.proc)
        else:
            self._again()

    def _release(self, attempt) -> None:
        self.holding = False
        attempt.release()
        self._again()

    def _again(self) -> None:
        self.world.at(self.world.now + self.rng.uniform(0.01, 0.5), f"{self.name}.next", self._next, proc=self.proc)


class RwContender(Contender):
    """A reader or a writer of a read/write lock (issue 62), driven at the engine's level as
    :class:`~celery_zklock.engine.rwlock.ReadWriteLock`'s sides take it:
    ``LockInternals(..., kind=READ)`` (a reader: holds while no exclusive node queues ahead,
    watches the nearest one) or ``kind=WRITE`` (a writer: waits for everyone ahead).  Style
    ``ours`` names its nodes as Curator does (``_c_<uuid>-__READ__<seq>``, ``-__WRIT__``);
    ``kazoo`` as kazoo's ``ReadLock`` and ``WriteLock`` do (``<uuid>__rlock__<seq>``,
    ``<uuid>__lock__<seq>``), with the same rule.  Readers come back every few ms to tens of
    ms (readers keep arriving: a writer must not starve); timeouts are few, so a wait that
    never ends shows (the checks' *Writer not starved* and *Readers share*)."""

    def __init__(self, run, name: str, role: str, style: str, keys: list[str], session: float) -> None:
        self.role = role
        self.shared = role == "reader"
        super().__init__(run, name, style, keys, session)

    def waiting(self):
        """(path, our node's name, its czxid) while our attempt waits in the queue, else None."""
        at = self.attempt
        if at is None or at.finished or at.state is not State.WAITING or at.node is None:
            return None
        return self.path, at.node, at.czxid

    def _next(self) -> None:
        if not self.active or not self.proc.alive:
            return
        self.path = self.rng.choice(self.keys)
        kind = NodeKind.READ if self.shared else NodeKind.WRITE
        internals = LockInternals(self.client, self.path, 1, self.name.encode(), kind=kind)
        if self.style == "kazoo":
            internals.prefix = f"{uuid.uuid4().hex}{'__rlock__' if self.shared else '__lock__'}"
        timeout = self.rng.choice((None, None, None, 0.0, 2.0))
        deadline = None if timeout is None else self.proc.monotonic() + timeout
        self.attempt = attempt = internals.attempt(deadline)
        on_ready(attempt.result, lambda r: self.thread.put(self._decided, attempt, r))

    def _decided(self, attempt, result) -> None:
        if attempt is not self.attempt:
            return
        try:
            held = result.get()
        except Exception:
            held = False
        if held:
            self.holding = True
            self.run.checks.granted_peer(self.name, self.path, attempt, self.client, shared=self.shared)
            holds = (0.002, 0.02, 0.1, 0.5) if self.shared else (0.002, 0.01, 0.05, 0.2)
            self.world.at(self.world.now + self.rng.choice(holds), f"{self.name}.release", self._release, attempt,
                          proc=self.proc)
        else:
            self._again()

    def _again(self) -> None:
        gap = (0.002, 0.08) if self.shared else (0.05, 0.4)
        self.world.at(self.world.now + self.rng.uniform(*gap), f"{self.name}.next", self._next, proc=self.proc)
