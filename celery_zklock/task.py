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
import math
import os
import threading
import time
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from celery import Task
from celery.states import STARTED
from celery.exceptions import Ignore
from celery.utils.log import get_task_logger

from .worker import agent_lock, worker_loss

from . import by_config, config, enqueue, metrics, prerun, signals
from .config import ZkSettings, cached_settings, load_settings
from .engine.client import get_client
from .engine.identity import Identity
from .engine.lock import FairLock, MultiLock
from .errors import LockLost, LockReentered, LockTimeout, LockUnavailable
from .interrupts import RunState
from .keys import KeySpec, compile_key, key_path
from .options import LOCK_OPTIONS, OPTION_DEFAULTS, check_option_names, check_option_values
from .redelivery import Redelivery
from .states import LOCK_WAITING, SKIPPED

logger = get_task_logger("celery_zklock")



#: How long a pool process waits for its agent's verdict (already decided: a local round trip).
_CLAIM_TIMEOUT = 5.0

_current: contextvars.ContextVar["HeldLock | None"] = contextvars.ContextVar("celery_zklock_current", default=None)


@dataclass
class HeldLock:
    """What :func:`current_lock` returns inside a running locked task."""

    keys: list[str]
    paths: list[str]
    tokens: dict[str, int]
    _lock: Any = field(repr=False)
    #: Seconds this run waited for its lock (wherever it waited: the worker's agent or here).
    wait: float = 0.0
    #: When the lock was granted (``time.time()``): the run's real start, and prerun's time.
    acquired_at: float = 0.0
    #: The task (name, id) whose run took this hold: a re-entered call runs under it.
    task: str = ""
    task_id: str | None = None

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


class _UnderOuter:
    """A nested call's hold: the outer's keys (never released here) and the ones it took."""

    def __init__(self, outer, taken) -> None:
        self.outer, self.taken = outer, taken

    @property
    def locks(self) -> list:
        return [*self.outer.locks, *self.taken.locks]

    def is_held(self) -> bool:
        return self.outer.is_held() and self.taken.is_held()

    def release(self) -> bool:
        """Release what this call took (its proof); the outer's keys are the outer's to prove."""
        return self.taken.release()


def _tokens_of(lock) -> dict[str, int]:
    tokens = getattr(lock, "tokens", None)  # MultiLock and AgentLock: per path
    return dict(tokens) if tokens is not None else {lock.path: lock.token}


def _lost_reason(lock) -> str | None:
    return next((lk.lost_reason for lk in lock.locks if lk.lost_reason), None)


