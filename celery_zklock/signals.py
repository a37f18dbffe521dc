"""Signals a locked task sends, in Celery's own style (``celery.utils.dispatch.Signal``).

Why signals besides events: events reach Flower only with ``-E`` and cross the broker;
a signal is an in-process hook for metrics, tracing and test harnesses (the Celery
compatibility harness counts acquisitions with them).  Receivers run in the process that
runs the task: connect them at import time so prefork children inherit them.  A receiver
that raises is logged by Celery and never affects the task.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_released", "lock_timed_out"]

lock_acquired = Signal(
    name="zklock_lock_acquired",
    providing_args={"task_id", "key", "paths", "token", "wait"},
)
lock_acquired.__doc__ = """Sent when a task holds its lock, just before its body runs (sender: the task)."""

lock_released = Signal(
    name="zklock_lock_released",
    providing_args={"task_id", "key", "paths", "proven"},
)
lock_released.__doc__ = """Sent after the body, once the lock is let go (sender: the task).

``proven`` is True when the release proved the lock was held to the end (our node still
existed when deleted); False means the run is reported as ``LockLost``.
"""

lock_timed_out = Signal(
    name="zklock_lock_timed_out",
    providing_args={"task_id", "key", "holders", "wait", "policy"},
)
lock_timed_out.__doc__ = """Sent when a task's lock was not had within ``lock_timeout``, just before
its ``on_lock_timeout`` policy applies (sender: the task).  ``policy`` is ``"retry"``,
``"skip"`` or ``"fail"``; ``holders`` the holders' identifiers, or None if they could not be
read.  A skipped run ends SUCCESS with the result None: this signal (or the
``task-lock-timeout`` event) is how a receiver tells it from a run that returned None.
"""
