"""Progress lines and Ctrl-C handling of the command-line programs (demo, examples, bench).

Why a flag as well as the exception: libraries on the way (kombu, redis-py, celery's result
consumer) may catch a KeyboardInterrupt raised inside them; every wait loop of the
programs (and :func:`support.workers.wait_ready`) checks :data:`STOP` too, so an interrupt
is never lost and the callers' ``finally`` blocks (the cleanup) always run.
"""

from __future__ import annotations

import signal
import threading
import time

__all__ = ["STOP", "say", "install_interrupt_handlers", "check_stop"]

_T0 = time.monotonic()

#: Set by the SIGINT/SIGTERM handler installed by :func:`install_interrupt_handlers`.
STOP = threading.Event()


def say(msg: str) -> None:
    """A progress line, stamped with seconds since the program started."""
    print(f"[{time.monotonic() - _T0:6.1f}s] {msg}", flush=True)


def _on_interrupt(signum, frame):
    STOP.set()
    raise KeyboardInterrupt


def install_interrupt_handlers() -> None:
    """Ctrl-C and SIGTERM both unwind into the callers' ``finally`` blocks (the cleanup)."""
    signal.signal(signal.SIGINT, _on_interrupt)
    signal.signal(signal.SIGTERM, _on_interrupt)


def check_stop() -> None:
    if STOP.is_set():
        raise KeyboardInterrupt
