"""One acquisition of a lock (Curator's ``LockInternals``), read top to bottom: start, create,
decide, watch the one ahead, take, hold, release (Curator's ``internalLockLoop``, as callbacks).

The module has three parts.  First the protocol, :class:`Attempt`, and what it does with
each collaborator's answer.  Then its fault branches, each a collaborator the path calls by
name, with its own state: :class:`KeyParent` (the key's container), :class:`HoldWatch`
(suspension, grace, the watch on our own node) and :class:`Ghosts` (a create whose reply was
lost).  Last the small types they share: :class:`State`, :class:`Pending`, :class:`Queue`
and :class:`AttemptView`.

Every handler runs under the attempt's ``mutex``, sends only asynchronous requests and
never blocks.  The collaborators read the attempt only through :class:`AttemptView` and
write none of it: what they find comes back as a decision (:class:`MultiAnswer`,
:class:`Remade`, :class:`Found`, :class:`HoldVerdict`) that the attempt applies itself.
The pure decisions are :func:`celery_zklock.engine.driver.gets_the_lock` (the queue),
:func:`multi_answered`, :func:`resolve` and :func:`verified`.  Why each step is as it is:
docs/design.md, "The attempt".
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol, Sequence

from kazoo.exceptions import (
    ConnectionClosedError,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
    UnimplementedError,
)
from kazoo.protocol.states import EventType, KazooState

from . import clock, kazoo_compat, znodes
from .session import RETRYABLE, ReleaseOutcome, guaranteed_delete


# ============================================================ the protocol: Attempt
class Attempt:
    """One acquisition, from the create to the release, driven by callbacks only.

    ``internals`` is the :class:`~celery_zklock.engine.internals.LockInternals` it belongs
    to (not imported here: the lock's constants import this module, not the reverse).
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
        (:func:`multi_answered`)."""
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
        watch starts now (:meth:`HoldWatch.suspend`)."""
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

    def unproven_at_release(self, reason: str) -> None:
        """A waited release whose delete did not prove the hold to its end (the blocking API's
        ``release(wait=True)``) says why, unless a loss seen while held already said so."""
        if self.lost_reason is None:
            self.lost_reason = reason

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
        """A look for ghosts answered (:func:`resolve`): its deletes, then what it found."""
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


# ============================================================ a fault branch: the key's container
class KeyParent:
    """The key's container znode: made with our node in one multi, beside our create, or again
    after it was reaped.

    Containers are reaped when empty, so on a key this process has not locked lately the
    parent probably does not exist.  Once the server has shown it knows containers, one
    ``multi`` makes it and our node (new keys that arrive together share one:
    :mod:`celery_zklock.engine.group_commit`); until then ``createContainer`` is pipelined
    beside our create.  A create that finds no parent makes it and tries again, within the
    same try.  Why: docs/design.md, "Creating our node".

    It makes the attempt's key exist, and tells the attempt how that went: the multi's
    answer to ``on_multi`` (a :class:`MultiAnswer`), a remade parent to ``on_remade`` (a
    :class:`Remade`); the attempt decides what follows.  No state of its own: which keys are
    being made is :data:`MAKERS`'."""

    def __init__(self, client, path: str, prefix: str, identifier: bytes, new_keys,
                 on_multi: Callable[[Any, MultiAnswer], None], on_remade: Callable[[Remade], None]) -> None:
        self._client = client
        self._path = path
        self._prefix = prefix
        self._identifier = identifier
        self._new_keys = new_keys  # the client's group commit of new keys' creates
        self._on_multi_answered = on_multi
        self._on_remade = on_remade

    def waits_for_maker(self, resume: Callable[[], None]) -> bool:
        """Is another attempt of this process making our key with its node?  Then ``resume``
        runs once that answers (:class:`Makers`), and this says so."""
        return MAKERS.wait(self._key(), resume)

    def _key(self) -> tuple[str, str]:
        return (znodes.client_key(self._client), self._path)

    def create_with_node(self, session) -> None:
        """The container and our node in one multi (group-committed with other new keys)."""
        MAKERS.begin(self._key())
        path, node = self._path, f"{self._path}/{self._prefix}"
        item = (path, node, self._identifier, kazoo_compat.acl_for(self._client, path),
                kazoo_compat.acl_for(self._client, node))
        kazoo_compat.on_ready(self._new_keys.submit(item, session), partial(self._on_multi, session))

    def create_beside(self) -> None:
        """``createContainer`` pipelined ahead of our create (containers not yet proven)."""
        container = kazoo_compat.create_container_async(self._client, self._path,
                                                        kazoo_compat.acl_for(self._client, self._path))
        kazoo_compat.on_ready(container, self._on_parent)

    def _on_parent(self, result) -> None:
        client = self._client
        try:
            result.get()
        except UnimplementedError:
            # A server without containers (< 3.5.3): persistent parents from now on,
            # deleted best-effort after release so they do not accumulate.
            znodes.mark_no_containers(client)
            return
        except NodeExistsError:
            pass  # answered all the same: the server knows containers
        except Exception:
            return  # its ancestors do not exist, or a connection blip: the create tells
        znodes.mark_containers_work(client)

    def _on_multi(self, session, result) -> None:
        """The multi answered: ours first (made, or sent again), then the attempts that waited
        for it (:class:`Makers`), in the order they came."""
        try:
            container, ours = result.get()
        except Exception:
            container = ours = None
            answer = MultiAnswer(Multi.CREATED, result)  # connection trouble: as for a create
        else:
            answer = multi_answered(container, ours, self._path)
        if isinstance(ours, tuple) or isinstance(container, NodeExistsError):
            RECENT.add(self._path)  # the key is there: the waiting attempts' creates are plain ones
        waiting = MAKERS.end(self._key())
        try:
            self._on_multi_answered(session, answer)
        finally:
            for resume in waiting:
                resume()

    def make_ancestor(self, parent: str) -> None:
        """The multi found an ancestor missing: make it (persistent), then create again."""
        acl = kazoo_compat.acl_for(self._client, parent)
        kazoo_compat.on_ready(self._client.ensure_path_async(parent, acl), self._made)

    def remake(self) -> None:
        """Our create found no parent: make it (a container; ancestors persistent), create again."""
        client, path = self._client, self._path

        def made(result) -> None:
            try:
                result.get()
            except NoNodeError:  # an ancestor is missing too
                parent = path.rsplit("/", 1)[0]
                if parent:
                    made_parent = client.ensure_path_async(parent, kazoo_compat.acl_for(client, parent))
                    return kazoo_compat.on_ready(made_parent, lambda r: self._made(r, ancestor=True))
            except UnimplementedError:
                znodes.mark_no_containers(client)
                created = client.create_async(path, b"", acl=acl, makepath=True)
                return kazoo_compat.on_ready(created, self._made)
            except Exception:
                pass
            self._made(result)

        acl = kazoo_compat.acl_for(client, path)
        if znodes.uses_containers(client):
            kazoo_compat.on_ready(kazoo_compat.create_container_async(client, path, acl), made)
        else:
            kazoo_compat.on_ready(client.create_async(path, b"", acl=acl, makepath=True), self._made)

    def _made(self, result, ancestor: bool = False) -> None:
        try:
            result.get()
        except NoAuthError:
            return self._on_remade(Remade.NO_AUTH)
        except Exception:
            pass  # exists already, or a connection blip: the next create tells
        self._on_remade(Remade.ANCESTOR if ancestor else Remade.KEY)


class Makers:
    """The keys whose container this process is making with a first node (a multi in flight),
    and the attempts that came for one meanwhile, in arrival order.

    Why they wait for its answer: each would send a multi of its own, and all but the first
    fail on the container the first made (or, committed in one group, roll it back); their
    retries then went after the create of an attempt that came later and found the key made
    (a writer passed five readers that had come before it)."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], list[Callable[[], None]]] = {}
        self._guard = threading.Lock()

    def begin(self, key: tuple[str, str]) -> None:
        with self._guard:
            self._waiting.setdefault(key, [])

    def wait(self, key: tuple[str, str], resume: Callable[[], None]) -> bool:
        """Queue ``resume`` behind the making of ``key``; False when none is in flight."""
        with self._guard:
            waiting = self._waiting.get(key)
            if waiting is None:
                return False
            waiting.append(resume)
            return True

    def end(self, key: tuple[str, str]) -> list[Callable[[], None]]:
        """The making answered: the attempts that waited, to resume in the order they came
        (after the maker's own create, if it sends one again: it came first)."""
        with self._guard:
            return self._waiting.pop(key, [])


MAKERS = Makers()


class Multi(enum.Enum):
    """How the multi that makes the key's container with our node was answered."""

    CREATED = "created"  # both made, or our create's own failure: an answer as a create's
    ROLLED_BACK = "rolled-back"  # another key's op failed the batch: send our create again
    KEY_EXISTS = "key-exists"  # another process made the key moments ago: create in it
    NO_AUTH = "no-auth"  # we may not create the key's container
    NO_ANCESTOR = "no-ancestor"  # an ancestor is missing: make it, then create again


@dataclass(frozen=True)
class MultiAnswer:
    """What the attempt is told of its multi: the step, and what that step needs."""

    step: Multi
    created: Any = None  # CREATED: the create's outcome, shaped as kazoo's async result
    listed: Queue | None = None  # CREATED: what is known of the queue (FRESH: ours is its first child)
    ancestor: str = ""  # NO_ANCESTOR: the parent to make


#: A multi's replies for ops it did not run because another op failed (before it, after it).
_NOT_RUN = (RolledBackError, RuntimeInconsistency)


def multi_answered(container, ours, path: str) -> MultiAnswer:
    """The multi's replies (``container``'s, ``ours``: a tuple or an exception each).  Both
    made, or neither: a rollback by another key's op, or a container that existed after
    all, sends the create again (the pipelined path)."""
    if isinstance(ours, tuple):
        # ZooKeeper answers a create inside a multi with its path only, but every node a
        # multi creates shares the transaction's zxid: the container's czxid is ours.
        return MultiAnswer(Multi.CREATED, _Made((ours[0], ours[1] or container[1])), Queue.FRESH)
    if isinstance(container, _NOT_RUN) and isinstance(ours, _NOT_RUN):
        return MultiAnswer(Multi.ROLLED_BACK)
    if isinstance(container, NodeExistsError):
        return MultiAnswer(Multi.KEY_EXISTS)
    if isinstance(container, NoAuthError):
        return MultiAnswer(Multi.NO_AUTH)
    parent = path.rsplit("/", 1)[0] if isinstance(container, NoNodeError) else ""
    if parent:
        return MultiAnswer(Multi.NO_ANCESTOR, ancestor=parent)
    # Our node's own failure: as for a create.
    failed = container if isinstance(container, Exception) and not isinstance(container, _NOT_RUN) else ours
    return MultiAnswer(Multi.CREATED, _Made(failed))


class Remade(enum.Enum):
    """How the making of a key's parent that a create found missing ended."""

    KEY = "key"  # made (or there already, or a blip): create again
    ANCESTOR = "ancestor"  # an ancestor was missing and is made: make the key again
    NO_AUTH = "no-auth"  # we may not create it


class _Made:
    """A create's outcome read out of a multi's reply, shaped as kazoo's async result."""

    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


# ============================================================ a fault branch: the hold once taken
#: Seconds after a grant by which the holder's watch on its own node is set (a hold
#: shorter than that never pays for it).
OWN_WATCH_WITHIN = 0.02


class HoldWatch:
    """The attempt's hold once taken: suspension and its grace, re-verification, the watch
    on our own node.

    A held lock is HELD_SUSPENDED (not held) while disconnected; re-verified (node exists,
    owned by our session) on reconnection; LOST when the suspension outlasts its grace (a
    third of the session timeout by default) or our node is deleted.  Why these numbers,
    and why the own-node watch waits :data:`OWN_WATCH_WITHIN`: docs/design.md, "Holding".

    Its own state: the grace timer of a suspension and the one watcher on our node (one per
    hold, so a watch set again is not doubled).  It reads the hold (state, node, session)
    through ``attempt`` and tells ``tell`` its verdicts (a :class:`HoldVerdict`), under the
    attempt's ``mutex``; the attempt moves between those states itself."""

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


# ============================================================ a fault branch: a create whose reply was lost
class Ghosts:
    """Looks for the attempt's lost creates: a create whose reply was lost may have succeeded.

    Once connected again, our prefix is looked for among the children: a node is adopted only
    if our session owns it, any other is deleted, so no ghost blocks the queue.  Once the
    attempt has given up, every such node is deleted and none adopted.

    Its own state: the session the last create was sent in (a ghost can only be ours if that
    session still lives).  It reads whether the attempt still wants the answer (``finished``,
    ``look``) and tells ``tell`` what it found (a :class:`Found`: :func:`resolve`), under the
    attempt's ``mutex``."""

    def __init__(self, client, path: str, prefix: str, mutex: threading.RLock, attempt: AttemptView,
                 tell: Callable[[Found], None]) -> None:
        self._client = client
        self._path = path
        self._prefix = prefix
        self._mutex = mutex
        self._attempt = attempt
        self._tell = tell
        self._session: int | None = None  # the session of the last create sent

    def create_sent(self, session: int | None) -> None:
        """A create went out in ``session``: its node, if its reply is lost, is a ghost of it."""
        self._session = session

    def may_be_ours(self, session_now: int | None) -> bool:
        """Could a lost create have made a node of ours that still lives?  Not once the
        session it was sent in has ended: its node went with it."""
        return session_now == self._session

    def look(self, look: int | None) -> None:
        """Read the queue for nodes of our prefix; ``look`` None: given up, delete every
        one of them and adopt none."""
        listed = self._client.get_children_async(self._path)
        kazoo_compat.on_ready(listed, partial(self._on_children, look, look is None))

    def _on_children(self, look, delete_only: bool, result) -> None:
        at = self._attempt
        with self._mutex:
            if at.finished:
                delete_only = True  # given up meanwhile: nothing may be adopted any more
            elif look != at.look:
                return
            try:
                children = result.get()
            except NoNodeError:
                children = []  # the container was reaped: no node of ours can exist
            except RETRYABLE:
                return self._tell(Found(Then.RECONNECT, delete_only))
            except Exception as exc:
                if delete_only:
                    return self._tell(Found(Then.SETTLE, delete_only))
                return self._tell(Found(Then.GIVE_UP, delete_only, error=exc))
            mine = [c for c in children if c.startswith(self._prefix)]
            if not mine:
                return self._tell(Found(Then.SETTLE if delete_only else Then.CREATE, delete_only))
            replies = {name: self._client.exists_async(f"{self._path}/{name}") for name in mine}
            kazoo_compat.on_all_ready(replies.values(),
                                      lambda: self._on_stats(look, delete_only, children, replies))

    def _on_stats(self, look, delete_only: bool, children, replies) -> None:
        at = self._attempt
        with self._mutex:
            stats = [(name, _outcome(reply)) for name, reply in replies.items()]
            found = resolve(children, stats, self._session, kazoo_compat.session_id(self._client),
                            cleanup=delete_only or at.finished, current=look == at.look)
            self._tell(found)


class Then(enum.Enum):
    """What the attempt does once a look for ghosts is answered (after its deletes)."""

    RECONNECT = "reconnect"  # the connection went meanwhile: look again once connected
    SETTLE = "settle"  # given up, and no node of ours is left to appear
    GIVE_UP = "give-up"  # the queue could not be read: nothing more can be learnt of the ghost
    CREATE = "create"  # no node of ours: create one
    ADOPT = "adopt"  # our session made our node: it is ours
    STALE = "stale"  # a newer look answers instead


@dataclass(frozen=True)
class Ghost:
    """Our node, made by a create whose reply was lost, and the queue it was found in."""

    name: str
    czxid: int
    session: int | None
    queue: Sequence[str]


@dataclass(frozen=True)
class Found:
    """A look for ghosts, answered: delete ``deletes`` (nodes of our prefix not ours to
    keep), as the cleanup's deletes if ``cleanup`` (the attempt has given up), then ``then``."""

    then: Then
    cleanup: bool
    deletes: tuple[str, ...] = ()
    ghost: Ghost | None = None  # ADOPT
    error: BaseException | None = None  # GIVE_UP


def resolve(queue: Sequence[str], stats, session: int | None, session_now: int | None, cleanup: bool,
            current: bool) -> Found:
    """What the ``exists`` replies on the nodes of our prefix say (``stats``: (name, stat,
    None or the exception raised), in the order sent).  Ours to adopt: the first node owned
    by ``session`` (the create's, still the live one), while the attempt still wants one
    (not ``cleanup``, the look ``current``); every other is deleted, so no ghost blocks
    the queue.  A connection lost on the way stops there: the nodes after it are looked at
    again."""
    adoptable = not cleanup and current
    keep: Ghost | None = None
    deletes: list[str] = []
    for name, stat in stats:
        if isinstance(stat, RETRYABLE):
            return Found(Then.RECONNECT, cleanup, tuple(deletes))
        if stat is None or isinstance(stat, Exception):
            continue
        if adoptable and keep is None and stat.ephemeralOwner == session == session_now:
            keep = Ghost(name, stat.czxid, session, queue)
        else:  # a stale twin of another session, or a ghost we may not keep
            deletes.append(name)
    if cleanup:
        return Found(Then.SETTLE, cleanup, tuple(deletes))
    if not current:
        return Found(Then.STALE, cleanup, tuple(deletes))
    if keep is None:
        return Found(Then.CREATE, cleanup, tuple(deletes))
    return Found(Then.ADOPT, cleanup, tuple(deletes), ghost=keep)


def _outcome(result):
    """An answered request's value, or the exception it raised."""
    try:
        return result.get()
    except Exception as exc:
        return exc


# ============================================================ shared: the states an Attempt moves between,
# and what its collaborators may read of it (AttemptView)

#: Lock paths whose parent this process saw lately (see znodes.RecentPaths).
RECENT = znodes.RecentPaths()


class State(enum.Enum):
    IDLE = "idle"  # not started, given up (timeout/cancel) or released
    CREATING = "creating"  # our node is being created, or a lost create is being resolved
    WAITING = "waiting"  # our node is queued behind holders
    HELD = "held"
    HELD_SUSPENDED = "held-suspended"  # held, but disconnected: unsafe until re-verified
    LOST = "lost"  # was held and is not any more; ``lost_reason`` says why


class Pending(enum.Enum):
    """What an attempt cut off from ZooKeeper does once connected again."""

    CREATE = "create"  # send our create (again)
    GHOST = "ghost"  # a create's reply was lost: adopt our node if it was made, else create
    READ = "read"  # read the queue again
    CLEANUP = "cleanup"  # given up with a create's reply lost: delete any node of ours


class Queue(enum.Enum):
    """What an attempt knows of its key's queue as its create is answered, besides a read."""

    # The key's container was made in the same multi as our node: ours is its first child.
    # Why not "sequence 0" alone: the sequence is the parent's cversion, which wraps
    # (znodes.SEQUENCE_WRAP), so an old parent names a node 0 again with others ahead.
    FRESH = "fresh"


WAITING_STATES = (State.CREATING, State.WAITING)
HELD_STATES = (State.HELD, State.HELD_SUSPENDED)


class AttemptView(Protocol):
    """What a collaborator (:class:`Ghosts`, :class:`HoldWatch`) may read of the
    :class:`Attempt` it serves, under the attempt's ``mutex``, and never write:
    whether a reply is still wanted (``finished``, ``look``) and which hold it is
    (``state``, ``node``, ``session``).  What they find they tell the attempt, which
    applies it itself."""

    @property
    def state(self) -> State: ...

    @property
    def node(self) -> str | None: ...

    @property
    def session(self) -> int | None: ...

    @property
    def finished(self) -> bool: ...

    @property
    def look(self) -> int: ...
