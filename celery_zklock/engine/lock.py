"""The blocking lock API: :class:`FairLock` and :class:`MultiLock` (Curator's ``InterProcessMutex``).

Why thin: the protocol lives in :mod:`celery_zklock.engine.internals`, which advances on ZooKeeper
callbacks and never blocks; these classes start an attempt and wait for its outcome in the
caller's thread, which is where user callbacks such as ``on_wait`` run.  Code that must
wait on many keys at once (one thread, thousands of locks) uses
:class:`~celery_zklock.engine.internals.LockInternals` directly.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Iterable

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionClosedError

from ..errors import LockLost, LockReentered
from . import clock, kazoo_compat, znodes
from .contenders import contenders
from .internals import LockInternals, State
from .owner import current_owner
from .session import DELETED, EXPIRED, GONE, ReleaseOutcome
from .znodes import Contender

if TYPE_CHECKING:
    from .attempt import Attempt

__all__ = ["FairLock", "MultiLock", "Contender", "contenders"]

LostCallback = Callable[["FairLock"], None]

DEFERRED = ReleaseOutcome.DEFERRED
_LOST_AT_RELEASE: dict[str | None, str] = {  # by ReleaseOutcome (a str), or None
    GONE: "lock node was already gone at release",
    EXPIRED: "ZooKeeper session expired before release",
    DEFERRED: "ZooKeeper unreachable at release for longer than the session timeout",
    None: "lock node was already gone at release",
}


class FairLock:
    """A fair, fenced, loss-aware ZooKeeper mutex (or N-holder semaphore) on ``path``.

    Re-entrant as Curator's ``InterProcessMutex``: the thread (or greenlet) that holds it
    may acquire it again, at once, and each acquire needs its release; the lock frees on
    the last one.  ``reentrant=False`` makes such a re-entry raise :class:`LockReentered`
    instead.  The owner is the thread or greenlet itself
    (:func:`~celery_zklock.engine.owner.current_owner`), never its id, which the runtime
    hands to later threads.  Another thread is not the owner: its acquire waits, as anyone
    else's would (one instance carries one hold, so it first waits for the owner to let go;
    create one ``FairLock`` per thread for each to queue in ZooKeeper at once — they may
    all share one started :class:`~kazoo.client.KazooClient`).

    An owner that ends while holding leaves its hold (and its node) in place until a
    release or the session's end: a later acquire from another thread waits for it like
    anyone else's, up to its deadline (a try-once returns False).  Any thread may release
    it; see :meth:`release`.

    ``on_lost(lock)`` is called, outside kazoo's connection thread, when a held lock is
    lost: session expired, our node deleted, or not verifiable after a reconnection.
    ``on_wait(lock, position)`` is called once per acquire, in the acquiring thread, when
    it has to queue.  ``suspended_grace`` (default: a third of the session timeout) is how
    long a held lock may stay disconnected before it is declared lost.
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
        reentrant: bool = True,
        kind: znodes.NodeKind = znodes.NodeKind.MUTEX,
    ) -> None:
        self.on_lost = on_lost
        self.on_wait = on_wait
        self.reentrant = reentrant
        self._owner: object | None = None  # current_owner() of the acquirer, from acquire to last release
        self._entries = 0  # the owner's acquires beyond the first, each owed a release
        self._free = threading.Condition()
        self._internals = LockInternals(
            client, path, max_holders, identifier, on_lost=self._lost if on_lost else None, suspended_grace=suspended_grace,
            kind=kind)
        self._attempt: Attempt | None = None
        self._cancelled = False

    # ------------------------------------------------------------------ state
    @property
    def client(self) -> KazooClient:
        return self._internals.client

    @property
    def path(self) -> str:
        return self._internals.path

    @property
    def max_holders(self) -> int:
        return self._internals.max_holders

    @property
    def identifier(self) -> bytes:
        """Our nodes' data."""
        return self._internals.identifier

    @property
    def kind(self) -> znodes.NodeKind:
        """What our nodes ask for: a mutex, a read or a write."""
        return self._internals.kind

    @property
    def state(self) -> State:
        return State.IDLE if self._attempt is None else self._attempt.state

    @property
    def token(self) -> int | None:
        """Fencing token (``znodes.fencing_token`` of our node's czxid) while held, else None."""
        a = self._attempt
        return a.token if a is not None and a.state in (State.HELD, State.HELD_SUSPENDED) else None

    @property
    def node(self) -> str | None:
        """Full path of our lock node while we wait or hold."""
        a = self._attempt
        node = a.node if a is not None else None
        return f"{self.path}/{node}" if node else None

    @property
    def lost_reason(self) -> str | None:
        return None if self._attempt is None else self._attempt.lost_reason

    @property
    def locks(self) -> list["FairLock"]:
        """``[self]``: a FairLock is a MultiLock of one path, for code that handles both."""
        return [self]

    @property
    def _suspended(self) -> bool:
        return self.state is State.HELD_SUSPENDED

    def is_held(self) -> bool:
        """True only while we hold the lock and the connection gives no reason to doubt it.

        False while SUSPENDED (the server may already have expired our session), and for
        good after LOST.  No I/O: cheap enough to call before every fenced write.
        """
        return self.state is State.HELD

    def owned_by_caller(self) -> bool:
        """Is the calling thread (or greenlet) this instance's owner: it acquired and has not
        released, whether the hold is live or was lost meanwhile?"""
        return self._owner is current_owner()

    def held_by_caller(self) -> bool:
        """Does the calling thread (or greenlet) own a live hold of this instance (Curator's
        ``isOwnedByCurrentThread``)?  No I/O."""
        return self._owner is current_owner() and self.state in (State.HELD, State.HELD_SUSPENDED)

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless :meth:`is_held`."""
        if not self.is_held():
            reason = self.lost_reason or ("connection suspended" if self._suspended else "not held")
            raise LockLost(self.path, reason)

    def cancel(self) -> None:
        """Make a pending (or the next) :meth:`acquire` give up and return False."""
        self._cancelled = True
        if self._attempt is not None:
            self._attempt.cancel()

    # ------------------------------------------------------------------ acquire / release
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
        if kazoo_compat.is_stopped(self.client):
            raise ValueError("the KazooClient is not started (or was stopped): call client.start() before acquiring")
        if kazoo_compat.closed_for_good(self.client):
            raise ConnectionClosedError("the KazooClient stopped connecting for good (its authentication failed, or its "
                                        "connection_retry ran out): lock with a new client")
        deadline = None if timeout is None else clock.monotonic() + timeout
        me = current_owner()  # held by reference and compared by identity: never recycled
        if self._owner is me:
            if self._entries == 0 and self.state in (State.IDLE, State.LOST):
                # Its hold ended, lost, without a release: a new one.  A hold lost by its
                # grace (cut off too long) may still have its node, at the head of the queue,
                # if the session survived: it goes first, or we would queue behind it.
                if self._attempt is not None:
                    self._attempt.release()
                self._let_go_of_ownership()
            else:
                return self._reenter()
        if not self._take_ownership(me, deadline):
            return False
        try:
            acquired = self._acquire(deadline)
        except BaseException:
            self._let_go_of_ownership()
            raise
        if not acquired:
            self._let_go_of_ownership()
        return acquired

    def _reenter(self) -> bool:
        """The owner acquires again (Curator's re-entry): count it, or refuse at once."""
        if self.state in (State.CREATING, State.WAITING):  # from an on_wait callback
            raise RuntimeError(f"FairLock on {self.path} is already {self.state.value} in this thread")
        if not self.reentrant:
            raise LockReentered(self.path, f"this FairLock (token {self.token}, node {self.node})")
        if self.state not in (State.HELD, State.HELD_SUSPENDED):  # lost under an outer hold: say so now
            raise LockLost(self.path, self.lost_reason or "not held")
        self._entries += 1
        return True

    def _take_ownership(self, me: object, deadline: float | None) -> bool:
        """Another thread's hold on this instance ends first (bounded by the deadline)."""
        with self._free:
            while self._owner is not None:
                left = None if deadline is None else deadline - clock.monotonic()
                if left is not None and left <= 0:
                    return False
                self._free.wait(left)
            self._owner = me
            return True

    def _let_go_of_ownership(self) -> None:
        with self._free:
            self._owner, self._entries = None, 0
            self._free.notify()

    def _acquire(self, deadline: float | None) -> bool:
        if self._cancelled:
            self._cancelled = False
            return False
        handler = self.client.handler
        wake = handler.event_object()
        position: list[int] = []

        def queued(index: int) -> None:
            position.append(index)
            wake.set()

        attempt = self._attempt = self._internals.attempt(deadline, on_wait=queued if self.on_wait else None)
        if self._cancelled:  # cancel() came as the attempt started: it reached the previous one
            attempt.cancel()
        try:
            if self.on_wait is not None:
                kazoo_compat.on_ready(attempt.result, lambda _result: wake.set())
                while not attempt.result.ready():
                    wake.wait()
                    wake.clear()
                    if position:
                        self.on_wait(self, position.pop())  # in the caller's thread, as documented
            # Waiting on the result itself: its set() wakes us directly, where a rawlink
            # callback would first pass through kazoo's completion queue (one hop more).
            acquired: bool = attempt.result.get()
        except BaseException:
            attempt.cancel()
            if attempt.state in (State.HELD, State.HELD_SUSPENDED):
                # Granted as the exception landed (an on_wait callback, a KeyboardInterrupt):
                # nobody will own this hold, so its node goes now.
                attempt.release()
            self._settle(attempt)
            raise
        finally:
            self._cancelled = False
        if not acquired:
            self._settle(attempt)
        return acquired

    def _settle(self, attempt: Attempt) -> None:
        """After giving up: wait (bounded) for the delete of our node, as a caller expects
        an acquire that returned False to have left nothing behind."""
        if attempt.cleanup is not None:
            try:
                attempt.cleanup.get(timeout=kazoo_compat.session_timeout(self.client) + 1.0)
            except Exception:
                pass  # still retried in the background until the session ends

    def release(self, wait: bool = True) -> bool:
        """Let go: delete our node, retrying through connection loss until done.

        With ``wait=True`` (the default) the delete's reply is also the proof that the lock
        was held *until this moment*: our node still existed, so our session never expired
        and nobody else could have held it.  If the delete finds the node already gone
        (session expired while the process was frozen or partitioned, node deleted by an
        operator) the lock is marked lost (``lost_reason`` says why) and this returns
        False — work done under it was not exclusive to the end.  While ZooKeeper is
        unreachable the wait is bounded by the session timeout + 1 s; the delete then goes
        on in the background at each reconnection of the same session.

        ``wait=False`` pipelines the release: the delete is sent and this returns without
        waiting for the reply (the next waiter is woken by the same delete either way).
        The delete is still guaranteed.  Only use it while the process keeps its client open.

        Returns True if a held lock was released (with ``wait=True``: and proven held to
        the end); False if there was nothing to release (never acquired, already released,
        already lost) or, with ``wait=True``, if the node turned out to be gone.

        Any thread may call it, not only the owner (as kazoo's ``Lock`` and
        ``threading.Lock`` allow; Curator's ``InterProcessMutex`` raises): the hold counts
        acquires and releases, whoever makes them, so a re-entered hold still needs one
        release per acquire.  Why not raise: a hold whose owner ended without releasing
        must be releasable before its session ends, and callers release from a helper
        thread to bound a release while ZooKeeper is unreachable (the fault tests do).
        """
        if self._entries > 0:  # a re-entry's release: the outermost hold goes on
            self._entries -= 1
            return self.is_held()
        attempt = self._attempt
        if attempt is None:
            return False
        if self._owner is not None:
            self._let_go_of_ownership()
        was_held, pending = attempt.release()
        if not was_held or not wait:
            return bool(was_held)
        if pending is None or isinstance(pending, str):
            outcome = pending
        else:
            try:
                outcome = pending.get(timeout=kazoo_compat.session_timeout(self.client) + 1.0)
            except self.client.handler.timeout_exception:
                outcome = DEFERRED
        if outcome != DELETED:
            attempt.unproven_at_release(_LOST_AT_RELEASE.get(outcome, _LOST_AT_RELEASE[None]))
            return False
        return True

    def _lost(self) -> None:  # given to LockInternals only with an on_lost
        if self.on_lost is not None:
            self.on_lost(self)

    def contenders(self) -> list[Contender]:
        """Every contender on this path in queue order, with identifiers and holder flag."""
        return contenders(self.client, self.path, self.max_holders)

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<FairLock {self.path} {self.state.value} token={self.token}>"


class MultiLock:
    """Several lock paths taken all-or-nothing under one deadline.

    Paths are de-duplicated and taken in one canonical (sorted) order, so two
    ``MultiLock`` users asking for the same paths in opposite orders can never deadlock.
    ``read_paths`` are taken for reading (shared with readers), the rest alone, with nodes
    of the ``exclusive`` kind (Curator's mutex names, or its read/write lock's writer's).
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
        reentrant: bool = True,
        read_paths: Iterable[str] = (),
        exclusive: znodes.NodeKind = znodes.NodeKind.MUTEX,
    ) -> None:
        unique = sorted({znodes.validate_path(p) for p in paths})
        if not unique:
            raise ValueError("MultiLock needs at least one path")
        reads = set(read_paths)
        self.locks = [
            FairLock(client, p, max_holders=max_holders, identifier=identifier, on_lost=on_lost, on_wait=on_wait,
                     reentrant=reentrant, kind=znodes.NodeKind.READ if p in reads else exclusive)
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
        deadline = None if timeout is None or not blocking else clock.monotonic() + timeout
        taken: list[FairLock] = []
        self.failed = None
        try:
            for lk in self.locks:
                left = None if deadline is None else max(0.0, deadline - clock.monotonic())
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

    def __exit__(self, *exc: object) -> None:
        self.release()
