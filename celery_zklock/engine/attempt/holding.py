"""Watching over a hold: suspension and its grace, re-verification, the watch on our own node.

A held lock is HELD_SUSPENDED (not held) while disconnected; re-verified (node exists,
owned by our session) on reconnection; LOST when the suspension outlasts its grace (a
third of the session timeout by default) or our node is deleted.  Why these numbers, and
why the own-node watch waits :data:`OWN_WATCH_WITHIN`: docs/design.md, "Holding".
"""

from __future__ import annotations

from functools import partial
from kazoo.exceptions import ConnectionClosedError, NoNodeError, SessionExpiredError
from kazoo.protocol.states import EventType

from .. import kazoo_compat
from ..session import RETRYABLE
from .state import AttemptPath, State

#: Seconds after a grant by which the holder's watch on its own node is set (a hold
#: shorter than that never pays for it).
OWN_WATCH_WITHIN = 0.02


class HoldWatch:
    """The attempt's hold once taken; its own state is the grace timer of a suspension and
    the one watcher on our node (one per hold, so a watch set again is not doubled)."""

    def __init__(self, attempt: AttemptPath) -> None:
        self.attempt = attempt
        self._grace_timer = None  # while HELD_SUSPENDED: when the suspension makes it LOST
        self._suspension = 0  # counts suspensions of the hold: the grace timer names its own
        self._own_watcher = None  # (node, session, watcher): the holder's watch on its node
        self._running = False  # a task runs under the hold (watch_when_run: the watch may start)
        self._armed = None  # (node, session) whose watch is scheduled or set

    def stop(self) -> None:
        self.attempt.monitor.timers.cancel(self._grace_timer)

    def watch_soon(self) -> None:
        """Just granted: watch our node within :data:`OWN_WATCH_WITHIN`, batched per client;
        with ``watch_when_run``, only once something runs under the hold (:meth:`running`)."""
        at = self.attempt
        if at.lk.watch_when_run and not self._running:
            return
        if self._armed == (at.node, at.session):
            return
        self._armed = (at.node, at.session)
        at.monitor.timers.soon(OWN_WATCH_WITHIN, self._watch_if_still_held, at.node, at.session)

    def running(self) -> None:
        """A task runs (or is about to) under this hold: from now on its node is watched.

        Why not at the grant: the agent grants ahead of a free pool process, and a hold
        that only waits in the worker's queue needs no watch (issue 39: one GetData for
        most tasks of a burst on distinct keys).  A deletion before the claim is then told
        :data:`OWN_WATCH_WITHIN` and a round trip after it (or by the release's proof), as
        one in the first moments of any hold is: docs/design.md, "Holding"."""
        at = self.attempt
        with at.mutex:
            self._running = True
            if at.state is State.HELD:
                self.watch_soon()

    def _watch_if_still_held(self, node, session) -> None:
        """Still the same hold, connected: watch our node (suspended: the re-verification does)."""
        at = self.attempt
        with at.mutex:
            if at.state is State.HELD and at.node == node and at.session == session:
                self._watch_own_node()

    def suspend(self) -> None:
        """HELD -> HELD_SUSPENDED: the grace starts now, and runs until a re-verification
        succeeds.  A disconnection while re-verifying does not restart it (nor come here):
        the hold was never confirmed in between, so its grace counts from the first cut."""
        at = self.attempt
        at.state = State.HELD_SUSPENDED
        at.monitor.timers.cancel(self._grace_timer)
        self._suspension += 1
        self._grace_timer = at.monitor.grace_timer(at.lk.grace(), partial(self._on_grace_over, self._suspension))
        if at.client.connected:
            self.verify(at.monitor.epoch)

    def _watch_own_node(self) -> None:
        """Learn at once if our node is deleted behind our back (operator, reaper, expiry).
        One-shot, and fired by a write too (the cohort's lease): set again after a change.
        ``get``, not ``exists``: no creation watch left for a node already gone."""
        at = self.attempt
        node, session = at.node, at.session
        if self._own_watcher is None or self._own_watcher[:2] != (node, session):
            self._own_watcher = (node, session, partial(self._own_node_changed, node, session))
        kazoo_compat.on_ready(at.client.get_async(f"{at.lk.path}/{node}", watch=self._own_watcher[2]),
                              partial(self._own_node_checked, node, session))

    def _own_node_changed(self, node, session, event) -> None:
        at = self.attempt
        with at.mutex:
            if at.node != node or at.session != session:
                return
            if event.type == EventType.DELETED:
                at.mark_lost("lock node was deleted")
            elif event.type == EventType.CHANGED and at.state is State.HELD:
                self._watch_own_node()  # written to (the lease): the watch is used up

    def _own_node_checked(self, node, session, result) -> None:
        at = self.attempt
        try:
            result.get()
            missing = False
        except NoNodeError:
            missing = True
        except Exception:
            return  # connection trouble: the monitor takes over
        if missing:
            with at.mutex:
                if at.node == node and at.session == session:
                    at.mark_lost("lock node was deleted")

    def verify(self, epoch: int) -> None:
        """After a reconnection: still ours only if the node exists and our session owns it."""
        at = self.attempt
        node, session = at.node, at.session
        exists = at.client.exists_async(f"{at.lk.path}/{node}")
        kazoo_compat.on_ready(exists, partial(self._on_verified, epoch, node, session))

    def _on_verified(self, epoch: int, node, session, result) -> None:
        at = self.attempt
        with at.mutex:
            if at.state is not State.HELD_SUSPENDED or at.node != node:
                return
            try:
                stat = result.get()
            except RETRYABLE:
                return  # disconnected again: the next CONNECTED re-verifies
            except (SessionExpiredError, ConnectionClosedError):
                return at.mark_lost("ZooKeeper session expired")
            except Exception:
                return
            if stat is not None and stat.ephemeralOwner == kazoo_compat.session_id(at.client) == session:
                # A newer suspension may have begun while the request was in flight: then
                # this verdict is stale and that suspension's own verify/grace decides.
                if at.monitor.epoch != epoch or not at.client.connected:
                    return
                at.state = State.HELD
                at.monitor.timers.cancel(self._grace_timer)
                self._watch_own_node()  # kazoo dropped our watches when the connection broke
            else:
                at.mark_lost("lock node gone after reconnection")

    def _on_grace_over(self, suspension: int, _epoch: int) -> None:
        """The suspension that armed this timer never ended in a re-verification: LOST.
        Why by suspension and not by the connection's epoch: a reconnection whose
        re-verification is cut off again bumps the epoch, yet is the same suspension
        (until 2026-11-28 that left no timer running, and a partition went unreported)."""
        at = self.attempt
        with at.mutex:
            if at.state is State.HELD_SUSPENDED and self._suspension == suspension:
                at.mark_lost("disconnected from ZooKeeper past the session-expiry safety margin")
