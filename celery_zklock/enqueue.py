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


def _instant(value: Any, app, now: float) -> float | None:
    """``expires`` or ``eta`` as Celery takes it (seconds from now, a datetime, or the ISO text
    a retry passes on) as ``time.time()``; a naive datetime read as the worker reads it."""
    if value is None:
        return None
    if isinstance(value, str):
        from celery.utils.time import maybe_iso8601

        value = maybe_iso8601(value)
    if isinstance(value, datetime.datetime):
        from celery.utils.time import maybe_make_aware

        return maybe_make_aware(value, app.conf.timezone).timestamp()  # as celery.worker.request does
    return now + float(value)


#: The options by which Celery's canvas makes a publish part of more work: a chain's step (its
#: rest; ``[]`` for the last step, whose result the chain's caller waits for), a chord's header,
#: a group's member, and a callback (Celery's trace publishes a task's one ``link`` with the
#: task's result as its argument and ``parent_id`` set; a plain ``delay``, even inside a task,
#: has no ``parent_id`` yet: ``send_task`` adds it later).  With ``link``/``link_error``, what
#: a publish is never deduped for.
CONTINUATIONS = ("chain", "chord", "group_id", "parent_id")


def publish(task, apply_async, args, kwargs, task_id, options: dict, opts, link=None, link_error=None) -> Any:
    """``task.apply_async`` under the task's enqueue guard (``opts.enqueue`` is set).

    ``apply_async`` is the plain publish (Celery's), which sends ``link``/``link_error``.
    Returns its AsyncResult, or with ``dedupe`` the queued task's; raises :class:`AlreadyQueued`
    with ``reject``, and :class:`LockUnavailable` when ZooKeeper cannot decide within
    ``zklock_connect_timeout`` (nothing is published then) — except for a retry, which is
    never dropped.  A publish that carries more work (callbacks, a chain's rest, a group or
    chord membership) is never deduped: the queued task carries none of it."""
    from celery.utils import uuid

    _check_arguments(task, args, kwargs)
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
    # No expires is added to the message: the guard's staleness is the guard's, counted from
    # the message's ETA, so neither a countdown nor a backlog discards the task (issue 40).
    eta = options.get("eta")
    if eta is None and options.get("countdown") is not None:
        eta = float(options["countdown"])
    expires = options.get("expires", task.expires)
    bound = guards.bound(now, _instant(eta, task.app, now), _instant(expires, task.app, now), opts.enqueue_expires)
    guard = guards.Guard(task_id, task.name, opts.enqueue_until, bound, retries, now)
    header = {"paths": paths, "until": opts.enqueue_until, "retries": retries}
    carried = _carried(options, link, link_error)
    # Sent even if another's guard is in the way: not a publish deduped into it.
    sent_anyway = retrying or (bool(carried) and opts.enqueue == "dedupe")
    try:
        client = get_client(opts)
        taken = guards.take(client, paths, guard, timeout=opts.connect_timeout, count=not sent_anyway)
    except Exception as exc:
        if retrying:
            # Task.retry turns a failed publish into Reject(requeue=False): the task would be
            # gone.  Sent without a new guard instead: its old one names this id (publishes
            # dedupe into the retry), and the retry's run ends it (Guard.ended_by).
            logger.warning("%s[%s]: retry published without checking its enqueue guard (%r)", task.name, task_id, exc)
            return apply_async(args, kwargs, task_id=task_id, **_with_header(options, header))
        if isinstance(exc, LockUnavailable):
            raise
        raise LockUnavailable(f"could not check the enqueue guard of {task.name} ({keys[0]!r}): {exc!r}; "
                              "nothing was published") from exc
    if taken.outcome is guards.TakeOutcome.HELD and not retrying:
        found_id = taken.found.id if taken.found else "?"
        key = by_path.get(taken.path or "", keys[0])  # a HELD result names its path
        if opts.enqueue == "reject":
            _event(task, "task-lock-rejected", key=key, queued=found_id)
            raise AlreadyQueued(key, found_id, task.name)
        if not carried:
            _event(task, "task-lock-deduped", key=key, queued=found_id)
            return task.AsyncResult(found_id)
        # Deduped, its callbacks or its chain's, group's or chord's rest would never run (or
        # would wait for good): sent unguarded instead, as a retry in the way is; a second run.
        logger.info("%s[%s]: not deduped into %s (queued for %r): it carries %s", task.name, task_id, found_id, key,
                    ", ".join(carried))
    # A retry or a publish carrying more work in the way of another's guard goes unguarded: not
    # with the header a retry copies from its request (the old try's, which may guard its run,
    # "finish", or name other paths).  A retry's run still ends any older guard of its own ("start").
    mine = taken.outcome is not guards.TakeOutcome.HELD
    sent: dict[str, Any] | None = header
    if not mine:
        sent = {**header, "until": "start"} if retrying else None
    options = _with_header(options, sent)
    try:
        result = apply_async(args, kwargs, task_id=task_id, **options)
    except BaseException:
        # Nothing was published (or the broker's answer was lost: then the next publish may
        # queue a duplicate, the README's one window for this): no guard may stay.
        if mine and taken.outcome is guards.TakeOutcome.TAKEN:
            _quietly(guards.release, client, paths, task_id, retries)
        raise
    if mine and task.app.conf.task_always_eager:
        _quietly(guards.release, client, paths, task_id, retries)  # the run is over
    elif mine:
        # Publishers that found it waiting may now dedupe into it.  Unconfirmed (we died, or
        # ZooKeeper went), it goes stale after guards.PUBLISH_WINDOW: a duplicate at worst.
        _quietly(guards.confirm, client, taken, guard, opts.connect_timeout)
    return result


