"""The lock agent's answers to the requests of one worker, in the order a request meets them.

Read top to bottom, one request's life:

1. :class:`Requests`, the main process's side: ``wait`` queues for the request's locks, path
   by path in canonical order through each key's :class:`~celery_zklock.worker.cohort.Cohort`
   (all or nothing, so two multi-key requests never deadlock); the main process is told
   ``queued`` if it has to wait, ``next`` once only a holder is ahead of it, and one verdict:
   ``granted`` (after its enqueue guard's start), or why not; or it cancels the wait.
2. :class:`Claims`, the pool's side: a pool process claims the verdict, is told whether its
   locks are still safe (pushed as that changes), and releases them with a proof.
3. :class:`GuardJobs`: the requests' enqueue guards (``lock_enqueue``), ended or moved as
   requests are decided, by blocking calls on a thread of their own.

Each class owns its state (the requests and their cohorts; the claimed requests; the guards'
jobs) and asks the others through their methods (what :class:`Requests` needs of the other
two: :class:`ClaimsView`, :class:`GuardsView`); a :class:`WaitRequest` is the record they
share.  All but the guards' blocking calls run on the agent's one event thread.  The messages:
:mod:`celery_zklock.worker.agent_protocol`.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from ..engine import clock, guards, kazoo_compat
from ..engine.contenders import holders_async
from ..engine.internals import State
from ..engine.kazoo_compat import on_all_ready
from ..engine.session import PROOFS
from .agent_protocol import (
    HANDOFF_MAX_WAIT,
    Bypass,
    Cancel,
    Carry,
    ClaimAnswer,
    Claimed,
    Connection,
    Decided,
    LockState,
    Next,
    Queued,
    Released,
    Verdict,
    Wait,
)
from .cohort import Cohort
from .cohort_rules import fresh, lease_window
from .lease_clock import lease_clock

logger = logging.getLogger("celery_zklock.worker.agent")

#: How long a timeout's verdict waits for the report of who holds the key (s).
HOLDERS_WITHIN = 0.5
#: The error of a request whose deadline passed while the agent was cut off from ZooKeeper.
UNREACHABLE_AT_DEADLINE = "ZooKeeper was unreachable when the lock's wait ended: the lock could not be decided"
#: How long (s) past its lease window a grant carried to the pool is kept for its claim when
#: the main process leaves first: the claim was sent inside the window, and may still be on
#: its way through this agent's event loop.
CARRY_GRACE = 1.0


def at_deadline(connected: bool) -> Verdict:
    """A request's deadline passed: a timeout only if ZooKeeper can say the key is busy.  Cut
    off, nothing says so (its holders may be gone, or nobody holds it): that is an outage,
    and ``on_lock_unavailable`` applies, never ``on_lock_timeout`` (a try-once singleton sent
    during an outage, or just after one before the agent reconnected, was skipped)."""
    return Verdict.TIMEOUT if connected else Verdict.UNAVAILABLE


@dataclass(frozen=True)
class Hold:
    """One path a request holds: the key's cohort, the slot (our node) and its fencing token."""

    cohort: Cohort
    slot: Any  # celery_zklock.worker.cohort.Slot
    token: int


@dataclass(eq=False)
class WaitRequest:
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
    holds: dict[str, "Hold"] = field(default_factory=dict)  # path -> its hold, in the order taken
    current: Cohort | None = None  # the cohort whose local queue it waits in
    expired: bool = False  # its deadline passed: a fresh node's first answer decides, on each key left
    verdict: Claimed | None = None  # what a claim is told once decided (the locks' state added then)
    shown_held: bool | None = None  # the last state pushed to the claimer
    next_sent: bool = False  # told the main process it is next in line (claimable undecided)
    queued: bool = False  # had to wait behind another holder (its key is contended)
    watched: bool = True  # the main process reads "queued" (events, LOCK_WAITING, metrics)
    timer: list | None = None
    granted_at: float | None = None
    carry_until: float | None = None  # lease clock: a pool process may start on its carried grant until then
    started: float = field(default_factory=clock.monotonic)
    seq: int | None = None  # the main process's number for this delivery (a task id can come again)
    done: bool = False  # released or cancelled
    read_paths: frozenset[str] = frozenset()  # those of ``paths`` taken for reading (lock_mode)
    readers: int = 1  # our read nodes per path at most (the pool's size)


