"""A pool process's side of the lock agent: claim the lock the agent took, hold it, give it back.

Why: when the worker's main process queued a request in the agent
(:mod:`celery_zklock.worker.wait_outside_pool`), the lock is already decided by the time the pool runs
the task; the pool process only claims it — one local round trip, no ZooKeeper session of
its own — and learns from the agent whether it stays safe to hold.  ``is_held()`` needs
no I/O: it is False once the agent says the lock is suspended or lost, and once the
agent has been silent for a third of the session timeout (frozen, killed, cut off).
"""

from __future__ import annotations

import os
import queue
import select
import threading
import time
from typing import Any, Callable, TypeVar

from ..engine.session import session_margin
from .agent_protocol import (
    BYPASSED,
    CARRIED,
    ENV,
    Carry,
    Claim,
    ClaimAnswer,
    Claimed,
    Connection,
    Hello,
    LockState,
    PeerRole,
    ProtocolError,
    Release,
    Released,
    Unclaim,
    from_wire,
)
from .cohort_rules import fresh
from .lease_clock import lease_clock

#: Seconds between the link thread's reads while no lock has been held through the link for
#: as long: it only keeps the agent's sends from blocking (heartbeats pile up otherwise).
IDLE_DRAIN = 1.0

#: Seconds between the link thread's reads while locks are held through the link (or were,
#: within :data:`IDLE_DRAIN`): the most a state push from the agent waits before
#: ``is_held()`` and an interrupt see it.
POLL = 0.05

_A = TypeVar("_A")  # the type of an answer a call waits for

_link_guard = threading.Lock()
_link: "AgentClient | None" = None