def _with_header(options: dict, header: dict | None) -> dict:
    """``options`` with the guard header set to ``header``, or without one (None)."""
    headers = dict(options.get("headers") or {})
    headers.pop(guards.HEADER, None)
    if header is not None:
        headers[guards.HEADER] = header
    return {**options, "headers": headers}


def _carried(options: dict, link, link_error) -> list[str]:
    """What a publish carries besides its own run (:data:`CONTINUATIONS`, callbacks): deduped,
    the queued task would run without it, and a chain, group or chord would wait for good."""
    carried = [name for name, value in (("link", link), ("link_error", link_error)) if value]
    return carried + [name for name in CONTINUATIONS if options.get(name) is not None]


def _check_arguments(task, args, kwargs) -> None:
    """Celery's own check of the call's arguments (``Task.apply_async`` with ``task.typing``),
    before the guard: a deduped publish never reaches Celery's, and a bad call must raise
    TypeError all the same, not return the queued task's result."""
    check = getattr(task, "__header__", None) if task.typing else None
    if check is not None:
        check(*(args or ()), **(kwargs or {}))


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
    except Exception as exc:  # the guard's own bound still ends it
        logger.warning("celery-zklock: enqueue guard not updated (%r); its bound ends it", exc)


#: Marks a task republished by ``lock_enqueue_unrun="republish"``: it is not republished again.
REPUBLISHED = "zklock_republished"


def unrun(task, request, gone: list, why: str, opts) -> None:
    """A guarded task ended without running: say how much deduped work went with it
    (a WARNING, the event ``task-lock-unrun``, the metric ``zklock_enqueue_unrun_deduped_total``)
    and, with ``lock_enqueue_unrun="republish"``, publish it once more."""
    deduped = sum(g.deduped for g in gone)
    if not deduped:
        return
    logger.warning("celery-zklock: %s[%s] ended unrun (%s); %d publish(es) deduped into it went with it",
                   task.name, request.id, why, deduped)
    metrics.record("unrun", task, deduped=deduped)
    if task.app.conf.worker_send_task_events and request.hostname:
        try:
            task.send_event("task-lock-unrun", why=why, deduped=deduped)
        except Exception as exc:  # monitoring must never break the task
            logger.debug("could not send task-lock-unrun: %r", exc)
    if opts.enqueue_unrun == "republish" and not (getattr(request, "headers", None) or {}).get(REPUBLISHED):
        _republish(task, request)


def _republish(task, request) -> None:
    """The deduped work, once: a new task with the same arguments and queue (never an
    error in the ending task: its own outcome stands)."""
    try:
        routing = {k: v for k, v in task.signature_from_request(request).options.items()
                   if k in ("queue", "exchange", "routing_key", "priority") and v is not None}
        again = task.apply_async(request.args, request.kwargs, headers={REPUBLISHED: True}, **routing)
        logger.warning("celery-zklock: %s[%s] republished as %s for the work deduped into it", task.name, request.id, again.id)
    except Exception as exc:
        logger.error("celery-zklock: could not republish %s[%s] (%r): its deduped work is lost", task.name, request.id, exc)