class EventLoop(Protocol):
    """What the agent's parts need of the :class:`~celery_zklock.worker.agent.Agent`: its
    ZooKeeper client, session monitor and settings, and its one event thread."""

    client: Any  # kazoo's KazooClient (the simulator's, under sim/)
    monitor: Any  # the client's SessionMonitor: its timers
    settings: Any  # celery_zklock.config.ZkSettings

    def post(self, fn: Callable, *args: Any) -> None: ...


class ClaimsView(Protocol):
    """What :class:`Requests` tells :class:`Claims`."""

    def send_verdict(self, wait: WaitRequest) -> None: ...
    def push_state(self, wait: WaitRequest) -> None: ...
    def discard(self, wait: WaitRequest) -> None: ...


class GuardsView(Protocol):
    """What :class:`Requests` and :class:`Claims` ask of :class:`GuardJobs`."""

    def start(self, wait: WaitRequest, after: Callable[[BaseException | None], None]) -> None: ...
    def decided(self, wait: WaitRequest, verdict: Verdict) -> None: ...
    def finished(self, wait: WaitRequest) -> None: ...


# ---------------------------------------------------------------------- 1. the main process's side
class Requests:
    """Requests from queueing to verdict, and the cohorts they wait in (each cohort's host).

    A grant, in order (:meth:`_take_next` is where it starts):

    1. the key's cohort grants a slot (:meth:`Cohort._grant <celery_zklock.worker.cohort.Cohort._grant>`,
       with the slot's fencing token) and calls :meth:`on_granted`;
    2. with every path held, :meth:`_take_next` makes the verdict (tokens and nodes);
    3. :meth:`_tell_verdict` first has the request's enqueue guard started, off the event
       thread (:meth:`GuardJobs.start`), and resumes in :meth:`_guard_started` (a guard
       that could not start: ``unavailable``);
    4. the verdict is recorded, the main process told, and a claimer waiting for it told
       (:meth:`Claims.send_verdict`).
    """

    def __init__(self, loop: EventLoop, claims: ClaimsView, guards: GuardsView) -> None:
        self.client, self.monitor, self.settings, self.post = loop.client, loop.monitor, loop.settings, loop.post
        self.claims = claims
        self.guards = guards
        self.waits: dict[str, WaitRequest] = {}
        self.cohorts: dict[tuple[str, int, bool], Cohort] = {}
        self.on_path: dict[str, list[Cohort]] = {}  # the cohorts of each path (its readers', its writers')
        # Mean time a lock was held (grant to release), per lock path and per task name:
        # how long a request next in line would idle in a pool process if handed over.
        self.hold_by_path: dict[str, float] = {}
        self.hold_by_task: dict[str, float] = {}

    # ------------------------------------------------------------------ wait
    def wait(self, peer: Connection, msg: Wait) -> None:
        wait = WaitRequest(
            id=msg.id,
            task=msg.task,
            paths=sorted(set(msg.paths)),
            max_holders=msg.max_holders or 1,
            deadline=None if msg.timeout is None else clock.monotonic() + float(msg.timeout),
            identity=msg.identity.encode(),
            owner=peer,
            early=msg.early,
            watched=msg.watched,
            guard=guards.guarded(msg.guard and {guards.HEADER: msg.guard}),
            seq=msg.seq,
            read_paths=frozenset(msg.read),
            readers=max(1, msg.readers),
        )
        old = self.waits.get(wait.id)
        if old is not None and not old.done:
            # The same task id while we still wait for, or hold, its lock: a retry the body
            # published while holding it, or a redelivery.  The running one keeps its lock;
            # this one runs in-process (its claim will say "unknown"), still protected.
            peer.send(Bypass(wait.id, wait.seq))
            return
        self.waits[wait.id] = wait
        if wait.deadline is not None:
            wait.timer = self.monitor.timers.call_at(wait.deadline, self.post, self._deadline, wait)
        self._take_next(wait)

    def _take_next(self, wait: WaitRequest) -> None:
        """Join the next path's local queue (canonical order) or, with all taken, grant."""
        if wait.done:
            return
        if len(wait.holds) == len(wait.paths):
            self.monitor.timers.cancel(wait.timer)
            tokens = {path: hold.token for path, hold in wait.holds.items()}
            nodes = {path: hold.slot.node_path for path, hold in wait.holds.items()}
            return self._tell_verdict(wait, Claimed(wait.id, Verdict.GRANTED, tokens=tokens, nodes=nodes))
        path = wait.paths[len(wait.holds)]
        reads = path in wait.read_paths
        key = (path, 0 if reads else wait.max_holders, reads)  # a path's readers: one cohort
        cohort = self.cohorts.get(key)
        if cohort is None:
            cohort = self.cohorts[key] = Cohort(self, path, wait.readers if reads else wait.max_holders, reads=reads)
            self.on_path.setdefault(path, []).append(cohort)
        elif reads:
            cohort.max_holders = wait.readers  # the pool's size now (--autoscale moves it)
        wait.current = cohort
        cohort.join(wait)
        if wait.expired and wait.current is cohort:
            # Its deadline passed on an earlier key (its grant was the answer it waited for):
            # one try here, as a timeout of 0 is, never a wait with no deadline while it
            # holds the keys before this one.
            self._deadline(wait)

    # ------------------------------------------------------------------ queued, next (the cohort's callbacks)
    def on_queued(self, wait: WaitRequest, position: int) -> None:
        if not wait.queued:
            wait.queued = True
            if wait.watched:
                wait.owner.send(Queued(wait.id, position, wait.seq))

    def on_next(self, wait: WaitRequest, ours: bool = True, streak_left: float | None = None) -> None:
        """Every path but the last is held and only a holder is ahead of it on the last: the
        main process may hand it to the pool now (docs/waiting.md, "Next in line").  ``ours``:
        the holder is one of this worker's, whose release passes the node on, unless the
        streak has less than ``streak_left`` to run; otherwise the holders ahead in ZooKeeper
        are other contenders', whose hold is not known here (the main process decides)."""
        if (not wait.early or wait.done or wait.verdict is not None or wait.next_sent
                or len(wait.holds) != len(wait.paths) - 1):
            return
        expected = self._expected_hold(wait)
        if expected is not None and expected > HANDOFF_MAX_WAIT:
            return
        if ours and streak_left is not None and expected is not None and expected >= streak_left:
            # The holder's release will end the streak: this request then waits behind the
            # other contender's streak, not for one hold.  Not told now; its node, once
            # queued, may tell it (ours=False).
            return
        wait.next_sent = True
        wait.owner.send(Next(wait.id, wait.seq, expected, ours))

    def _expected_hold(self, wait: WaitRequest) -> float | None:
        held = self.hold_by_path.get(wait.paths[-1])
        return held if held is not None else self.hold_by_task.get(wait.task)

    # ------------------------------------------------------------------ granted: the verdict
    def on_granted(self, wait: WaitRequest, cohort: Cohort, slot, token: int) -> None:
        wait.holds[cohort.path] = Hold(cohort, slot, token)
        wait.current = None
        self._wake_siblings(cohort)
        self._take_next(wait)

    def _tell_verdict(self, wait: WaitRequest, verdict: Claimed) -> None:
        """The request's one verdict, told to the main process (and to its claimer, if any).
        A grant is told only once its enqueue guard's start is done (step 3 above)."""
        if wait.done or wait.verdict is not None:
            return
        self.monitor.timers.cancel(wait.timer)
        decided = verdict.verdict
        assert isinstance(decided, Verdict)  # the agent's own verdicts: never a ClaimAnswer
        if decided is Verdict.GRANTED and wait.guard is not None and not wait.guard_moved:
            # Its enqueue guard ends (or becomes ours) before its body can start: a publish
            # after the start is then never deduped into a run that began without it.
            wait.guard_moved = True
            self.guards.start(wait, after=lambda error: self._guard_started(wait, verdict, error))
            return
        told = wait.verdict = replace(verdict, waited=round(clock.monotonic() - wait.started, 6))
        if decided is Verdict.GRANTED:
            wait.granted_at = clock.monotonic()
        self.guards.decided(wait, decided)
        claimer = wait.claimer
        carry = self._carry(wait, told) if claimer is None and decided is Verdict.GRANTED else None
        # The claimer first: a request next in line has a pool process waiting for this
        # verdict, and the main process only records it.
        if claimer is not None:
            self.claims.send_verdict(wait)
        wait.owner.send(Decided(wait.id, decided, wait.seq, wait.queued, verdict.error, carry))
        if claimer is not None and decided is not Verdict.GRANTED:
            self.forget(wait)

    def _guard_started(self, wait: WaitRequest, verdict: Claimed, error: BaseException | None) -> None:
        """A grant whose guard could not be ended (or moved) is not told as granted: its locks
        go and the pool process follows ``on_lock_unavailable`` (its retry takes the guard over)."""
        if error is None:
            return self._tell_verdict(wait, verdict)
        self.let_go(wait)
        self._tell_verdict(wait, Claimed(wait.id, Verdict.UNAVAILABLE,
                                         error=f"could not end the enqueue guard at the start: {error!r}"))

    def _carry(self, wait: WaitRequest, granted: Claimed) -> Carry | None:
        """The grant, for the main process to hand to the pool with the task, when every path
        was granted on a young proof (the lease: a write to the node, or the create that made
        it, sent less than the lease window ago): the pool process may start on it without
        waiting for its claim's answer while that proof stays younger than the lease window
        (:func:`~celery_zklock.worker.cohort_rules.lease_window`).  Why safe: the same
        argument as the lease, the session outlives the proof by its timeout; the claim
        still moves the lock to the pool's connection, and a state unlike "held" is pushed
        to it then.  None when a path has no young proof: the claim's answer is waited for."""
        session = kazoo_compat.session_timeout(self.client)
        proofs = []
        for hold in wait.holds.values():
            proof = hold.slot.proof()  # a fresh node's create is its first proof
            if not hold.slot.held or not fresh(proof, hold.cohort.clock(), session):
                return None
            proofs.append(proof)
        if not proofs:
            return None
        proof = min(proofs)
        wait.carry_until = proof + lease_window(session)
        return Carry(proof, session, granted.waited, granted.tokens or {})

    def carry_left(self, wait: WaitRequest) -> float:
        """Seconds (monotonic) until a grant carried to the pool can no longer be started on
        and claimed, with :data:`CARRY_GRACE` for the claim to be read; 0 when none was."""
        if wait.carry_until is None or wait.claimer is not None:
            return 0.0
        left = wait.carry_until - lease_clock() + CARRY_GRACE
        return max(0.0, left)

    def on_slot_lost(self, wait: WaitRequest) -> None:
        self.claims.push_state(wait)

    # ------------------------------------------------------------------ timed out, failed
    def _deadline(self, wait: WaitRequest) -> None:
        if wait.done or wait.verdict is not None or wait.current is None:
            return
        if wait.current.expire(wait):
            self.on_timed_out(wait, wait.current.path)

    def on_timed_out(self, wait: WaitRequest, path: str) -> None:
        """Free what it took, then say who holds the key: read asynchronously, and waited
        for at most :data:`HOLDERS_WITHIN` (a timeout is told on time, ZooKeeper or not;
        holders ``None``: they could not be read).  Cut off from ZooKeeper, the verdict is
        an outage instead (:func:`at_deadline`)."""
        self._left(wait)
        self.let_go(wait)
        if at_deadline(self.client.connected) is Verdict.UNAVAILABLE:
            return self._tell_verdict(wait, Claimed(wait.id, Verdict.UNAVAILABLE, error=UNREACHABLE_AT_DEADLINE))

        def told(holders) -> None:
            self.monitor.timers.cancel(bound)
            self._tell_verdict(wait, Claimed(wait.id, Verdict.TIMEOUT, holders=holders))

        bound = self.monitor.timers.call_at(clock.monotonic() + HOLDERS_WITHIN, self.post, told, None)
        holders_async(self.client, path, wait.max_holders, lambda holders: self.post(told, holders))

    def on_failed(self, wait: WaitRequest, exc: BaseException) -> None:
        self._left(wait)
        self.let_go(wait)
        self._tell_verdict(wait, Claimed(wait.id, Verdict.UNAVAILABLE, error=str(exc)))

    def _left(self, wait: WaitRequest) -> None:
        """``wait`` is out of its cohort's queue (failed, timed out): not waited for there."""
        if wait.current is not None:
            self._wake_siblings(wait.current)
        wait.current = None

    def _wake_siblings(self, cohort: Cohort) -> None:
        """A waiter left ``cohort``'s queue: the other cohorts of its path may now queue the
        nodes they held back for it (:meth:`Cohort.pump`); on the next turn, not inside
        this cohort's own pump."""
        for other in self.on_path.get(cohort.path, ()):
            if other is not cohort and other.waiting():
                self.post(other.pump)

    def earliest_elsewhere(self, cohort: Cohort) -> float | None:
        """When the earliest request of this worker that waits for ``cohort``'s path in another
        cohort (its readers', its writers') came; None when none waits.  No node of ours may
        pass it (:meth:`Cohort.pump`, a local handoff): across modes, FIFO among this worker's
        requests is ZooKeeper's queue order.  At most a few cohorts share a path."""
        return min((other.first_came() for other in self.on_path.get(cohort.path, ())
                    if other is not cohort and other.waiting()), default=None)

    # ------------------------------------------------------------------ cancelled
    def delivery(self, request_id: str, seq: int | None) -> WaitRequest | None:
        """The live wait of that delivery of ``request_id``: the same task id may come again
        (a retry with no countdown, a redelivery) once the first let go, and what the main
        process says of the first must not end the next (``seq`` None: whichever waits)."""
        wait = self.waits.get(request_id)
        if wait is None or wait.done or (seq is not None and wait.seq != seq):
            return None
        return wait

    def cancel(self, request_id: str, why: Cancel = Cancel.FINISHED, in_pool: bool = False,
               seq: int | None = None) -> None:
        """Stop waiting for a request: ``revoked`` or ``shutdown`` by the main process, or
        ``finished`` by the pool without claiming (a grant nobody claimed is let go).

        A request handed to the pool while next in line (``in_pool``) and still undecided
        gets the verdict ``why`` instead: its pool process must not run it.  Decided, it
        runs (or ran) as granted: its own release lets go."""
        wait = self.delivery(request_id, seq)
        if wait is None or (wait.claimer is not None and wait.verdict is not None):
            return
        if in_pool and wait.verdict is not None:
            return
        if why is Cancel.REVOKED:
            self.guards.decided(wait, Verdict.REVOKED)
        elif why is Cancel.FINISHED:
            # Done in the pool without claiming (its process died before it could, or it ran
            # in process): a guard moved at the grant, or never moved, must not outlive it.
            self.guards.finished(wait)
        if not in_pool:
            if wait.claimer is None:
                self.abandon(wait)
            return
        self.let_go(wait)
        self._tell_verdict(wait, Claimed(wait.id, Verdict(why.value)))

    # ------------------------------------------------------------------ letting go
    def let_go(self, wait: WaitRequest) -> list:
        """Leave the local queue and let go of every path taken (the next of ours may get
        it at once); the release proof per path, newest first."""
        if wait.current is not None:
            cohort, wait.current = wait.current, None
            cohort.leave(wait)
            self._wake_siblings(cohort)
            self._tidy(cohort)
        outcomes = []
        for hold in reversed(list(wait.holds.values())):
            outcomes.append(hold.cohort.release(wait))
            self._tidy(hold.cohort)
        wait.holds.clear()
        return outcomes

    def learn_hold(self, wait: WaitRequest) -> None:
        if wait.granted_at is None:
            return
        held = clock.monotonic() - wait.granted_at
        for table, key in ((self.hold_by_path, wait.paths[-1]), (self.hold_by_task, wait.task)):
            if len(table) > 10_000:
                table.clear()  # bounded: many one-off keys must not grow the agent
            mean = table.get(key)
            table[key] = held if mean is None else mean + 0.3 * (held - mean)

    def _tidy(self, cohort: Cohort) -> None:
        if cohort.idle and self.cohorts.get(cohort.key) is cohort:
            del self.cohorts[cohort.key]
            siblings = [c for c in self.on_path.pop(cohort.path, ()) if c is not cohort]
            if siblings:
                self.on_path[cohort.path] = siblings

    def tidy_all(self) -> None:
        """On the heartbeat: pump keys whose node was suspended while free, forget idle ones."""
        for cohort in list(self.cohorts.values()):
            if cohort.wants_pump:
                cohort.pump()  # a node suspended while free: granted, or let go, once verified again
            self._tidy(cohort)

    def abandon(self, wait: WaitRequest) -> None:
        """Stop waiting for, or let go of, a request nobody runs."""
        self.forget(wait)
        self.let_go(wait)

    def undone(self) -> list[WaitRequest]:
        """The requests not yet done (a copy: the caller may end them as it goes)."""
        return [w for w in self.waits.values() if not w.done]

    def forget(self, wait: WaitRequest) -> None:
        wait.done = True
        self.claims.discard(wait)
        self.monitor.timers.cancel(wait.timer)
        if self.waits.get(wait.id) is wait:
            del self.waits[wait.id]