class AgentClient:
    """This process's connection to its worker's agent.

    Who reads the socket: a caller waiting for its answer (a claim, a release) reads it
    itself; the link's thread only drains what came meanwhile, on a clock (:data:`POLL`
    while locks are held, :data:`IDLE_DRAIN` otherwise), and never waits on the socket.
    Why a clock and not a thread that waits on the socket: such a thread was woken twice
    per task (a lock registered, its release called) and took the GIL from the body each
    time; on five hot keys that was half of a pool process's context switches and about a
    tenth of its CPU per task (issue 39).  What it costs: a state push (suspended, lost)
    reaches ``is_held()`` and an interrupt up to :data:`POLL` later, on top of the time the
    agent takes to learn of the loss from ZooKeeper (docs/design.md)."""

    def __init__(self, path: str) -> None:
        self.pid = os.getpid()
        self.conn = Connection.open(path)
        self.last_heard = time.monotonic()
        # (answer type, id) -> its caller's queue; a None there ends the wait (the link ended).
        self._replies: dict[tuple[type, str | None], queue.SimpleQueue[Any]] = {}
        self._locks: dict[str, "AgentLock"] = {}
        # A state pushed between the claim's reply and the lock's registration: kept for it,
        # with its place among the pushes (see _take).
        self._early: dict[str, tuple[int, LockState]] = {}
        self._pushes = 0  # pushes taken off the socket so far
        self._guard = threading.Lock()
        self._receiving = threading.Lock()  # held by whichever thread takes bytes off the socket
        self._turn = threading.Condition()
        self._caller_reads = False  # a caller reads for its answer: a second caller queues
        self._busy_at = float("-inf")  # when a lock last registered
        self._dozing = False  # the link's thread sleeps IDLE_DRAIN: a registering lock wakes it
        self.conn.send(Hello(PeerRole.POOL, self.pid))
        threading.Thread(target=self._poll, name="zklock-agent-link", daemon=True).start()

    @property
    def alive(self) -> bool:
        return not self.conn.closed

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def call(self, message: Claim | Release, answer: type[_A], timeout: float,
             until: Callable[[_A], bool] | None = None) -> _A | None:
        """Send ``message``; the agent's answer of type ``answer`` for the same id, or None
        (timeout, gone).

        With ``until``, answers for which ``until(answer)`` is false are interim: the wait
        goes on, without a time limit, for as long as the link lives."""
        key = (answer, message.id)
        replies: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._guard:
            self._replies[key] = replies
        with self._turn:
            reads = not self._caller_reads  # another thread of this process reads already: queue
            self._caller_reads = True
        try:
            if not self.conn.send(message):
                return None
            deadline: float | None = time.monotonic() + timeout
            while True:
                reply = self._next_reply(replies, deadline, reads)
                if reply is None or until is None or until(reply):
                    return reply
                deadline = None  # an interim answer: no time limit from here on
        finally:
            with self._guard:
                self._replies.pop(key, None)
            if reads:
                with self._turn:
                    self._caller_reads = False

    def _next_reply(self, replies: queue.SimpleQueue[Any], deadline: float | None, reads: bool):
        """The next answer put in ``replies``, reading the socket here when ``reads``; None at
        ``deadline`` or once the link ends."""
        while True:
            try:
                return replies.get_nowait()  # None: the link ended
            except queue.Empty:
                pass
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if not reads:
                try:
                    return replies.get(timeout=left)
                except queue.Empty:
                    return None
            with self._receiving:
                if self.conn.closed:
                    return None
                try:
                    ready, _, _ = select.select([self.conn.sock], [], [], left)
                except (OSError, ValueError):
                    ready = [self.conn.sock]  # closed under us: receive() says so
                if ready:
                    self._take(self.conn.receive(block=False))

    def register(self, lock: AgentLock) -> tuple[int, LockState] | None:
        """Route the agent's states of ``lock`` to it from now on; the state pushed before it
        registered (after its claim's answer), if one came, with its place among the pushes."""
        with self._guard:
            self._locks[lock.id] = lock
            early = self._early.pop(lock.id, None)
        self.reading_needed()
        return early

    def forget(self, lock_id: str) -> None:
        """A lock given back: no state of it is routed any more."""
        self._locks.pop(lock_id, None)

    def send(self, message: Claim | Release) -> bool:
        """A message whose answer nobody waits for here (a carried grant's claim, a release
        whose proof nobody waits for)."""
        if isinstance(message, Claim):
            # A carried grant's: no answer will clear what was kept for its id, which was
            # pushed to an earlier lock of that id (a retry keeps its task's id).
            self._void_kept(message.id)
        return self.conn.send(message)

    def unclaim(self, request_id: str) -> None:
        """This process stopped waiting for a claim's answer: the agent is to let go of
        whatever it decides for it, and a state it pushed early is void."""
        self.conn.send(Unclaim(request_id))
        self._void_kept(request_id)

    def _void_kept(self, request_id: str) -> None:
        """A state kept for ``request_id`` is for no lock this process will register."""
        with self._guard:
            self._early.pop(request_id, None)

    def heard_within(self, silence: float) -> bool:
        """Has the agent been heard within ``silence`` (what a lock held through it tolerates),
        reading what came first?  Why: with no lock held the link is drained only now and then
        (:data:`IDLE_DRAIN`), so a lock started on a carried grant after an idle spell would
        begin as "not held", or on an agent that has in fact gone silent."""
        self._drain()
        return self.alive and self.silent_for() < silence

    def reading_needed(self) -> None:
        """A lock was registered: the link's thread reads every :data:`POLL` from now on
        (woken only if it dozes)."""
        with self._turn:
            self._busy_at = time.monotonic()
            if self._dozing:
                self._dozing = False
                self._turn.notify_all()

    def _poll(self) -> None:
        while not self.conn.closed:
            with self._turn:
                busy = bool(self._locks) or time.monotonic() - self._busy_at < IDLE_DRAIN
                self._dozing = not busy
                self._turn.wait(POLL if busy else IDLE_DRAIN)
                self._dozing = False
            self._drain()

    def _drain(self) -> None:
        """Take what came while nobody read (heartbeats, a late answer): never blocks."""
        if not self._receiving.acquire(blocking=False):
            return  # a caller reads
        try:
            while not self._caller_reads and not self.conn.closed:
                messages = self.conn.receive(block=False)
                self._take(messages)
                if not messages:
                    return
        finally:
            self._receiving.release()

    def _take(self, messages: list | None) -> None:
        """What came off the socket (None: its end), on whichever thread read it."""
        if messages is None:
            return self._ended()
        if not messages:
            return
        self.last_heard = time.monotonic()
        for msg in messages:
            if isinstance(msg, LockState):
                # Numbered as read: one thread at a time reads (_receiving), so this is the
                # order the agent sent them in, and a lock applies none older than one it has.
                with self._guard:
                    self._pushes += 1
                    place = self._pushes
                    lock = self._locks.get(msg.id)
                    if lock is None:
                        if len(self._early) > 1000:
                            self._early.clear()
                        self._early[msg.id] = (place, msg)
                if lock is not None:
                    lock.pushed(place, msg)
                continue
            with self._guard:
                if isinstance(msg, Claimed):
                    # What was kept for its id came before the claim's answer, so it was
                    # pushed to an earlier lock of that id (a retry keeps its task's id).
                    self._early.pop(msg.id, None)
                replies = self._replies.get((type(msg), getattr(msg, "id", None)))
            if replies is not None:
                replies.put(msg)

    def _ended(self) -> None:
        """The agent is gone: every lock held through it is lost, every wait ends."""
        for lock in list(self._locks.values()):  # (receive() marked the connection closed)
            lock.update(False, True, "the worker's lock agent is gone")
        with self._guard:
            for replies in self._replies.values():
                replies.put(None)
        with self._turn:
            self._turn.notify_all()


