"""The lock agent's requests: each one's locks taken path by path, then one verdict.

The main process's side of a request: queue for its locks, be told ``queued``/``next``, get
one verdict, or be cancelled.  Paths are taken in canonical order through each key's
:class:`~celery_zklock.worker.cohort.Cohort`, all or nothing, so two multi-key requests
never deadlock.  Runs on the agent's event thread; what a pool process is told once it
claims the verdict is :mod:`celery_zklock.worker.agent_claims`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from ..engine import clock, guards, kazoo_compat
from ..engine.contenders import holders_async
from .agent_protocol import HANDOFF_MAX_WAIT, Bypass, Cancel, Carry, Claimed, Decided, Next, Queued, Verdict, Wait
from .agent_socket import Connection
from .cohort import Cohort
from .cohort_rules import fresh, lease_window
from .lease_clock import lease_clock

#: How long a timeout's verdict waits for the report of who holds the key (s).
HOLDERS_WITHIN = 0.5
#: The error of a request whose deadline passed while the agent was cut off from ZooKeeper.
UNREACHABLE_AT_DEADLINE = "ZooKeeper was unreachable when the lock's wait ended: the lock could not be decided"


def at_deadline(connected: bool) -> Verdict:
    """A request's deadline passed: a timeout only if ZooKeeper can say the key is busy.  Cut
    off, nothing says so (its holders may be gone, or nobody holds it): that is an outage,
    and ``on_lock_unavailable`` applies, never ``on_lock_timeout`` (a try-once singleton sent
    during an outage, or just after one before the agent reconnected, was skipped)."""
    return Verdict.TIMEOUT if connected else Verdict.UNAVAILABLE

#: How long (s) past its lease window a grant carried to the pool is kept for its claim when
#: the main process leaves first: the claim was sent inside the window, and may still be on
#: its way through this agent's event loop.
CARRY_GRACE = 1.0


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
    """What :class:`Requests` tells :class:`~celery_zklock.worker.agent_claims.Claims`."""

    def send_verdict(self, wait: WaitRequest) -> None: ...
    def push_state(self, wait: WaitRequest) -> None: ...
    def discard(self, wait: WaitRequest) -> None: ...


class GuardsView(Protocol):
    """What :class:`Requests` asks of :class:`~celery_zklock.worker.agent_guards.GuardJobs`."""

    def start(self, wait: WaitRequest, after: Callable[[BaseException | None], None]) -> None: ...
    def decided(self, wait: WaitRequest, verdict: Verdict) -> None: ...
    def finished(self, wait: WaitRequest) -> None: ...


class Requests:
    """Requests from queueing to verdict, and the cohorts they wait in (each cohort's host).

    A grant, in order (:meth:`_take_next` is where it starts):

    1. the key's cohort grants a slot (:meth:`Cohort._grant <celery_zklock.worker.cohort.Cohort._grant>`,
       with the slot's fencing token) and calls :meth:`on_granted`;
    2. with every path held, :meth:`_take_next` makes the verdict (tokens and nodes);
    3. :meth:`_tell_verdict` first has the request's enqueue guard started, off the event
       thread (:meth:`GuardJobs.start <celery_zklock.worker.agent_guards.GuardJobs.start>`),
       and resumes in :meth:`_guard_started` (a guard that could not start: ``unavailable``);
    4. the verdict is recorded, the main process told, and a claimer waiting for it told
       (:meth:`Claims.send_verdict <celery_zklock.worker.agent_claims.Claims.send_verdict>`).
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

    # The cohort's callbacks (on the event thread).
    def on_granted(self, wait: WaitRequest, cohort: Cohort, slot, token: int) -> None:
        wait.holds[cohort.path] = Hold(cohort, slot, token)
        wait.current = None
        self._wake_siblings(cohort)
        self._take_next(wait)

    def on_failed(self, wait: WaitRequest, exc: BaseException) -> None:
        self._left(wait)
        self.let_go(wait)
        self._tell_verdict(wait, Claimed(wait.id, Verdict.UNAVAILABLE, error=str(exc)))

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

    def on_slot_lost(self, wait: WaitRequest) -> None:
        self.claims.push_state(wait)

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
            if other is not cohort and other.queue:
                self.post(other.pump)

    def earliest_elsewhere(self, cohort: Cohort) -> float | None:
        """When the earliest request of this worker that waits for ``cohort``'s path in another
        cohort (its readers', its writers') came; None when none waits.  No node of ours may
        pass it (:meth:`Cohort.pump`, a local handoff): across modes, FIFO among this worker's
        requests is ZooKeeper's queue order.  At most a few cohorts share a path."""
        return min((other.queue.first().started for other in self.on_path.get(cohort.path, ())
                    if other is not cohort and other.queue), default=None)

    def _deadline(self, wait: WaitRequest) -> None:
        if wait.done or wait.verdict is not None or wait.current is None:
            return
        if wait.current.expire(wait):
            self.on_timed_out(wait, wait.current.path)

    def _expected_hold(self, wait: WaitRequest) -> float | None:
        held = self.hold_by_path.get(wait.paths[-1])
        return held if held is not None else self.hold_by_task.get(wait.task)

    def learn_hold(self, wait: WaitRequest) -> None:
        if wait.granted_at is None:
            return
        held = clock.monotonic() - wait.granted_at
        for table, key in ((self.hold_by_path, wait.paths[-1]), (self.hold_by_task, wait.task)):
            if len(table) > 10_000:
                table.clear()  # bounded: many one-off keys must not grow the agent
            mean = table.get(key)
            table[key] = held if mean is None else mean + 0.3 * (held - mean)

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

    def _guard_started(self, wait: WaitRequest, verdict: Claimed, error: BaseException | None) -> None:
        """A grant whose guard could not be ended (or moved) is not told as granted: its locks
        go and the pool process follows ``on_lock_unavailable`` (its retry takes the guard over)."""
        if error is None:
            return self._tell_verdict(wait, verdict)
        self.let_go(wait)
        self._tell_verdict(wait, Claimed(wait.id, Verdict.UNAVAILABLE,
                                         error=f"could not end the enqueue guard at the start: {error!r}"))

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

    def forget(self, wait: WaitRequest) -> None:
        wait.done = True
        self.claims.discard(wait)
        self.monitor.timers.cancel(wait.timer)
        if self.waits.get(wait.id) is wait:
            del self.waits[wait.id]
