"""The lock protocol, event-driven (Curator's ``LockInternals``): one :class:`Attempt` per acquire.

Why event-driven: an attempt advances only on ZooKeeper callbacks — a create or children
reply, a watch firing, a connection-state change from the client's
:class:`~celery_zklock.engine.session.SessionMonitor`, a timer — and never blocks.  So one
process can wait on thousands of keys with no thread per waiter; the blocking
:class:`~celery_zklock.engine.lock.FairLock` is a thin wrapper that waits for the outcome.

Protocol: each contender creates an EPHEMERAL_SEQUENTIAL child ``_c_<uuid>-lock-<seq>``;
the ``max_holders`` lowest sequences hold (:func:`~celery_zklock.engine.driver.gets_the_lock`
decides).  ``create`` and ``get_children`` are pipelined (ZooKeeper answers one session's
requests in order): an uncontended acquire is one round trip.  On a key this process has
not locked lately the container's creation rides along instead, and a node with sequence
0 holds without a read (a sequence is the parent's child-change count, so 0 means no
child ever existed before ours).  A waiter sets data watches (``get``, never ``exists``, so
no creation watch is left behind) on the contenders the driver names, and re-reads the
children when one fires — unless the driver said the watched window is everyone ahead of
us, where the deletion of any of them makes us a holder at once (a handoff costs one
notification, not a notification plus a round trip).

Safety rules kazoo's ``Lock`` leaves to the caller and this module keeps:

* one monotonic deadline for the whole attempt; at the deadline our node is deleted;
* a create whose reply was lost may have succeeded: after reconnecting we look for our
  uuid among the children and adopt the node only if its ``ephemeralOwner`` is our
  session, deleting any other (no ghost nodes blocking the queue);
* a held lock is HELD_SUSPENDED (not held) while disconnected; re-verified (node exists,
  owned by our session) on reconnection; LOST when the session expires, the node is
  deleted, or the suspension outlasts a third of the session timeout (kazoo cannot learn
  of an expiry while cut off and notices the cut only after two thirds of it);
* the fencing token is derived from our node's ``czxid`` (:func:`~celery_zklock.engine.znodes.fencing_token`):
  zxids are totally ordered, so a later holder's token is larger, even if the parent was
  deleted and recreated.
"""

from __future__ import annotations

import enum
import threading
import uuid
from functools import partial
from typing import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionClosedError, NoAuthError, NoNodeError, SessionExpiredError, UnimplementedError
from kazoo.protocol.states import EventType, KazooState

from . import kazoo_compat, znodes
from .driver import gets_the_lock
from .identity import Identity
from .session import RETRYABLE, SessionMonitor, guaranteed_delete, monitor_for

#: Lock paths whose parent this process saw lately (see znodes.RecentPaths).
RECENT = znodes.RecentPaths()


class State(enum.Enum):
    IDLE = "idle"  # not started, given up (timeout/cancel) or released
    CREATING = "creating"  # our node is being created, or a lost create is being resolved
    WAITING = "waiting"  # our node is queued behind holders
    HELD = "held"
    HELD_SUSPENDED = "held-suspended"  # held, but disconnected: unsafe until re-verified
    LOST = "lost"  # was held and is not any more; ``lost_reason`` says why


_WAITING_STATES = (State.CREATING, State.WAITING)
_HELD_STATES = (State.HELD, State.HELD_SUSPENDED)


