"""Watching over a hold: suspension and its grace, re-verification, the watch on our own node.

A held lock is HELD_SUSPENDED (not held) while disconnected; re-verified (node exists,
owned by our session) on reconnection; LOST when the suspension outlasts its grace (a
third of the session timeout by default) or our node is deleted.  The watch tells its
attempt a :class:`HoldVerdict`; the attempt moves between those states itself.  Why
these numbers, and why the own-node watch waits :data:`OWN_WATCH_WITHIN`:
docs/design.md, "Holding".
"""

from __future__ import annotations

import enum
import threading
from functools import partial
from typing import Callable

from kazoo.exceptions import ConnectionClosedError, NoNodeError, SessionExpiredError
from kazoo.protocol.states import EventType

from .. import kazoo_compat
from ..session import RETRYABLE
from .state import AttemptView, State

#: Seconds after a grant by which the holder's watch on its own node is set (a hold
#: shorter than that never pays for it).
OWN_WATCH_WITHIN = 0.02


class HoldVerdict(enum.Enum):
    """What the watch over a hold tells its attempt: held again, or lost (the value is the
    attempt's ``lost_reason``)."""

    HELD = "held"  # re-verified after a reconnection
    SESSION_EXPIRED = "ZooKeeper session expired"
    NODE_DELETED = "lock node was deleted"
    NODE_GONE = "lock node gone after reconnection"
    GRACE_OVER = "disconnected from ZooKeeper past the session-expiry safety margin"


def verified(outcome, session_now: int | None, session: int | None, same_suspension: bool) -> HoldVerdict | None:
    """The verdict of a re-verification's ``exists`` (``outcome``: its stat, None, or the
    exception it raised); None when it settles nothing.  ``same_suspension``: connected
    still, in the epoch it was sent in.  Why that matters: a newer suspension may have
    begun while the request was in flight, and then its own verify and grace decide."""
    if isinstance(outcome, RETRYABLE):
        return None  # disconnected again: the next CONNECTED re-verifies
    if isinstance(outcome, (SessionExpiredError, ConnectionClosedError)):
        return HoldVerdict.SESSION_EXPIRED
    if isinstance(outcome, Exception):
        return None
    if outcome is not None and outcome.ephemeralOwner == session_now == session:
        return HoldVerdict.HELD if same_suspension else None
    return HoldVerdict.NODE_GONE


