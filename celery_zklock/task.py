"""The Celery glue: :class:`ZkLockedTask` and :func:`current_lock`.

Why the lock is taken in ``__call__`` with a ``finally``: Celery skips ``after_return`` for
RETRY/IGNORED/REJECTED and runs hard-time-limit handlers in the *parent* process, where the
child's ZooKeeper client does not exist; ``__call__`` wraps exactly the body in the process
that runs it, whatever sent the task (``delay``, ``send_task``, beat, a direct call).
Lock state lives in locals and a context variable, never on ``self``: one task instance is
shared by every thread of a process.
"""

from __future__ import annotations

import contextvars
import ctypes
import json
import math
import os
import socket
import sys
import threading
import time
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from celery import Task, states
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore
from celery.utils.log import get_task_logger

from . import config, signals, worker_loss, znodes
from .client import get_client
from .config import ZkSettings, cached_settings, load_settings
from .errors import ConfigurationError, LockLost, LockTimeout, LockUnavailable
from .keys import KeySpec, compile_key, key_path
from .lock import FairLock, MultiLock
from .options import LOCK_OPTIONS, check_option_names, check_option_values

logger = get_task_logger("celery_zklock")


#: How long a redelivered copy waits for its original's final state to be stored.
_RESULT_GRACE = 2.0

SKIPPED = "SKIPPED"  # custom state stored for a task skipped by on_lock_timeout="skip"
LOCK_WAITING = "LOCK_WAITING"  # custom state while a task waits in the lock queue

_current: contextvars.ContextVar["HeldLock | None"] = contextvars.ContextVar("celery_zklock_current", default=None)


@dataclass
class HeldLock:
    """What :func:`current_lock` returns inside a running locked task."""

    keys: list[str]
    paths: list[str]
    tokens: dict[str, int]
    _lock: Any = field(repr=False)

    @property
    def key(self) -> str:
        return self.keys[0]

    @property
    def path(self) -> str:
        return self.paths[0]

    @property
    def token(self) -> int:
        """Fencing token: pass it with every write the lock protects; reject lower ones."""
        return max(self.tokens.values())

    def is_held(self) -> bool:
        return self._lock.is_held()

    def ensure(self) -> None:
        """Raise :class:`LockLost` unless the lock is still held (no I/O)."""
        if not self._lock.is_held():
            raise LockLost(self.key, _lost_reason(self._lock) or "not held")


def current_lock() -> HeldLock:
    """The lock held by the locked task running in this thread/greenlet."""
    held = _current.get()
    if held is None:
        raise RuntimeError("current_lock() called outside a running ZkLockedTask")
    return held


def _fair_locks(lock) -> list[FairLock]:
    return lock.locks if isinstance(lock, MultiLock) else [lock]


def _lost_reason(lock) -> str | None:
    return next((lk.lost_reason for lk in _fair_locks(lock) if lk.lost_reason), None)


