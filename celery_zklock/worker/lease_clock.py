"""The clock every lease age in the cohort is read from: one function, :func:`lease_clock`.

Why not ``time.monotonic()``: on Linux it stops while the host or VM is suspended, and
ZooKeeper's clock does not.  A lease says "a write sent at ``t`` succeeded, so our session
lives until at least ``t`` + session timeout", measured on the *server's* time; after a
suspend longer than the session timeout, a monotonic reading still calls that proof young,
and a local handoff would be granted on a session that is already gone (its holder's token
then trails a holder's elsewhere).  ``CLOCK_BOOTTIME`` is monotonic *and* counts suspended
time, so a suspend ages the lease as it ages the session.  Where it is missing (macOS, other
Unixes, Windows) this falls back to ``time.monotonic()``: a suspend there is as unsafe as
before, and nothing else changes.

One named seam, so a test (or the simulator of issue 35) injects one clock for every lease
reading: :class:`~celery_zklock.worker.cohort.Cohort` takes it as ``clock``.
"""

from __future__ import annotations

import time
from typing import Callable

#: What a lease clock is: seconds, monotonic, with an arbitrary origin.
Clock = Callable[[], float]


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def _choose() -> tuple[Clock, str]:
    if hasattr(time, "CLOCK_BOOTTIME"):
        try:
            _boottime()
        except OSError:  # a kernel without it (Linux < 2.6.39)
            pass
        else:
            return _boottime, "CLOCK_BOOTTIME"
    return time.monotonic, "time.monotonic (does not count a suspend)"


#: The lease clock of this platform, and its name (for logs and tests).
lease_clock, LEASE_CLOCK_NAME = _choose()
