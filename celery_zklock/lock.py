"""The fair (FIFO) ZooKeeper lock engine: :class:`FairLock` and :class:`MultiLock`.

Protocol, in one paragraph: each contender creates an EPHEMERAL_SEQUENTIAL child
``_c_<uuid>-lock-<seq>`` under the lock path; the ``max_holders`` lowest sequences hold the
lock.  ``create`` and ``get_children`` are pipelined (ZooKeeper answers one session's
requests in order), so an uncontended acquire costs one round trip (on a new key the
container's creation rides along instead, and a node with sequence 0 holds without a
read: a sequence is the parent's child-change count).  A waiter sets data
watches (``get``, never ``exists``, so no creation watch is left behind) on the
``max_holders`` contenders immediately ahead of it and re-reads the children when one
fires: with ``max_holders=1`` that is exactly one notification per release and no herd.

Why the window and not only "the node N places ahead": with N > 1 holders release in any
order and waiters time out in any order; a waiter watching only the node N ahead misses
the departure of the nodes between it and that node and can wait forever while a slot is
free (e.g. N=2, queue A B C D me: D times out, B releases — C and I should now both hold,
yet C watches A and I watch C).  Watching the N nodes immediately ahead is the smallest
set whose changes can free a slot for us; at most N waiters wake per departure.

Safety rules that kazoo's ``Lock`` leaves to the caller and this module enforces:

* one monotonic deadline for the whole acquire; on timeout our node is deleted first;
* a create whose reply was lost (connection loss) may have succeeded: we look for our
  uuid among the children and adopt the node only if its ``ephemeralOwner`` is our
  session, otherwise delete it and create anew (no ghost nodes that block the queue);
* release retries the delete until it succeeds or the session is gone;
* SUSPENDED makes :meth:`FairLock.is_held` False until the node is re-verified after
  reconnection; LOST (session expired) makes it False for good and fires ``on_lost``.
  No ZooKeeper I/O runs inside kazoo's state listener (it would block kazoo's
  connection thread); verification runs on a handler-spawned worker;
* the fencing token is our node's ``czxid``: zxids are totally ordered, so each later
  holder's token is larger, even if the parent was deleted and recreated.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from typing import Callable, Iterable, Sequence

from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    NoAuthError,
    NoNodeError,
    OperationTimeoutError,
    SessionExpiredError,
    UnimplementedError,
)
from kazoo.protocol.states import EventType, KazooState

from . import znodes
from .errors import LockLost
from .znodes import Contender

__all__ = ["FairLock", "MultiLock", "Contender"]

LostCallback = Callable[["FairLock"], None]

# States of one FairLock.
_IDLE, _WAITING, _HELD, _LOST = "idle", "waiting", "held", "lost"

_RETRYABLE = (ConnectionLoss, OperationTimeoutError)

# Outcomes of deleting our node at release.
_DELETED, _GONE, _EXPIRED, _DEFERRED = "deleted", "gone", "expired", "deferred"
_LOST_AT_RELEASE = {
    _GONE: "lock node was already gone at release",
    _EXPIRED: "ZooKeeper session expired before release",
    _DEFERRED: "ZooKeeper unreachable at release for longer than the session timeout",
    None: "lock node was already gone at release",
}


#: Lock paths whose parent this process saw lately (see znodes.RecentPaths).
_RECENT = znodes.RecentPaths()


def default_identifier() -> str:
    """What a node says about its owner when the caller gives nothing: host, pid, thread."""
    return json.dumps(
        {"host": socket.gethostname(), "pid": os.getpid(), "thread": threading.current_thread().name},
        separators=(",", ":"),
    )


class _Wake:
    """One wait of a waiter: an event (handler-specific) plus "a watched node was deleted"."""

    __slots__ = ("event", "deleted")

    def __init__(self, event) -> None:
        self.event = event
        self.deleted = False

    def set(self) -> None:
        self.event.set()

    def wait(self, timeout: float | None) -> None:
        self.event.wait(timeout)


class FairLock:
    """A fair, fenced, loss-aware ZooKeeper mutex (or N-holder semaphore) on ``path``.

    Use one ``FairLock`` per acquisition site; it is not re-entrant and one instance must
    not be acquired by two threads at once (create one per thread — they may all share one
    started :class:`~kazoo.client.KazooClient`).

    ``on_lost(lock)`` is called, outside kazoo's connection thread, when a held lock is
    lost: session expired, our node deleted, or not verifiable after a reconnection.
    """

    def __init__(
        self,
        client: KazooClient,
        path: str,
        *,
        max_holders: int = 1,
        identifier: str | bytes | None = None,
        on_lost: LostCallback | None = None,
        on_wait: Callable[["FairLock", int], None] | None = None,
        suspended_grace: float | None = None,
    ) -> None:
        if not isinstance(client, KazooClient):
            raise ValueError(f"client must be a kazoo KazooClient, got {type(client).__name__}")
        self.path = znodes.validate_path(path)
        if isinstance(max_holders, bool) or not isinstance(max_holders, int) or max_holders < 1:
            raise ValueError(f"max_holders must be an int >= 1, got {max_holders!r}")
        if identifier is None:
            identifier = default_identifier()
        if isinstance(identifier, str):
            identifier = identifier.encode("utf-8")
        if not isinstance(identifier, bytes):
            raise ValueError(f"identifier must be str or bytes, got {type(identifier).__name__}")
        if len(identifier) > 64 * 1024:
            raise ValueError("identifier must be at most 64 KiB")
        self.client = client
        self.max_holders = max_holders
        self.identifier = identifier
        self.on_lost = on_lost
        self.on_wait = on_wait
        # How long a held lock may stay SUSPENDED before we declare it lost.  kazoo cannot
        # learn that the server expired our session while it is cut off, and it notices the
        # cut only after 2/3 of the session timeout without replies; the server expires the
        # session one session timeout after it last heard from us.  So once SUSPENDED, at
        # most ~1/3 of the session timeout is left before another contender may hold the
        # lock: past that we must assume it is gone (Curator's "simulated expiration").
        self.suspended_grace = suspended_grace
        self._suspend_epoch = 0
        self._uuid = uuid.uuid4().hex
        self._prefix = znodes.node_prefix(self._uuid)
        self._node: str | None = None  # our child's name once created
        self._token: int | None = None
        self._session_id: int | None = None
        self._state = _IDLE
        self._suspended = False
        self._cancelled = False
        self._guard = client.handler.rlock_object()
        self._wake = _Wake(client.handler.event_object())
        self._connected = client.handler.event_object()
        self._lost_reason: str | None = None
        self._listening = False

    # ------------------------------------------------------------------ public API
    @property
    def token(self) -> int | None:
        """Fencing token (our node's czxid) while held, else None."""
        return self._token if self._state == _HELD else None

    @property
    def node(self) -> str | None:
        """Full path of our lock node while we wait or hold."""
        return f"{self.path}/{self._node}" if self._node else None

    @property
    def lost_reason(self) -> str | None:
        return self._lost_reason

    def is_held(self) -> bool:
        """True only while we hold the lock and the connection gives no reason to doubt it.

        False while SUSPENDED (the server may already have expired our session), and for
        good after LOST.  No I/O: cheap enough to call before every fenced write.
        """
        return self._state == _HELD and not self._suspended

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless :meth:`is_held`."""
        if not self.is_held():
            raise LockLost(self.path, self._lost_reason or ("connection suspended" if self._suspended else "not held"))

    def cancel(self) -> None:
        """Make a pending (or the next) :meth:`acquire` give up and return False."""
        self._cancelled = True
        self._wake.set()

    def acquire(self, timeout: float | None = None, blocking: bool = True) -> bool:
        """Join the queue and wait until we hold the lock or give up.

        ``timeout`` (seconds) bounds the *whole* call with one monotonic deadline;
        ``blocking=False`` or ``timeout=0`` tries once.  Returns True when held, False on
        timeout or :meth:`cancel` — in both cases our node is already deleted.
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"timeout must be >= 0 or None, got {timeout!r}")
        if not blocking:
            timeout = 0
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._guard:
            if self._state in (_WAITING, _HELD):
                raise RuntimeError(f"FairLock on {self.path} is already {self._state}; it is not re-entrant")
            self._state = _WAITING
            self._waited = False
            self._suspended = False
            self._lost_reason = None
        self._check_client()
        self._listen()
        try:
            acquired = self._acquire(deadline)
        except NoAuthError:
            self._abandon()
            raise znodes.no_auth_error(self.path, "joining the lock queue") from None
        except BaseException:
            self._abandon()
            raise
        if not acquired:
            self._abandon()
        self._cancelled = False
        return acquired

    def release(self, wait: bool = True) -> bool:
        """Let go: delete our node, retrying through connection loss until done.

        With ``wait=True`` (the default) the delete's reply is also the proof that the lock
        was held *until this moment*: our node still existed, so our session never expired
        and nobody else could have held it.  If the delete finds the node already gone
        (session expired while the process was frozen or partitioned, node deleted by an
        operator) the lock is marked lost (``lost_reason`` says why) and this returns
        False — work done under it was not exclusive to the end.

        ``wait=False`` pipelines the release: the delete is sent and this returns without
        waiting for the reply, saving one round trip on the caller's path (the next
        waiter is woken by the same delete either way).  The delete is still guaranteed:
        a failed reply hands it to a background retry that runs until the node is gone or
        the session is.  Only use it while the process keeps its ZooKeeper client open.

        Returns True if a held lock was released (with ``wait=True``: and proven held to
        the end); False if there was nothing to release (never acquired, already released,
        already lost) or, with ``wait=True``, if the node turned out to be gone.
        """
        with self._guard:
            was_held = self._state == _HELD
        outcome = self._abandon(wait)
        if was_held and wait and outcome != _DELETED:
            with self._guard:
                if self._lost_reason is None:
                    self._lost_reason = _LOST_AT_RELEASE[outcome]
            return False
        return was_held

    def contenders(self) -> list[Contender]:
        """Every contender on this path in queue order, with identifiers and holder flag."""
        return contenders(self.client, self.path, self.max_holders)

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<FairLock {self.path} {self._state} token={self.token}>"

    # ------------------------------------------------------------------ acquire internals
    def _check_client(self) -> None:
        if self.client._stopped.is_set():
            raise ValueError(
                "the KazooClient is not started (or was stopped): call client.start() before acquiring"
            )

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _expired(self, deadline: float | None) -> bool:
        return deadline is not None and time.monotonic() >= deadline

    def _acquire(self, deadline: float | None) -> bool:
        children = self._create(deadline)
        if children is None:
            return False
        while True:
            if self._cancelled:
                return False
            if self._session_lost():
                # Our node died with the session: queue again at the back (new session).
                children = self._create(deadline)
                if children is None:
                    return False
                continue
            ordered = znodes.sort_contenders(children)
            try:
                index = ordered.index(self._node)
            except ValueError:
                # Our node is gone (deleted by an operator or the worker-loss reaper).
                self._node = None
                children = self._create(deadline)
                if children is None:
                    return False
                continue
            if index < self.max_holders:
                held = self._take()
                if held is None:
                    continue  # the children were read in a session that has since ended
                return held
            if deadline is not None and self._expired(deadline):
                return False
            if self.on_wait is not None and not self._waited:
                self._waited = True
                self.on_wait(self, index)
            wake = self._wake = _Wake(self.client.handler.event_object())
            ahead = ordered[index - self.max_holders : index]
            deleted = self._watch_any(ahead, wake)
            if not deleted and not self._cancelled:
                wake.wait(self._remaining(deadline))
            if (deleted or wake.deleted) and index == self.max_holders and not self._cancelled:
                # Everyone ahead of us was in the watched window and one of them is gone:
                # fewer than max_holders are ahead now (new contenders only ever queue
                # behind us), so we hold without re-reading the children — the handoff
                # costs one notification, not a notification plus a round trip.
                held = self._take()
                if held is not None:
                    return held
            children = self._retry(lambda: self.client.get_children(self.path), deadline)
            if children is None:
                return False

    def _take(self) -> bool | None:
        """Become the holder.  None if our session changed since the children were read."""
        with self._guard:
            if self._state != _WAITING:
                return False
            if self._session_lost():
                return None
            self._state = _HELD
            if not self.client.connected:
                # The connection dropped between the children reply and now: the listener
                # saw us still waiting, so start the suspension here.
                self._begin_suspension()
                if self.client.connected:
                    self.client.handler.spawn(self._verify)
                return True
        self._watch_own_node()
        return True

    def _watch_any(self, names: Sequence[str], wake) -> bool:
        """Set a data watch on each of ``names``.

        Returns True when one of them is already deleted.  ``wake`` is set when a watch
        fires; ``wake.deleted`` records that a watched node was deleted (not merely
        changed, nor a connection event).
        """

        def fired(event) -> None:
            if event.type == EventType.DELETED:
                wake.deleted = True
            wake.set()

        results = [self.client.get_async(f"{self.path}/{n}", watch=fired) for n in names]
        deleted = False
        for r in results:
            try:
                r.get()
            except NoNodeError:
                deleted = True
            except (*_RETRYABLE, SessionExpiredError):
                wake.set()  # re-read the children once connected again
        return deleted

    def _create(self, deadline: float | None) -> list[str] | None:
        """Create our node and return the children read right after it (one round trip).

        Handles a missing parent (created as a container) and ghost nodes.  Returns None
        when the deadline passes or the lock is cancelled before the node exists.
        """
        full_prefix = f"{self.path}/{self._prefix}"
        maybe_ghost = False
        while True:
            if self._cancelled:
                return None
            if not self._wait_connected(deadline):
                return None
            session = self._current_session()
            if maybe_ghost:
                found = self._adopt_ghost(session, deadline)
                if found is not None:
                    return found
                maybe_ghost = False
                continue
            parent = listed = None
            if self.path not in _RECENT and znodes.uses_containers(self.client):
                # A key we have not locked lately: its container probably does not exist
                # (they are reaped when empty), so create it in the same round trip.  The
                # children are not read here: on a new container our sequence says that
                # we are first (see _first_in_queue), which saves a request per new key.
                parent = znodes.create_container_async(self.client, self.path)
            created = self.client.create_async(
                full_prefix, self.identifier, ephemeral=True, sequence=True, include_data=True
            )
            if parent is None:
                listed = self.client.get_children_async(self.path)
            if parent is not None:
                try:
                    parent.get()
                except UnimplementedError:
                    # A server without containers (< 3.5.3): from now on persistent
                    # parents, deleted after release, so they do not accumulate.
                    znodes.mark_no_containers(self.client)
                except Exception:
                    pass  # exists already, or its ancestors do not: the create tells
            try:
                path, stat = created.get()
            except NoNodeError:
                _RECENT.discard(self.path)
                if listed is not None:
                    try:
                        listed.get()
                    except Exception:
                        pass
                self._retry(lambda: znodes.create_container(self.client, self.path), deadline)
                continue
            except _RETRYABLE:
                maybe_ghost = True
                self._sleep_until_connected(deadline)
                if self._expired(deadline):
                    # We must still clean up a possible ghost before giving up.
                    self._adopt_ghost(session, None, delete_only=True)
                    return None
                continue
            except (SessionExpiredError, ConnectionClosedError):
                if not self._wait_connected(deadline):
                    return None
                continue
            _RECENT.add(self.path)
            self._node = path.rsplit("/", 1)[1]
            self._token = stat.czxid
            self._session_id = session
            if listed is None and _first_in_queue(self._node):
                return [self._node]
            try:
                if listed is not None:
                    return listed.get()
            except _RETRYABLE:
                pass
            return self._retry(lambda: self.client.get_children(self.path), deadline)

    def _adopt_ghost(self, session: int | None, deadline: float | None, delete_only: bool = False):
        """After a lost create reply: adopt our node if our session owns it, else delete it.

        The key's container may be gone by now (the lost create failed, and the server
        reaped the then-empty container): then no node of ours can exist, nothing to adopt.
        """

        def children_or_none_left():
            try:
                return self.client.get_children(self.path)
            except NoNodeError:
                return []

        children = self._retry(children_or_none_left, deadline, forever=delete_only)
        if children is None:
            return None
        mine = [c for c in children if c.startswith(self._prefix)]
        keep = None
        for name in mine:
            full = f"{self.path}/{name}"
            stat = self._retry(lambda: self.client.exists(full), deadline, forever=delete_only)
            if stat is None:
                continue
            if not delete_only and keep is None and stat.ephemeralOwner == self._current_session():
                keep = (name, stat)
            else:
                self._delete(full)
        if keep is None:
            return None
        self._node, stat = keep
        self._token = stat.czxid
        self._session_id = self._current_session()
        return children

    def _current_session(self) -> int | None:
        # kazoo keeps the id across a reconnection and clears it when the session ends;
        # ``client_id`` would read None during SUSPENDED, which is not what we mean.
        return self.client._session_id

    def _session_lost(self) -> bool:
        return self._node is not None and self._session_id is not None and self._current_session() != self._session_id

    # ------------------------------------------------------------------ retries and waiting
    def _wait_connected(self, deadline: float | None) -> bool:
        if self.client.connected:
            return True
        self._sleep_until_connected(deadline)
        return self.client.connected and not self._cancelled

    def _sleep_until_connected(self, deadline: float | None) -> None:
        self._connected.clear()
        if self.client.connected:
            return
        self._connected.wait(self._remaining(deadline))

    def _retry(self, op: Callable, deadline: float | None, forever: bool = False):
        """Run ``op``, retrying through connection loss until ``deadline`` (or forever)."""
        while True:
            try:
                return op()
            except _RETRYABLE:
                if not forever and self._expired(deadline):
                    return None
                self._sleep_until_connected(None if forever else deadline)
                if self._cancelled and not forever:
                    return None
            except SessionExpiredError:
                # Our session ended while we waited: wait for kazoo's new session; the
                # caller notices the session change and queues again with a new node.
                if forever or self._expired(deadline):
                    return None
                self._sleep_until_connected(deadline)
                if self._cancelled:
                    return None
            except ConnectionClosedError:
                if forever:
                    return None
                raise

    def _delete(self, full: str) -> str:
        """Delete a node, retrying through connection loss until done or the session is gone.

        While the ensemble is unreachable kazoo cannot learn that the session expired, so
        after one session timeout we stop blocking the caller and leave a listener that
        deletes the node on the next reconnection of the same session (a node must never
        outlive its release just because the network blinked).
        """
        session = self._current_session()
        give_up = time.monotonic() + self.client._session_timeout / 1000.0 + 1.0
        retried = False
        while True:
            if self._current_session() != session:
                return _EXPIRED  # ephemeral nodes die with their session
            try:
                # Not client.delete(): while kazoo reconnects, a sync call waits for the
                # reconnection however long a partition lasts.  Bound the wait instead.
                self.client.delete_async(full).get(timeout=max(0.05, give_up - time.monotonic()))
                return _DELETED
            except self.client.handler.timeout_exception:
                _defer_delete(self.client, full, session)
                return _DEFERRED
            except NoNodeError:
                # On a retry in the same session, the node can only have gone by our own
                # earlier delete, whose reply the connection loss swallowed.
                return _DELETED if retried else _GONE
            except (SessionExpiredError, ConnectionClosedError):
                return _EXPIRED
            except NoAuthError:
                # The ACL changed under a held lock: the node stays until our session ends.
                raise znodes.no_auth_error(full, "deleting our lock node at release") from None
            except _RETRYABLE:
                retried = True
                if time.monotonic() >= give_up:
                    _defer_delete(self.client, full, session)
                    return _DEFERRED
                self._sleep_until_connected(min(give_up, time.monotonic() + 1.0))

    def _abandon(self, wait: bool = True) -> str | None:
        """Delete our node (if any) and go idle.  Used by release, timeout and errors.

        Returns the delete's outcome (``_DELETED``, ``_GONE``, ...), None without a node.
        """
        with self._guard:
            node = self._node
            session = self._session_id
            self._node = None
            self._token = None
            if self._state != _LOST:
                self._state = _IDLE
        outcome = None
        if node is not None and session != self._current_session():
            outcome = _EXPIRED
        elif node is not None:
            if wait:
                outcome = self._delete(f"{self.path}/{node}")
            else:
                self._delete_in_background(f"{self.path}/{node}")
            if not znodes.uses_containers(self.client):
                # Best effort and never waited for: the parent goes once its last child has.
                self.client.delete_async(self.path)
        self._unlisten()
        return outcome

    # ------------------------------------------------------------------ connection state
    def _listen(self) -> None:
        if not self._listening:
            self.client.add_listener(self._on_state)
            self._listening = True
        if self.client.connected:
            self._connected.set()

    def _unlisten(self) -> None:
        if self._listening:
            self.client.remove_listener(self._on_state)
            self._listening = False

    def _on_state(self, state: str) -> None:
        """kazoo state listener: flag, wake and hand off — never ZooKeeper I/O here."""
        with self._guard:
            if state == KazooState.SUSPENDED:
                self._connected.clear()
                if self._state == _HELD:
                    self._begin_suspension()
            elif state == KazooState.CONNECTED:
                self._connected.set()
                if self._state == _HELD and self._suspended:
                    self.client.handler.spawn(self._verify)
            elif state == KazooState.LOST:
                self._connected.clear()
                if self._state == _HELD:
                    self._mark_lost("ZooKeeper session expired")
        self._wake.set()

    def _begin_suspension(self) -> None:
        """Held lock, connection gone: unsafe until re-verified; lost past the grace."""
        self._suspended = True
        self._suspend_epoch += 1
        self.client.handler.spawn(self._expire_if_still_suspended, self._suspend_epoch)

    def _delete_in_background(self, full: str) -> None:
        def done(result) -> None:
            try:
                result.get()
            except NoNodeError:
                pass
            except (SessionExpiredError, ConnectionClosedError):
                pass
            except Exception:
                self.client.handler.spawn(self._delete, full)

        self.client.delete_async(full).rawlink(done)

    def _watch_own_node(self) -> None:
        """Learn at once if our node is deleted behind our back (operator, reaper, expiry).

        The request is not waited for: it costs no latency on the acquire path.
        """
        node, session = self._node, self._session_id

        def changed(event) -> None:
            if event.type == "DELETED" and self._node == node and self._session_id == session:
                self._mark_lost("lock node was deleted")

        def checked(result) -> None:
            try:
                missing = result.get() is None
            except Exception:
                return  # connection trouble: the state listener takes over
            if missing and self._node == node and self._session_id == session:
                self._mark_lost("lock node was deleted")

        self.client.exists_async(f"{self.path}/{node}", watch=changed).rawlink(checked)

    def _grace(self) -> float:
        if self.suspended_grace is not None:
            return self.suspended_grace
        return self.client._session_timeout / 1000.0 / 3.0

    def _expire_if_still_suspended(self, epoch: int) -> None:
        self.client.handler.sleep_func(self._grace())
        with self._guard:
            if self._state == _HELD and self._suspended and self._suspend_epoch == epoch:
                self._mark_lost("disconnected from ZooKeeper past the session-expiry safety margin")

    def _verify(self) -> None:
        """After a reconnection: still ours only if the node exists and our session owns it."""
        node, epoch = self._node, self._suspend_epoch
        if node is None or self._state != _HELD:
            return
        try:
            stat = self.client.exists(f"{self.path}/{node}")
        except _RETRYABLE:
            return  # still disconnected; the next CONNECTED re-verifies
        except (SessionExpiredError, ConnectionClosedError):
            self._mark_lost("ZooKeeper session expired")
            return
        if stat is not None and stat.ephemeralOwner == self._current_session() == self._session_id:
            with self._guard:
                # A newer suspension may have begun while exists() was in flight: then this
                # verdict is stale and that suspension's own verify/grace decides.
                if self._suspend_epoch != epoch or not self.client.connected or self._state != _HELD:
                    return
                self._suspended = False
            self._watch_own_node()  # kazoo dropped our watches when the connection broke
        else:
            self._mark_lost("lock node gone after reconnection")

    def _mark_lost(self, reason: str) -> None:
        with self._guard:
            if self._state != _HELD:
                return
            self._state = _LOST
            self._lost_reason = reason
            self._suspended = False
        cb = self.on_lost
        if cb is not None:
            self.client.handler.spawn(cb, self)


