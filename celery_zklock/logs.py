"""The library's loggers, named once.

Why two kinds: Celery's task logger prefixes each line with the running task's name and id,
and prints ``???[???]`` where no task runs (the worker's main process, its lock agent, beat).
So what is logged while a task runs goes to ``celery_zklock.task`` (a task logger), and every
other line to a plain ``celery_zklock.*`` logger (``celery.utils.log.get_logger``).  All are
under ``celery_zklock``, which a user's logging config can name.
"""

from __future__ import annotations

import logging

from celery.utils.log import get_task_logger

TASK_LOGGER = "celery_zklock.task"


def task_logger() -> logging.Logger:
    """The logger of code that runs inside a task (its lines name the task)."""
    return get_task_logger(TASK_LOGGER)
