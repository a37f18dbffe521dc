"""Custom task states of locked tasks, beside Celery's own (``celery.states``).

Why a module: the task (in-pool waiting) and the worker's main process (waiting in the
lock agent) both store them, and neither may import the other.
"""

SKIPPED = "SKIPPED"  # stored for a task skipped by on_lock_timeout="skip"
LOCK_WAITING = "LOCK_WAITING"  # stored while a task waits in the lock queue (monitoring only)
