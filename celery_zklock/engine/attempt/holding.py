"""Holding: a held lock, the connection's events, and how a hold is lost.

A held lock is HELD_SUSPENDED (not held) while disconnected; re-verified (node exists,
owned by our session) on reconnection; LOST when the session expires, the node is
deleted, or the suspension outlasts a third of the session timeout (kazoo cannot learn
of an expiry while cut off and notices the cut only after two thirds of it).

A holder also watches its own node, to learn when an operator or the reaper deletes it
(and sets it again after each write to the node, which uses the one-shot watch up).
That watch is set :data:`OWN_WATCH_WITHIN` after the grant, in one batch for every lock
of the client, not with the grant: a hold shorter than that never pays for the request
and its notification (a third of an uncontended acquire+release), and a deletion in the
first moments is still caught, a little later, or by the release's proof.
"""

from __future__ import annotations

from functools import partial

from kazoo.exceptions import ConnectionClosedError, NoNodeError, SessionExpiredError
from kazoo.protocol.states import EventType, KazooState

from .. import kazoo_compat
from ..session import RETRYABLE
from .state import HELD_STATES, WAITING_STATES, Pending, State

#: Seconds after a grant by which the holder's watch on its own node is set (see above).
OWN_WATCH_WITHIN = 0.02


class Holding:
    def _take(self) -> None:
        if kazoo_compat.session_id(self.client) != self.session:
            return self._requeue()  # the children were read in a session that has ended
        if self.client.connected:
            self.state = State.HELD
        else:
            # The connection dropped between the deciding reply and now: the monitor told
            # us while we were still waiting, so the suspension starts here.
            self._suspend()
        self.monitor.timers.soon(OWN_WATCH_WITHIN, self._watch_if_still_held, self.node, self.session)
        self._finish(True)

    def _watch_if_still_held(self, node, session) -> None:
        """Still the same hold, connected: watch our node (suspended: the re-verification does)."""
        with self._guard:
            if self.state is State.HELD and self.node == node and self.session == session:
                self._watch_own_node()

    def _suspend(self) -> None:
        self.state = State.HELD_SUSPENDED
        self.monitor.timers.cancel(self._grace_timer)
        self._grace_timer = self.monitor.grace_timer(self.lk.grace(), self._on_grace_over)
        if self.client.connected:
            self._verify(self.monitor.epoch)

    def _watch_own_node(self) -> None:
        """Learn at once if our node is deleted behind our back (operator, reaper, expiry).

        The watch is one-shot, and a write to the node fires it too (NodeDataChanged): the
        cohort's lease writes to a held node, so a change sets it again — one ``exists`` per
        fired watch, none per hold.  One watcher per hold, so a watch set again after a
        reconnection (kazoo keeps the old one) is not doubled.  ``get``, not ``exists``: on a
        node already gone, ``exists`` would leave a creation watch on the server for a name
        nobody creates again (the simulator's leak check found it)."""
        node, session = self.node, self.session
        if self._own_watcher is None or self._own_watcher[:2] != (node, session):
            self._own_watcher = (node, session, partial(self._own_node_changed, node, session))
        kazoo_compat.on_ready(self.client.get_async(f"{self.lk.path}/{node}", watch=self._own_watcher[2]),
                              partial(self._own_node_checked, node, session))

    def _own_node_changed(self, node, session, event) -> None:
        with self._guard:
            if self.node != node or self.session != session:
                return
            if event.type == EventType.DELETED:
                self._mark_lost("lock node was deleted")
            elif event.type == EventType.CHANGED and self.state is State.HELD:
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
            with self._guard:
                if self.node == node and self.session == session:
                    self._mark_lost("lock node was deleted")

    def on_connection(self, state: str, epoch: int) -> None:
        """From the :class:`SessionMonitor`, on kazoo's connection thread: flags and async requests only."""
        with self._guard:
            if state == KazooState.SUSPENDED:
                if self.state is State.HELD:
                    self._suspend()
            elif state == KazooState.CONNECTED:
                if self.state is State.HELD_SUSPENDED:
                    self._verify(epoch)
                elif self._pending == Pending.CLEANUP or (not self._finished and self.state in WAITING_STATES):
                    self._resume()
            elif state == KazooState.LOST:
                if self.state in HELD_STATES:
                    self._mark_lost("ZooKeeper session expired")

    def _verify(self, epoch: int) -> None:
        """After a reconnection: still ours only if the node exists and our session owns it."""
        node, session = self.node, self.session
        exists = self.client.exists_async(f"{self.lk.path}/{node}")
        kazoo_compat.on_ready(exists, partial(self._on_verified, epoch, node, session))

    def _on_verified(self, epoch: int, node, session, result) -> None:
        with self._guard:
            if self.state is not State.HELD_SUSPENDED or self.node != node:
                return
            try:
                stat = result.get()
            except RETRYABLE:
                return  # disconnected again: the next CONNECTED re-verifies
            except (SessionExpiredError, ConnectionClosedError):
                return self._mark_lost("ZooKeeper session expired")
            except Exception:
                return
            if stat is not None and stat.ephemeralOwner == kazoo_compat.session_id(self.client) == session:
                # A newer suspension may have begun while the request was in flight: then
                # this verdict is stale and that suspension's own verify/grace decides.
                if self.monitor.epoch != epoch or not self.client.connected:
                    return
                self.state = State.HELD
                self.monitor.timers.cancel(self._grace_timer)
                self._watch_own_node()  # kazoo dropped our watches when the connection broke
            else:
                self._mark_lost("lock node gone after reconnection")

    def _on_grace_over(self, epoch: int) -> None:
        with self._guard:
            if self.state is State.HELD_SUSPENDED and self.monitor.epoch == epoch:
                self._mark_lost("disconnected from ZooKeeper past the session-expiry safety margin")

    def _mark_lost(self, reason: str) -> None:
        if self.state not in HELD_STATES:
            return
        self.state = State.LOST
        self.monitor.timers.cancel(self._grace_timer)
        self.lost_reason = reason
        if self.lk.on_lost is not None:
            self.client.handler.spawn(self.lk.on_lost)
