"""celery-zklock: fair ZooKeeper locks for Celery tasks.

Layers (see the README's Architecture): the lock protocol in :mod:`celery_zklock.engine`
(the blocking API in :mod:`celery_zklock.engine.lock`), what runs in a worker in
:mod:`celery_zklock.worker`, the Celery glue at the top (:mod:`celery_zklock.task`,
:mod:`celery_zklock.enqueue`), settings in :mod:`celery_zklock.config`, test servers in
:mod:`celery_zklock.testing`.

Names are imported on first use (PEP 562): the worker-loss reaper
(:mod:`celery_zklock.worker.reaper`) runs in a fresh interpreter on the critical path of a lock
handoff and must not pay for importing Celery.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "FairLock": "engine.lock",
    "MultiLock": "engine.lock",
    "KazooLock": "engine.kazoo_lock",
    "KazooReadLock": "engine.kazoo_lock",
    "KazooWriteLock": "engine.kazoo_lock",
    "ReadWriteLock": "engine.rwlock",
    "Contender": "engine.lock",
    "contenders": "engine.lock",
    "ZkLockError": "errors",
    "ConfigurationError": "errors",
    "LockTimeout": "errors",
    "LockLost": "errors",
    "LockUnavailable": "errors",
    "LockReentered": "errors",
    "LockUpgradeRefused": "errors",
    "AlreadyQueued": "errors",
    "encode_key": "keys",
    "ZkLockedTask": "task",
    "HeldLock": "task",
    "current_lock": "task",
    "lock_path": "task",
    "lock_configured_tasks": "task",
    "SKIPPED": "states",
    "LOCK_WAITING": "states",
}

# Spelled out, for type checkers and linters (which do not run code); the same names as
# _EXPORTS and the imports under TYPE_CHECKING below (tests/test_packaging.py).
__all__ = [
    "FairLock", "MultiLock", "KazooLock", "KazooReadLock", "KazooWriteLock", "ReadWriteLock", "Contender",
    "contenders", "ZkLockError", "ConfigurationError", "LockTimeout", "LockLost", "LockUnavailable", "LockReentered",
    "LockUpgradeRefused", "AlreadyQueued", "encode_key", "ZkLockedTask", "HeldLock", "current_lock", "lock_path",
    "lock_configured_tasks", "SKIPPED", "LOCK_WAITING",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # declared once, in pyproject.toml; read on first use (no import cost)
        from importlib.metadata import PackageNotFoundError, version

        try:
            globals()[name] = value = version("celery-zklock")
        except PackageNotFoundError as exc:  # a source tree on sys.path, never installed
            raise AttributeError("celery_zklock.__version__: the celery-zklock distribution is not installed") from exc
        return value
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_zklock' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS, "__version__"})


if TYPE_CHECKING:
    __version__: str
    from .engine.kazoo_lock import KazooLock, KazooReadLock, KazooWriteLock
    from .engine.lock import Contender, FairLock, MultiLock, contenders
    from .engine.rwlock import ReadWriteLock
    from .errors import (
        AlreadyQueued,
        ConfigurationError,
        LockLost,
        LockReentered,
        LockTimeout,
        LockUnavailable,
        LockUpgradeRefused,
        ZkLockError,
    )
    from .keys import encode_key
    from .states import LOCK_WAITING, SKIPPED
    from .task import HeldLock, ZkLockedTask, current_lock, lock_configured_tasks, lock_path