def beside_agent() -> bool:
    """Does this pool process belong to a worker whose lock agent queues for the same keys?
    Then a lock taken here must never be waited for: the agent's nodes ahead may be granted
    to requests that need this very process (decision.lock_in_process, ``give_back``)."""
    return bool(os.environ.get(ENV))


def link() -> AgentClient | None:
    """This process's link to its worker's agent; None when tasks lock in-process."""
    global _link
    path = os.environ.get(ENV)
    if not path:
        return None
    current = _link
    if current is not None and current.pid == os.getpid() and current.alive:
        return current
    with _link_guard:
        if _link is None or _link.pid != os.getpid() or not _link.alive:
            try:
                _link = AgentClient(path)
            except OSError:
                return None
        return _link


class AgentLock:
    """The lock a pool process holds through the agent: what ``current_lock()`` wraps."""

    def __init__(self, link: AgentClient, request_id: str, tokens: dict[str, int], grace: float,
                 release_bound: float, on_lost: Callable[[AgentLock], None] | None = None,
                 state: Claimed | None = None) -> None:
        """``state``: the claim's answer (None: held, as granted)."""
        self.link = link
        self.id = request_id
        # Started on the grant its task carried, not on the claim's answer.
        self.carried = state is not None and state.carried
        self.tokens = tokens
        self.grace = grace
        self.release_bound = release_bound
        self.on_lost = on_lost
        self.lost_reason: str | None = None
        self._held = True
        self._settled = threading.Event()  # set whenever the agent says held, or lost
        self._applying = threading.RLock()  # a push's place checked and its state applied as one
        self._last_push = 0  # the place of the newest push applied
        # The claim's answer first, then what the agent pushed since.  A push kept for this
        # lock before it registered (newer than the answer) and one the link's thread delivers
        # as it registers may be applied in either order: their places decide which stands.
        if state is None:
            self.update(True, False, None)
        else:
            self.update(state.held, state.lost, state.reason)
        early = link.register(self)
        if early is not None:
            self.pushed(*early)

    @property
    def locks(self) -> list["AgentLock"]:
        return [self]

    def is_held(self) -> bool:
        return self._held and self.link.alive and self.link.silent_for() < self.grace

    def pushed(self, place: int, state: LockState) -> None:
        """A state the agent pushed, ``place``-th off the link: applied unless a newer push was."""
        with self._applying:
            if place <= self._last_push:
                return
            self._last_push = place
            self.update(state.held, state.lost, state.reason)

    def update(self, held: bool, lost: bool, reason: str | None) -> None:
        """What the agent says of this lock now (its claim's answer, a pushed state, its end)."""
        with self._applying:  # the link's end (any thread) and a push may come at once
            if self.lost_reason is not None:
                return  # lost stays lost: nothing said after it (an older state) changes it
            self._held = held and not lost
            if lost:
                self.lost_reason = reason or "lock lost"
                if self.on_lost is not None:
                    self.on_lost(self)
            self.suspended_reason = None if (held or lost) else (reason or "not held")
            if held or lost:
                self._settled.set()
            else:
                self._settled.clear()

    def confirmed(self, timeout: float) -> bool:
        """Wait until the agent says the lock is safe to hold (True), or lost, or ``timeout``
        passes (False).  Why: a body must not start while ZooKeeper cannot confirm its lock
        — a grant made before the connection dropped says nothing about now."""
        self._settled.wait(timeout)
        return self._held and self.lost_reason is None and self.link.alive

    def abandon(self) -> None:
        """Give back a lock whose body never ran: no proof is owed, so none is waited for
        (waiting could stall the pool process another session timeout)."""
        self.link.forget(self.id)
        self.link.send(Release(self.id))

    def release(self) -> bool:
        """Give the lock back; True only if the agent proved it held to the end."""
        self.link.forget(self.id)
        if self.lost_reason is not None:
            # Already lost (the agent said so): there is no proof left to wait for, and
            # while ZooKeeper is unreachable the agent's delete would keep the task's
            # result waiting up to release_bound.  The agent still deletes the node.
            self.abandon()
            return False
        reply = self.link.call(Release(self.id), Released, self.release_bound)
        if reply is None:
            self.lost_reason = self.lost_reason or "the worker's lock agent did not confirm the release"
            return False
        if not reply.proven:
            # The agent's delete found no node: its session expired (frozen, partitioned)
            # or the node was deleted, and someone else may have held the lock meanwhile.
            self.lost_reason = self.lost_reason or reply.reason or "lock not held at release"
            return False
        return self.lost_reason is None


