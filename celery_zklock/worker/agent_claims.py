"""The lock agent's pool side: a pool process claims a request's verdict, is told whether
its locks are still safe, and releases them with a proof.

Once claimed, a lock belongs to that connection: a grant carries the locks' state *now*,
later changes are pushed (:meth:`Claims.push_state`), and a release is answered only once
ZooKeeper (or the local handoff's write) proves the lock was held to the end.  On the
agent's event thread.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..engine import kazoo_compat
from ..engine.internals import State
from ..engine.kazoo_compat import on_all_ready
from ..engine.session import PROOFS
from .agent_protocol import ClaimAnswer, Claimed, LockState, Released, Verdict
from .agent_requests import GuardsView, Requests, WaitRequest
from .agent_socket import Connection

logger = logging.getLogger("celery_zklock.worker.agent")


class Claims:
    """Claims, lock states and releases; its own state is the set of claimed requests
    (granted and claimed: their states are pushed on every heartbeat)."""

    requests: Requests  # set by the Agent once both exist (each tells the other)

    def __init__(self, post, client, guards: GuardsView) -> None:
        self.post, self.client, self.guards = post, client, guards
        self.claimed: set[WaitRequest] = set()

    def discard(self, wait: WaitRequest) -> None:
        self.claimed.discard(wait)

    def claim(self, peer: Connection, request_id: str, carried: bool = False) -> None:
        """Hand a decided request, or one next in line, to the pool process that runs it.

        A next-in-line claimer is told ``pending`` and gets the verdict the moment it is
        decided.  Other undecided requests are not claimable: the claimer would run
        in-process and could queue behind our own node.  A ``carried`` claim started on
        the grant its task brought along: it is told nothing unless the lock is no longer
        what that grant said (held), or was never this agent's to give."""
        wait = self.requests.waits.get(request_id)
        if carried:
            return self._carried(peer, request_id, wait)
        if wait is not None and wait.claimer is peer and wait.verdict is not None and not wait.done:
            # It claimed with the carried grant, which had aged by the time it was sent:
            # it waits for the verdict after all.
            return self.send_verdict(wait)
        if (wait is None or wait.done or wait.claimer is not None
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
                or wait.done or wait.claimer is not None):
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

    def unclaim(self, peer: Connection, request_id: str) -> None:
        """The claimer stopped waiting for its claim's answer and locks in-process instead.

        Why: a busy agent may answer a claim after the pool process's claim timeout; the
        grant then belongs to a connection that went on without it, and its node would hold
        the key for every worker (the in-process lock queues behind it) until that process
        exits.  The claim came first on the same connection, so it is decided here already;
        only that claimer's request is let go.  Its enqueue guard is left to the pool
        process, which now locks guarded in-process (:mod:`celery_zklock.task`)."""
        wait = self.requests.waits.get(request_id)
        if wait is None or wait.done or wait.claimer is not peer:
            return  # not claimed by it ("unknown": it owes nothing here)
        wait.guard = None
        self.requests.abandon(wait)
        logger.warning("zklock agent: request %s: its pool process stopped waiting for the claim's answer "
                       "(this agent answered late: busy?) and locks in-process; its lock here is let go", request_id)

    def release(self, peer: Connection, request_id: str) -> None:
        """Let go of a claimed request's locks; the answer says whether each one was proven
        held to the end (the delete, or the local handoff's write, found our node).
        Answered from those replies: no thread waits."""
        wait = self.requests.waits.get(request_id)
        if wait is None or wait.claimer is not peer or wait.done:
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

    # ------------------------------------------------------------------ lock state
    @staticmethod
    def _lost_reason(wait: WaitRequest) -> str | None:
        for slot in (hold.slot for hold in wait.holds.values()):
            if slot.attempt.lost_reason:
                return slot.attempt.lost_reason
            if slot.lost:
                return "lock lost"
        return None

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

    def push_state(self, wait: WaitRequest) -> None:
        if (wait.claimer is None or wait.done or wait.verdict is None
                or wait.verdict.verdict is not Verdict.GRANTED):
            return
        state = self._state(wait)
        if wait.shown_held == state.held and not state.lost:
            return
        wait.shown_held = state.held
        wait.claimer.send(state)

    @staticmethod
    def _runs(wait: WaitRequest) -> None:
        """A body runs (or is about to) under the request's holds: claimed on its verdict, or
        on the grant its task carried."""
        for hold in wait.holds.values():
            hold.slot.attempt.hold.running()  # its node is watched from now on

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


def _outcome(pending):
    """A release outcome: the delete's result once ready, or the string/None given."""
    if pending is None or isinstance(pending, str):
        return pending
    try:
        return pending.get(timeout=0)
    except Exception:
        return None
