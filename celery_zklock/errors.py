"""Exceptions raised by celery-zklock.

Kept apart so the lock engine, the Celery glue and user code can import them without
pulling in Celery or kazoo state.
"""

from __future__ import annotations


class ZkLockError(Exception):
    """Base class of every celery-zklock error."""


class ConfigurationError(ZkLockError, ValueError):
    """A setting, task option or ``lock_key`` template is invalid; the message says what to fix."""


class LockTimeout(ZkLockError):
    """The lock could not be had within the timeout.

    ``key`` is the lock key (or keys) and ``holders`` the identifiers of whoever held it
    when we gave up, so "who holds the lock?" is answered in the error itself: ``None`` when
    they could not be read, empty when none was left by the time they were read.
    """

    def __init__(self, key: object = None, timeout: float | None = None, holders: list[str] | None = None) -> None:
        self.key = key
        self.timeout = timeout
        self.holders = None if holders is None else list(holders)
        # args are the constructor's: Celery's JSON result backend rebuilds cls(*args).
        super().__init__(key, timeout, self.holders)

    def __str__(self) -> str:
        if self.holders is None:
            held_by = "its holders could not be read"
        elif not self.holders:
            held_by = "no holder was left when they were read"
        else:
            held_by = "held by: " + ", ".join(self.holders)
        return f"lock {self.key!r} not acquired within {self.timeout}s ({held_by})"


class LockLost(ZkLockError):
    """The lock was held and is no longer (session expired, node deleted, or unverifiable).

    Raised instead of letting work continue silently without mutual exclusion.
    """

    def __init__(self, key: object = None, reason: str = "lock lost") -> None:
        self.key = key
        self.reason = reason
        super().__init__(key, reason)

    def __str__(self) -> str:
        return f"lock {self.key!r} lost: {self.reason}"


class LockReentered(ZkLockError, RuntimeError):
    """A re-entry where re-entry is turned off (``FairLock(reentrant=False)``, the task
    option ``lock_reentrant=False``): raised at once, never after waiting for itself.

    ``key`` is the lock key (or path) and ``holder`` says who in this thread holds it.
    """

    def __init__(self, key: object = None, holder: str | None = None) -> None:
        self.key = key
        self.holder = holder
        super().__init__(key, holder)

    def __str__(self) -> str:
        return (f"lock {self.key!r} is already held in this thread by {self.holder or 'its caller'}, and re-entry "
                "is turned off (lock_reentrant=False / FairLock(reentrant=False)): waiting would wait for itself")


class LockUpgradeRefused(ZkLockError, RuntimeError):
    """The holder of a read lock asked for its write lock: refused at once.  Why: its own read
    node queues ahead of the writer's node it would create, so the write would wait for
    itself; and two readers upgrading would each wait for the other.  Release the read lock
    first, or take the write lock first and read under it (a downgrade)."""

    def __init__(self, key: object = None) -> None:
        self.key = key
        super().__init__(key)

    def __str__(self) -> str:
        return (f"lock {self.key!r}: the read lock's holder may not take its write lock (an upgrade waits for "
                f"itself, and two upgrading readers for each other); release the read lock first, or take "
                f"the write lock first and read under it")


class LockUnavailable(ZkLockError):
    """ZooKeeper could not be reached, so the task was not run (never run unprotected)."""


class AlreadyQueued(ZkLockError):
    """A publish refused by ``lock_enqueue="reject"``: a task of the same key is queued
    (or, with ``lock_enqueue_until="finish"``, running).  ``key`` and ``task_id`` (the one in
    the way) say which; ``AsyncResult(task_id)`` follows it."""

    def __init__(self, key: str, task_id: str, task: str = "") -> None:
        self.key = key
        self.task_id = task_id
        self.task = task
        super().__init__(f"{task or 'a task'} with lock key {key!r} is already queued as {task_id}")

    def __reduce__(self):
        return (type(self), (self.key, self.task_id, self.task))