def silence_grace(requested: float, granted: float | None) -> float:
    """How long a claimer trusts its lock while the agent is silent: a third of the agent's
    session timeout, as negotiated with its server (``granted``: the claim's answer's
    ``session_timeout``, None when it does not say), and never more than a third of the one
    asked for.  Why the negotiated one: a frozen agent's session expires after *that*, and a
    server's ``maxSessionTimeout`` may have cut it short; trusting a third of the request
    could outlast the session itself."""
    session = requested if granted is None else min(requested, float(granted))
    return session_margin(session)


def carried_grant(request) -> Carry | None:
    """The grant this request brought from the main process, taken off the request (None when
    none did, or it does not read as one: the claim's answer is then waited for).

    Why in ``delivery_info`` (:data:`~celery_zklock.worker.agent_protocol.CARRIED`): the worker
    builds it anew for each delivery of a message, and a copy of the request's headers (a
    retry, a replacement) does not carry it into the next one.  Why taken off, before the
    body runs: a retry made from this request passes ``delivery_info`` on as publish options."""
    carry = _taken(request, CARRIED)
    if carry is None:
        return None
    try:
        return from_wire(Carry, carry)
    except ProtocolError:
        return None


def bypassed(request) -> bool:
    """Is this delivery one the agent knows its task id by another delivery of
    (:data:`~celery_zklock.worker.agent_protocol.BYPASSED`)?  Then it must not claim by that id: it
    would take the other delivery's grant, and both would run on it.  Taken off the request,
    as the carried grant is."""
    return bool(_taken(request, BYPASSED))


def _taken(request, field: str):
    """A field the main process set in the request's ``delivery_info``, taken off it."""
    info = getattr(request, "delivery_info", None)
    return info.pop(field, None) if isinstance(info, dict) else None


def starts_on_carried(send, request_id: str, carry: Carry) -> bool:
    """Claim on the carried grant (``send`` the claim to the agent) and start without waiting
    for an answer, if its proof is still younger than the lease window, read *after* the
    claim was sent: the agent keeps an unclaimed carried grant that long (plus a grace), so
    the claim reaches it first.  False: the claim's answer is waited for (the simulator's
    pool processes call this too)."""
    proof, session = carry.proof, carry.session_timeout
    if not fresh(proof, lease_clock(), session):
        return False
    if not send(Claim(request_id, carried=True)):
        return False
    return fresh(proof, lease_clock(), session)


def claim(request_id: str, timeout: float, carried: Carry | None = None) -> tuple[AgentClient, Claimed] | None:
    """Ask the agent for the verdict on ``request_id``: its answer, never ``pending`` nor
    ``unknown``; None when there is no agent to ask, or it has no verdict for this request.

    With a ``carried`` grant (:func:`carried_grant`) still young, that grant is the verdict:
    the claim is sent, not waited for (the agent pushes a state only if the lock is no
    longer held as the grant said).  Why: on a hot key the claim's round trip through a
    busy agent is in the gap between one holder's end and the next one's start (issue 39).

    A request handed over while next in line is ``pending``: wait here for its verdict
    (the release ahead of it, its deadline, or its revocation); the agent's heartbeat
    keeps the link alive, and a dead agent ends the wait (the request then locks
    in-process: its node died with the agent's session).  A first answer that does not
    come within ``timeout`` is withdrawn (:class:`~.agent_protocol.Unclaim`) before the request
    locks in-process."""
    current = link()
    if current is None:
        return None
    if (carried is not None and current.heard_within(session_margin(carried.session_timeout))
            and starts_on_carried(current.send, request_id, carried)):
        return current, carried.as_claimed(request_id)
    reply = current.call(Claim(request_id), Claimed, timeout, until=lambda r: r.verdict is not ClaimAnswer.PENDING)
    if reply is None and current.alive:
        # No answer in time (a busy agent): this process locks in-process now, so the
        # agent must let go of whatever it decides for the claim (a late grant would hold
        # the key, with this process queued behind it).  Sent before locking: the agent
        # reads it after the claim, on the same connection.
        current.unclaim(request_id)
    if reply is None or reply.verdict is ClaimAnswer.UNKNOWN:
        return None
    return current, reply