class ZkLockedTask(Task):
    """A Task that waits its turn in a fair ZooKeeper lock queue before its body runs.

    Options (decorator kwargs): ``lock_key`` (template, callable, list of those, or None
    for one lock per task name), ``lock_timeout``, ``lock_max_holders``,
    ``on_lock_timeout`` (retry/skip/fail), ``on_lock_lost`` (fail/interrupt),
    ``on_lock_unavailable`` (retry/fail), ``lock_retry_countdown``, ``lock_retry_backoff``,
    ``lock_retry_backoff_max``, ``lock_max_retries``.  Unset options fall back to the
    ``zklock_*`` settings.
    """

    Request = "celery_zklock.worker_loss:LockAwareRequest"

    lock_key: Any = None
    lock_max_holders: int = 1
    lock_timeout: float | None = None
    on_lock_timeout: str | None = None
    on_lock_lost: str | None = None
    on_lock_unavailable: str | None = None
    lock_retry_countdown: float | None = None
    lock_retry_backoff: float | None = None
    lock_retry_backoff_max: float | None = None
    lock_max_retries: int | None = None

    _lock_spec: KeySpec | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        where = f"task {_name(cls)}"
        check_option_names(cls, ZkLockedTask, where)
        check_option_values({k: v for k, v in vars(cls).items() if k in LOCK_OPTIONS}, where)
        cls._lock_spec = compile_key(cls.__dict__.get("lock_key", cls.lock_key), _body(cls), _name(cls))

    # -------------------------------------------------------------- option resolution
    def lock_options(self) -> ZkSettings:
        """The ``zklock_*`` settings with this task's options (and annotations) applied."""
        settings = cached_settings(self.app)
        cached = self.__dict__.get("_zk_options")
        if cached is not None and cached[0] is settings:
            return cached[1]
        check_option_values({k: getattr(self, k) for k in LOCK_OPTIONS}, f"task {self.name}")
        overrides = {
            setting.removeprefix("zklock_"): getattr(self, option)
            for option, setting in config.TASK_OPTIONS.items()
            if getattr(self, option) is not None
        }
        if overrides.get("timeout") == math.inf:
            overrides["timeout"] = None
        opts = dataclasses.replace(settings, **overrides)
        self.__dict__["_zk_options"] = (settings, opts)
        return opts

    def lock_keys(self, args: tuple, kwargs: dict) -> list[str]:
        spec = self._lock_spec or compile_key(self.lock_key, _body(type(self)), self.name)
        if spec.task_name != self.name and not spec.parts:
            spec = KeySpec((), spec.signature, self.name)
        return spec.keys(args, kwargs)

    def lock_paths(self, args: tuple, kwargs: dict, settings: ZkSettings | None = None) -> list[str]:
        settings = settings or load_settings(self.app.conf)
        return [key_path(settings.root, k) for k in self.lock_keys(args, kwargs)]

    # -------------------------------------------------------------- the wrapper
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        direct = bool(req.called_directly)
        opts = self.lock_options()
        keys = self.lock_keys(args, kwargs)
        paths = [key_path(opts.root, k) for k in keys]
        label = keys[0] if len(keys) == 1 else keys

        try:
            client = get_client(opts)
        except LockUnavailable as exc:
            return self._unavailable(exc, opts, label, direct)

        run_state = _RunState(threading.get_ident())
        identity = json.dumps(
            {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "task_id": req.id,
                "retries": req.retries or 0,
                "task": self.name,
                "worker": req.hostname,
            },
            separators=(",", ":"),
        )
        started = time.monotonic()

        # acks_late redelivery: a copy of a task id that is still queued or running ahead of
        # us.  The copy keeps its place behind the original (so the two never run at once)
        # and, once the original is done, runs only if the original left no final state.
        check_duplicates = bool(self.acks_late and not direct and req.id)
        duplicate_seen: list[bool] = []

        def on_wait(fair: FairLock, position: int) -> None:
            # Monitoring only: nothing here may fail the task or escape into the lock.
            try:
                if check_duplicates and self._duplicates_ahead(fair, (req.id, req.retries or 0)):
                    duplicate_seen.append(True)
                    logger.info("copy of task %s queued behind its original under lock %s; waiting", req.id, label)
                    return  # never LOCK_WAITING: the original's state must not be overwritten
            except Exception as exc:
                logger.warning("could not look for an earlier copy of task %s under lock %s: %r", req.id, label, exc)
            logger.info("waiting for lock %s (position %s)", label, position)
            self._lock_event("task-lock-waiting", key=label, position=position)
            if req.id and not direct and not self.ignore_result:
                try:
                    self.update_state(state=LOCK_WAITING, meta={"key": label, "position": position})
                except Exception as exc:
                    logger.warning("could not store state %s for task %s (waiting anyway): %r", LOCK_WAITING, req.id, exc)

        def on_lost(lock: FairLock) -> None:
            run_state.lost(lock.lost_reason or "lock lost", opts.on_lost == "interrupt")

        common = dict(max_holders=self.lock_max_holders, identifier=identity, on_lost=on_lost, on_wait=on_wait)
        lock = FairLock(client, paths[0], **common) if len(paths) == 1 else MultiLock(client, paths, **common)

        # From the first acquire until the body's own try below, any exception (a kazoo
        # error, the backend read, a signal) must not leave our node behind.
        try:
            delivery = (req.id, req.retries or 0) if check_duplicates else None
            acquired = self._acquire(client, lock, opts, delivery, duplicate_seen)
            waited = time.monotonic() - started
            if acquired and duplicate_seen and self._finished_elsewhere(req.id):
                lock.release()
                logger.warning(
                    "task %s already finished under lock %s (this is a redelivered copy): not running it again",
                    req.id, label,
                )
                self._lock_event("task-lock-duplicate", key=label)
                raise Ignore()
            if not acquired:
                if not client.connected:
                    return self._unavailable(
                        LockUnavailable(f"lost the ZooKeeper connection while waiting for lock {label!r}"),
                        opts, label, direct,
                    )
                return self._timed_out(LockTimeout(label, opts.timeout, _holders(lock)), opts, waited, direct)
            held = HeldLock(keys, paths, {lk.path: lk.token for lk in _fair_locks(lock)}, lock)
        except BaseException:
            lock.release()
            raise

        logger.debug("acquired lock %s token=%s after %.3fs", label, held.token, waited)
        self._lock_event("task-lock-acquired", key=label, wait=round(waited, 6), token=held.token)
        signals.lock_acquired.send(sender=self, task_id=req.id, key=label, paths=paths, token=held.token, wait=waited)
        ctx_token = _current.set(held)
        proven = False
        run_state.enter()
        try:
            try:
                if direct:
                    result = super().__call__(*args, **kwargs)
                else:
                    result = self.run(*args, **kwargs)
            finally:
                # leave() first: after it no interrupt can be raised into this thread, so
                # the release below always runs to the end.
                run_state.leave_for_good()
                _current.reset(ctx_token)
                # The release's reply is the proof that the lock was ours to the end (see
                # FairLock.release): a process frozen or cut off past its session timeout
                # learns here that someone else may have run meanwhile.
                proven = lock.release()
                signals.lock_released.send(sender=self, task_id=req.id, key=label, paths=paths, proven=proven)
        except LockLost:
            raise self._lost_error(label, run_state) from None
        if not proven and run_state.reason is None:
            run_state.reason = _lost_reason(lock) or "lock not held at release"
        if run_state.reason is not None:
            raise self._lost_error(label, run_state)
        return result

    def _acquire(self, client, lock, opts: ZkSettings, delivery: tuple | None, duplicate_seen: list[bool]) -> bool:
        """Take ``lock`` under the task's timeout — except for an acks_late redelivered copy.

        ``delivery`` (task id, retries) is set when copies must be looked for.  A copy whose
        original (same task id and attempt) is queued or running ahead of it must neither run beside it nor apply a timeout
        policy (that would store SKIPPED/FAILURE/RETRY over the running original): it waits
        without a deadline until the original is gone.
        """
        timeout = opts.timeout
        while True:
            acquired = lock.acquire(timeout=timeout)
            if acquired:
                if delivery is None or self.lock_max_holders == 1:
                    return True  # one slot: nobody can be ahead of a holder
                ahead = self._duplicates_ahead(lock, delivery)
                if not ahead:
                    return True
                # Several slots: the original may hold one beside us.  Wait for it with no
                # slot held, so a MultiLock copy can never block its own original.
                duplicate_seen.append(True)
                lock.release()
                _wait_nodes_gone(client, ahead)
            elif delivery is None or not client.connected:
                return False
            elif not duplicate_seen and not self._copies_queued(lock, delivery):
                return False  # an honest timeout: nobody with our task id is in the queue
            else:
                duplicate_seen.append(True)
                logger.info("task %s: its original still holds or awaits the lock; waiting without a deadline", delivery[0])
            timeout = None

    # -------------------------------------------------------------- outcomes
    def _lost_error(self, label: Any, run_state: "_RunState") -> LockLost:
        reason = run_state.reason or "lock lost"
        logger.error("lock %s lost while running (%s): reporting failure", label, reason)
        self._lock_event("task-lock-lost", key=label, reason=reason)
        return LockLost(label, reason)

    def _timed_out(self, exc: LockTimeout, opts: ZkSettings, waited: float, direct: bool) -> Any:
        self._lock_event("task-lock-timeout", key=exc.key, wait=round(waited, 6), holders=exc.holders, policy=opts.on_timeout)
        if opts.on_timeout == "fail":
            logger.warning("%s; failing", exc)
            raise exc
        if opts.on_timeout == "skip":
            logger.warning("%s; skipped (on_lock_timeout='skip')", exc)
            if direct:
                return None
            if self.request.id and not self.ignore_result:
                self.update_state(state=SKIPPED, meta={"key": exc.key, "holders": exc.holders, "timeout": exc.timeout})
            raise Ignore()
        raise self._retry(exc, opts, f"lock timeout: {exc}")

    def _unavailable(self, exc: LockUnavailable, opts: ZkSettings, label: Any, direct: bool) -> Any:
        logger.error("task not run (never unprotected): %s", exc)
        self._lock_event("task-lock-unavailable", key=label, error=str(exc))
        if opts.on_unavailable == "fail" or direct:
            raise exc
        raise self._retry(exc, opts, str(exc))

    def _retry(self, exc: Exception, opts: ZkSettings, why: str) -> Exception:
        retries = self.request.retries or 0
        countdown = min(opts.retry_backoff_max, opts.retry_countdown * (opts.retry_backoff ** retries))
        max_retries = self.max_retries if opts.max_retries is None else opts.max_retries
        logger.info("retry %s in %.2fs: %s", retries + 1, countdown, why)
        return self.retry(exc=exc, countdown=countdown, max_retries=max_retries)

    def _duplicates_ahead(self, lock, delivery: tuple) -> list[str]:
        """acks_late redelivery: paths of nodes *ahead of ours* carrying our task id and attempt.

        The attempt (``retries``) matters: a retry published by the body while it still
        holds the lock has the same task id but is new work, not a copy.

        Only nodes ahead count: when two copies race, each sees the other; the one that
        queued first is the original for our purposes.
        """
        found = []
        for lk in _fair_locks(lock):
            mine = znodes.sequence_of((lk.node or "").rsplit("/", 1)[-1])
            for c in lk.contenders():
                if mine is None or c.sequence >= mine:
                    continue
                if _delivery_of(c.identifier) == delivery:
                    found.append(f"{lk.path}/{c.node}")
        return found

    def _copies_queued(self, lock, delivery: tuple) -> bool:
        """After a timeout (our node deleted): is a node of our delivery in any queue?"""
        try:
            return any(_delivery_of(c.identifier) == delivery for lk in _fair_locks(lock) for c in lk.contenders())
        except Exception as exc:
            logger.warning("could not look for an earlier copy of task %s: %r", delivery[0], exc)
            return False

    def _finished_elsewhere(self, task_id: str) -> bool:
        """Did the original delivery of this task id already reach a final state?

        Without a result backend we cannot tell, and run the copy (at-least-once, as
        Celery's acks_late promises): losing the work would be worse than repeating it.
        """
        if self.ignore_result or isinstance(self.backend, DisabledBackend):
            return False
        # Celery stores the original's result just *after* its __call__ (and so its
        # release) returns: give that write a moment to land before deciding.
        deadline = time.monotonic() + _RESULT_GRACE
        while True:
            try:
                if self.backend.get_state(task_id) in states.READY_STATES:
                    return True
            except Exception as exc:
                logger.warning("cannot read the state of task %s (%r); running the redelivered copy", task_id, exc)
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def _lock_event(self, type_: str, **fields: Any) -> None:
        """Celery event for Flower/monitors; only when task events are on (``-E``)."""
        if not self.app.conf.worker_send_task_events or self.request.called_directly or not self.request.hostname:
            return
        try:
            self.send_event(type_, **fields)
        except Exception as exc:  # monitoring must never break the task
            logger.debug("could not send %s event: %r", type_, exc)


