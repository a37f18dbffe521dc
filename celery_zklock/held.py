"""What a running locked task holds, and how losing it stops the body.

Why a context variable: one task instance is shared by every thread (and greenlet) of a
process, so the hold of *this* run (:class:`HeldLock`, :func:`current_lock`) can live
neither on ``self`` nor in a global; the wrapper in :mod:`celery_zklock.task` sets it around
the body and resets it after.  Why :class:`RunState` is here: a lost hold interrupts the body
(``on_lock_lost="interrupt"``) by raising into its thread or greenlet, which must never land
after the body, where it would skip the release; it is the one place that knows whether the
body runs and how to reach it.
"""

from __future__ import annotations

import contextvars
import ctypes
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from .errors import LockLost

#: The hold of the locked run in this thread or greenlet (set by celery_zklock.task around the body).
CURRENT: contextvars.ContextVar["HeldLock | None"] = contextvars.ContextVar("celery_zklock_current", default=None)


class LockPart(Protocol):
    """One lock of a hold: why it was lost, if it was."""

    @property
    def lost_reason(self) -> str | None: ...


class Holding(Protocol):
    """What a locked run holds: a :class:`~celery_zklock.engine.lock.FairLock` or
    :class:`~celery_zklock.engine.lock.MultiLock` (waited for in the process), the agent's
    :class:`~celery_zklock.worker.agent_client.AgentLock`, or a :class:`NestedLock`."""

    @property
    def locks(self) -> Sequence[LockPart]: ...

    def is_held(self) -> bool: ...

    def release(self) -> bool: ...


@dataclass
class HeldLock:
    """What :func:`current_lock` returns inside a running locked task."""

    keys: list[str]
    paths: list[str]
    tokens: dict[str, int]
    _lock: Holding = field(repr=False)
    #: Seconds this run waited for its lock (wherever it waited: the worker's agent or here).
    wait: float = 0.0
    #: When the lock was granted (``time.time()``): the run's real start, and prerun's time.
    acquired_at: float = 0.0
    #: The task (name, id) whose run took this hold: a re-entered call runs under it.
    task: str = ""
    task_id: str | None = None
    #: The paths held for reading (``lock_mode``), shared with other readers; the rest are written.
    read_paths: frozenset[str] = frozenset()

    @property
    def key(self) -> str:
        return self.keys[0]

    @property
    def modes(self) -> dict[str, str]:
        """Each key's mode: "read" (shared with readers) or "write" (alone)."""
        return {k: "read" if p in self.read_paths else "write" for k, p in zip(self.keys, self.paths, strict=True)}

    @property
    def mode(self) -> str:
        """"read" when every key is read; otherwise "write" (the body writes at least one)."""
        return "read" if all(p in self.read_paths for p in self.paths) else "write"

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
            raise LockLost(self.key, lost_reason_of(self._lock) or "not held")


def current_lock() -> HeldLock:
    """The lock held by the locked task running in this thread/greenlet."""
    held = CURRENT.get()
    if held is None:
        raise RuntimeError("current_lock() called outside a running ZkLockedTask")
    return held


class NestedLock:
    """A nested call's hold: the outer's keys (never released here) and the ones it took."""

    def __init__(self, outer: Holding, taken: Holding) -> None:
        self.outer, self.taken = outer, taken

    @property
    def locks(self) -> list[LockPart]:
        return [*self.outer.locks, *self.taken.locks]

    def is_held(self) -> bool:
        return self.outer.is_held() and self.taken.is_held()

    def release(self) -> bool:
        """Release what this call took (its proof); the outer's keys are the outer's to prove."""
        return self.taken.release()


def tokens_of(lock: Any) -> dict[str, int]:
    """The fencing token of each path of a granted lock (``Any``: a FairLock has one
    ``path`` and ``token``, a MultiLock and an AgentLock have ``tokens`` per path)."""
    tokens = getattr(lock, "tokens", None)
    return dict(tokens) if tokens is not None else {lock.path: lock.token}


def holding_of(held: HeldLock) -> Holding:
    """The lock under a run's hold (private on :class:`HeldLock`, which users see): a call
    nested in that run holds through it too."""
    return held._lock


def lost_reason_of(lock: Holding) -> str | None:
    return next((lk.lost_reason for lk in lock.locks if lk.lost_reason), None)


# ------------------------------------------------------------------ interrupting the body when the hold is lost
class RunState:
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


def _current_greenlet() -> Any:
    if "gevent" not in sys.modules:  # never import gevent into a process that does not use it
        return None
    from gevent import getcurrent, monkey

    if monkey.is_module_patched("threading"):
        return getcurrent()
    return None


def _kill_greenlet(glet: Any, reason: str, run_state: RunState) -> None:
    import gevent

    def throw() -> None:
        # Runs later in the hub: the body may have ended (and begun releasing) meanwhile.
        if run_state.running:
            glet.throw(LockLost("lock", reason))

    gevent.get_hub().loop.run_callback(throw)
