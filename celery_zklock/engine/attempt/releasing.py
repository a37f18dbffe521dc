"""Releasing: the guaranteed delete of our node, and what it says about the hold."""

from __future__ import annotations

from .. import kazoo_compat, znodes
from ..session import Outcome, guaranteed_delete
from .state import HELD_STATES, State


class Releasing:
    def release(self):
        """Let go.  Returns ``(was_held, outcome)``: outcome is None without a node,
        :attr:`~celery_zklock.engine.session.Outcome.EXPIRED`, or the guaranteed delete's async result."""
        with self._guard:
            if not self._finished:
                self._give_up(False)
                return False, self.cleanup
            was_held = self.state in HELD_STATES
            self.monitor.timers.cancel(self._grace_timer)
            node, session = self.node, self.session
            self.node = self.token = None
            if self.state is not State.LOST:
                self.state = State.IDLE
            self.monitor.unsubscribe(self)
        if node is None:
            return was_held, None
        if session != kazoo_compat.session_id(self.client):
            return was_held, Outcome.EXPIRED
        outcome = self._delete(node, session)
        if not znodes.uses_containers(self.client):
            self.client.delete_async(self.lk.path)  # best effort: goes once its last child has
        return was_held, outcome

    def _delete(self, name: str, session):
        full = f"{self.lk.path}/{name}"
        return guaranteed_delete(
            self.monitor, full, session, on_no_auth=lambda: znodes.no_auth_error(full, "deleting our lock node")
        )
