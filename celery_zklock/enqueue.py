"""The Celery side of enqueue-time singletons (``lock_enqueue``): publish under a guard.

Why at ``apply_async``: ``delay()``, signatures, beat and ``Task.retry`` all publish through
it, and it is the one place that can both refuse (``reject``) and return another task's
``AsyncResult`` without sending anything (``dedupe``).  The guard protocol itself lives in
:mod:`celery_zklock.engine.guards`; ending a guard at a task's start, finish, revocation or expiry
happens where the task's lock is decided (the worker's lock agent, or the pool process
that waits in process), and in the worker's main process for requests discarded unrun.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from typing import Any

from celery import signals as celery_signals
from celery.utils.log import get_logger

from . import config, metrics

from .engine import guards
from .engine.client import get_client
from .errors import AlreadyQueued, LockUnavailable

logger = get_logger("celery_zklock.enqueue")


def _expires_at(expires: Any, now: float) -> float:
    """``expires`` as Celery takes it (seconds, a datetime, or the ISO text a retry passes on)."""
    if isinstance(expires, str):
        from celery.utils.time import maybe_iso8601

        expires = maybe_iso8601(expires)
    if isinstance(expires, datetime.datetime):
        if expires.tzinfo is None:
            expires = expires.replace(tzinfo=datetime.timezone.utc)
        return expires.timestamp()
    return now + float(expires)


def publish(task, apply_async, args, kwargs, task_id, options: dict, opts) -> Any:
    """``task.apply_async`` under the task's enqueue guard (``opts.enqueue`` is set).

    ``apply_async`` is the plain publish (Celery's).  Returns its AsyncResult, or with
    ``dedupe`` the queued task's; raises :class:`AlreadyQueued` with ``reject``, and
    :class:`LockUnavailable` when ZooKeeper cannot decide (nothing is published then)."""
    from celery.utils import uuid

    args_t, kwargs_d = tuple(args or ()), dict(kwargs or {})
    keys = task.lock_keys(args_t, kwargs_d)
    by_path = {guards.guard_path(opts.root, task.name, k): k for k in keys}
    paths = sorted(by_path)
    task_id = task_id or uuid()
    request = task.request
    # Task.retry republishes the running task's id: never refused, by its own guard or another's.
    retrying = not request.called_directly and request.id == task_id
    retries = int(options.get("retries") or 0)
    now = time.time()
    expires = options.get("expires")
    if expires is None:
        expires = task.expires if task.expires is not None else opts.enqueue_expires
        options["expires"] = expires
    guard = guards.Guard(task_id, task.name, opts.enqueue_until, _expires_at(expires, now), retries, now)
    try:
        client = get_client(opts)
        taken = guards.take(client, paths, guard)
    except LockUnavailable:
        raise
    except Exception as exc:
        raise LockUnavailable(f"could not check the enqueue guard of {task.name} ({keys[0]!r}): {exc!r}; "
                              "nothing was published") from exc
    if taken.outcome == guards.HELD and not retrying:
        found_id = taken.found.id if taken.found else "?"
        key = by_path.get(taken.path, keys[0])
        if opts.enqueue == "reject":
            _event(task, "task-lock-rejected", key=key, queued=found_id)
            raise AlreadyQueued(key, found_id, task.name)
        _event(task, "task-lock-deduped", key=key, queued=found_id)
        return task.AsyncResult(found_id)
    mine = taken.outcome != guards.HELD  # a retry in the way of another's guard goes unguarded
    if mine:
        headers = dict(options.get("headers") or {})
        headers[guards.HEADER] = {"paths": paths, "until": opts.enqueue_until, "retries": retries}
        options["headers"] = headers
    try:
        return apply_async(args, kwargs, task_id=task_id, **options)
    except BaseException:
        if mine and taken.outcome == "taken":  # nothing was published: no guard may stay
            _quietly(guards.release, client, paths, task_id, retries)
        raise
    finally:
        if mine and task.app.conf.task_always_eager:
            _quietly(guards.release, client, paths, task_id, retries)  # the run is over


def _event(task, type_: str, **fields: Any) -> None:
    """Counted in the metrics, and a Celery event when publishers send them
    (``task_send_sent_event``, as Celery's own ``task-sent``)."""
    metrics.record(type_[len("task-lock-"):], task, **fields)
    logger.info("%s: %s %s", task.name, type_, fields)
    if not task.app.conf.task_send_sent_event:
        return
    try:
        with task.app.events.default_dispatcher() as dispatcher:
            dispatcher.send(type_, name=task.name, **fields)
    except Exception as exc:  # monitoring must never break a publish
        logger.debug("could not send %s: %r", type_, exc)


def _quietly(fn, *args) -> None:
    try:
        fn(*args)
    except Exception as exc:  # the message's expires still bounds the guard
        logger.warning("celery-zklock: enqueue guard not updated (%r); its message's expires bounds it", exc)


# ------------------------------------------------------------------ in the running process
def started(task, request, opts) -> None:
    """The guarded task starts in this process (it locked in process): end or move its guard."""
    header = guards.guarded(request)
    if header is not None:
        _quietly(lambda: guards.start(get_client(opts), header["paths"], request.id, int(header.get("retries") or 0),
                                      header["until"]))


def finished(task, request, opts) -> None:
    """It finished (or ended unrun): its running guard, or a guard it never moved, goes."""
    header = guards.guarded(request)
    if header is not None:
        retries = int(header.get("retries") or 0)
        _quietly(lambda: guards.release(get_client(opts), header["paths"], request.id, retries))


# ------------------------------------------------------------------ discarded unrun by a worker
def _discarded(sender=None, request=None, **_kw) -> None:
    """``task_revoked`` in the worker's main process (revoked, or expired): its guard ends.

    The main process does no ZooKeeper I/O (it forks the pool): the lock agent does it, or,
    waiting in the pool, a short-lived ``python -m celery_zklock.engine.guards`` helper."""
    header = guards.guarded(request) if request is not None else None
    if header is None:
        return
    job = {"paths": header["paths"], "id": request.id, "retries": int(header.get("retries") or 0)}
    from .worker import worker_queue

    if worker_queue.unguard(job):
        return
    task = getattr(request, "task", None)
    app = getattr(task, "app", None)
    if app is None:
        return
    try:
        wire = config.to_wire(config.cached_settings(app))
        helper = subprocess.Popen([sys.executable, "-m", "celery_zklock.engine.guards"], stdin=subprocess.PIPE,
                                  start_new_session=True, env=os.environ.copy())
        helper.stdin.write((json.dumps({**job, "settings": wire}) + "\n").encode())
        helper.stdin.close()
    except Exception as exc:
        logger.warning("celery-zklock: could not end the enqueue guard of %s (%r); its expires bounds it", request.id, exc)


celery_signals.task_revoked.connect(_discarded, weak=False)
