"""Who is running: the identity a :class:`~celery_zklock.engine.lock.FairLock` keys its hold on.

Why not a number: ``threading.get_ident()`` is handed to the next thread once a thread has
exited, and under gevent it is ``id()`` of the greenlet, its address, reused once the greenlet
is freed.  A hold keyed on it was re-entered by an unrelated thread (issue 41).  Nor
``threading.current_thread()``: under gevent monkey-patching it is a ``_DummyThread`` found in
``threading._active`` by that same id (gevent drops the entry when a ``Greenlet`` ends, never
for a raw greenlet), and in CPython before 3.13 a thread not started by :mod:`threading`
gets a ``_DummyThread`` that stays in ``_active`` under its id after the thread has gone.

So the identity is an object that only this thread (or greenlet) can ever be: the lock holds
a reference to it and compares with ``is``; while it is held, its memory cannot be reused.
"""

from __future__ import annotations

import _thread
import sys


class ThreadOwner:
    """One OS thread's identity, made on first use in that thread and dropped when it ends."""

    __slots__ = ("name", "__weakref__")

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<thread {self.name}>"


# The interpreter's own thread-local, captured here: a thread's values die with the thread
# (never with an id), whatever gevent or eventlet patch later (their greenlets take the
# branch below anyway).
_per_thread = _thread._local()


def current_owner() -> object:
    """The running greenlet under gevent/eventlet monkey-patching, else the running thread's
    :class:`ThreadOwner`: an object no later thread or greenlet can be.

    Greenlets of one thread are one owner when nothing is patched (they share the thread's
    blocking primitives, so they could not wait for each other anyway), as before.
    """
    if _threads_are_greenlets():
        import greenlet

        return greenlet.getcurrent()
    owner = getattr(_per_thread, "owner", None)
    if owner is None:
        import threading

        owner = _per_thread.owner = ThreadOwner(threading.current_thread().name)
    return owner


def _threads_are_greenlets() -> bool:
    """True when gevent or eventlet has patched ``threading`` (checked at each call: patching
    may come after this module is imported; a module never imported was never patched)."""
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None and gevent_monkey.is_module_patched("threading"):
        return True
    patcher = sys.modules.get("eventlet.patcher")
    return patcher is not None and patcher.is_monkey_patched("thread")
