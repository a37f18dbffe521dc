"""A fair read/write lock: :class:`ReadWriteLock` (Curator's ``InterProcessReadWriteLock``).

Readers of a path share it, a writer has it alone, in one FIFO queue: a reader waits only
for the exclusive nodes queued ahead of it (:func:`~celery_zklock.engine.driver.reader_gets_the_lock`),
a writer for everyone ahead (:func:`~celery_zklock.engine.driver.gets_the_lock`), so a stream
of readers never starves a writer: readers that come after it queue behind it.  Both sides
are :class:`~celery_zklock.engine.lock.FairLock` s, with its interface, fencing and loss
detection; their nodes carry Curator's names (``__READ__``, ``__WRIT__``), and every peer's
node on the path is ordered (docs/engine.md, "Read/write locks").

Re-entry as Curator's: the write holder may take the read lock (a downgrade), a read holder
may not take the write lock (:class:`~celery_zklock.errors.LockUpgradeRefused`).  Where it
differs, on purpose: Curator's downgraded read is a new node, behind any writer that queued
while it wrote, and that writer holds as soon as the write node goes, beside the read; here
the read is carried by the write node, which stays until both are released, so no writer
slips in (readers behind wait for it, too).
"""

from __future__ import annotations

from typing import Any, Callable

from kazoo.client import KazooClient

from ..errors import LockUpgradeRefused
from .lock import FairLock
from .znodes import NodeKind

__all__ = ["ReadLock", "ReadWriteLock", "WriteLock"]


class WriteLock(FairLock):
    """The write side: exclusive, and the carrier of its holder's reads (a downgrade).

    While reads ride on its hold (``carried``), a release of the write ends the write
    (``is_held()`` and ``token`` turn False and None) and leaves the node in the queue for
    them; the last of them deletes it.  The holder may take the write again meanwhile: its
    node never left the head of the queue, so nobody came between.
    """

    def __init__(self, client: KazooClient, path: str, **options: Any) -> None:
        super().__init__(client, path, kind=NodeKind.WRITE, **options)
        self.read_side: ReadLock | None = None  # set by ReadWriteLock: the upgrade it refuses
        self.carried = 0  # read holds on our node
        self._write_ended = False  # released as a write, the node kept for the carried reads

    def carries_for_caller(self) -> bool:
        """Does the caller hold our node (as a write, or downgraded to reads)?"""
        return super().held_by_caller()

    def held_by_caller(self) -> bool:
        return super().held_by_caller() and not self._write_ended

    def is_held(self) -> bool:
        return super().is_held() and not self._write_ended

    @property
    def token(self) -> int | None:
        return None if self._write_ended else super().token

    def acquire(self, timeout: float | None = None, blocking: bool = True) -> bool:
        if self.read_side is not None and self.read_side.owned_by_caller():
            # Held, or lost without its release (its node may still queue ahead of ours).
            raise LockUpgradeRefused(self.path)
        if (self._write_ended or self.carried) and self.owned_by_caller():
            if self.carries_for_caller():
                if self._write_ended:
                    self._write_ended = False  # the write again, on the node that never left
                    return True
            else:
                self._lose_carried()  # the node went (lost) with the reads it carried: a new hold
        # Another thread waits for our owner's hold to end, downgraded reads included.
        return super().acquire(timeout, blocking)

    def _lose_carried(self) -> None:
        """The node carrying our downgraded reads is lost: they are, too.  Their releases
        then say so (False), and none of them may delete a later node of ours."""
        self._write_ended, self.carried = False, 0
        if self.read_side is not None:
            self.read_side.drop_carried()

    def release(self, wait: bool = True) -> bool:
        if self._write_ended:
            return False  # released already; the node waits for the reads
        if self.carried and self._entries == 0 and self._owner is not None:
            self._write_ended = True
            return self.node_held()
        return super().release(wait)

    def carry_read(self) -> None:
        self.carried += 1

    def node_held(self) -> bool:
        """Is our node held, for the write or for the reads it carries?"""
        return super().is_held()

    def node_token(self) -> int | None:
        return super().token

    def end_read(self, wait: bool = True) -> bool:
        """A carried read's release: the last one after the write's deletes the node."""
        self.carried -= 1
        if self.carried or not self._write_ended:
            return self.node_held()
        self._write_ended = False
        return super().release(wait)


class ReadLock(FairLock):
    """The read side: shared with every reader, exclusive of writers.  The write side's
    holder reads under its write node (``carried``); anyone else queues a read node."""

    def __init__(self, client: KazooClient, path: str, write_side: WriteLock, **options: Any) -> None:
        super().__init__(client, path, kind=NodeKind.READ, **options)
        self._write_side = write_side
        self._carried = 0  # our holds that ride on the write node

    def acquire(self, timeout: float | None = None, blocking: bool = True) -> bool:
        if self._write_side.carries_for_caller():
            self._write_side.carry_read()
            self._carried += 1
            return True
        return super().acquire(timeout, blocking)

    def release(self, wait: bool = True) -> bool:
        if self._carried:
            self._carried -= 1
            return self._write_side.end_read(wait)
        return super().release(wait)

    def drop_carried(self) -> None:
        """The write node our carried reads rode on is lost (see WriteLock._lose_carried)."""
        self._carried = 0

    @property
    def node(self) -> str | None:
        if self._carried:
            return self._write_side.node
        return super().node

    def is_held(self) -> bool:
        if self._carried:
            return self._write_side.node_held()
        return super().is_held()

    @property
    def token(self) -> int | None:
        if self._carried:
            return self._write_side.node_token()
        return super().token

    @property
    def lost_reason(self) -> str | None:
        if self._carried:
            return self._write_side.lost_reason
        return super().lost_reason


class ReadWriteLock:
    """A read/write lock on ``path``: ``.read`` and ``.write``, each a fair, fenced,
    loss-aware lock with :class:`~celery_zklock.engine.lock.FairLock`'s interface.

    One instance per thread that locks, as with ``FairLock``; instances may share a started
    client.  Options (``identifier``, ``on_lost``, ``on_wait``, ``suspended_grace``,
    ``reentrant``) apply to both sides.
    """

    def __init__(self, client: KazooClient, path: str, *, identifier: str | bytes | None = None,
                 on_lost: Callable[[FairLock], None] | None = None,
                 on_wait: Callable[[FairLock, int], None] | None = None, suspended_grace: float | None = None,
                 reentrant: bool = True) -> None:
        options = dict(identifier=identifier, on_lost=on_lost, on_wait=on_wait, suspended_grace=suspended_grace,
                       reentrant=reentrant)
        self.write = WriteLock(client, path, **options)
        self.read = ReadLock(client, path, self.write, **options)
        self.write.read_side = self.read

    path = property(lambda self: self.write.path)
    client = property(lambda self: self.write.client)

    def __repr__(self) -> str:
        return f"<ReadWriteLock {self.path} read={self.read.state.value} write={self.write.state.value}>"