class _RunState:
    """Whether the body is running, and how to interrupt it when the lock is lost."""

    def __init__(self, thread_ident: int) -> None:
        self.thread_ident = thread_ident
        self.guard = threading.Lock()
        self.running = False
        self.interrupted = False  # an interrupt was raised into the thread
        self.reason: str | None = None
        self.greenlet = _current_greenlet()

    def enter(self) -> None:
        with self.guard:
            self.running = True

    def leave_for_good(self) -> None:
        """Stop interrupts, and take delivery of one raised but not yet delivered.

        Retried until it completes: an interrupt delivered *inside* this method must not
        skip the release that follows it.  A pending interrupt is not cancelled with
        ``PyThreadState_SetAsyncExc(tid, NULL)``: that leaves CPython's eval-breaker flag
        set (every later bytecode of the process takes the slow path); it is let land
        here instead, where it is caught.
        """
        while True:
            try:
                with self.guard:
                    self.running = False
                    pending, self.interrupted = self.interrupted, False
                if pending and self.greenlet is None:
                    for _ in range(1000):  # the eval loop checks for it at each iteration
                        pass
                return
            except LockLost:
                continue

    def lost(self, reason: str, interrupt: bool) -> None:
        with self.guard:
            self.reason = reason
            if not (interrupt and self.running):
                return
            self.interrupted = True
            if self.greenlet is not None:
                _kill_greenlet(self.greenlet, reason, self)
            else:
                # Raised in the task's thread at its next bytecode, like a soft time limit.
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_ident), ctypes.py_object(LockLost))