class HoldWatch:
    """The attempt's hold once taken.  Its own state: the grace timer of a suspension and
    the one watcher on our node (one per hold, so a watch set again is not doubled).  It
    reads the hold (state, node, session) through ``attempt`` and tells ``tell`` its
    verdicts, under the attempt's ``mutex``."""

    def __init__(self, client, monitor, path: str, grace: Callable[[], float], watch_when_run: bool,
                 mutex: threading.RLock, attempt: AttemptView, tell: Callable[[HoldVerdict], None]) -> None:
        self._client = client
        self._monitor = monitor  # the client's SessionMonitor: timers, epoch
        self._path = path
        self._grace = grace
        self._watch_when_run = watch_when_run
        self._mutex = mutex
        self._attempt = attempt
        self._tell = tell
        self._grace_timer = None  # while HELD_SUSPENDED: when the suspension makes it LOST
        self._suspension = 0  # counts suspensions of the hold: the grace timer names its own
        self._own_watcher: tuple | None = None  # (node, session, watcher): the holder's watch on its node
        self._running = False  # a task runs under the hold (watch_when_run: the watch may start)
        self._armed: tuple | None = None  # (node, session) whose watch is scheduled or set

    def stop(self) -> None:
        self._monitor.timers.cancel(self._grace_timer)

    def watch_soon(self) -> None:
        """Just granted: watch our node within :data:`OWN_WATCH_WITHIN`, batched per client;
        with ``watch_when_run``, only once something runs under the hold (:meth:`running`)."""
        at = self._attempt
        if self._watch_when_run and not self._running:
            return
        if self._armed == (at.node, at.session):
            return
        self._armed = (at.node, at.session)
        self._monitor.timers.soon(OWN_WATCH_WITHIN, self._watch_if_still_held, at.node, at.session)

    def running(self) -> None:
        """A task runs (or is about to) under this hold: from now on its node is watched.

        Why not at the grant: the agent grants ahead of a free pool process, and a hold
        that only waits in the worker's queue needs no watch (issue 39: one GetData for
        most tasks of a burst on distinct keys).  A deletion before the claim is then told
        :data:`OWN_WATCH_WITHIN` and a round trip after it (or by the release's proof), as
        one in the first moments of any hold is: docs/design.md, "Holding"."""
        with self._mutex:
            self._running = True
            if self._attempt.state is State.HELD:
                self.watch_soon()

    def _watch_if_still_held(self, node, session) -> None:
        """Still the same hold, connected: watch our node (suspended: the re-verification does)."""
        at = self._attempt
        with self._mutex:
            if at.state is State.HELD and at.node == node and at.session == session:
                self._watch_own_node()

    def suspend(self) -> None:
        """The attempt is HELD_SUSPENDED: the grace starts now, and runs until a
        re-verification succeeds.  A disconnection while re-verifying does not restart it
        (nor come here): the hold was never confirmed in between, so its grace counts from
        the first cut."""
        self._monitor.timers.cancel(self._grace_timer)
        self._suspension += 1
        self._grace_timer = self._monitor.grace_timer(self._grace(), partial(self._on_grace_over, self._suspension))
        if self._client.connected:
            self.verify(self._monitor.epoch)

    def _watch_own_node(self) -> None:
        """Learn at once if our node is deleted behind our back (operator, reaper, expiry).
        One-shot, and fired by a write too (the cohort's lease): set again after a change.
        ``get``, not ``exists``: no creation watch left for a node already gone."""
        node, session = self._attempt.node, self._attempt.session
        if self._own_watcher is None or self._own_watcher[:2] != (node, session):
            self._own_watcher = (node, session, partial(self._own_node_changed, node, session))
        kazoo_compat.on_ready(self._client.get_async(f"{self._path}/{node}", watch=self._own_watcher[2]),
                              partial(self._own_node_checked, node, session))

    def _own_node_changed(self, node, session, event) -> None:
        at = self._attempt
        with self._mutex:
            if at.node != node or at.session != session:
                return
            if event.type == EventType.DELETED:
                self._tell(HoldVerdict.NODE_DELETED)
            elif event.type == EventType.CHANGED and at.state is State.HELD:
                self._watch_own_node()  # written to (the lease): the watch is used up

    def _own_node_checked(self, node, session, result) -> None:
        try:
            result.get()
            missing = False
        except NoNodeError:
            missing = True
        except Exception:
            return  # connection trouble: the monitor takes over
        if missing:
            with self._mutex:
                if self._attempt.node == node and self._attempt.session == session:
                    self._tell(HoldVerdict.NODE_DELETED)

    def verify(self, epoch: int) -> None:
        """After a reconnection: still ours only if the node exists and our session owns it."""
        node, session = self._attempt.node, self._attempt.session
        exists = self._client.exists_async(f"{self._path}/{node}")
        kazoo_compat.on_ready(exists, partial(self._on_verified, epoch, node, session))

    def _on_verified(self, epoch: int, node, session, result) -> None:
        at = self._attempt
        with self._mutex:
            if at.state is not State.HELD_SUSPENDED or at.node != node:
                return
            try:
                outcome = result.get()
            except Exception as exc:
                outcome = exc
            same_suspension = self._monitor.epoch == epoch and self._client.connected
            verdict = verified(outcome, kazoo_compat.session_id(self._client), session, same_suspension)
            if verdict is None:
                return
            self._tell(verdict)
            if verdict is HoldVerdict.HELD:
                self._monitor.timers.cancel(self._grace_timer)
                self._watch_own_node()  # kazoo dropped our watches when the connection broke

    def _on_grace_over(self, suspension: int, _epoch: int) -> None:
        """The suspension that armed this timer never ended in a re-verification: LOST.
        Why by suspension and not by the connection's epoch: a reconnection whose
        re-verification is cut off again bumps the epoch, yet is the same suspension
        (a partition would otherwise go unreported)."""
        with self._mutex:
            if self._attempt.state is State.HELD_SUSPENDED and self._suspension == suspension:
                self._tell(HoldVerdict.GRACE_OVER)
