"""Stopping a running task body when its lock is lost (``on_lock_lost="interrupt"``).

Why a module of its own: raising into another thread (``PyThreadState_SetAsyncExc``) or
greenlet is delicate — the exception must never land after the body, where it would
skip the release — and none of it is about locks or Celery.  :class:`RunState` is the
one place that knows whether the body runs and how to reach it.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from .errors import LockLost


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


def _current_greenlet():
    if "gevent" not in sys.modules:  # never import gevent into a process that does not use it
        return None
    from gevent import getcurrent, monkey

    if monkey.is_module_patched("threading"):
        return getcurrent()
    return None


def _kill_greenlet(glet, reason: str, run_state: RunState) -> None:
    import gevent

    def throw() -> None:
        # Runs later in the hub: the body may have ended (and begun releasing) meanwhile.
        if run_state.running:
            glet.throw(LockLost("lock", reason))

    gevent.get_hub().loop.run_callback(throw)