# ------------------------------------------------------------------ in the running process
def started(task, request, opts) -> None:
    """The guarded task starts in this process (it locked in process): end or move its guard.
    Raises :class:`LockUnavailable` when that cannot be done: the body must not run."""
    header = guards.guarded(request)
    if header is None:
        return
    try:
        guards.start(get_client(opts), header["paths"], request.id, int(header.get("retries") or 0),
                     header["until"], timeout=opts.connect_timeout)
    except LockUnavailable:
        raise
    except Exception as exc:
        raise LockUnavailable(f"could not end the enqueue guard of {task.name}[{request.id}] at its start: {exc!r}") from exc


def finished(task, request, opts, ran: bool = True, why: str = "") -> None:
    """It finished (or ended unrun): its running guard, or a guard it never moved, goes.
    A release ZooKeeper refuses now is tried again in the background (:func:`_later`), and
    the unrun step follows it there: the count of the work deduped into it comes with it."""
    header = guards.guarded(request)
    if header is None:
        return
    retries = int(header.get("retries") or 0)

    def ended(gone: list) -> None:
        if not ran:
            unrun(task, request, gone, why, opts)

    try:
        gone = guards.release(get_client(opts), header["paths"], request.id, retries, timeout=opts.connect_timeout)
    except Exception as exc:
        logger.warning("celery-zklock: enqueue guard of %s not ended (%r); trying again in the background", request.id, exc)
        _later(task, request, opts, header["paths"], retries, ended)
        return
    ended(gone)


def _later(task, request, opts, paths: list[str], retries: int, then, every: float = 1.0) -> None:
    """Keep trying a guard's release off the task's thread until it goes or its bound would
    end it anyway (a guard left in place swallows every publish for its key); then ``then``
    with the guards that went, under the task's request (it is per thread)."""
    import threading

    def loop() -> None:
        deadline = time.monotonic() + opts.enqueue_expires
        while time.monotonic() < deadline:
            time.sleep(every)
            try:
                gone = guards.release(get_client(opts), paths, request.id, retries, timeout=opts.connect_timeout)
            except Exception:
                continue
            task.push_request(vars(request))
            try:
                then(gone)
            finally:
                task.pop_request()
            return

    threading.Thread(target=loop, name="zklock-guard-release", daemon=True).start()


# ------------------------------------------------------------------ discarded unrun by a worker
def _discarded(sender=None, request=None, **_kw) -> None:
    """``task_revoked`` in the worker's main process (revoked, or expired): its guard ends.

    The main process does no ZooKeeper I/O (it forks the pool): the lock agent does it, or,
    waiting in the pool, a short-lived ``python -m celery_zklock.engine.guards`` helper."""
    header = guards.guarded(request) if request is not None else None
    if header is None:
        return
    job = {"paths": header["paths"], "id": request.id, "retries": int(header.get("retries") or 0)}
    from .worker import wait_outside_pool

    if wait_outside_pool.unguard(job):
        return
    # The sender is the task; the request's ``task`` is only its name (Celery's Context).
    app = getattr(sender, "app", None)
    if app is None:
        from celery import current_app

        found = current_app.tasks.get(getattr(request, "task", None))
        app = found.app if found is not None else None
    if app is None:
        logger.warning("celery-zklock: could not end the enqueue guard of %s (no app for %r); its expires bounds it",
                       request.id, sender)
        return
    try:
        wire = config.to_wire(config.cached_settings(app))
        helper = subprocess.Popen([sys.executable, "-m", "celery_zklock.engine.guards"], stdin=subprocess.PIPE,
                                  start_new_session=True, env=os.environ.copy())
        stdin = helper.stdin
        assert stdin is not None  # stdin=PIPE
        stdin.write((json.dumps({**job, "settings": wire}) + "\n").encode())
        stdin.close()
    except Exception as exc:
        logger.warning("celery-zklock: could not end the enqueue guard of %s (%r); its expires bounds it", request.id, exc)


celery_signals.task_revoked.connect(_discarded, weak=False)