def _first_in_queue(name: str) -> bool:
    """True when our node's sequence proves that no other child was ever created before it.

    ZooKeeper names a sequential node after its parent's ``cversion``, the count of child
    creations and deletions the parent has seen.  A sequence of 0 therefore means the
    parent had never had a child when ours was created: every other contender, of any
    kind (ours, Curator's, kazoo's), queues behind us, and we hold without reading the
    children.  Any other number falls back to reading them.
    """
    return znodes.sequence_of(name) == 0


def _defer_delete(client: KazooClient, full: str, session: int | None) -> None:
    """Delete ``full`` on the next reconnection of ``session``; drop the task if it ended."""

    def on_state(state: str) -> bool:
        if client._session_id != session:
            return True  # session gone: the ephemeral node went with it
        if state == KazooState.CONNECTED:
            def run() -> None:
                try:
                    client.delete(full)
                except NoNodeError:
                    pass
                except Exception:  # retried by the next reconnection
                    client.add_listener(on_state)
            client.handler.spawn(run)
            return True
        return False

    client.add_listener(on_state)


def contenders(client: KazooClient, path: str, max_holders: int = 1) -> list[Contender]:
    """Holders and waiters on ``path`` in queue order (any of our, Curator's or kazoo's nodes)."""
    try:
        ordered = znodes.sort_contenders(client.get_children(path))
    except NoNodeError:
        return []
    pending = [(name, client.get_async(f"{path}/{name}")) for name in ordered]
    out = []
    for name, result in pending:
        try:
            data, _ = result.get()
        except NoNodeError:
            continue
        out.append(
            Contender(name, znodes.sequence_of(name) or 0, data.decode("utf-8", "replace"), len(out) < max_holders)
        )
    return out


