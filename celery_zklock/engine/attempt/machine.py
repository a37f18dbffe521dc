"""One acquisition, read top to bottom: start, create, decide, watch the one ahead, take,
hold, release (Curator's ``internalLockLoop``, as callbacks).

Every handler runs under the attempt's ``mutex``, sends only asynchronous requests and
never blocks.  What goes wrong on the way is handled by collaborators the path calls by
name, each with its own state: :class:`~.parents.KeyParent` (the key's container),
:class:`~.ghosts.Ghosts` (a create whose reply was lost) and :class:`~.holding.HoldWatch`
(suspension, grace, the watch on our own node).  They read the attempt only through
:class:`~.state.AttemptView` and write none of it: what they find comes back as a
decision (:class:`~.parents.MultiAnswer`, :class:`~.parents.Remade`,
:class:`~.ghosts.Found`, :class:`~.holding.HoldVerdict`) that the attempt applies here.
Why each step is as it is: docs/design.md, "The attempt".
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Any

from kazoo.exceptions import ConnectionClosedError, NoAuthError, NoNodeError, SessionExpiredError
from kazoo.protocol.states import EventType, KazooState

from .. import clock, kazoo_compat, znodes
from ..session import RETRYABLE, ReleaseOutcome, guaranteed_delete
from .ghosts import Found, Ghosts, Then
from .holding import HoldVerdict, HoldWatch
from .parents import KeyParent, Multi, MultiAnswer, Remade
from .state import HELD_STATES, RECENT, WAITING_STATES, Pending, Queue, State


class Attempt:
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
        # When the create behind our node was sent (lease clock, engine.clock.boottime): its
        # success proves our session alive at or after then, as a write's does (the lease).
        self.create_sent: float | None = None
        self.lost_reason: str | None = None
        self.result = self.client.handler.async_result()  # True held / False gave up
        self.cleanup: Any = None  # set once given up: ready when no node of ours is left (see _settle_cleanup)
        self._cleanups: list = []  # the deletes made after giving up
        self.cleanup_sealed = False  # every delete after giving up is in _cleanups
        self.mutex = threading.RLock()  # every handler of the attempt and its collaborators
        self.finished = False  # the result is set
        self.look = 0  # counts children reads and watch sets: replies of an older look are ignored
        self.pending: Pending | None = None  # what to do once connected again
        self.create_in_flight = False
        self._waited = False
        self._deadline_timer = None
        self._deadline_passed = False
        path = internals.path
        self.parent = KeyParent(self.client, path, prefix, internals.identifier, self.monitor.new_keys,
                                on_multi=self._on_multi, on_remade=self._on_remade)
        self.ghosts = Ghosts(self.client, path, prefix, self.mutex, self, tell=self._on_ghosts)
        self.hold = HoldWatch(self.client, self.monitor, path, internals.grace, internals.watch_when_run,
                              self.mutex, self, tell=self._on_hold)

    # ------------------------------------------------------------------ 1. start
    def start(self, deadline: float | None) -> None:
        with self.mutex:
            self.state = State.CREATING
            self.monitor.subscribe(self)
            if deadline is not None:
                self._deadline_timer = self.monitor.timers.call_at(deadline, self._on_deadline)
            self._send_create()

    # ------------------------------------------------------------------ 2. create our node
    def _send_create(self, same_try: bool = False) -> None:
        """Create our node, and read the queue in the same round trip (ZooKeeper answers one
        session's requests in order).  ``same_try``: sent again within the one try that
        ``timeout=0`` allows (the key's container had been reaped)."""
        if self._deadline_passed and not same_try:
            return self._give_up(False)
        if not self.client.connected:
            return self._await_connection(Pending.CREATE)
        if self.lk.path not in RECENT and self.parent.waits_for_maker(self._create_when_made):
            return  # created once the key is made, in the order we came
        self.pending = None
        session = kazoo_compat.session_id(self.client)
        self.ghosts.create_sent(session)
        self.create_in_flight = True
        self.create_sent = clock.boottime()
        new_key = self.lk.path not in RECENT and znodes.uses_containers(self.client)
        if new_key and znodes.containers_known_to_work(self.client):
            return self.parent.create_with_node(session)
        if new_key:
            self.parent.create_beside()
        node = f"{self.lk.path}/{self.prefix}"
        created = self.client.create_async(
            node, self.lk.identifier, acl=kazoo_compat.acl_for(self.client, node), ephemeral=True, sequence=True,
            include_data=True,
        )
        listed = None if new_key else self.client.get_children_async(self.lk.path)
        kazoo_compat.on_ready(created, partial(self._on_created, session, listed))

    def _on_created(self, session, listed, result) -> None:
        with self.mutex:
            self.create_in_flight = False
            try:
                path, stat = result.get()
            except NoNodeError:
                RECENT.discard(self.lk.path)
                if not self.finished:
                    self.parent.remake()
                return self._settle_cleanup()
            except RETRYABLE:
                # The create may have run with its reply lost: resolve it once connected.
                return self._await_connection(Pending.GHOST)
            except SessionExpiredError:
                return self._await_connection(Pending.CREATE)
            except NoAuthError:
                if not self.finished:
                    self._give_up(znodes.no_auth_error(self.lk.path, "joining the lock queue"))
                return self._settle_cleanup()
            except Exception as exc:  # ConnectionClosedError: the client was stopped
                if not self.finished:
                    self._give_up(exc)
                return self._settle_cleanup()
            RECENT.add(self.lk.path)
            name = path.rsplit("/", 1)[1]
            if self.finished:  # given up while the create was in flight
                self._delete_given_up(name, session)
                return self._settle_cleanup()
            if not self._adopt(name, stat.czxid, session):
                return
            if listed is Queue.FRESH and znodes.sequence_of(name) == 0:
                return self._act_on_queue([name])  # made with its container: it holds
            if listed is not None and listed is not Queue.FRESH:
                look = self._next_look()
                kazoo_compat.on_ready(listed, partial(self._on_children, look))
            else:
                self._read_children()

    def _adopt(self, name: str, czxid: int, session) -> bool:
        """Make ``name`` our node, with the fencing token its ``czxid`` gives; False (given up)
        when the token would be inexact."""
        self.node, self.czxid, self.session = name, czxid, session
        try:
            self.token = znodes.fencing_token(czxid)
        except znodes.TokenOutOfRange as exc:  # never an inexact token: our node goes
            self._give_up(exc)
            self._settle_cleanup()
            return False
        return True

    # ------------------------------------------------------------------ 2a. the key's container (KeyParent)
    def _create_when_made(self) -> None:
        """Another attempt's multi made our key (or failed): the try we were waiting to make."""
        with self.mutex:
            if not self.finished and self.state is State.CREATING and not self.create_in_flight:
                self._send_create(same_try=True)

    def _on_multi(self, session, answer: MultiAnswer) -> None:
        """The key's container and our node in one multi, answered
        (:func:`~.parents.multi_answered`)."""
        if answer.step is Multi.CREATED:
            return self._on_created(session, answer.listed, answer.created)
        with self.mutex:
            self.create_in_flight = False
            if answer.step in (Multi.ROLLED_BACK, Multi.KEY_EXISTS):
                if not self.finished and self.state is State.CREATING:
                    self._send_create(same_try=True)
                return self._settle_cleanup()
            if answer.step is Multi.NO_AUTH:
                if not self.finished:
                    self._give_up(znodes.no_auth_error(self.lk.path, "creating the lock's parent znode"))
                return self._settle_cleanup()
            if self.finished:  # NO_ANCESTOR, given up meanwhile
                return self._settle_cleanup()
        self.parent.make_ancestor(answer.ancestor)

    def _on_remade(self, remade: Remade) -> None:
        """The key's parent, which our create found missing, is made again (or not)."""
        with self.mutex:
            if self.finished or self.state is not State.CREATING or self.create_in_flight:
                return
            if remade is Remade.NO_AUTH:
                return self._give_up(znodes.no_auth_error(self.lk.path, "creating the lock's parent znode"))
            if remade is Remade.ANCESTOR:
                return self.parent.remake()
            self._send_create(same_try=True)

    # ------------------------------------------------------------------ 3. decide
    def _next_look(self) -> int:
        self.look += 1
        return self.look

    def _read_children(self) -> None:
        look = self._next_look()
        kazoo_compat.on_ready(self.client.get_children_async(self.lk.path), partial(self._on_children, look))

    def _on_children(self, look, result) -> None:
        with self.mutex:
            if look != self.look or self.finished or self.state not in WAITING_STATES:
                return
            try:
                children = result.get()
            except NoNodeError:
                children = []  # the parent is gone, and our node with it
            except RETRYABLE:
                return self._await_connection(Pending.READ)
            except SessionExpiredError:
                return self._await_connection(Pending.CREATE)
            except NoAuthError:
                return self._give_up(znodes.no_auth_error(self.lk.path, "reading the lock queue"))
            except Exception as exc:
                return self._give_up(exc)
            if kazoo_compat.session_id(self.client) != self.session:
                return self._requeue()
            self._act_on_queue(children)

    def _act_on_queue(self, children) -> None:
        """The driver's decision on the queue: hold, or wait watching the nodes it names."""
        decision = self.lk.decide(children, self.node)
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

    # ------------------------------------------------------------------ 4. watch the ones ahead
    def _watch(self, look, handoff: bool, path: str) -> None:
        """A data watch (``get``: no creation watch left behind) on a contender the driver
        named, set again after its data changed (a lease write costs no children read)."""
        watched = self.client.get_async(path, watch=partial(self._on_watch, look, handoff))
        kazoo_compat.on_ready(watched, partial(self._on_watch_set, look, handoff, path))

    def _on_watch_set(self, look, handoff: bool, path: str, result) -> None:
        with self.mutex:
            if look != self.look or self.finished or self.state is not State.WAITING:
                return
            try:
                reply = result.get()
            except NoNodeError:
                reply = None
            except NoAuthError:
                # A node we may not read (a peer's ACL): the server set no watch, and sends us
                # no event on it either (exists' watch included).  Watch the queue instead:
                # the node's end changes it.
                watched = self.client.get_children_async(self.lk.path, watch=partial(self._on_watch, look, handoff))
                name = path.rsplit("/", 1)[1]
                return kazoo_compat.on_ready(watched, partial(self._on_queue_watch_set, look, handoff, name))
            except RETRYABLE:
                return self._await_connection(Pending.READ)
            except Exception:
                self.pending = Pending.READ  # session trouble: the next CONNECTED decides
                return
            if reply is None:
                self._advance(handoff)  # gone before our watch was set

    def _on_queue_watch_set(self, look, handoff: bool, name: str, result) -> None:
        """The queue's watch, set in place of the data watch a node ahead refused us: the
        node may be gone already."""
        with self.mutex:
            if look != self.look or self.finished or self.state is not State.WAITING:
                return
            try:
                children = result.get()
            except NoAuthError:
                return self._give_up(znodes.no_auth_error(self.lk.path, "watching the lock queue"))
            except RETRYABLE:
                return self._await_connection(Pending.READ)
            except Exception:
                self.pending = Pending.READ  # session trouble: the next CONNECTED decides
                return
            if name not in children:
                self._advance(handoff)

    def _on_watch(self, look, handoff: bool, event) -> None:
        with self.mutex:
            if look != self.look or self.finished or self.state is not State.WAITING:
                return
            if event.type == EventType.DELETED:
                self._advance(handoff)
            elif event.type == EventType.CHANGED:
                self._watch(look, handoff, event.path)
            elif event.type != EventType.NONE:
                self._read_children()

    def _advance(self, handoff: bool) -> None:
        """A watched node left.  If we watched everyone ahead of us, we hold: new
        contenders only ever queue behind us, so fewer than max_holders are ahead now."""
        if handoff:
            self._take()
        else:
            self._read_children()

    # ------------------------------------------------------------------ 5. take and hold
    def _take(self) -> None:
        if kazoo_compat.session_id(self.client) != self.session:
            return self._requeue()  # the children were read in a session that has ended
        if self.client.connected:
            self.state = State.HELD
        else:
            # The connection dropped between the deciding reply and now: the monitor told
            # us while we were still waiting, so the suspension starts here.
            self._suspend()
        self.hold.watch_soon()
        self._finish(True)

    def on_connection(self, state: str, epoch: int) -> None:
        """From the :class:`SessionMonitor`, on kazoo's connection thread: flags and async requests only."""
        with self.mutex:
            if state == KazooState.SUSPENDED:
                if self.state is State.HELD:
                    self._suspend()
            elif state == KazooState.CONNECTED:
                if self.state is State.HELD_SUSPENDED:
                    self.hold.verify(epoch)
                elif self.pending is Pending.CLEANUP or (not self.finished and self.state in WAITING_STATES):
                    self._resume()
            elif state == KazooState.LOST:
                if self.state in HELD_STATES:
                    self._mark_lost(HoldVerdict.SESSION_EXPIRED.value)
                elif not self.finished and self.state in WAITING_STATES and kazoo_compat.closed_for_good(self.client):
                    # Its authentication failed: kazoo never connects this client again, and a
                    # wait for CONNECTED would be for good (its connection loop ends just after).
                    self._give_up(ConnectionClosedError("the KazooClient stopped connecting for good (its "
                                                       "authentication failed): lock with a new client"))

    def _suspend(self) -> None:
        """HELD -> HELD_SUSPENDED: not held until re-verified, within the grace the hold's
        watch starts now (:meth:`HoldWatch.suspend <.holding.HoldWatch.suspend>`)."""
        self.state = State.HELD_SUSPENDED
        self.hold.suspend()

    def _on_hold(self, verdict: HoldVerdict) -> None:
        """The hold's watch found it re-verified (held again) or lost."""
        if verdict is HoldVerdict.HELD:
            self.state = State.HELD
        else:
            self._mark_lost(verdict.value)

    def _mark_lost(self, reason: str) -> None:
        if self.state not in HELD_STATES:
            return
        self.state = State.LOST
        self.hold.stop()
        self.lost_reason = reason
        if self.lk.on_lost is not None:
            self.client.handler.spawn(self.lk.on_lost)

    # ------------------------------------------------------------------ 6. release
    def release(self) -> tuple[bool, Any]:
        """Let go.  Returns ``(was_held, outcome)``: outcome is None without a node,
        :attr:`~celery_zklock.engine.session.ReleaseOutcome.EXPIRED`, or the guaranteed delete's async result."""
        with self.mutex:
            if not self.finished:
                self._give_up(False)
                return False, self.cleanup
            was_held = self.state in HELD_STATES
            self.hold.stop()
            node, session = self.node, self.session
            self.node = self.token = None
            if self.state is not State.LOST:
                self.state = State.IDLE
            self.monitor.unsubscribe(self)
        if node is None:
            return was_held, None
        if session != kazoo_compat.session_id(self.client):
            return was_held, ReleaseOutcome.EXPIRED
        outcome = self._delete(node, session)
        if not znodes.uses_containers(self.client):
            self.client.delete_async(self.lk.path)  # best effort: goes once its last child has
        return was_held, outcome

    def _delete(self, name: str, session):
        full = f"{self.lk.path}/{name}"
        return guaranteed_delete(
            self.monitor, full, session, on_no_auth=lambda: znodes.no_auth_error(full, "deleting our lock node")
        )

    # ------------------------------------------------------------------ giving up, and coming back
    def _finish(self, value: bool | BaseException) -> None:
        if self.finished:
            return
        self.finished = True
        self.monitor.timers.cancel(self._deadline_timer)
        if isinstance(value, BaseException):
            self.result.set_exception(value)
        else:
            self.result.set(value)

    def _give_up(self, value: bool | BaseException) -> None:
        """Deadline, cancel or error before holding: delete whatever node we have or may have."""
        self.state = State.IDLE
        self.pending = Pending.CLEANUP if self.pending is Pending.GHOST else None
        node, self.node, self.token = self.node, None, None
        self.cleanup = self.client.handler.async_result()
        if node is not None:
            self._delete_given_up(node, self.session)
        if self.pending is None and not self.create_in_flight:
            self.monitor.unsubscribe(self)
            self._cleaned_up()
        self._finish(value)

    def _delete_given_up(self, name: str, session) -> None:
        """Delete a node of ours after giving up; :attr:`cleanup` waits for its reply."""
        self._cleanups.append(self._delete(name, session))

    def _cleaned_up(self) -> None:
        """Nothing of ours can still appear: :attr:`cleanup` is ready once the deletes are
        answered.  Why wait for a create's reply too: a caller of a cancelled acquire
        expects no node of ours queued once it returns (kazoo's test_lock_cancel)."""
        cleanup, self.cleanup_sealed = self.cleanup, True
        kazoo_compat.on_all_ready(self._cleanups, lambda: cleanup.set(None))

    def cancel(self, value: bool | BaseException = False) -> None:
        with self.mutex:
            if not self.finished and self.state in WAITING_STATES:
                self._give_up(value)

    def _on_deadline(self) -> None:
        """Give up now if queued or cut off; a request in flight first gets its answer
        (``timeout=0`` means "try once": the create and the children read still happen)."""
        with self.mutex:
            if self.finished or self.state not in WAITING_STATES:
                return
            self._deadline_passed = True
            if self.state is State.WAITING or self.pending is not None:
                self._give_up(False)

    def _await_connection(self, kind: Pending | None) -> None:
        """A request failed for want of a connection: go on with ``kind`` once connected."""
        if self.finished:
            kind = Pending.CLEANUP if kind in (Pending.GHOST, Pending.CLEANUP) else None
        self.pending = kind
        if self._deadline_passed and not self.finished:
            return self._give_up(False)
        if kind is None:
            return self._settle_cleanup()
        if self.client.connected:
            self._resume()

    def _resume(self) -> None:
        pending = self.pending
        if self.create_in_flight:
            return  # its reply (success or connection loss) decides what comes next
        if pending is Pending.CLEANUP:
            return self._clean_ghosts()
        if self.finished or self.state not in WAITING_STATES:
            return
        if self.node is not None and kazoo_compat.session_id(self.client) != self.session:
            self._requeue()  # our node died with the old session
        elif pending is Pending.GHOST:
            if not self.ghosts.may_be_ours(kazoo_compat.session_id(self.client)):
                self._send_create()  # a ghost of the old session died with it
            else:
                self._look_for_ghost()
        elif pending is Pending.CREATE or self.node is None:
            self._send_create()
        else:
            self._read_children()

    def _requeue(self) -> None:
        """Our node is gone (session expired, deleted by an operator or the reaper): queue again."""
        self.node = self.token = self.session = None
        self.state = State.CREATING
        self._send_create()

    def _settle_cleanup(self) -> None:
        """Once given up and nothing of ours can still appear: stop listening to the session."""
        if self.finished and not self.create_in_flight and self.state is State.IDLE:
            self.pending = None
            self.monitor.unsubscribe(self)
            if self.cleanup is not None and not self.cleanup_sealed:
                self._cleaned_up()

    # ------------------------------------------------------------------ a create whose reply was lost (Ghosts)
    def _look_for_ghost(self) -> None:
        """After a lost create reply: adopt our node if our session owns it, else delete it.
        ``pending`` stays GHOST until the look is answered: a give-up meanwhile must still
        clean up (and keep listening to the session for it), and a reconnection meanwhile
        looks again rather than create a second node behind the ghost."""
        self.pending = Pending.GHOST
        self.ghosts.look(self._next_look())

    def _clean_ghosts(self) -> None:
        """Given up while a create's reply was lost: delete any node of ours, adopt none."""
        if not self.ghosts.may_be_ours(kazoo_compat.session_id(self.client)):
            return self._settle_cleanup()
        self.ghosts.look(None)

    def _on_ghosts(self, found: Found) -> None:
        """A look for ghosts answered (:func:`~.ghosts.resolve`): its deletes, then what it found."""
        for name in found.deletes:
            if found.cleanup:
                self._delete_given_up(name, kazoo_compat.session_id(self.client))  # cleanup waits for it
            else:
                self._delete(name, kazoo_compat.session_id(self.client))
        if found.then is Then.RECONNECT:
            return self._await_connection(Pending.CLEANUP if found.cleanup else Pending.GHOST)
        if found.then is Then.SETTLE:
            return self._settle_cleanup()
        if found.then is Then.GIVE_UP:
            assert found.error is not None
            self.pending = None  # nothing more can be learnt of the ghost: given up
            return self._give_up(found.error)
        if found.then is Then.CREATE:
            return self._send_create()
        if found.then is Then.ADOPT:
            assert found.ghost is not None
            self.pending = None
            ghost = found.ghost
            if self._adopt(ghost.name, ghost.czxid, ghost.session):
                self._act_on_queue(ghost.queue)
