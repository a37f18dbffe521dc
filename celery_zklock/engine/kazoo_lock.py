"""kazoo's lock interfaces on our locks: :class:`KazooLock` (kazoo's ``Lock``) on a
:class:`~celery_zklock.engine.lock.FairLock`, :class:`KazooReadLock` and :class:`KazooWriteLock`
(kazoo's ``ReadLock`` and ``WriteLock``) on the sides of a
:class:`~celery_zklock.engine.rwlock.ReadWriteLock`.

Why: a kazoo user switches with one import and keeps their code (``acquire`` raising
``LockTimeout``, ``cancel`` making a waiting acquire raise ``CancelledError``,
``contenders()`` as identifiers, ``is_acquired``), and gains what the FairLock under it
does: one deadline for the whole acquire, fencing tokens, exclusion with Curator's
``InterProcessMutex`` on the same path, and the release proof.  A wrapper of the lock, not
a subclass: the two interfaces disagree on return values and on re-entry, and each stays
true to its own.  kazoo's own lock tests run against them (``tests/engine/test_kazoo_suite.py``).
"""

from __future__ import annotations

from typing import Iterable

from kazoo.client import KazooClient
from kazoo.exceptions import CancelledError, LockTimeout

from ..errors import LockReentered
from .lock import FairLock
from .rwlock import ReadWriteLock
from .znodes import LOCK_MARKERS

__all__ = ["KazooLock", "KazooReadLock", "KazooWriteLock"]


class KazooLock:
    """``kazoo.recipe.lock.Lock``'s interface, semantics and exceptions, on a fair lock.

    As kazoo's: not re-entrant, and one instance may be shared by threads (each acquire
    waits for the instance's hold to end, then queues).  Where it differs, on purpose:

    - ``timeout`` bounds the whole acquire (kazoo waits up to ``timeout`` per wake-up);
    - a second acquire by the thread that holds returns False at once (kazoo waits out
      the timeout for a release that cannot come, or forever without one);
    - ``is_acquired`` turns False when the lock is lost (session expired, node deleted;
      kazoo keeps True), and ``release()`` returns False when our node turned out to be
      gone: the work done under the lock was not exclusive to the end;
    - no persistent locks: ``acquire(ephemeral=False)`` raises ValueError.

    ``reentrant=True`` (not in kazoo) makes the holding thread's acquire succeed at once
    instead, as ``FairLock`` does by default; each acquire then needs its release.
    """

    def __init__(self, client: KazooClient, path: str, identifier: str | None = None,
                 extra_lock_patterns: Iterable[str] = (), *, reentrant: bool = False) -> None:
        unknown = [p for p in extra_lock_patterns if p not in LOCK_MARKERS]
        if unknown:
            raise ValueError(
                f"extra_lock_patterns {unknown!r} not supported: {type(self).__name__} always orders the nodes "
                f"of kazoo's locks and Curator's ({', '.join(LOCK_MARKERS)}), and no others")
        # kazoo writes str(identifier or "") as the node's data: contenders() gives it back.
        self.data = str(identifier or "").encode("utf-8")
        self._fair = self._make_lock(client, path, self.data, reentrant)
        self._cancelled = False

    @staticmethod
    def _make_lock(client: KazooClient, path: str, identifier: bytes, reentrant: bool) -> FairLock:
        """The lock underneath (a subclass's: a side of a read/write lock)."""
        return FairLock(client, path, identifier=identifier, reentrant=reentrant)

    client = property(lambda self: self._fair.client)
    path = property(lambda self: self._fair.path)

    @property
    def fair_lock(self) -> FairLock:
        """The FairLock underneath: ``ensure()``, ``on_lost``, ``release(wait=False)``."""
        return self._fair

    @property
    def node(self) -> str | None:
        """Our node's name under ``path`` while we wait or hold (kazoo's ``node``)."""
        node = self._fair.node
        return node.rsplit("/", 1)[1] if node else None

    @property
    def is_acquired(self) -> bool:
        """Acquired and neither released nor lost (True while merely suspended)."""
        return self._fair.token is not None

    @property
    def is_held(self) -> bool:
        """Held with no reason for doubt: False while the connection is suspended."""
        return self._fair.is_held()

    @property
    def token(self) -> int | None:
        """Fencing token while held (from our node's czxid): larger for each later holder."""
        return self._fair.token

    @property
    def lost_reason(self) -> str | None:
        return self._fair.lost_reason

    def acquire(self, blocking: bool = True, timeout: float | None = None, ephemeral: bool = True) -> bool:
        """Wait for the lock (``blocking=False``: try once and return False if taken).

        Raises ``kazoo.exceptions.LockTimeout`` when a blocking acquire runs out of
        ``timeout``, ``CancelledError`` after :meth:`cancel`; our node is deleted first.
        """
        if not ephemeral:
            raise ValueError(
                "KazooLock has no persistent locks (ephemeral=False): a node that outlives its "
                "session holds the lock forever after a crash, and the fencing token and the "
                "release proof rest on the session; use kazoo's Lock for that")
        try:
            acquired = self._fair.acquire(timeout=timeout if blocking else 0)
        except LockReentered:
            return False  # the holding thread again: kazoo's Lock is not re-entrant
        if acquired:
            self._cancelled = False  # a cancel that raced the grant is spent, as kazoo's is
            return True
        if self._cancelled:
            self._cancelled = False
            raise CancelledError()
        if blocking:
            raise LockTimeout(f"Failed to acquire lock on {self.path} after {timeout} seconds")
        return False

    def release(self) -> bool:
        """Let go.  True if we held it to this moment; False if not acquired, or if our
        node was already gone (the lock had been lost: see ``lost_reason``)."""
        return self._fair.release()

    def cancel(self) -> None:
        """Make a waiting (or the next) acquire raise ``CancelledError``."""
        self._cancelled = True
        self._fair.cancel()

    def contenders(self) -> list[str]:
        """Identifiers of everyone queued on ``path``, holders first (kazoo's, Curator's too)."""
        return [c.identifier for c in self._fair.contenders()]

    def __enter__(self) -> "KazooLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.path} acquired={self.is_acquired} token={self.token}>"