class MultiLock:
    """Several lock paths taken all-or-nothing under one deadline.

    Paths are de-duplicated and taken in one canonical (sorted) order, so two
    ``MultiLock`` users asking for the same paths in opposite orders can never deadlock.
    If any path cannot be had in time, every path already taken is released.
    """

    def __init__(
        self,
        client: KazooClient,
        paths: Iterable[str],
        *,
        max_holders: int = 1,
        identifier: str | bytes | None = None,
        on_lost: Callable[[FairLock], None] | None = None,
        on_wait: Callable[[FairLock, int], None] | None = None,
    ) -> None:
        unique = sorted({znodes.validate_path(p) for p in paths})
        if not unique:
            raise ValueError("MultiLock needs at least one path")
        self.locks = [
            FairLock(client, p, max_holders=max_holders, identifier=identifier, on_lost=on_lost, on_wait=on_wait)
            for p in unique
        ]
        self.failed: FairLock | None = None

    @property
    def paths(self) -> list[str]:
        return [lk.path for lk in self.locks]

    @property
    def tokens(self) -> dict[str, int | None]:
        return {lk.path: lk.token for lk in self.locks}

    def acquire(self, timeout: float | None = None, blocking: bool = True) -> bool:
        deadline = None if timeout is None or not blocking else time.monotonic() + timeout
        taken: list[FairLock] = []
        self.failed = None
        try:
            for lk in self.locks:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not lk.acquire(timeout=0 if not blocking else left):
                    self.failed = lk
                    break
                taken.append(lk)
            else:
                return True
        except BaseException:
            for lk in reversed(taken):
                lk.release()
            raise
        for lk in reversed(taken):
            lk.release()
        return False

    def release(self, wait: bool = True) -> bool:
        """Release every path; True only if each was held (and, with ``wait``, to the end)."""
        released = [lk.release(wait) for lk in reversed(self.locks)]
        return all(released)

    def is_held(self) -> bool:
        return all(lk.is_held() for lk in self.locks)

    def ensure(self) -> None:
        for lk in self.locks:
            lk.ensure()

    def cancel(self) -> None:
        for lk in self.locks:
            lk.cancel()

    def __enter__(self) -> "MultiLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