class LockInternals:
    """What stays the same across a lock's attempts: where, how many holders, who we are."""

    def __init__(self, client: KazooClient, path: str, max_holders: int = 1, identifier: str | bytes | None = None,
                 on_lost: Callable[[], None] | None = None, suspended_grace: float | None = None) -> None:
        if not isinstance(client, KazooClient):
            raise ValueError(f"client must be a kazoo KazooClient, got {type(client).__name__}")
        if isinstance(max_holders, bool) or not isinstance(max_holders, int) or max_holders < 1:
            raise ValueError(f"max_holders must be an int >= 1, got {max_holders!r}")
        if identifier is None:
            identifier = Identity.of_this_thread().to_bytes()
        if isinstance(identifier, str):
            identifier = identifier.encode("utf-8")
        if not isinstance(identifier, bytes):
            raise ValueError(f"identifier must be str or bytes, got {type(identifier).__name__}")
        if len(identifier) > 64 * 1024:
            raise ValueError("identifier must be at most 64 KiB")
        self.client = client
        self.path = znodes.validate_path(path)
        self.max_holders = max_holders
        self.identifier = identifier
        self.on_lost = on_lost
        self.suspended_grace = suspended_grace
        self.monitor: SessionMonitor = monitor_for(client)
        self.prefix = znodes.node_prefix(uuid.uuid4().hex)
        self._attempts = 0

    def grace(self) -> float:
        if self.suspended_grace is not None:
            return self.suspended_grace
        return kazoo_compat.session_timeout(self.client) / 3.0

    def attempt(self, deadline: float | None, on_wait: Callable[[int], None] | None = None,
                on_next: Callable[[], None] | None = None) -> "Attempt":
        """Start an acquisition; ``attempt.result`` resolves to True (held) or False.

        ``on_wait(position)`` is called once if the attempt has to queue, ``on_next()`` once
        when it is next in line (every node ahead of it is a holder: the first release makes
        it a holder, without another read), and callbacks
        rawlinked to ``attempt.result`` run on kazoo's completion thread: neither may
        block (no I/O waits), since they share that thread with every other lock.

        Each attempt after the first gets a fresh node prefix: a node that an earlier,
        abandoned attempt is still cleaning up must never be adopted as this one's ghost.
        """
        if self._attempts:
            self.prefix = znodes.node_prefix(uuid.uuid4().hex)
        self._attempts += 1
        attempt = Attempt(self, self.prefix, on_wait, on_next)
        attempt.start(deadline)
        return attempt


