"""The Celery glue: :class:`ZkLockedTask` and :func:`current_lock`.

Why the lock is taken in ``__call__`` with a ``finally``: Celery skips ``after_return`` for
RETRY/IGNORED/REJECTED and runs hard-time-limit handlers in the *parent* process, where the
child's ZooKeeper client does not exist; ``__call__`` wraps exactly the body in the process
that runs it, whatever sent the task (``delay``, ``send_task``, beat, a direct call).
Lock state lives in locals and a context variable (:mod:`celery_zklock.held`), never on
``self``: one task instance is shared by every thread of a process.

This module holds the class users subclass: its options and the call path, each step in
one place.  How the lock is decided (waited for here or claimed from the agent) and what
follows (prerun, the policy, the events, the enqueue guard) is :mod:`celery_zklock.decision`;
what the body holds, and how losing it interrupts the body, :mod:`celery_zklock.held`.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any, Callable

from celery import Task

from . import by_config, config, decision, enqueue, signals
from .config import ZkSettings, cached_settings, load_settings
from .decision import GuardOwner, Reentry
from .errors import LockLost, LockReentered, LockUpgradeRefused
from .held import CURRENT, HeldLock, LockPart, NestedLock, RunState, current_lock, holding_of, lost_reason_of, tokens_of
from .keys import KeySpec, compile_key, key_path
from .logs import task_logger
from .options import LOCK_OPTIONS, OPTION_DEFAULTS, check_option_names, check_option_values
from .redelivery import redelivered
from .states import LOCK_WAITING, SKIPPED
from .worker import agent_client, worker_hooks

#: The public names; HeldLock and current_lock live in celery_zklock.held, the states in
#: celery_zklock.states (``from celery_zklock.task import SKIPPED`` keeps working).
__all__ = ["ZkLockedTask", "HeldLock", "current_lock", "lock_path", "lock_configured_tasks", "SKIPPED", "LOCK_WAITING"]

logger = task_logger()

#: How long a pool process waits for its agent's verdict (already decided: a local round trip).
_CLAIM_TIMEOUT = 5.0


class ZkLockedTask(Task):  # type: ignore[misc]  # celery ships no annotations: its Task is Any to mypy
    """A Task that waits its turn in a fair ZooKeeper lock queue before its body runs.

    Options are decorator kwargs or class attributes: ``lock_key``, ``lock_max_holders``
    and one per per-task setting (``lock_timeout`` for ``zklock_timeout``...; see
    :data:`celery_zklock.options.LOCK_OPTIONS`).  Unset (None) options fall back to the
    ``zklock_*`` settings.  The option attributes are set from that declaration below.
    """

    Request = "celery_zklock.worker.worker_hooks:LockAwareRequest"

    #: The tracer's ``task_prerun`` is sent when the lock is decided (see celery_zklock.decision.fire_prerun).
    _zklock_defers_prerun = True

    _lock_spec: KeySpec | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        where = f"task {_name(cls)}"
        with worker_hooks.configuration_exits():  # a worker starting stops with the message alone
            check_option_names(cls, ZkLockedTask, where)
            check_option_values({k: v for k, v in vars(cls).items() if k in LOCK_OPTIONS}, where)
            cls._lock_spec = compile_key(cls.__dict__.get("lock_key", cls.lock_key), _body(cls), _name(cls))

    # -------------------------------------------------------------- option resolution
    def lock_options(self) -> ZkSettings:
        """The ``zklock_*`` settings with this task's options (and annotations) applied."""
        settings = cached_settings(self.app)
        cached: tuple[ZkSettings, ZkSettings] | None = self.__dict__.get("_zk_options")
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
        self._spec().check_modes(opts.lock_mode, self.lock_max_holders, f"task {self.name}")
        self.__dict__["_zk_options"] = (settings, opts)
        return opts

    def _spec(self) -> KeySpec:
        spec = self._lock_spec or compile_key(self.lock_key, _body(type(self)), self.name)
        if spec.task_name != self.name and not spec.parts:
            spec = KeySpec((), spec.signature, self.name)
        return spec

    def lock_keys(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        return self._spec().keys(args, kwargs)

    def lock_paths(self, args: tuple[Any, ...], kwargs: dict[str, Any], settings: ZkSettings | None = None) -> list[str]:
        return _paths(settings or load_settings(self.app.conf), self.lock_keys(args, kwargs))

    def lock_read_paths(self, args: tuple[Any, ...], kwargs: dict[str, Any], settings: ZkSettings | None = None,
                        request: Any = None) -> frozenset[str]:
        """The paths of this call taken for reading (``lock_mode``); the others are written.
        A delivery that may be a copy (:func:`~celery_zklock.redelivery.redelivered`) writes
        every key: as a reader it could hold beside its original, still running, and run a
        second time; as a writer it holds once the original is done, and then finds its
        final state (redelivered copies are rare: their exclusion costs little)."""
        opts = settings or self.lock_options()
        if request is not None and redelivered(request):
            return frozenset()
        return frozenset(_paths(opts, sorted(self._spec().read_keys(args, kwargs, opts.lock_mode))))

    # -------------------------------------------------------------- publishing
    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None, producer: Any = None,
                    link: Any = None, link_error: Any = None, shadow: str | None = None, **options: Any) -> Any:
        """Celery's, under an enqueue guard when ``lock_enqueue`` is set (:mod:`celery_zklock.enqueue`)."""
        opts = self.lock_options()
        if not opts.enqueue:
            return super().apply_async(args, kwargs, task_id, producer, link, link_error, shadow, **options)

        def plain(a: Any, k: Any, task_id: str | None = None, **o: Any) -> Any:
            return super(ZkLockedTask, self).apply_async(a, k, task_id, producer, link, link_error, shadow, **o)

        return enqueue.publish(self, plain, args, kwargs, task_id, options, opts, link=link, link_error=link_error)

    # -------------------------------------------------------------- the wrapper
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        opts = self.lock_options()
        keys = self.lock_keys(args, kwargs)
        call = Call(args, kwargs, self.request, bool(self.request.called_directly), opts, keys, _paths(opts, keys),
                    self.lock_read_paths(args, kwargs, opts, self.request))
        outer = CURRENT.get()
        if outer is not None and not set(call.paths).isdisjoint(outer.paths):
            return self._reentered(outer, call)
        return self._locked_call(call)

    def _run_body(self, call: "Call") -> Any:
        return super().__call__(*call.args, **call.kwargs) if call.direct else self.run(*call.args, **call.kwargs)

    def _reentered(self, outer: HeldLock, call: "Call") -> Any:
        """A locked call inside a locked body of this thread, on keys that body holds
        (Curator's re-entry, at task level): it runs at once under the outer hold, which
        it never releases; only keys the outer does not hold are taken (and released) here."""
        keys, paths, label = call.keys, call.paths, call.label
        entry = decision.reentry(outer.paths, outer.read_paths, paths, call.read_paths, call.opts.reentrant)
        if entry is Reentry.TAKES_THE_REST:
            # The rest are taken in process, as a nested call always waits (see the README
            # on deadlocks: the canonical order no longer spans the whole set).
            missing = [p for p in paths if p not in outer.paths]
            sub_keys = [k for k, p in zip(keys, paths, strict=True) if p in missing]
            inner_label = sub_keys[0] if len(sub_keys) == 1 else sub_keys
            return self._locked_call(call, Nested(outer, missing, inner_label))
        decision.fire_prerun(self)  # decided at once: under the outer hold, or refused
        held_paths = [p for p in paths if p in outer.paths]
        if entry is Reentry.UPGRADE_REFUSED:
            upgrade = next(p for p in held_paths if p in outer.read_paths and p not in call.read_paths)
            raise LockUpgradeRefused(keys[paths.index(upgrade)])
        if entry is Reentry.REFUSED:
            holder = f"{outer.task}[{outer.task_id}] (token {outer.token})"
            decision.lock_event(self, "task-lock-reentered", key=label, holder=holder, refused=True)
            raise LockReentered(label, holder)
        held = HeldLock(keys, paths, {p: outer.tokens[p] for p in held_paths}, holding_of(outer),
                        acquired_at=outer.acquired_at, task=outer.task, task_id=outer.task_id,
                        read_paths=frozenset(p for p in paths if p in outer.read_paths))
        logger.debug("re-entered lock %s under %s[%s] (token %s)", label, outer.task, outer.task_id, held.token)
        decision.lock_event(self, "task-lock-reentered", key=label, token=held.token, holder=f"{outer.task}[{outer.task_id}]")
        ctx_token = CURRENT.set(held)
        try:
            return self._run_body(call)
        finally:
            CURRENT.reset(ctx_token)

    def _locked_call(self, call: "Call", nested: "Nested | None" = None) -> Any:
        """Take the lock (all of the call's paths, or only those a ``nested`` call's outer hold
        lacks), run the body, release with the proof.  The lock is claimed from the worker's
        lock agent, which queued for it before the pool got the request (prefork/solo with
        zklock_wait_in="worker"), or waited for here (acks_late tasks too: redelivered copies
        are recognised here); :func:`celery_zklock.decision.act` acts on what either decided."""
        run_state = RunState(threading.get_ident())
        started = time.monotonic()

        def on_lost(lock: LockPart) -> None:
            run_state.lost(lock.lost_reason or "lock lost", call.opts.on_lost == "interrupt")

        req, direct, opts = call.req, call.direct, call.opts
        label = nested.label if nested else call.label
        taken = decision.act(
            self, opts, label, direct,
            claim=lambda: self._claimed(call, nested, on_lost),
            wait_here=lambda: decision.lock_in_process(
                self, req, direct, opts, label, nested.take if nested else call.paths, on_lost, started,
                give_back=(nested is None and not direct and not self.acks_late and bool(req.id)
                           and agent_client.beside_agent()),
                read_paths=call.read_paths),
            guard_here=GuardOwner.RUN if nested is None and not direct else GuardOwner.NONE)
        if taken.lock is None:
            return taken.result  # not run: the policy's value
        return self._run_holding(call, nested, taken, run_state)

    def _claimed(self, call: "Call", nested: "Nested | None",
                 on_lost: Callable[[LockPart], None]) -> "decision.LockDecision | None":
        """The agent's verdict on this request; None when there is none to claim (a direct,
        nested or acks_late call, or another delivery of its id waits in the agent): the
        lock is waited for here."""
        req = call.req
        carried = agent_client.carried_grant(req)  # off the request whether used or not: never republished
        bypassed = agent_client.bypassed(req)  # another delivery of its id waits in the agent: not ours to claim
        if call.direct or nested is not None or self.acks_late or not req.id or bypassed:
            return None
        claimed = agent_client.claim(req.id, _CLAIM_TIMEOUT, carried)
        return None if claimed is None else decision.claimed_lock(self, claimed, call.opts, on_lost)

    def _run_holding(self, call: "Call", nested: "Nested | None", taken: decision.Taken, run_state: RunState) -> Any:
        """Run the body with the hold set as :func:`current_lock`; release with the proof."""
        req, opts, paths, label, lock, waited = call.req, call.opts, call.paths, call.label, taken.lock, taken.waited
        guarded = taken.guard is GuardOwner.RUN  # started before the body: it ends after it
        tokens = tokens_of(lock)
        if nested is not None:  # keys the outer holds keep its tokens; the lock is both
            tokens = {**{p: nested.outer.tokens[p] for p in paths if p in nested.outer.tokens}, **tokens}
            lock = NestedLock(holding_of(nested.outer), lock)
        held = HeldLock(call.keys, paths, tokens, lock, wait=waited, acquired_at=time.time(), task=self.name,
                        task_id=req.id, read_paths=call.read_paths)
        acquired_at = time.monotonic()

        logger.debug("acquired lock %s (%s) token=%s after %.3fs", label, held.mode, held.token, waited)
        decision.lock_event(self, "task-lock-acquired", key=label, wait=round(waited, 6), token=held.token,
                             mode=held.mode)
        signals.lock_acquired.send(sender=self, task_id=req.id, key=label, paths=paths, token=held.token, wait=waited)
        ctx_token = CURRENT.set(held)
        proven = False
        run_state.enter()
        try:
            try:
                result = self._run_body(call)
            finally:
                # leave() first: after it no interrupt can be raised into this thread, so
                # the release below always runs to the end.
                run_state.leave_for_good()
                CURRENT.reset(ctx_token)
                # The release's reply is the proof that the lock was ours to the end (see
                # FairLock.release): a process frozen or cut off past its session timeout
                # learns here that someone else may have run meanwhile.
                proven = lock.release()
                if guarded:
                    enqueue.finished(self, req, opts)
                signals.lock_released.send(sender=self, task_id=req.id, key=label, paths=paths, proven=proven)
                decision.lock_event(self, "task-lock-released", key=label, token=held.token, proven=proven,
                                     held=round(time.monotonic() - acquired_at, 6))
        except LockLost:
            raise decision.lost_error(self, label, run_state) from None
        if not proven and run_state.reason is None:
            run_state.reason = lost_reason_of(lock) or "lock not held at release"
        if run_state.reason is not None:
            raise decision.lost_error(self, label, run_state)
        return result


