"""This beat's place in its group's election: a fair lock on the group's path, whose holder is
the active scheduler.

Why a :class:`~celery_zklock.engine.lock.FairLock`: it already is a FIFO queue of ephemeral
nodes that tells its holder when the node is gone (session expired, deleted) and doubts it
while disconnected; standbys wait in creation order and the next one leads as soon as the
leader's node goes, within the session timeout of its death.  The waiting happens on a
thread of its own, so beat's loop never blocks on ZooKeeper.
"""

from __future__ import annotations

import threading
import time
from enum import Enum
from typing import Callable

from celery.utils.log import get_logger
from kazoo.client import KazooClient

from ..engine import kazoo_compat
from ..engine.client import disconnect
from ..engine.lock import FairLock
from ..errors import LockUnavailable

logger = get_logger("celery.beat.zklock")
#: How often (s) a beat that keeps failing to join its election says so (ZooKeeper's own
#: outage and its end are logged once each, by engine.client.OutageLog).
REFUSED_EVERY = 60.0


class Role(Enum):
    LEADER = "leader"
    STANDBY = "standby"
    LEFT = "left"  # this beat left the election: it is shutting down


class Election:
    """Joins the queue at ``path`` (connecting first, again and again while ZooKeeper is
    unreachable) and tells ``on_change(role, reason)`` when this beat leads or stops leading."""

    def __init__(self, connect: Callable[[], KazooClient], path: str, identity: bytes,
                 on_change: Callable[[Role, str], None], backoff: Callable[[int], float]) -> None:
        self.path = path
        self.client: KazooClient | None = None
        self._connect = connect
        self._identity = identity
        self._on_change = on_change
        self._backoff = backoff
        self._lock: FairLock | None = None
        self._term = 0  # counts this beat's terms as leader; 0 until the first
        self._leading = threading.Event()
        self._ended = threading.Event()  # the current term ended (lost, deposed)
        self._reason = ""
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zklock-beat-election", daemon=True)

    def start(self, client: KazooClient | None = None) -> None:
        """Run; ``client``: one already connected (the start-up check made it)."""
        self.client = client
        self._thread.start()

    # ------------------------------------------------------------------ what the scheduler reads
    def term(self) -> int | None:
        """The current term's number while this beat leads, else None."""
        return self._term if self._leading.is_set() else None

    def held(self) -> bool:
        """Leading, and the connection gives no reason to doubt it (no I/O)."""
        lock = self._lock
        return self._leading.is_set() and lock is not None and lock.is_held()

    @property
    def node(self) -> str | None:
        lock = self._lock
        return lock.node if lock is not None else None

    @property
    def token(self) -> int:
        lock = self._lock
        return (lock.token or 0) if lock is not None else 0

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` for leadership; True when leading."""
        return self._leading.wait(timeout)

    def wait_closed(self, timeout: float) -> bool:
        """Block up to ``timeout`` for this beat to leave the election; True once it has."""
        return self._closed.wait(timeout)

    def node_if_held(self) -> str | None:
        """Our election node while :meth:`held`, read from one term's lock (two reads of
        ``held()`` and ``node`` could mix a term's hold with the next term's waiting node)."""
        lock = self._lock
        return lock.node if self._leading.is_set() and lock is not None and lock.is_held() else None

    def step_down(self, reason: str, lock: FairLock | None = None, node: str | None = None) -> None:
        """End the term now (its node is gone); the thread queues again.  ``lock`` or ``node``:
        the term this word is about.  A term's end is often told twice (the node's watch, then
        a tick write that found it gone): a late word about an ended term is ignored, or it
        would end the next term at once."""
        current = self._lock
        if (lock is not None and lock is not current) or (node is not None and (current is None or
                                                                                current.node != node)):
            return
        self._reason = reason
        self._leading.clear()
        self._ended.set()

    def close(self) -> None:
        """Leave the election: a leader's node is deleted at once, so a standby leads now."""
        self._closed.set()
        self._leading.clear()
        self._ended.set()
        lock = self._lock
        if lock is not None:
            lock.cancel()
        self._thread.join(5.0)
        if self.client is not None:
            disconnect(self.client)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        failures = 0
        said_at = -REFUSED_EVERY  # joining fails (an outage): said at most once a REFUSED_EVERY
        while not self._closed.is_set():
            dead = self.client is not None and kazoo_compat.closed_for_good(self.client)
            if dead and not failures:
                # Its authentication failed (or a connection dropped mid-SASL-handshake):
                # kazoo never connects it again.  A new one is checked as at start, and takes
                # its place once connected (the scheduler reads the client meanwhile).
                logger.warning("beat: zklock: the ZooKeeper client stopped connecting for good; connecting a new one")
            if self.client is None or dead:
                try:
                    old, self.client = self.client, self._connect()
                    failures = 0
                    if old is not None:
                        disconnect(old)
                except LockUnavailable as exc:
                    delay = self._backoff(failures)
                    failures += 1
                    logger.error("beat: zklock: %s; standing by (sending nothing), next try in %.1fs", exc, delay)
                    self._closed.wait(delay)
                    continue
            lock = self._lock = FairLock(self.client, self.path, identifier=self._identity, reentrant=False,
                                         on_lost=lambda lk: self.step_down(f"lost the election node: {lk.lost_reason}",
                                                                           lock=lk))
            self._ended.clear()  # before the acquire: a loss right after it must end the term it starts
            self._reason = ""
            try:
                held = lock.acquire()
            except Exception as exc:  # unavailable, refused: say so (not every second), wait, queue again
                if time.monotonic() - said_at >= REFUSED_EVERY:
                    said_at = time.monotonic()
                    logger.error("beat: zklock: cannot join the election at %s: %s; standing by (sending nothing), "
                                 "trying again every %.0fs (said again in %.0fs if it still fails)", self.path, exc,
                                 self._backoff(0), REFUSED_EVERY)
                self._closed.wait(self._backoff(0))
                continue
            if not held or self._closed.is_set():
                lock.release()
                continue
            self._term += 1
            self._leading.set()
            self._on_change(Role.LEADER, f"token {lock.token}")
            while not self._ended.wait(1.0):
                pass
            self._leading.clear()
            if self._closed.is_set():
                lock.release()
                self._on_change(Role.LEFT, "shutting down")
                return
            self._on_change(Role.STANDBY, self._reason or "stepped down")
            lock.release(wait=False)