def _current_greenlet():
    if "gevent" not in sys.modules:  # never import gevent into a process that does not use it
        return None
    from gevent import getcurrent, monkey

    if monkey.is_module_patched("threading"):
        return getcurrent()
    return None


def _kill_greenlet(glet, reason: str, run_state: _RunState) -> None:
    import gevent

    def throw() -> None:
        # Runs later in the hub: the body may have ended (and begun releasing) meanwhile.
        if run_state.running:
            glet.throw(LockLost("lock", reason))

    gevent.get_hub().loop.run_callback(throw)


def _delivery_of(identifier: str | None) -> tuple | None:
    """(task id, retries) from a node's identifier; None for nodes not written by a task."""
    try:
        info = json.loads(identifier)
        return (info["task_id"], info.get("retries", 0))
    except (TypeError, ValueError, AttributeError, KeyError):
        return None


def _holders(lock) -> list[str | None]:
    """Who holds the lock, for the timeout message; best effort."""
    try:
        return [c.identifier for lk in _fair_locks(lock) for c in lk.contenders() if c.holder]
    except Exception:
        return []


def _wait_nodes_gone(client, nodes: list[str]) -> None:
    """Block until every znode in ``nodes`` is deleted (a watch each, no polling)."""
    for node in nodes:
        while True:
            changed = client.handler.event_object()
            if client.exists(node, watch=lambda _event: changed.set()) is None:
                break
            # Re-checked every second too: a watch does not survive a session expiry.
            changed.wait(1.0)


# ------------------------------------------------------------------ class helpers
def _body(cls: type):
    """The task function, minus ``self`` for bound tasks, for signature checks."""
    run = cls.__dict__.get("run")
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return run.__func__
    import functools
    import inspect

    try:
        params = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return functools.partial(run, None)
    return run


def _name(cls: type) -> str:
    return cls.__dict__.get("name") or f"{cls.__module__}.{cls.__qualname__}"


def lock_path(key: str, app=None) -> str:
    """The znode path of lock ``key`` under ``zklock_root`` — share it with Curator/kazoo users."""
    if app is None:
        from celery import current_app as app  # only for the documented helper's convenience
    return key_path(load_settings(app.conf).root, key)


worker_loss.install()
