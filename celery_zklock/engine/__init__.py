"""The lock engine: a fair ZooKeeper lock (and semaphore) with no Celery in it.

Why a layer of its own: the protocol — sequential ephemeral nodes, watches on the
predecessor, sessions, fencing tokens — is what Curator and kazoo peers interoperate with, and
it is tested and benchmarked on its own (``FairLock`` against kazoo's ``Lock``).  It imports
only the base modules (errors, settings, keys); the worker side and the Celery glue build on
it, never the other way round (``tests/test_structure.py``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Imported on first use (PEP 562), as the package's own names are: importing one engine
# module (the worker-loss reaper's path) must not import the blocking API with it.
_EXPORTS = {"FairLock": "lock", "MultiLock": "lock", "KazooLock": "kazoo_lock", "KazooReadLock": "kazoo_lock",
            "KazooWriteLock": "kazoo_lock", "ReadWriteLock": "rwlock"}

# Spelled out, for type checkers and linters (which do not run code); the same names as
# _EXPORTS and the imports under TYPE_CHECKING below (tests/test_packaging.py).
__all__ = ["FairLock", "MultiLock", "KazooLock", "KazooReadLock", "KazooWriteLock", "ReadWriteLock"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_zklock.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .kazoo_lock import KazooLock, KazooReadLock, KazooWriteLock
    from .lock import FairLock, MultiLock
    from .rwlock import ReadWriteLock