class KazooReadLock(KazooLock):
    """``kazoo.recipe.lock.ReadLock``'s interface on the read side of a
    :class:`~celery_zklock.engine.rwlock.ReadWriteLock`: shared with every reader, held
    while no writer (nor mutex holder, of any peer) queues ahead of it.

    :class:`KazooLock`'s interface and its differences from kazoo's.  Its node is Curator's
    read node (``__READ__``); kazoo's ``ReadLock`` and ``WriteLock`` on the same path
    are ordered by it, and see it given ``extra_lock_patterns`` (docs/engine.md).
    ``contenders()`` lists everyone queued on the path, readers and writers, as kazoo's.
    """

    @staticmethod
    def _make_lock(client: KazooClient, path: str, identifier: bytes, reentrant: bool) -> FairLock:
        return ReadWriteLock(client, path, identifier=identifier, reentrant=reentrant).read


class KazooWriteLock(KazooLock):
    """``kazoo.recipe.lock.WriteLock``'s interface on the write side of a
    :class:`~celery_zklock.engine.rwlock.ReadWriteLock`: held alone, once everyone queued
    ahead of it (readers, writers, mutex holders, of any peer) has gone.

    :class:`KazooLock`'s interface and its differences from kazoo's.  Its node is Curator's
    write node (``__WRIT__``), which kazoo's ``ReadLock`` and ``WriteLock`` see given
    ``extra_lock_patterns`` (docs/engine.md).
    """

    @staticmethod
    def _make_lock(client: KazooClient, path: str, identifier: bytes, reentrant: bool) -> FairLock:
        return ReadWriteLock(client, path, identifier=identifier, reentrant=reentrant).write