for _option, _default in OPTION_DEFAULTS.items():
    setattr(ZkLockedTask, _option, _default)


# ------------------------------------------------------------------ what a call carries
@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a locked task: its arguments, request and options, and the keys it locks."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    req: Any  # celery's Context
    direct: bool  # called directly (``task(...)``), not run by a worker or eagerly
    opts: ZkSettings
    keys: list[str]
    paths: list[str]
    read_paths: frozenset[str] = frozenset()  # those of ``paths`` taken for reading (lock_mode)

    @property
    def label(self) -> Any:
        """The key, or the keys of a multi-key lock: as events and errors name it."""
        return self.keys[0] if len(self.keys) == 1 else self.keys


@dataclasses.dataclass(frozen=True)
class Nested:
    """A locked call inside a locked body of this thread: the outer hold, and the paths
    (with their label) it does not hold, taken and released by this call."""

    outer: HeldLock
    take: list[str]
    label: Any


def _paths(settings: ZkSettings, keys: list[str]) -> list[str]:
    return [key_path(settings.root, k) for k in keys]


# ------------------------------------------------------------------ class helpers
def _body(cls: type) -> Callable[..., Any] | None:
    """The task function, minus ``self`` for bound tasks, for signature checks."""
    run: Callable[..., Any] | None = cls.__dict__.get("run")
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


def lock_path(key: str, app: Any = None) -> str:
    """The znode path of lock ``key`` under ``zklock_root`` — share it with Curator/kazoo users."""
    if app is None:
        from celery import current_app  # only for the documented helper's convenience

        app = current_app
    return key_path(load_settings(app.conf).root, key)


def lock_configured_tasks(app: Any) -> list[str]:
    """Lock the tasks ``zklock_tasks`` names (see :mod:`celery_zklock.by_config`): done at
    worker start; call it in another process that runs those tasks eagerly."""
    return by_config.lock_tasks(app, ZkLockedTask)


worker_hooks.before_validation.append(lock_configured_tasks)
worker_hooks.install()
decision.install_prerun()
