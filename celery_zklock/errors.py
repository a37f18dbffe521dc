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
    when we gave up, so "who holds the lock?" is answered in the error itself.
    """

    def __init__(self, key: object, timeout: float | None, holders: list[str] | None = None) -> None:
        self.key = key
        self.timeout = timeout
        self.holders = list(holders or [])
        held_by = ", ".join(self.holders) if self.holders else "unknown"
        super().__init__(f"lock {key!r} not acquired within {timeout}s (held by: {held_by})")

    def __reduce__(self):  # keep the fields across pickling (Celery result backends)
        return (type(self), (self.key, self.timeout, self.holders))


class LockLost(ZkLockError):
    """The lock was held and is no longer (session expired, node deleted, or unverifiable).

    Raised instead of letting work continue silently without mutual exclusion.
    """

    def __init__(self, key: object, reason: str = "lock lost") -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"lock {key!r} lost: {reason}")

    def __reduce__(self):
        return (type(self), (self.key, self.reason))


class LockUnavailable(ZkLockError):
    """ZooKeeper could not be reached, so the task was not run (never run unprotected)."""