class ZkLockedTask(Task):
    """A Task that waits its turn in a fair ZooKeeper lock queue before its body runs.

    Options are decorator kwargs or class attributes: ``lock_key``, ``lock_max_holders``
    and one per per-task setting (``lock_timeout`` for ``zklock_timeout``...; see
    :data:`celery_zklock.options.LOCK_OPTIONS`).  Unset (None) options fall back to the
    ``zklock_*`` settings.  The option attributes are set from that declaration below.
    """

    Request = "celery_zklock.worker.worker_loss:LockAwareRequest"

    #: The tracer's ``task_prerun`` is sent when the lock is decided (see celery_zklock.prerun).
    _zklock_defers_prerun = True

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
            config.SETTINGS[setting].field: getattr(self, option)
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

    # -------------------------------------------------------------- publishing
    def apply_async(self, args=None, kwargs=None, task_id=None, producer=None, link=None, link_error=None,
                    shadow=None, **options):
        """Celery's, under an enqueue guard when ``lock_enqueue`` is set (:mod:`celery_zklock.enqueue`)."""
        opts = self.lock_options()
        if not opts.enqueue:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

        def plain(a, k, task_id=None, **o):
            return super(ZkLockedTask, self).apply_async(a, k, task_id, producer, link, link_error, shadow, **o)

        return enqueue.publish(self, plain, args, kwargs, task_id, options, opts)

    # -------------------------------------------------------------- the wrapper
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        req = self.request
        direct = bool(req.called_directly)
        opts = self.lock_options()
        keys = self.lock_keys(args, kwargs)
        paths = [key_path(opts.root, k) for k in keys]
        label = keys[0] if len(keys) == 1 else keys
        outer = _current.get()
        if outer is not None and not set(paths).isdisjoint(outer.paths):
            return self._reentered(outer, args, kwargs, direct, opts, keys, paths, label)
        return self._locked_call(args, kwargs, req, direct, opts, keys, paths, label)

    def _reentered(self, outer: HeldLock, args, kwargs, direct: bool, opts: ZkSettings, keys, paths, label) -> Any:
        """A locked call inside a locked body of this thread, on keys that body holds
        (Curator's re-entry, at task level): it runs at once under the outer hold, which
        it never releases; only keys the outer does not hold are taken (and released) here."""
        held_paths = [p for p in paths if p in outer.paths]
        missing = [p for p in paths if p not in outer.paths]
        if not opts.reentrant:
            prerun.fire(self)
            holder = f"{outer.task}[{outer.task_id}] (token {outer.token})"
            self._lock_event("task-lock-reentered", key=label, holder=holder, refused=True)
            raise LockReentered(label, holder)
        if missing:
            # The rest are taken in process, as a nested call always waits (see the README
            # on deadlocks: the canonical order no longer spans the whole set).
            sub_keys = [k for k, p in zip(keys, paths) if p in missing]
            inner_label = sub_keys[0] if len(sub_keys) == 1 else sub_keys
            return self._locked_call(args, kwargs, self.request, direct, opts, keys, paths, label,
                                     take=missing, inner_label=inner_label, outer=outer)
        prerun.fire(self)
        held = HeldLock(keys, paths, {p: outer.tokens[p] for p in held_paths}, outer._lock,
                        acquired_at=outer.acquired_at, task=outer.task, task_id=outer.task_id)
        logger.debug("re-entered lock %s under %s[%s] (token %s)", label, outer.task, outer.task_id, held.token)
        self._lock_event("task-lock-reentered", key=label, token=held.token, holder=f"{outer.task}[{outer.task_id}]")
        ctx_token = _current.set(held)
        try:
            return super().__call__(*args, **kwargs) if direct else self.run(*args, **kwargs)
        finally:
            _current.reset(ctx_token)

    def _locked_call(self, args, kwargs, req, direct: bool, opts: ZkSettings, keys, paths, label,
                     take: list[str] | None = None, inner_label: Any = None, outer: HeldLock | None = None) -> Any:
        """Take the lock (all of ``paths``, or only ``take`` under an ``outer`` hold), run the
        body, release with the proof."""

        run_state = RunState(threading.get_ident())

        def on_lost(lock) -> None:
            run_state.lost(lock.lost_reason or "lock lost", opts.on_lost == "interrupt")

        started = time.monotonic()
        # Queued by the worker's lock agent before the pool got the request (prefork/solo
        # with zklock_wait_in="worker"): claim its verdict.  acks_late tasks wait here, in
        # process, where redelivered copies are recognised.
        try:
            nested = outer is not None
            claimed = (None if direct or nested or self.acks_late or not req.id
                       else agent_lock.claim(req.id, _CLAIM_TIMEOUT))
            # Its enqueue guard (lock_enqueue) ends or moves where its lock is decided: in the
            # agent for a claimed request, here for one that locks in process.
            guarded = claimed is None and not nested and not direct
            if claimed is not None:
                lock, waited = self._claimed_lock(claimed, opts, label, on_lost)
            else:
                try:
                    lock, waited, early = self._lock_in_process(req, direct, opts, inner_label if nested else label,
                                                                take if nested else paths, on_lost, started)
                except BaseException:
                    if guarded:
                        enqueue.finished(self, req, opts)  # ends unrun (a retry took its guard over)
                    raise
                if lock is None:
                    if guarded:
                        enqueue.finished(self, req, opts)
                    return early
                if guarded:
                    enqueue.started(self, req, opts)
        finally:
            prerun.fire(self)  # decided (held or given up), or failed: prerun never goes unsent
        tokens = _tokens_of(lock)
        if outer is not None:  # keys the outer holds keep its tokens; the lock is both
            tokens = {**{p: outer.tokens[p] for p in paths if p in outer.tokens}, **tokens}
            lock = _UnderOuter(outer._lock, lock)
        held = HeldLock(keys, paths, tokens, lock, wait=waited, acquired_at=time.time(), task=self.name, task_id=req.id)
        acquired_at = time.monotonic()

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
                if guarded:
                    enqueue.finished(self, req, opts)
                signals.lock_released.send(sender=self, task_id=req.id, key=label, paths=paths, proven=proven)
                self._lock_event("task-lock-released", key=label, token=held.token, proven=proven,
                                 held=round(time.monotonic() - acquired_at, 6))
        except LockLost:
            raise self._lost_error(label, run_state) from None
        if not proven and run_state.reason is None:
            run_state.reason = _lost_reason(lock) or "lock not held at release"
        if run_state.reason is not None:
            raise self._lost_error(label, run_state)
        return result

    def _lock_in_process(self, req, direct: bool, opts: ZkSettings, label, paths: list[str], on_lost, started: float):
        """Wait for the lock in this process.  Returns (lock, waited, None) when held, or
        (None, waited, value) after a policy that returns instead of raising."""
        try:
            client = get_client(opts)
        except LockUnavailable as exc:
            return None, 0.0, self._unavailable(exc, opts, label, direct)

        identity = Identity.of_this_process(
            task_id=req.id, retries=req.retries or 0, task=self.name, worker=req.hostname,
            holders=self.lock_max_holders if self.lock_max_holders > 1 else None,
        ).to_bytes()
        copies = Redelivery(self, client, req.id, req.retries or 0, enabled=bool(self.acks_late and not direct))

        counted_waiting = [False]  # in the zklock_waiting gauge until the wait ends

        def on_wait(fair: FairLock, position: int) -> None:
            # Monitoring only: nothing here may fail the task or escape into the lock.
            if copies.queued_behind_original(fair):
                logger.info("copy of task %s queued behind its original under lock %s; waiting", req.id, label)
                return  # never LOCK_WAITING: the original's state must not be overwritten
            logger.info("waiting for lock %s (position %s)", label, position)
            self._lock_event("task-lock-waiting", key=label, position=position)
            counted_waiting[0] = True
            if req.id and not direct and not self.ignore_result:
                try:
                    self.update_state(state=LOCK_WAITING, meta={"key": label, "position": position})
                except Exception as exc:
                    logger.warning("could not store state %s for task %s (waiting anyway): %r", LOCK_WAITING, req.id, exc)

        common = dict(max_holders=self.lock_max_holders, identifier=identity, on_lost=on_lost, on_wait=on_wait)
        lock = FairLock(client, paths[0], **common) if len(paths) == 1 else MultiLock(client, paths, **common)

        # From the first acquire until the body's own try below, any exception (a kazoo
        # error, the backend read, a signal) must not leave our node behind.
        try:
            try:
                acquired = copies.acquire(lock, opts.timeout, self.lock_max_holders)
            finally:
                if counted_waiting[0]:
                    metrics.record("waited", self)
            waited = time.monotonic() - started
            prerun.fire(self)  # the lock is decided: the run (or its policy) starts now
            if acquired and counted_waiting[0] and self.track_started and not self.ignore_result and not direct:
                # The wait overwrote the tracer's STARTED with LOCK_WAITING: started is now.
                self._store_started()
            if acquired and copies.finished_elsewhere():
                lock.release()
                logger.warning(
                    "task %s already finished under lock %s (this is a redelivered copy): not running it again",
                    req.id, label,
                )
                self._lock_event("task-lock-duplicate", key=label)
                raise Ignore()
            if not acquired:
                if not client.connected:
                    return None, waited, self._unavailable(
                        LockUnavailable(f"lost the ZooKeeper connection while waiting for lock {label!r}"),
                        opts, label, direct,
                    )
                return None, waited, self._timed_out(LockTimeout(label, opts.timeout, _holders(lock)), opts, waited, direct)
        except BaseException:
            lock.release()
            raise
        return lock, waited, None

    def _claimed_lock(self, claimed, opts: ZkSettings, label, on_lost):
        """The lock the worker's agent took for this request, or its timeout/unavailable verdict."""
        link, verdict = claimed
        waited = float(verdict.get("waited") or 0.0)
        prerun.fire(self)  # decided by the agent: the run (or its policy) starts now
        if verdict["verdict"] == "revoked":
            # Handed over while next in line, then revoked: the main process has recorded
            # REVOKED and deleted its node; the body never runs.
            logger.info("task %s revoked while waiting for lock %s: not run", self.request.id, label)
            raise Ignore()
        if verdict["verdict"] == "shutdown":
            # Warm shutdown while next in line: its message was acknowledged when this
            # process took it, so it goes back to the broker as a new message with the same
            # id, arguments and retry count (what Celery's retry publishes), and queues anew.
            logger.info("worker shutting down: task %s goes back to the broker (lock %s)", self.request.id, label)
            self.signature_from_request(self.request).apply_async()
            raise Ignore()
        if verdict["verdict"] == "timeout":
            self._timed_out(LockTimeout(label, opts.timeout, verdict.get("holders") or []), opts, waited, False)
        if verdict["verdict"] != "granted":
            self._unavailable(LockUnavailable(verdict.get("error") or "the lock agent could not reach ZooKeeper"),
                              opts, label, False)
        lock = agent_lock.AgentLock(
            link, self.request.id, verdict["tokens"], grace=opts.session_timeout / 3.0,
            release_bound=opts.session_timeout + 1.0, on_lost=on_lost, state=verdict,
        )
        if lock.suspended_reason is not None or lock.lost_reason is not None:
            # Granted, but the lock is not safe to hold now (the connection dropped between
            # the grant and this claim, or the lock is already lost): the body waits until
            # the agent's session is confirmed again, or the lock is declared lost; it never
            # runs on hope, and a lock lost before the body started is not a LockLost run.
            logger.warning("lock %s not confirmed at start (%s): waiting for ZooKeeper", label,
                           lock.lost_reason or lock.suspended_reason)
            if not lock.confirmed(opts.session_timeout + 1.0):
                why = lock.lost_reason or lock.suspended_reason or "not confirmed"
                lock.abandon()
                self._unavailable(LockUnavailable(f"lock {label!r} could not be confirmed before the run: {why}"),
                                  opts, label, False)
        return lock, waited

    # -------------------------------------------------------------- outcomes
    def _lost_error(self, label: Any, run_state: RunState) -> LockLost:
        reason = run_state.reason or "lock lost"
        logger.error("lock %s lost while running (%s): reporting failure", label, reason)
        self._lock_event("task-lock-lost", key=label, reason=reason)
        return LockLost(label, reason)

    def _store_started(self) -> None:
        try:
            self.update_state(state=STARTED, meta={"pid": os.getpid(), "hostname": self.request.hostname})
        except Exception as exc:  # monitoring only
            logger.warning("could not store state %s for task %s: %r", STARTED, self.request.id, exc)

    def _timed_out(self, exc: LockTimeout, opts: ZkSettings, waited: float, direct: bool) -> Any:
        prerun.fire(self)
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
        prerun.fire(self)
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

    def _lock_event(self, type_: str, **fields: Any) -> None:
        """Celery event for Flower/monitors, only when task events are on (``-E``); and the
        worker's Prometheus metrics when ``zklock_metrics_port`` is set."""
        metrics.record(type_[len("task-lock-"):], self, **fields)
        if not self.app.conf.worker_send_task_events or self.request.called_directly or not self.request.hostname:
            return
        try:
            self.send_event(type_, **fields)
        except Exception as exc:  # monitoring must never break the task
            logger.debug("could not send %s event: %r", type_, exc)


def _holders(lock) -> list[str | None]:
    """Who holds the lock, for the timeout message; best effort."""
    try:
        return [c.identifier for lk in lock.locks for c in lk.contenders() if c.holder]
    except Exception:
        return []


for _option, _default in OPTION_DEFAULTS.items():
    setattr(ZkLockedTask, _option, _default)


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


def lock_configured_tasks(app) -> list[str]:
    """Lock the tasks ``zklock_tasks`` names (see :mod:`celery_zklock.by_config`): done at
    worker start; call it in another process that runs those tasks eagerly."""
    return by_config.lock_tasks(app, ZkLockedTask)


worker_loss.before_validation.append(lock_configured_tasks)
worker_loss.install()
prerun.install()
