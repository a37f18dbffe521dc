"""Waiting: read the queue, let the driver decide, watch the nodes it names.

Data watches (``get``, never ``exists``, so no creation watch is left behind) are set on
the contenders :func:`~celery_zklock.engine.driver.gets_the_lock` names.  When the driver
says the watched window is everyone ahead of us, the deletion of any of them makes us a
holder at once: a handoff costs one notification, not a notification plus a round trip.
Replies of an earlier look (``_look`` counts children reads and watch sets) are ignored.
"""

from __future__ import annotations

from functools import partial

from kazoo.exceptions import NoAuthError, NoNodeError, SessionExpiredError
from kazoo.protocol.states import EventType

from .. import kazoo_compat, znodes
from ..driver import gets_the_lock
from ..session import RETRYABLE
from .state import WAITING_STATES, Pending, State


class Waiting:
    def _next_look(self) -> int:
        self._look += 1
        return self._look

    def _read_children(self) -> None:
        look = self._next_look()
        kazoo_compat.on_ready(self.client.get_children_async(self.lk.path), partial(self._on_children, look))

    def _on_children(self, look, result) -> None:
        with self._guard:
            if look != self._look or self._finished or self.state not in WAITING_STATES:
                return
            try:
                children = result.get()
            except NoNodeError:
                children = []  # the parent is gone, and our node with it
            except RETRYABLE:
                return self._await(Pending.READ)
            except SessionExpiredError:
                return self._await(Pending.CREATE)
            except NoAuthError:
                return self._give_up(znodes.no_auth_error(self.lk.path, "reading the lock queue"))
            except Exception as exc:
                return self._give_up(exc)
            if kazoo_compat.session_id(self.client) != self.session:
                return self._requeue()
            self._decide(children)

    def _decide(self, children) -> None:
        decision = gets_the_lock(children, self.node, self.lk.max_holders)
        if decision.index is None:
            return self._requeue()
        if decision.holds:
            return self._take()
        if self._deadline_passed:
            return self._give_up(False)
        self.state = State.WAITING
        if self.on_wait is not None and not self._waited:
            self._waited = True
            self.on_wait(decision.index)
        if decision.handoff and self.on_next is not None:
            on_next, self.on_next = self.on_next, None
            on_next()
        look = self._next_look()
        # With on_next pending, also watch the nodes whose departure makes us next in line:
        # their departure is no handoff, only a reason to look again.
        soon = decision.soon if self.on_next is not None else ()
        for name, handoff in [(w, decision.handoff) for w in decision.watch] + [(w, False) for w in soon]:
            self._watch(look, handoff, f"{self.lk.path}/{name}")

    def _on_watch_set(self, look, handoff: bool, result) -> None:
        with self._guard:
            if look != self._look or self._finished or self.state is not State.WAITING:
                return
            try:
                result.get()
            except NoNodeError:
                self._advance(handoff)  # gone before our watch was set
            except RETRYABLE:
                self._await(Pending.READ)
            except Exception:
                self._pending = Pending.READ  # session trouble: the next CONNECTED decides

    def _on_watch(self, look, handoff: bool, event) -> None:
        with self._guard:
            if look != self._look or self._finished or self.state is not State.WAITING:
                return
            if event.type == EventType.DELETED:
                self._advance(handoff)
            elif event.type == EventType.CHANGED:
                self._watch(look, handoff, event.path)
            elif event.type != EventType.NONE:
                self._read_children()

    def _watch(self, look, handoff: bool, path: str) -> None:
        """Watch ``path`` (a contender's node): when the driver names it, and again after its
        data changed.  A change leaves the queue as it was, so it costs no children read: a
        cohort holder's agent renews its lease by writing its node, on a hot key every few
        milliseconds, and each write used to cost every watcher a children read besides."""
        watched = self.client.get_async(path, watch=partial(self._on_watch, look, handoff))
        kazoo_compat.on_ready(watched, partial(self._on_watch_set, look, handoff))

    def _advance(self, handoff: bool) -> None:
        """A watched node left.  If we watched everyone ahead of us, we hold: new
        contenders only ever queue behind us, so fewer than max_holders are ahead now."""
        if handoff:
            self._take()
        else:
            self._read_children()