# ---------------------------------------------------------------------- 2. the pool's side
class Claims:
    """Claims, lock states and releases; its own state is the set of claimed requests
    (granted and claimed: their states are pushed on every heartbeat).

    Once claimed, a lock belongs to that connection: a grant carries the locks' state *now*,
    later changes are pushed (:meth:`push_state`), and a release is answered only once
    ZooKeeper (or the local handoff's write) proves the lock was held to the end."""

    requests: Requests  # attached by the Agent once both exist (each tells the other)

    def __init__(self, post, client, guards: GuardsView) -> None:
        self.post, self.client, self.guards = post, client, guards
        self.claimed: set[WaitRequest] = set()

    def attach(self, requests: Requests) -> None:
        """The requests whose grants are claimed here (made after this, as they tell it)."""
        self.requests = requests

    # ------------------------------------------------------------------ claim
    def claim(self, peer: Connection, request_id: str, carried: bool = False) -> None:
        """Hand a decided request, or one next in line, to the pool process that runs it.

        A next-in-line claimer is told ``pending`` and gets the verdict the moment it is
        decided.  Other undecided requests are not claimable: the claimer would run
        in-process and could queue behind our own node.  A ``carried`` claim started on
        the grant its task brought along: it is told nothing unless the lock is no longer
        what that grant said (held), or was never this agent's to give."""
        wait = self.requests.delivery(request_id, None)
        if carried:
            return self._carried(peer, request_id, wait)
        if wait is not None and wait.claimer is peer and wait.verdict is not None:
            # It claimed with the carried grant, which had aged by the time it was sent:
            # it waits for the verdict after all.
            return self.send_verdict(wait)
        if (wait is None or wait.claimer is not None
                or (wait.verdict is None and not wait.next_sent)):
            peer.send(Claimed(request_id, ClaimAnswer.UNKNOWN))
            return
        wait.claimer = peer
        self.claimed.add(wait)
        if wait.verdict is None:
            peer.send(Claimed(request_id, ClaimAnswer.PENDING))
            return
        self.send_verdict(wait)
        if wait.verdict.verdict is not Verdict.GRANTED:
            self.requests.forget(wait)

    def _carried(self, peer: Connection, request_id: str, wait: WaitRequest | None) -> None:
        if (wait is None or wait.verdict is None or wait.verdict.verdict is not Verdict.GRANTED
                or wait.claimer is not None):
            # A pool process runs on a grant this agent does not hold for it (it was let
            # go meanwhile, or granted by an agent that has since been replaced).
            peer.send(LockState(request_id, held=False, lost=True,
                                reason="the worker's lock agent no longer holds the lock granted to this task"))
            return
        wait.claimer = peer
        self.claimed.add(wait)
        self._runs(wait)
        wait.shown_held = True  # what the carried grant told it
        self.push_state(wait)

    def send_verdict(self, wait: WaitRequest) -> None:
        """Tell the claimer its verdict; a grant carries the locks' state *now*: a request
        granted before ZooKeeper became unreachable may be claimed only later (no free pool
        process until then), and its body must not start on the old grant alone."""
        message, claimer = wait.verdict, wait.claimer
        assert message is not None and claimer is not None  # told once decided and claimed
        if message.verdict is Verdict.GRANTED:
            self._runs(wait)
            state = self._state(wait)
            wait.shown_held = state.held
            # The session the server granted, which may be shorter than the one asked for:
            # the claimer trusts our silence for a third of it (agent_client.silence_grace).
            message = replace(message, held=state.held, lost=state.lost, reason=state.reason,
                              session_timeout=kazoo_compat.session_timeout(self.client))
        claimer.send(message)

    @staticmethod
    def _runs(wait: WaitRequest) -> None:
        """A body runs (or is about to) under the request's holds: claimed on its verdict, or
        on the grant its task carried."""
        for hold in wait.holds.values():
            hold.slot.attempt.hold.running()  # its node is watched from now on

    def unclaim(self, peer: Connection, request_id: str) -> None:
        """The claimer stopped waiting for its claim's answer and locks in-process instead.

        Why: a busy agent may answer a claim after the pool process's claim timeout; the
        grant then belongs to a connection that went on without it, and its node would hold
        the key for every worker (the in-process lock queues behind it) until that process
        exits.  The claim came first on the same connection, so it is decided here already;
        only that claimer's request is let go.  Its enqueue guard is left to the pool
        process, which now locks guarded in-process (:mod:`celery_zklock.task`)."""
        wait = self.requests.delivery(request_id, None)
        if wait is None or wait.claimer is not peer:
            return  # not claimed by it ("unknown": it owes nothing here)
        wait.guard = None
        self.requests.abandon(wait)
        logger.warning("zklock agent: request %s: its pool process stopped waiting for the claim's answer "
                       "(this agent answered late: busy?) and locks in-process; its lock here is let go", request_id)

    def any_claimed(self) -> bool:
        """Has any pool process claimed a request here (granted, or next in line waiting for
        its verdict)?  The agent must stay while one has: the lock is, or will be, its."""
        return bool(self.claimed)

    # ------------------------------------------------------------------ lock state
    def push_states(self) -> None:
        """Every heartbeat: tell each claimer what changed in its locks' state."""
        for wait in list(self.claimed):
            self.push_state(wait)

    def push_state(self, wait: WaitRequest) -> None:
        if (wait.claimer is None or wait.done or wait.verdict is None
                or wait.verdict.verdict is not Verdict.GRANTED):
            return
        state = self._state(wait)
        if wait.shown_held == state.held and not state.lost:
            return
        wait.shown_held = state.held
        wait.claimer.send(state)

    def _state(self, wait: WaitRequest) -> LockState:
        """Whether the request's locks are safe to hold right now, as a claimer is told."""
        slots = [hold.slot for hold in wait.holds.values()]
        held = bool(slots) and all(s.held for s in slots)
        lost = any(s.lost or s.attempt.state is State.LOST for s in slots)
        reason = self._lost_reason(wait)
        if not held and reason is None:
            suspended = any(s.attempt.state is State.HELD_SUSPENDED for s in slots)
            reason = "ZooKeeper connection suspended" if suspended else "not held"
        return LockState(wait.id, held, lost, reason)

    @staticmethod
    def _lost_reason(wait: WaitRequest) -> str | None:
        for slot in (hold.slot for hold in wait.holds.values()):
            if slot.attempt.lost_reason:
                return slot.attempt.lost_reason
            if slot.lost:
                return "lock lost"
        return None

    # ------------------------------------------------------------------ release
    def release(self, peer: Connection, request_id: str) -> None:
        """Let go of a claimed request's locks; the answer says whether each one was proven
        held to the end (the delete, or the local handoff's write, found our node).
        Answered from those replies: no thread waits."""
        wait = self.requests.delivery(request_id, None)
        if wait is None or wait.claimer is not peer:
            peer.send(Released(request_id, proven=False, reason="not held through the agent"))
            return
        self.requests.learn_hold(wait)
        self.guards.finished(wait)
        reason = self._lost_reason(wait)
        outcomes = self.requests.let_go(wait)
        self.requests.forget(wait)
        pending = [p for p in outcomes if not isinstance(p, str)]

        def answer() -> None:
            proven = all(_outcome(p) in PROOFS for p in outcomes)
            why = reason or (None if proven else "lock node was already gone at release")
            peer.send(Released(request_id, proven, why))

        if not pending:
            return answer()
        on_all_ready(pending, lambda: self.post(answer))

    def discard(self, wait: WaitRequest) -> None:
        self.claimed.discard(wait)


