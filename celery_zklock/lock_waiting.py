"""What a locked task says while it waits for its lock, wherever it waits.

Why one place: a task waits in the process that runs it (``acks_late``, threads/gevent
pools, eager ``apply()``, a pool process that could not claim) or in the worker's main
process (held aside while the lock agent queues for it), and a monitor must read the same
either way: the ``task-lock-waiting`` event, the ``LOCK_WAITING`` state (only where
:func:`~celery_zklock.states.stores_waiting`) and the ``zklock_waiting`` gauge, counted once
per wait.  Each place brings only how it sends an event, stores a state and logs
(:class:`Waiter`): the task's own in its process, Celery's ``Request`` in the main process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from celery.utils.log import get_logger

from . import metrics
from .logs import task_logger
from .states import LOCK_WAITING, stores_waiting


@dataclass(frozen=True)
class Waiter:
    """A task waiting for its lock, and how its waiting is told where it waits."""

    task: Any
    task_id: str | None
    label: Any  # the key, or the keys of a multi-key lock: as events name it
    send_event: Callable[..., Any]  # (type, **fields)
    store_state: Callable[[str, dict], Any] | None  # (state, meta); None: no state is stored for this wait
    log: logging.Logger

    @classmethod
    def running(cls, task, label: Any, direct: bool, send_event: Callable[..., Any]) -> "Waiter":
        """A task waiting in the process that runs it (``send_event``: how it sends its
        ``task-lock-*`` events); a direct call stores no state."""
        req = task.request
        store = None if direct or not req.id else (lambda state, meta: task.update_state(state=state, meta=meta))
        return cls(task, req.id, label, send_event, store, task_logger())

    @classmethod
    def held_aside(cls, req) -> "Waiter":
        """A request (Celery's worker ``Request``) held aside in the worker's main process
        while its lock agent queues for it."""
        keys = req.task.lock_keys(tuple(req.args or ()), dict(req.kwargs or {}))

        def store(state: str, meta: dict) -> None:
            req.task.backend.store_result(req.id, meta, state)

        return cls(req.task, req.id, keys[0] if len(keys) == 1 else keys, req.send_event, store,
                   get_logger("celery_zklock.worker"))


def record(waiter: Waiter, position: Any, first: bool) -> None:
    """Say that ``waiter`` waits at ``position`` in its lock's queue; ``first``: its wait
    begins here (counted in the gauge; :func:`ended` takes it out).  Monitoring only:
    nothing here may fail the task."""
    if first:
        metrics.record("waiting", waiter.task)
    try:
        waiter.send_event("task-lock-waiting", key=waiter.label, position=position)
        if waiter.store_state is not None and stores_waiting(waiter.task):
            waiter.store_state(LOCK_WAITING, {"key": waiter.label, "position": position})
    except Exception as exc:
        waiter.log.warning("could not record that task %s waits for lock %s: %r", waiter.task_id, waiter.label, exc)


def ended(task) -> None:
    """A wait counted by :func:`record` ended (held, given up or failed): out of the gauge."""
    metrics.record("waited", task)
