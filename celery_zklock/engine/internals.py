"""The lock protocol, event-driven (Curator's ``LockInternals``): one :class:`Attempt` per acquire.

Why event-driven: an attempt advances only on ZooKeeper callbacks — a create or children
reply, a watch firing, a connection-state change from the client's
:class:`~celery_zklock.engine.session.SessionMonitor`, a timer — and never blocks.  So one
process can wait on thousands of keys with no thread per waiter; the blocking
:class:`~celery_zklock.engine.lock.FairLock` is a thin wrapper that waits for the outcome.

Protocol: each contender creates an EPHEMERAL_SEQUENTIAL child ``_c_<uuid>-lock-<seq>``;
the ``max_holders`` lowest sequences hold (:func:`~celery_zklock.engine.driver.gets_the_lock`
decides).  A reader's child is ``_c_<uuid>-__READ__<seq>`` and a read/write lock's writer's
``_c_<uuid>-__WRIT__<seq>`` (Curator's names): a reader holds while no exclusive node queues
ahead of it (:func:`~celery_zklock.engine.driver.reader_gets_the_lock`).  One acquisition is :class:`~celery_zklock.engine.attempt.Attempt`, read
top to bottom; this module holds what stays the same across a lock's attempts.

The fencing token is derived from our node's ``czxid``
(:func:`~celery_zklock.engine.znodes.fencing_token`): zxids are totally ordered, so a later
holder's token is larger, even if the parent was deleted and recreated.
"""

from __future__ import annotations

import uuid
from typing import Callable

from kazoo.client import KazooClient

from . import kazoo_compat, znodes
from .attempt import RECENT, Attempt, State
from .driver import Decision, gets_the_lock, reader_gets_the_lock
from .identity import Identity
from .session import SessionMonitor, monitor_for, session_margin

__all__ = ["Attempt", "LockInternals", "RECENT", "State"]


class LockInternals:
    """What stays the same across a lock's attempts: where, how many holders, who we are."""

    def __init__(self, client: KazooClient, path: str, max_holders: int = 1, identifier: str | bytes | None = None,
                 on_lost: Callable[[], None] | None = None, suspended_grace: float | None = None,
                 watch_when_run: bool = False, kind: znodes.NodeKind = znodes.NodeKind.MUTEX) -> None:
        if not isinstance(client, KazooClient):
            raise ValueError(f"client must be a kazoo KazooClient, got {type(client).__name__}")
        if isinstance(max_holders, bool) or not isinstance(max_holders, int) or max_holders < 1:
            raise ValueError(f"max_holders must be an int >= 1, got {max_holders!r}")
        if kind is znodes.NodeKind.READ and max_holders != 1:
            raise ValueError(f"a reader shares the lock with every reader: max_holders must be 1, got {max_holders!r}")
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
        # The own-node watch starts when a task runs under the hold (HoldWatch.running), not
        # at the grant: the agent's grants may wait for a free pool process (issue 39).
        self.watch_when_run = watch_when_run
        self.monitor: SessionMonitor = monitor_for(client)
        self.kind = kind
        self.prefix = znodes.node_prefix(uuid.uuid4().hex, kind)
        self._attempts = 0

    def decide(self, children, node: str) -> Decision:
        """The driver's rule for our kind of node: a reader's, or the holders' window."""
        if self.kind is znodes.NodeKind.READ:
            return reader_gets_the_lock(children, node)
        return gets_the_lock(children, node, self.max_holders)

    def grace(self) -> float:
        if self.suspended_grace is not None:
            return self.suspended_grace
        return session_margin(kazoo_compat.session_timeout(self.client))

    def attempt(self, deadline: float | None, on_wait: Callable[[int], None] | None = None,
                on_next: Callable[[], None] | None = None) -> "Attempt":
        """Start an acquisition; ``attempt.result`` resolves to True (held) or False.

        ``on_wait(position)`` is called once if the attempt has to queue, ``on_next()`` once
        when it is next in line (every node ahead of it is a holder: the first release makes
        it a holder, without another read).  They, and callbacks linked to ``attempt.result``
        with :func:`~celery_zklock.engine.kazoo_compat.on_ready`, run on kazoo's completion
        thread: none may block (no I/O waits), since they share that thread with every lock.

        Each attempt after the first gets a fresh node prefix: a node that an earlier,
        abandoned attempt is still cleaning up must never be adopted as this one's ghost.
        """
        if self._attempts:
            self.prefix = znodes.node_prefix(uuid.uuid4().hex, self.kind)
        self._attempts += 1
        attempt = Attempt(self, self.prefix, on_wait, on_next)
        attempt.start(deadline)
        return attempt