def _outcome(pending):
    """A release outcome: the delete's result once ready, or the string/None given."""
    if pending is None or isinstance(pending, str):
        return pending
    try:
        return pending.get(timeout=0)
    except Exception:
        return None


# ---------------------------------------------------------------------- 3. the enqueue guards
#: Run on the event thread once a guard's job is done: ``after(error)``, None when it succeeded.
After = Callable[[BaseException | None], None]

#: How many times (about a second apart) the agent tries a guard's release again.
_RELEASE_TRIES = 600


class GuardJobs:
    """Guard updates, in order, off the event thread; its own state is the job queue (and
    its thread, started with the first job).

    A guard's updates are blocking ZooKeeper calls (:mod:`celery_zklock.engine.guards`): they
    run in order on one thread of their own (a task's end must not overtake its start), and
    only their completions come back to the event thread.  When a grant's guard starts is
    part of its verdict (:meth:`Requests._tell_verdict`)."""

    def __init__(self, loop: EventLoop) -> None:
        self.client, self.monitor, self.post = loop.client, loop.monitor, loop.post
        # (fn, its arguments after the client, after(error) or None, tries so far)
        self.jobs: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...], After | None, int]] = queue.SimpleQueue()
        self.started = False  # the jobs' thread, started with the first job

    def start(self, wait: WaitRequest, after: After) -> None:
        """A granted request's guard ends (or becomes ours) before its body may start."""
        guard = wait.guard
        assert guard is not None  # started only for a request that has one
        self.op(guards.start, guard["paths"], wait.id, int(guard.get("retries") or 0), guard["until"], after=after)

    def decided(self, wait: WaitRequest, verdict: Verdict) -> None:
        """Its lock is decided: granted, the guard ends (``start``) or becomes an ephemeral
        node of our session (``finish``); revoked, it ends.  ``shutdown`` leaves it: the
        message goes back to the broker, still queued.  ``timeout`` and ``unavailable`` leave
        it to the pool process that follows the task's policy: its retry takes the guard
        over (no instant for a duplicate), or it ends it and reports the work deduped into
        it (:func:`celery_zklock.enqueue.unrun`); unclaimed, ``finished`` ends it here."""
        guard = wait.guard
        if guard is None or verdict in (Verdict.SHUTDOWN, Verdict.TIMEOUT, Verdict.UNAVAILABLE):
            return
        retries = int(guard.get("retries") or 0)
        if verdict is Verdict.GRANTED:  # started by start() already
            if guard["until"] != "finish":
                wait.guard = None
        else:
            wait.guard = None
            self.op(guards.release, guard["paths"], wait.id, retries)

    def finished(self, wait: WaitRequest) -> None:
        """A granted request ran (or its process died before it could claim it): its running
        guard goes; an undecided one's guard (never moved) goes too."""
        if wait.verdict is not None and wait.verdict.verdict is Verdict.SHUTDOWN:
            return  # its message goes back to the broker, still queued under it
        guard, wait.guard = wait.guard, None
        if guard is not None:
            self.op(guards.release, guard["paths"], wait.id, int(guard.get("retries") or 0))

    def op(self, fn: Callable[..., Any], *args: Any, after: After | None = None) -> None:
        """A guard's blocking ZooKeeper calls, off the event thread and in order on one
        thread of their own (a task's end must not overtake its start); ``after(error)`` then
        runs on the event thread, whatever the outcome (``error`` is None when it was done)."""
        if not self.started:
            self.started = True
            threading.Thread(target=self._loop, name="zklock-agent-guards", daemon=True).start()
        self.jobs.put((fn, args, after, 0))

    def _loop(self) -> None:
        while True:
            fn, args, after, tries = self.jobs.get()
            error = None
            try:
                done = fn(self.client, *args)
            except Exception as exc:
                error = exc
                logger.warning("zklock agent: enqueue guard of %s not updated (%r)", args[1], exc)
                if fn is guards.release and after is None and tries < _RELEASE_TRIES:
                    # A guard left in place swallows every publish of its key: try again
                    # (each try is bounded by the client's timeout), until its bound would.
                    self.monitor.timers.call_at(clock.monotonic() + 1.0, self.jobs.put, (fn, args, None, tries + 1))
            else:
                if fn is guards.release:
                    for gone in done or ():
                        if gone.deduped:
                            logger.warning("zklock agent: task %s ended unrun; %d publish(es) deduped into it went with it",
                                           gone.id, gone.deduped)
            if after is not None:
                self.post(after, error)
