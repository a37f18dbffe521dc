"""One active ``celery beat`` among many, elected on ZooKeeper: ``-S celery_zklock.beat:ZkScheduler``.

:mod:`.scheduler` is the Celery glue, :mod:`.election` this beat's place in the queue,
:mod:`.ledger` the tick records and :mod:`.rules` the pure decisions.  docs/beat.md says
when to use it and how it compares with RedBeat's lock.
"""

from .scheduler import ZkScheduler, folder, group_path

__all__ = ["ZkScheduler", "folder", "group_path"]
