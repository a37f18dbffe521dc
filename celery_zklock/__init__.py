"""celery-zklock: fair ZooKeeper locks for Celery tasks.

The lock protocol lives in :mod:`celery_zklock.lock`, znode naming in
:mod:`celery_zklock.znodes`, test servers in :mod:`celery_zklock.testing`.
"""

from __future__ import annotations

from .errors import ConfigurationError, LockLost, LockTimeout, LockUnavailable, ZkLockError
from .lock import Contender, FairLock, MultiLock, contenders

__all__ = [
    "FairLock",
    "MultiLock",
    "Contender",
    "contenders",
    "ZkLockError",
    "ConfigurationError",
    "LockTimeout",
    "LockLost",
    "LockUnavailable",
]

__version__ = "0.1.0"

from .keys import encode_key  # noqa: E402
from .task import LOCK_WAITING, SKIPPED, HeldLock, ZkLockedTask, current_lock, lock_path  # noqa: E402

__all__ += ["ZkLockedTask", "HeldLock", "current_lock", "lock_path", "encode_key", "SKIPPED", "LOCK_WAITING"]
