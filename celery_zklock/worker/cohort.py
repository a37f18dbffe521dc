"""Lock cohorting in the worker's agent: one contender node per key, a local queue behind it.

Why (Dice, Marathe and Shavit, "Lock Cohorting", PPoPP 2012): with a node per waiting task, a
hot key's ZooKeeper queue grew with its backlog, and every join and grant with it.  Here the
agent keeps at most ``max_holders`` nodes per key (the global lock, queued fairly with other
workers, Curator and kazoo) and its own requests wait in memory, in arrival order (the local
lock, a :class:`WaitQueue`); a node passes to our next request without a release (a local
handoff), within the streak bound of :func:`~celery_zklock.worker.cohort_rules.passes_locally`
once someone else queues.  A handoff is granted only on a proof that the node is still ours: the reply to a
check of it through the leader, or a young one (the lease,
:func:`~celery_zklock.worker.cohort_rules.fresh`, aged on the lease clock, which counts a
suspend).  The design, the fencing proof and the lease's argument are in
docs/waiting.md.  Everything here runs on the agent's one event thread.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice, takewhile
from typing import Any, Callable, Iterator, Protocol

from ..engine import kazoo_compat
from ..engine.internals import Attempt, LockInternals, State
from ..engine.kazoo_compat import on_ready
from ..engine.session import LEASED, WRITTEN, ReleaseOutcome, guaranteed_proof, session_margin
from ..engine.znodes import NodeKind, exclusive_kind, fencing_token, sequence_of
from .cohort_rules import fresh, passes_locally, renews, streak_left
from .lease_clock import Clock, lease_clock


class CohortHost(Protocol):
    """What a :class:`Cohort` needs from the agent that holds it: its ZooKeeper client and
    settings, its event thread (``post``), and what it is told as its waiters move."""

    client: Any  # kazoo's KazooClient (the simulator's, under sim/)
    settings: Any  # celery_zklock.config.ZkSettings: cohort_handoffs, cohort_hold

    def post(self, fn: Callable, *args: Any) -> None: ...
    def on_granted(self, wait, cohort: "Cohort", slot: "Slot", token: int) -> None: ...
    def on_queued(self, wait, position: int) -> None: ...
    def on_next(self, wait, ours: bool = True, streak_left: float | None = None) -> None: ...
    def on_timed_out(self, wait, path: str) -> None: ...
    def on_failed(self, wait, exc: BaseException) -> None: ...
    def on_slot_lost(self, wait) -> None: ...
    def earliest_elsewhere(self, cohort: "Cohort") -> float | None: ...


@dataclass(eq=False)
class Slot:
    """One contender node of ours for the key, and which of our requests holds through it."""

    attempt: Attempt = field(init=False)  # set as the slot is made (its callbacks name the slot)
    holder: Any = None  # the agent's WaitRequest holding through this node, if any
    handing_on: bool = False  # the holder is reserved: granted once the handoff's proof answers
    grants: int = 0  # holders this node has had
    since: float | None = None  # when it was first granted
    foreign: bool = False  # another contender queues for the key (seen while held)
    watching: bool = False  # looking for such contenders (only once a local waiter exists)
    lost: bool = False
    answered: bool = False  # the create and first look at the queue have answered
    confirmed: float | None = None  # when the newest proof of the node that succeeded was sent
    proving: int = 0  # proofs of the node (checks, a rename) in flight

    @property
    def held(self) -> bool:
        return self.attempt.state is State.HELD and not self.lost

    def proof(self) -> float | None:
        """When the youngest proof of the node was sent: its newest check that succeeded, or
        the create that made it (held: that create succeeded); None before either."""
        sent = [t for t in (self.confirmed, self.attempt.create_sent) if t is not None]
        return max(sent) if sent else None

    @property
    def node_path(self) -> str:
        return f"{self.attempt.lk.path}/{self.attempt.node}"


class WaitQueue:
    """A cohort's local queue: our requests waiting for the key's node, in arrival order;
    FIFO with O(1) join, leave and put-back-first.

    Why not a ``deque``: leaving it (timeout, cancel, revoke, a process gone) and asking a
    waiter's place were linear in the backlog.  When the worker's main process goes,
    thousands of its requests leave in one event of the agent's one thread, in any order:
    out of order, 5,000 leaves cost 12.5M comparisons (0.25 s measured; quadratic, so 10,000
    cost about 1 s), and an event thread that busy stops its heartbeats and is killed as
    frozen (``agent.STUCK_AFTER``).  An insertion-ordered dict keyed by identity joins,
    leaves, and finds the first and last in O(1); :meth:`within` answers the one position
    question the cohort asks (among the first ``k``? ``k`` is a handful of fresh nodes) in
    O(k).  Waiters are compared by identity only: a request is itself, never an equal copy."""

    __slots__ = ("_waits",)

    def __init__(self) -> None:
        self._waits: OrderedDict[int, Any] = OrderedDict()

    def append(self, wait) -> None:
        """Join at the back (a waiter already queued stays where it is)."""
        self._waits.setdefault(id(wait), wait)

    def appendleft(self, wait) -> None:
        """Put back at the front (a reserved waiter whose node was lost: first in line still)."""
        self._waits[id(wait)] = wait
        self._waits.move_to_end(id(wait), last=False)

    def remove(self, wait) -> bool:
        """Leave; False if it was not queued."""
        return self._waits.pop(id(wait), None) is not None

    def first(self):
        """The first in line, or None."""
        return next(iter(self._waits.values()), None)

    def last(self):
        """The last in line, or None."""
        return next(reversed(self._waits.values()), None)

    def within(self, wait, k: int) -> bool:
        """Is ``wait`` among the first ``k`` in line?  O(k), whatever the backlog."""
        return id(wait) in self._waits and any(w is wait for w in islice(self._waits.values(), k))

    def __contains__(self, wait) -> bool:
        return id(wait) in self._waits

    def __len__(self) -> int:
        return len(self._waits)

    def __iter__(self) -> Iterator:
        return iter(self._waits.values())


@dataclass(eq=False)
class Cohort:
    """One key (path and holder count) as this agent sees it: its slots and local queue."""

    host: CohortHost  # the agent's Requests
    path: str
    max_holders: int  # our nodes at most: the semaphore's size, or for readers the pool's
    queue: WaitQueue = field(default_factory=WaitQueue)  # our waiters, in arrival order
    slots: list = field(default_factory=list)
    overdue: list = field(default_factory=list)  # waiters with wait.expired set, still queued
    clock: Clock = lease_clock  # every lease and streak age is read from it (it counts a suspend)
    #: Readers (lock_mode "read"): each node is a read node, held beside other readers, and
    #: passed among ours as a write node is; at most ``max_holders`` of them (the pool's size:
    #: no more of ours can run at once), however many wait.
    reads: bool = False

    @property
    def key(self) -> tuple[str, int, bool]:
        """How the agent files it: a path's readers (one cohort, whatever the pool's size) and
        its writers (or semaphore) apart."""
        return (self.path, 0 if self.reads else self.max_holders, self.reads)

    # ------------------------------------------------------------------ requests
    def join(self, wait) -> None:
        self.queue.append(wait)
        self.pump()
        if self.queue.last() is wait:  # not granted (the queue is scanned by no one:
            index = len(self.queue) - 1  # a backlog of thousands costs O(1) per join)
            if index >= self._fresh():
                self.host.on_queued(wait, index + self.busy)  # it waits for a holder of ours
        self._tell_next()

    def leave(self, wait) -> bool:
        """Stop waiting (timeout, cancel, revoke, a lost peer).  True if it was queued here."""
        if not self.queue.remove(wait):
            return False
        self.pump()
        self._tell_next()
        return True

    def expire(self, wait) -> bool:
        """The request's deadline passed.  True if it gives up now; False if it still holds
        here, or if a node that would serve it has not had its first answer yet (a timeout
        of 0 means "try once": that answer decides).  From now on ``wait.expired``: it never
        waits here again without its deadline applying (a reserved one whose handoff fails
        times out then, :meth:`_passed`)."""
        wait.expired = True
        if wait not in self.queue:
            return False
        if self.queue.within(wait, self._fresh()):
            self.overdue.append(wait)
            return False
        return self.leave(wait)

    def release(self, wait):
        """``wait`` lets go of its slot here.  Returns the proof: an async result resolving
        to WRITTEN/DELETED (held to the end) or GONE/EXPIRED, or a ReleaseOutcome at once when none can come."""
        slot = next((s for s in self.slots if s.holder is wait), None)
        if slot is None:
            return ReleaseOutcome.NOT_HELD
        slot.holder = None
        if slot.lost or slot.attempt.state is State.LOST:
            self._drop_slot(slot, replace=True)  # a node of ours may still be there: keep the place
            self.pump()
            return ReleaseOutcome.LOST
        nxt = self._next_waiter()
        if nxt is not None and slot.held and self._passes_on(slot, self.clock(), nxt):
            # Ours to pass on only if ZooKeeper confirms it: on a young proof (the lease) the
            # next holder starts now; otherwise it is reserved and granted on the proof's reply.
            self.queue.remove(nxt)
            now = self.clock()
            if fresh(slot.confirmed, now, kazoo_compat.session_timeout(self.host.client)):
                # The grant first, then any renewing proof: the next holder is told before
                # kazoo's thread is woken for it.
                self._grant(slot, nxt, reserved=True)
                if renews(slot.confirmed, now, slot.proving > 0):
                    self._prove(slot)
                return LEASED  # the young proof covers the leaving holder too: no wait for a reply
            # A handoff that waits for ZooKeeper anyway (a hold of 0.2 s or more) names its next
            # holder in the node, for `celery zklock status`: the writes are as rare as the holds
            # are long, and the watches they fire are set again (docs/waiting.md).
            proof = self._prove(slot, rename=nxt.identity)
            slot.holder, slot.handing_on = nxt, True
            self._on_passed(proof, slot, nxt, now)
            return proof
        proof = self._drop_slot(slot, replace=True)
        self.pump()
        return proof

    def _passes_on(self, slot: Slot, now: float, wait) -> bool:
        """May ``slot`` pass to our next waiter, ``wait``, now (the streak bound,
        :func:`passes_locally`)?  Judged when a handoff is decided and again when its proof
        answers.  Never past a request of this worker that came first for the same path in
        another mode (a writer past earlier readers, a reader past an earlier writer): the
        node goes, and theirs, queued behind it, is next."""
        settings = self.host.settings
        return (passes_locally(slot.grants, slot.since or 0.0, now, slot.foreign, settings.cohort_handoffs,
                               settings.cohort_hold)
                and not self._passes_over(wait))

    def _passes_over(self, wait) -> bool:
        """Would serving ``wait`` now pass a request of this worker that came first for the
        path in another mode (a writer past earlier readers, a reader past an earlier writer)?"""
        earliest = self.host.earliest_elsewhere(self)
        return earliest is not None and earliest < wait.started

    def _on_passed(self, proof, slot: Slot, wait, sent: float) -> None:
        on_ready(proof, lambda result: self.host.post(self._passed, slot, wait, sent, result))

    def _passed(self, slot: Slot, wait, sent: float, result) -> None:
        """The handoff's proof answered: grant the reserved waiter, or find the node gone.
        A reply older than a third of the session timeout (the agent was stopped, or its host
        suspended, meanwhile) proves nothing about now: the proof goes again first."""
        if not slot.handing_on or slot.holder is not wait:
            return  # this reservation was answered already: a node is granted once per proof
        try:
            written = result.get() == WRITTEN
        except Exception:
            written = False
        left = wait.current is not self  # cancelled, revoked or its worker gone meanwhile
        bounded = False  # the streak reached its bound while the proof was out: the node goes
        if written and slot in self.slots and slot.held and not left:
            now = self.clock()
            if now - sent >= session_margin(kazoo_compat.session_timeout(self.host.client)):
                return self._on_passed(self._prove(slot, rename=wait.identity), slot, wait, now)
            if self._passes_on(slot, now, wait):
                slot.handing_on, slot.holder = False, None
                return self._grant(slot, wait, reserved=True)
            # Another contender was seen while the proof was out (a partition held its reply
            # back, say), and the streak is at its bound: judged again here, at the grant, or
            # the handoffs decided before it was seen would all go through.
            bounded = True
        slot.handing_on, slot.holder = False, None
        overdue = not left and wait.expired  # its deadline passed while it was reserved
        if not left and not overdue:
            self.queue.appendleft(wait)  # first in line still: for the next node
        if not written:
            slot.lost = True
        if slot in self.slots and (not written or not slot.held or bounded):
            # Lost meanwhile (a suspension past its grace, then the write went through): a node
            # not held must go, or it stays first in the key's queue with nobody to grant.
            self._drop_slot(slot, replace=True)
        self.pump()
        if overdue:
            self.host.on_timed_out(wait, self.path)  # not queued again with no deadline

    # ------------------------------------------------------------------ the cohort's engine
    def pump(self) -> None:
        """Grant free held nodes to waiters, then keep as many nodes queued as waiters need."""
        for slot in list(self.slots):
            if slot.holder is None and slot.held:
                nxt = self._next_waiter()
                if nxt is None or self._passes_over(nxt):
                    self._drop_slot(slot)
                else:
                    self._grant(slot, nxt)
        pending = [s for s in self.slots if s.holder is None]
        want = max(0, min(len(self.queue), self.max_holders - self.busy))
        # New nodes only for waiters that came before every request of this worker waiting
        # for this path in another mode (a reader beyond the pool's worth of read nodes, a
        # writer): a later one's node would queue ahead of the node that request is still to
        # get.  The other cohort pumps this one as its waiters are granted or leave.
        earliest = self.host.earliest_elsewhere(self)
        made = want if earliest is None else sum(
            1 for _ in takewhile(lambda wait: wait.started < earliest, islice(self.queue, want)))
        while len(pending) < made:
            pending.append(self._new_slot())
        for slot in pending[want:]:
            if slot.attempt.state not in (State.HELD, State.HELD_SUSPENDED):
                self._drop_slot(slot)
        self._expire_answered()

    @property
    def busy(self) -> int:
        """How many of our slots have a holder."""
        return sum(1 for s in self.slots if s.holder is not None)

    def _fresh(self) -> int:
        """Nodes of ours whose first answer is still to come: the first that many waiters
        may be granted by it without ever queueing.  Not one whose create waits for the
        connection (``pending``): no answer comes while ZooKeeper is away, and a deadline must
        not wait for one (``FairLock`` gives up at its deadline when cut off, too)."""
        return sum(1 for s in self.slots if s.holder is None and not s.answered and s.attempt.pending is None)

    def waiting(self) -> bool:
        """Does any request wait in this cohort's local queue?"""
        return bool(self.queue)

    def first_came(self) -> float:
        """When the first in line came (with a request waiting)."""
        return self.queue.first().started

    def _next_waiter(self):
        """The first in line.  One whose deadline passed is still here only because a fresh
        node's first answer decides for it ("try once"): a grant is its answer."""
        return self.queue.first()

    def _grant(self, slot: Slot, wait, reserved: bool = False) -> None:
        if not reserved:
            self.queue.remove(wait)
        if slot.since is None:
            slot.since = self.clock()
            if slot.attempt.lk.identifier != wait.identity:  # created for a waiter that left
                self._prove(slot, rename=wait.identity)
        czxid = slot.attempt.czxid
        assert czxid is not None  # a node that was granted was created
        token = fencing_token(czxid, slot.grants)
        slot.grants += 1
        slot.holder = wait
        self.host.on_granted(wait, self, slot, token)
        self._tell_next()

    def _tell_next(self) -> None:
        """The first waiter behind a holder of ours takes the node when it lets go, unless
        that release ends the streak (told how long the streak may still run); from now on,
        whether anyone else queues for the key matters (the streak bound)."""
        busy = [s for s in self.slots if s.holder is not None]
        if self.queue and busy:
            settings, now = self.host.settings, self.clock()
            for slot in busy:
                # A local handoff may follow: the node's first proof now, while its holder
                # holds, so that the release finds a lease and the next holder starts without
                # waiting for a write (a streak's first handoff used to wait for one).  Later
                # proofs are renewed at the handoffs (release).
                if slot.held and not slot.handing_on and slot.confirmed is None and not slot.proving:
                    self._prove(slot)
            left = [streak_left(s.grants, s.since or now, now, s.foreign, settings.cohort_handoffs,
                                settings.cohort_hold) for s in busy]
            bounded = [s for s in left if s is not None]
            self.host.on_next(self.queue.first(), True, max(bounded) if len(bounded) == len(left) else None)
            for slot in busy:
                if not slot.watching:
                    slot.watching = True
                    self._watch_queue(slot)

    def _prove(self, slot: Slot, rename: bytes | None = None):
        """Check the node through the leader (or with ``rename``, write that owner into it);
        its success is a proof of the node as of the send.  Why a check and not a write of
        the next holder's name: a write woke every contender watching the node, and the
        holder's own watch, each of which read the node again (issue 39); so on a lease's
        quick handoffs the node goes on naming an earlier task of the same worker."""
        sent = self.clock()
        slot.proving += 1
        written = guaranteed_proof(slot.attempt.monitor, slot.node_path, slot.attempt.session, rename)
        on_ready(written, lambda result: self.host.post(self._wrote, slot, sent, result))
        return written

    def _wrote(self, slot: Slot, sent: float, result) -> None:
        slot.proving -= 1
        try:
            ok = result.get() == WRITTEN
        except Exception:
            ok = False
        if ok:
            slot.confirmed = sent if slot.confirmed is None else max(slot.confirmed, sent)
        elif not slot.lost:
            self._slot_lost(slot)  # a holder granted on a young proof learns it now

    def _new_slot(self) -> Slot:
        # Callbacks only post to the agent's thread (this one), which runs them after this
        # returns: the slot is complete by then.
        slot = Slot()
        post = self.host.post
        internals = LockInternals(self.host.client, self.path, 1 if self.reads else self.max_holders,
                                  self.queue.first().identity, on_lost=lambda: post(self._slot_lost, slot),
                                  watch_when_run=True,
                                  kind=NodeKind.READ if self.reads else exclusive_kind(self.host.settings.curator_interop))
        slot.attempt = internals.attempt(
            None, on_wait=lambda position: post(self._answered, slot), on_next=lambda: post(self._zk_next, slot))
        self.slots.append(slot)
        on_ready(slot.attempt.result, lambda result: post(self._decided, slot, result))
        return slot

    def _drop_slot(self, slot: Slot, replace: bool = False):
        """Let go of a node (delete it, or stop waiting).  With ``replace``, first queue a new
        one for the waiters, so the next holder is woken by this delete and we keep a place."""
        if slot in self.slots:
            self.slots.remove(slot)
        if replace and self._next_waiter() is not None:
            self.pump()
        slot.attempt.cancel()
        _, outcome = slot.attempt.release()
        return outcome if outcome is not None else ReleaseOutcome.NOT_HELD

    # ------------------------------------------------------------------ ZooKeeper's answers
    def _decided(self, slot: Slot, result) -> None:
        slot.answered = True
        try:
            held = result.get()
        except Exception as exc:
            if slot in self.slots:
                self.slots.remove(slot)
                for wait in list(self.queue):  # the same error would meet every one of them
                    self.queue.remove(wait)
                    self.host.on_failed(wait, exc)
            return
        if slot not in self.slots:
            if held:
                slot.attempt.release()  # dropped while its answer was in flight
            return
        if not held:
            self.slots.remove(slot)
        self.pump()

    def _answered(self, slot: Slot) -> None:
        """The node had to queue: its waiters learn they wait; those whose deadline passed
        meanwhile give up now."""
        slot.answered = True
        busy = self.busy
        # Only waiters that joined behind a fresh node were not told yet (join tells the
        # others), and they joined within its first max_holders places; a reserved waiter
        # put back at the front moves them one place per slot at most.  So the scan is
        # bounded by max_holders, not by the backlog: on a hot key this runs at every streak.
        for index, wait in enumerate(islice(self.queue, 2 * self.max_holders + 1)):
            self.host.on_queued(wait, busy + index)
        self._expire_answered()

    def _expire_answered(self) -> None:
        """Waiters whose deadline passed while a fresh node could still serve them give up
        once no fresh node is ahead of them (only those are scanned: a pump is O(1) in the
        backlog)."""
        if not self.overdue:
            return
        fresh = self._fresh()
        for wait in list(self.overdue):
            if wait not in self.queue:
                self.overdue.remove(wait)
            elif not self.queue.within(wait, fresh):
                self.overdue.remove(wait)
                self.queue.remove(wait)
                self.host.on_timed_out(wait, self.path)

    def _zk_next(self, slot: Slot) -> None:
        """The node has only holders ahead of it in ZooKeeper: its first waiter is next, behind
        holders that are not ours (another worker's streak may hold the key for a while)."""
        if slot in self.slots and slot.holder is None and self.queue:
            self.host.on_next(self.queue.first(), False)

    def _slot_lost(self, slot: Slot) -> None:
        slot.lost = True
        if slot.holder is not None:
            self.host.on_slot_lost(slot.holder)
        elif slot in self.slots:
            self._drop_slot(slot, replace=True)
            self.pump()

    def _watch_queue(self, slot: Slot) -> None:
        """While a node is held and ours wait behind it, learn whether anyone else queues (one
        children read, a child watch until someone shows up): only then is the streak bounded."""
        client = self.host.client

        def changed(_event) -> None:
            self.host.post(look)

        def look() -> None:
            if slot not in self.slots or slot.foreign:
                return
            if not slot.held:
                slot.foreign = True  # suspended: no read now, and a fired watch is used up
                return
            on_ready(client.get_children_async(self.path, watch=changed),
                     lambda result: self.host.post(self._seen, slot, result))

        look()

    def _seen(self, slot: Slot, result) -> None:
        try:
            children = result.get()
        except Exception:
            # No read, so no watch: a contender that came now would never be seen, and the
            # streak would run unbounded.  Count the key as contended (the safe side): this
            # node's streak is bounded, and the next node of ours reads the queue afresh.
            slot.foreign = True
            return
        ours = {s.attempt.node for s in self.slots}
        slot.foreign = any(c not in ours and sequence_of(c) is not None for c in children)

    @property
    def idle(self) -> bool:
        return not self.queue and not self.slots

    @property
    def wants_pump(self) -> bool:
        """A node of ours held with no holder, or waiters and no holder: the tick pumps it.
        Why: a node taken suspended (or suspended while free) is kept for a waiter, and
        nothing tells the cohort when its re-verification succeeds; whether a waiter still
        wants it or not, held again it must be granted or let go (it holds the key for every
        worker meanwhile)."""
        if self.queue and not self.busy:
            return True
        return any(s.holder is None and s.held for s in self.slots)
