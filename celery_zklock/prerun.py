"""One meaning for ``task_prerun`` around a lock wait: it fires once the lock is decided.

Why: Celery's tracer sends ``task_prerun`` just before it calls the task, and a locked task
may wait for its lock in different places — before the pool process gets the request (the
worker's lock agent), or inside the call itself (waiting in the pool, ``acks_late``,
threads/gevent pools, eager ``apply()``).  Left alone, prerun would mean "before the wait"
in some places and "after it" in others, and everything that reads it would be wrong
somewhere: a timing dashboard (prerun -> postrun) would count the wait as run time, a DB
session opened in prerun would be held idle through the wait, a tracing span would start
at a time that depends on where the task happened to wait.

So for a locked task the tracer's ``task_prerun`` is held back in the running thread (or
greenlet) and sent by ``ZkLockedTask.__call__`` at the moment the lock is decided: just
before the body runs with the lock held, or just before a timeout/unavailable policy is
applied (so prerun and postrun stay paired, as tracing integrations expect).  The wait is
never inside prerun -> postrun, wherever it happened; the wait itself is on
``current_lock().wait`` and in the ``task-lock-acquired`` event.

This patches one module global of Celery's tracer (``celery.app.trace.send_prerun``,
looked up at each call); without it (another Celery layout) prerun keeps Celery's own
timing and nothing else changes.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

_held: contextvars.ContextVar[tuple[Any, dict] | None] = contextvars.ContextVar("celery_zklock_prerun", default=None)
_send: Callable[..., Any] | None = None


def _defers(sender: Any) -> bool:
    return bool(getattr(sender, "_zklock_defers_prerun", False))


def _send_prerun(sender: Any = None, **named: Any) -> Any:
    if _send is None or not _defers(sender):
        return (_send or (lambda **_: []))(sender=sender, **named)
    _held.set((sender, named))
    return []


def install() -> bool:
    """Hold back the tracer's prerun for locked tasks (idempotent).  False where Celery's
    tracer has no ``send_prerun`` to wrap."""
    global _send
    try:
        from celery.app import trace
    except ImportError:  # pragma: no cover - Celery is a dependency
        return False
    current = getattr(trace, "send_prerun", None)
    if current is None:
        return False
    if current is not _send_prerun:
        _send = current
        trace.send_prerun = _send_prerun
    return True


def fire(task: Any) -> None:
    """Send ``task``'s held-back prerun now, if one is held for its current request (once)."""
    held = _held.get()
    if held is None:
        return
    sender, named = held
    if sender is not task or named.get("task_id") != getattr(task.request, "id", None):
        return
    _held.set(None)
    if _send is not None:
        _send(sender=sender, **named)
