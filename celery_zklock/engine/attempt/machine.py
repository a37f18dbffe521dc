"""The attempt's lifecycle: start, deadline, cancel, giving up, resuming after a reconnection.

Every handler of every piece runs under ``_guard``, sends only asynchronous requests,
and never blocks.  Safety rules kazoo's ``Lock`` leaves to the caller and this keeps:
one monotonic deadline for the whole attempt; at the deadline our node is deleted.
"""

from __future__ import annotations

import threading

from .. import kazoo_compat

from .creating import Creating
from .ghosts import Ghosts
from .holding import Holding
from .releasing import Releasing
from .state import WAITING_STATES, Pending, State
from .waiting import Waiting


class Attempt(Creating, Ghosts, Waiting, Holding, Releasing):
    """One acquisition, from the create to the release, driven by callbacks only.

    ``internals`` is the :class:`~celery_zklock.engine.internals.LockInternals` it belongs
    to (not imported here: the lock's constants import the machine, not the reverse).
    """

    def __init__(self, internals, prefix: str, on_wait, on_next=None) -> None:
        self.lk = internals
        self.client = internals.client
        self.monitor = internals.monitor
        self.prefix = prefix
        self.on_wait = on_wait
        self.on_next = on_next
        self.state = State.IDLE
        self.node: str | None = None  # our child's name once created or adopted
        self.token: int | None = None  # znodes.fencing_token of our node (its first grant)
        self.czxid: int | None = None
        self.session: int | None = None  # the session our node belongs to
        self.lost_reason: str | None = None
        self.result = self.client.handler.async_result()  # True held / False gave up
        self.cleanup = None  # async result of the delete made when giving up
        self._guard = threading.RLock()
        self._finished = False  # the result is set
        self._look = 0
        self._pending: Pending | None = None  # what to do once connected
        self._create_in_flight = False
        self._create_session: int | None = None
        self._waited = False
        self._deadline_timer = None
        self._deadline_passed = False
        self._own_watcher = None  # (node, session, watcher): the holder's watch on its node
        self._grace_timer = None  # while HELD_SUSPENDED: when the suspension makes it LOST

    def start(self, deadline: float | None) -> None:
        with self._guard:
            self.state = State.CREATING
            self.monitor.subscribe(self)
            if deadline is not None:
                self._deadline_timer = self.monitor.timers.call_at(deadline, self._on_deadline)
            self._send_create()

    def _finish(self, value: bool | BaseException) -> None:
        if self._finished:
            return
        self._finished = True
        self.monitor.timers.cancel(self._deadline_timer)
        if isinstance(value, BaseException):
            self.result.set_exception(value)
        else:
            self.result.set(value)

    def _give_up(self, value: bool | BaseException) -> None:
        """Deadline, cancel or error before holding: delete whatever node we have or may have."""
        self.state = State.IDLE
        self._pending = Pending.CLEANUP if self._pending == Pending.GHOST else None
        node, self.node, self.token = self.node, None, None
        if node is not None:
            self.cleanup = self._delete(node, self.session)
        if self._pending is None and not self._create_in_flight:
            self.monitor.unsubscribe(self)
        self._finish(value)

    def cancel(self, value: bool | BaseException = False) -> None:
        with self._guard:
            if not self._finished and self.state in WAITING_STATES:
                self._give_up(value)

    def _on_deadline(self) -> None:
        """Give up now if queued or cut off; a request in flight first gets its answer
        (``timeout=0`` means "try once": the create and the children read still happen)."""
        with self._guard:
            if self._finished or self.state not in WAITING_STATES:
                return
            self._deadline_passed = True
            if self.state is State.WAITING or self._pending is not None:
                self._give_up(False)

    def _await(self, kind: Pending | None) -> None:
        """A request failed for want of a connection: go on with ``kind`` once connected."""
        if self._finished:
            kind = Pending.CLEANUP if kind in (Pending.GHOST, Pending.CLEANUP) else None
        self._pending = kind
        if self._deadline_passed and not self._finished:
            return self._give_up(False)
        if kind is None:
            return self._settle_cleanup()
        if self.client.connected:
            self._resume()

    def _resume(self) -> None:
        pending = self._pending
        if self._create_in_flight:
            return  # its reply (success or connection loss) decides what comes next
        if pending == Pending.CLEANUP:
            return self._clean_ghosts()
        if self._finished or self.state not in WAITING_STATES:
            return
        if self.node is not None and kazoo_compat.session_id(self.client) != self.session:
            self._requeue()  # our node died with the old session
        elif pending == Pending.GHOST:
            if kazoo_compat.session_id(self.client) != self._create_session:
                self._send_create()  # a ghost of the old session died with it
            else:
                self._adopt_ghost()
        elif pending == Pending.CREATE or self.node is None:
            self._send_create()
        else:
            self._read_children()

    def _settle_cleanup(self) -> None:
        """Once given up and nothing of ours can still appear: stop listening to the session."""
        if self._finished and not self._create_in_flight and self.state is State.IDLE:
            self._pending = None
            self.monitor.unsubscribe(self)