class Attempt:
    """One acquisition, from the create to the release, driven by callbacks only.

    Every handler runs under ``_guard``, sends only asynchronous requests and ignores
    replies of an earlier look (``_look`` counts children reads and watch sets).
    """

    def __init__(self, internals: LockInternals, prefix: str, on_wait, on_next=None) -> None:
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
        self._pending: str | None = None  # what to do once connected: create/ghost/read
        self._create_in_flight = False
        self._create_session: int | None = None
        self._waited = False
        self._deadline_timer = None
        self._deadline_passed = False

    # ------------------------------------------------------------------ start and finish
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
        self._pending = "cleanup" if self._pending == "ghost" else None
        node, self.node, self.token = self.node, None, None
        if node is not None:
            self.cleanup = self._delete(node, self.session)
        if self._pending is None and not self._create_in_flight:
            self.monitor.unsubscribe(self)
        self._finish(value)

    def cancel(self, value: bool | BaseException = False) -> None:
        with self._guard:
            if not self._finished and self.state in _WAITING_STATES:
                self._give_up(value)

    def _on_deadline(self) -> None:
        """Give up now if queued or cut off; a request in flight first gets its answer
        (``timeout=0`` means "try once": the create and the children read still happen)."""
        with self._guard:
            if self._finished or self.state not in _WAITING_STATES:
                return
            self._deadline_passed = True
            if self.state is State.WAITING or self._pending is not None:
                self._give_up(False)

    def _await(self, kind: str | None) -> None:
        """A request failed for want of a connection: go on with ``kind`` once connected."""
        if self._finished:
            kind = "cleanup" if kind in ("ghost", "cleanup") else None
        self._pending = kind
        if self._deadline_passed and not self._finished:
            return self._give_up(False)
        if kind is None:
            return self._settle_cleanup()
        if self.client.connected:
            self._resume()

    # ------------------------------------------------------------------ creating our node
    def _send_create(self, same_try: bool = False) -> None:
        # same_try: the create is being resent because the key's container had been
        # reaped; the remake and the resend belong to the one try that timeout=0 allows.
        if self._deadline_passed and not same_try:
            return self._give_up(False)
        if not self.client.connected:
            return self._await("create")
        self._pending = None
        session = kazoo_compat.session_id(self.client)
        self._create_session = session
        self._create_in_flight = True
        new_key = self.lk.path not in RECENT and znodes.uses_containers(self.client)
        if new_key:
            # A key not locked lately: its container probably does not exist (they are
            # reaped when empty), so create it in the same round trip, and read no children.
            kazoo_compat.create_container_async(
                self.client, self.lk.path, kazoo_compat.acl_for(self.client, self.lk.path)
            ).rawlink(self._on_parent)
        node = f"{self.lk.path}/{self.prefix}"
        created = self.client.create_async(
            node, self.lk.identifier, acl=kazoo_compat.acl_for(self.client, node), ephemeral=True, sequence=True,
            include_data=True,
        )
        listed = None if new_key else self.client.get_children_async(self.lk.path)
        created.rawlink(partial(self._on_created, session, listed))

    def _on_parent(self, result) -> None:
        try:
            result.get()
        except UnimplementedError:
            # A server without containers (< 3.5.3): persistent parents from now on,
            # deleted best-effort after release so they do not accumulate.
            znodes.mark_no_containers(self.client)
        except Exception:
            pass  # exists already, or its ancestors do not: the create tells

    def _on_created(self, session, listed, result) -> None:
        with self._guard:
            self._create_in_flight = False
            try:
                path, stat = result.get()
            except NoNodeError:
                RECENT.discard(self.lk.path)
                if not self._finished:
                    self._make_parent_then_create()
                return self._settle_cleanup()
            except RETRYABLE:
                # The create may have run with its reply lost: resolve it once connected.
                return self._await("ghost")
            except SessionExpiredError:
                return self._await("create")
            except NoAuthError:
                if not self._finished:
                    self._give_up(znodes.no_auth_error(self.lk.path, "joining the lock queue"))
                return self._settle_cleanup()
            except Exception as exc:  # ConnectionClosedError: the client was stopped
                if not self._finished:
                    self._give_up(exc)
                return self._settle_cleanup()
            RECENT.add(self.lk.path)
            name = path.rsplit("/", 1)[1]
            if self._finished:  # given up while the create was in flight
                self.cleanup = self._delete(name, session)
                return self._settle_cleanup()
            self.node, self.czxid, self.session = name, stat.czxid, session
            self.token = znodes.fencing_token(stat.czxid)
            if listed is None and znodes.sequence_of(name) == 0:
                return self._decide([name])
            if listed is not None:
                look = self._next_look()
                listed.rawlink(partial(self._on_children, look))
            else:
                self._read_children()

    def _make_parent_then_create(self) -> None:
        """Our create found no parent: make it (a container; ancestors persistent), create again."""
        path = self.lk.path

        def made(result) -> None:
            try:
                result.get()
            except NoNodeError:  # an ancestor is missing too
                parent = path.rsplit("/", 1)[0]
                if parent:
                    return self.client.ensure_path_async(parent, kazoo_compat.acl_for(self.client, parent)).rawlink(
                        lambda r: self._parent_made(r, retry=True))
            except UnimplementedError:
                znodes.mark_no_containers(self.client)
                return self.client.create_async(path, b"", acl=kazoo_compat.acl_for(self.client, path),
                                                makepath=True).rawlink(self._parent_made)
            except Exception:
                pass
            self._parent_made(result)

        acl = kazoo_compat.acl_for(self.client, path)
        if znodes.uses_containers(self.client):
            kazoo_compat.create_container_async(self.client, path, acl).rawlink(made)
        else:
            self.client.create_async(path, b"", acl=acl, makepath=True).rawlink(self._parent_made)

    def _parent_made(self, result, retry: bool = False) -> None:
        with self._guard:
            if self._finished or self.state is not State.CREATING or self._create_in_flight:
                return
            try:
                result.get()
            except NoAuthError:
                return self._give_up(znodes.no_auth_error(self.lk.path, "creating the lock's parent znode"))
            except Exception:
                pass  # exists already, or a connection blip: the next create tells
            if retry:
                return self._make_parent_then_create()
            self._send_create(same_try=True)

    def _resume(self) -> None:
        pending = self._pending
        if self._create_in_flight:
            return  # its reply (success or connection loss) decides what comes next
        if pending == "cleanup":
            return self._clean_ghosts()
        if self._finished or self.state not in _WAITING_STATES:
            return
        if self.node is not None and kazoo_compat.session_id(self.client) != self.session:
            self._requeue()  # our node died with the old session
        elif pending == "ghost":
            if kazoo_compat.session_id(self.client) != self._create_session:
                self._send_create()  # a ghost of the old session died with it
            else:
                self._adopt_ghost()
        elif pending == "create" or self.node is None:
            self._send_create()
        else:
            self._read_children()

    def _requeue(self) -> None:
        """Our node is gone (session expired, deleted by an operator or the reaper): queue again."""
        self.node = self.token = self.session = None
        self.state = State.CREATING
        self._send_create()

    # ------------------------------------------------------------------ ghosts
    def _adopt_ghost(self) -> None:
        """After a lost create reply: adopt our node if our session owns it, else delete it."""
        self._pending = None
        look = self._next_look()
        self.client.get_children_async(self.lk.path).rawlink(partial(self._on_ghost_children, look, False))

    def _clean_ghosts(self) -> None:
        """Given up while a create's reply was lost: delete any node of ours, adopt none."""
        if kazoo_compat.session_id(self.client) != self._create_session:
            return self._settle_cleanup()
        self.client.get_children_async(self.lk.path).rawlink(partial(self._on_ghost_children, None, True))

    def _on_ghost_children(self, look, delete_only: bool, result) -> None:
        with self._guard:
            if self._finished:
                delete_only = True  # given up meanwhile: nothing may be adopted any more
            elif look != self._look:
                return
            try:
                children = result.get()
            except NoNodeError:
                children = []  # the container was reaped: no node of ours can exist
            except RETRYABLE:
                return self._await("cleanup" if delete_only else "ghost")
            except Exception as exc:
                if delete_only:
                    return self._settle_cleanup()
                return self._give_up(exc)
            mine = [c for c in children if c.startswith(self.prefix)]
            if not mine:
                if delete_only:
                    return self._settle_cleanup()
                return self._send_create()
            replies = {name: self.client.exists_async(f"{self.lk.path}/{name}") for name in mine}
            remaining = [len(replies)]

            def checked(_result) -> None:
                remaining[0] -= 1
                if remaining[0] == 0:
                    self._on_ghost_stats(look, delete_only, children, replies)

            for r in replies.values():
                r.rawlink(checked)

    def _on_ghost_stats(self, look, delete_only: bool, children, replies) -> None:
        with self._guard:
            session = self._create_session
            keep = None
            for name, r in replies.items():
                try:
                    stat = r.get()
                except RETRYABLE:
                    return self._await("cleanup" if delete_only else "ghost")
                except Exception:
                    continue
                if stat is None:
                    continue
                adoptable = not delete_only and not self._finished and look == self._look
                if adoptable and keep is None and stat.ephemeralOwner == session == kazoo_compat.session_id(self.client):
                    keep = (name, stat)
                else:  # a stale twin of another session, or a ghost we may not keep
                    self._delete(name, kazoo_compat.session_id(self.client))
            if delete_only or self._finished:
                return self._settle_cleanup()
            if look != self._look:
                return
            if keep is None:
                return self._send_create()
            self.node, self.czxid, self.session = keep[0], keep[1].czxid, session
            self.token = znodes.fencing_token(self.czxid)
            self._decide(children)

    def _settle_cleanup(self) -> None:
        """Once given up and nothing of ours can still appear: stop listening to the session."""
        if self._finished and not self._create_in_flight and self.state is State.IDLE:
            self._pending = None
            self.monitor.unsubscribe(self)

    # ------------------------------------------------------------------ waiting
    def _next_look(self) -> int:
        self._look += 1
        return self._look

    def _read_children(self) -> None:
        look = self._next_look()
        self.client.get_children_async(self.lk.path).rawlink(partial(self._on_children, look))

    def _on_children(self, look, result) -> None:
        with self._guard:
            if look != self._look or self._finished or self.state not in _WAITING_STATES:
                return
            try:
                children = result.get()
            except NoNodeError:
                children = []  # the parent is gone, and our node with it
            except RETRYABLE:
                return self._await("read")
            except SessionExpiredError:
                return self._await("create")
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
            watch = partial(self._on_watch, look, handoff)
            self.client.get_async(f"{self.lk.path}/{name}", watch=watch).rawlink(
                partial(self._on_watch_set, look, handoff)
            )

    def _on_watch_set(self, look, handoff: bool, result) -> None:
        with self._guard:
            if look != self._look or self._finished or self.state is not State.WAITING:
                return
            try:
                result.get()
            except NoNodeError:
                self._advance(handoff)  # gone before our watch was set
            except RETRYABLE:
                self._await("read")
            except Exception:
                self._pending = "read"  # session trouble: the next CONNECTED decides

    def _on_watch(self, look, handoff: bool, event) -> None:
        with self._guard:
            if look != self._look or self._finished or self.state is not State.WAITING:
                return
            if event.type == EventType.DELETED:
                self._advance(handoff)
            elif event.type != EventType.NONE:
                self._read_children()
            # NONE: a connection event; the monitor's CONNECTED re-reads the children.

    def _advance(self, handoff: bool) -> None:
        """A watched node left.  If we watched everyone ahead of us, we hold: new
        contenders only ever queue behind us, so fewer than max_holders are ahead now."""
        if handoff:
            self._take()
        else:
            self._read_children()

    # ------------------------------------------------------------------ holding
    def _take(self) -> None:
        if kazoo_compat.session_id(self.client) != self.session:
            return self._requeue()  # the children were read in a session that has ended
        if self.client.connected:
            self.state = State.HELD
        else:
            # The connection dropped between the deciding reply and now: the monitor told
            # us while we were still waiting, so the suspension starts here.
            self._suspend()
        self._watch_own_node()
        self._finish(True)

    def _suspend(self) -> None:
        self.state = State.HELD_SUSPENDED
        self.monitor.grace_timer(self.lk.grace(), self._on_grace_over)
        if self.client.connected:
            self._verify(self.monitor.epoch)

    def _watch_own_node(self) -> None:
        """Learn at once if our node is deleted behind our back (operator, reaper, expiry)."""
        node, session = self.node, self.session

        def changed(event) -> None:
            if event.type == EventType.DELETED:
                with self._guard:
                    if self.node == node and self.session == session:
                        self._mark_lost("lock node was deleted")

        def checked(result) -> None:
            try:
                missing = result.get() is None
            except Exception:
                return  # connection trouble: the monitor takes over
            if missing:
                with self._guard:
                    if self.node == node and self.session == session:
                        self._mark_lost("lock node was deleted")

        self.client.exists_async(f"{self.lk.path}/{node}", watch=changed).rawlink(checked)

    def on_connection(self, state: str, epoch: int) -> None:
        """From the :class:`SessionMonitor`, on kazoo's connection thread: flags and async requests only."""
        with self._guard:
            if state == KazooState.SUSPENDED:
                if self.state is State.HELD:
                    self._suspend()
            elif state == KazooState.CONNECTED:
                if self.state is State.HELD_SUSPENDED:
                    self._verify(epoch)
                elif self._pending == "cleanup" or (not self._finished and self.state in _WAITING_STATES):
                    self._resume()
            elif state == KazooState.LOST:
                if self.state in _HELD_STATES:
                    self._mark_lost("ZooKeeper session expired")

    def _verify(self, epoch: int) -> None:
        """After a reconnection: still ours only if the node exists and our session owns it."""
        node, session = self.node, self.session
        self.client.exists_async(f"{self.lk.path}/{node}").rawlink(partial(self._on_verified, epoch, node, session))

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
                self._watch_own_node()  # kazoo dropped our watches when the connection broke
            else:
                self._mark_lost("lock node gone after reconnection")

    def _on_grace_over(self, epoch: int) -> None:
        with self._guard:
            if self.state is State.HELD_SUSPENDED and self.monitor.epoch == epoch:
                self._mark_lost("disconnected from ZooKeeper past the session-expiry safety margin")

    def _mark_lost(self, reason: str) -> None:
        if self.state not in _HELD_STATES:
            return
        self.state = State.LOST
        self.lost_reason = reason
        if self.lk.on_lost is not None:
            self.client.handler.spawn(self.lk.on_lost)

    # ------------------------------------------------------------------ release
    def release(self):
        """Let go.  Returns ``(was_held, outcome)``: outcome is None without a node, the
        string :data:`~celery_zklock.engine.session.EXPIRED`, or the guaranteed delete's async result."""
        with self._guard:
            if not self._finished:
                self._give_up(False)
                return False, self.cleanup
            was_held = self.state in _HELD_STATES
            node, session = self.node, self.session
            self.node = self.token = None
            if self.state is not State.LOST:
                self.state = State.IDLE
            self.monitor.unsubscribe(self)
        if node is None:
            return was_held, None
        if session != kazoo_compat.session_id(self.client):
            return was_held, "expired"
        outcome = self._delete(node, session)
        if not znodes.uses_containers(self.client):
            self.client.delete_async(self.lk.path)  # best effort: goes once its last child has
        return was_held, outcome

    def _delete(self, name: str, session):
        full = f"{self.lk.path}/{name}"
        return guaranteed_delete(
            self.monitor, full, session, on_no_auth=lambda: znodes.no_auth_error(full, "deleting our lock node")
        )
