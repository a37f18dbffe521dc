"""Lock tasks by configuration (``zklock_tasks``), without changing their code.

Why a registry swap at worker start: a task is locked by its class (``ZkLockedTask.__call__``
runs around the body, and its request class frees a dead pool process's lock), so a task
we cannot edit — a ``shared_task`` of a reusable app, ``celery.backend_cleanup``, a task
whose base is already taken — gets a subclass of *both* ``ZkLockedTask`` and its own class,
with the configured options, registered under the same name.  Everything that looks the
task up by name then sees the locked one: the worker's strategies, the pool processes
(forked later), waiting in the worker's lock agent, ``apply()`` through the registry, the
same policies, events and ``current_lock()``.  ``task_annotations`` could set lock options
but cannot change a task's class, so it cannot make an unlocked task locked.

It is installed by importing ``celery_zklock`` anywhere in the worker — which Celery does
itself for every ``celery`` command, through our ``celery.commands`` entry point (the
``celery zklock`` CLI) — and runs when the worker starts (``worker_init``, before the settings and every locked
task are validated: a bad entry stops the worker) or when
``celery_zklock.lock_configured_tasks(app)`` is called (a producer that runs tasks eagerly).  A task object imported before the swap
and called directly (``sync_account(...)``) is the original, unlocked one.
"""

from __future__ import annotations

import difflib
import fnmatch
from typing import Any

from .config import load_settings
from .errors import ConfigurationError
from .options import LOCK_OPTIONS, is_locked_task, suggest_option


def lock_tasks(app, base: type) -> list[str]:
    """Replace every task matched by ``zklock_tasks`` with a subclass of ``base``
    (``ZkLockedTask``) and of its own class; returns the names.

    Raises ConfigurationError naming the pattern or task and what to fix: a pattern that
    matches no registered task, an unknown option, a ``lock_key`` field that is not a
    parameter, or a task that is a ZkLockedTask already (its options belong in one place)."""
    entries = load_settings(app.conf).tasks
    if not entries:
        return []
    registered = sorted(app.tasks)
    plan: dict[str, dict[str, Any]] = {}
    for pattern, options in entries:
        options = dict(options)
        for name in options:
            if name not in LOCK_OPTIONS:
                meant = suggest_option(name)
                hint = f" Did you mean {meant!r}?" if meant else ""
                raise ConfigurationError(f"zklock_tasks[{pattern!r}]: unknown lock option {name!r}.{hint} "
                                         f"Known: {', '.join(LOCK_OPTIONS)}")
        matched = [n for n in registered if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            close = difflib.get_close_matches(pattern, [n for n in registered if not n.startswith("celery.")] or registered,
                                              n=3, cutoff=0.5)
            hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
            raise ConfigurationError(f"zklock_tasks: {pattern!r} matches no registered task.{hint} (Patterns are "
                                     "task names or fnmatch globs such as 'proj.billing.*'.)")
        for name in matched:
            plan.setdefault(name, {}).update(options)  # later entries refine earlier ones
    for name, options in plan.items():
        _lock(app, name, options, base)
    return sorted(plan)


def _lock(app, name: str, options: dict[str, Any], base: type) -> None:
    task = app.tasks[name]
    if is_locked_task(task):
        if getattr(type(task), "_zklock_by_config", False):
            return  # already swapped (a second call)
        raise ConfigurationError(f"zklock_tasks: task {name!r} is a ZkLockedTask already; set its lock options "
                                 "in one place (its decorator or zklock_tasks), not both")
    original = type(task)
    attrs: dict[str, Any] = {
        "name": name,
        "__module__": original.__module__,
        "__doc__": original.__doc__,
        "_zklock_by_config": True,
        **options,
    }
    if "run" in original.__dict__:
        attrs["run"] = original.__dict__["run"]  # so the lock_key template is checked against it
    cls = type(original.__name__, (base, original), attrs)  # base.__init_subclass__ checks options and lock_key
    locked = cls()
    try:
        locked.__qualname__ = getattr(task, "__qualname__", original.__qualname__)
    except AttributeError:
        pass
    app._tasks[name] = locked
    locked.bind(app)
