"""The clock every lease age in the cohort is read from: :func:`lease_clock`.

Why not ``time.monotonic()``: on Linux it stops while the host or VM is suspended, and
ZooKeeper's clock does not.  A lease says "a write sent at ``t`` succeeded, so our session
lives until at least ``t`` + session timeout", measured on the *server's* time; after a
suspend longer than the session timeout, a monotonic reading still calls that proof young,
and a local handoff would be granted on a session that is already gone (its holder's token
then trails a holder's elsewhere).  ``CLOCK_BOOTTIME`` is monotonic *and* counts suspended
time, so a suspend ages the lease as it ages the session
(:func:`celery_zklock.engine.clock.boottime`, which the simulator drives).
"""

from __future__ import annotations

from typing import Callable

from ..engine.clock import SystemClocks, boottime

#: What a lease clock is: seconds, monotonic, with an arbitrary origin.
Clock = Callable[[], float]

#: The lease clock, and the name of the system clock behind it (for logs and tests).
lease_clock: Clock = boottime
LEASE_CLOCK_NAME = SystemClocks.BOOTTIME_NAME
