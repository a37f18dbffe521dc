"""Custom task states of locked tasks, beside Celery's own (``celery.states``).

Why a module: the task (in-pool waiting) and the worker's main process (waiting in the
lock agent) both store them, and neither may import the other.
"""

#: Stored by earlier versions for a run skipped by on_lock_timeout="skip"; no longer stored (a
#: skipped run ends SUCCESS with the result None, so Celery's APIs see it finished), kept so
#: imports and results stored before still read.
SKIPPED = "SKIPPED"
LOCK_WAITING = "LOCK_WAITING"  # stored while a task waits in the lock queue (monitoring only)


def stores_waiting(task) -> bool:
    """Is ``LOCK_WAITING`` stored for ``task`` when it has to wait?

    Only when the task tracks its start (``track_started`` / ``task_track_started``), as
    Celery stores ``STARTED`` only then: it is one more result-backend write per waiting
    task, made in the worker's main process, and on a hot key every task waits (on the
    flash sale it cost about a tenth of the throughput).  The ``task-lock-waiting`` event,
    the log line and the ``zklock_waiting`` gauge are kept for every task."""
    return bool(getattr(task, "track_started", False)) and not task.ignore_result
