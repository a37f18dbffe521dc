"""The clocks the lock reads, behind one seam: :func:`monotonic` and :func:`boottime`.

Why one seam: deadlines, timers and lease ages decide safety, and the simulator
(``sim/``) must control every reading of them to replay a run from its seed, including a
host suspend, which ``time.monotonic()`` does not see on Linux and ZooKeeper's clock does.
Production reads the system clocks through :data:`SYSTEM`; :func:`use` swaps the source
for the whole process.  Nothing else differs between the two.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clocks(Protocol):
    def monotonic(self) -> float:
        """Seconds, monotonic, arbitrary origin; may stop while the host is suspended."""

    def boottime(self) -> float:
        """Seconds, monotonic, and counting a host's suspend as ZooKeeper's clock does."""


def _has_boottime() -> bool:
    if not hasattr(time, "CLOCK_BOOTTIME"):
        return False
    try:
        time.clock_gettime(time.CLOCK_BOOTTIME)
    except OSError:  # a kernel without it (Linux < 2.6.39)
        return False
    return True


class SystemClocks:
    """The machine's clocks.  Without CLOCK_BOOTTIME (macOS, other Unixes, Windows)
    ``boottime`` falls back to ``time.monotonic()``: a suspend there is as unsafe as before."""

    if _has_boottime():
        BOOTTIME_NAME = "CLOCK_BOOTTIME"

        @staticmethod
        def boottime() -> float:
            return time.clock_gettime(time.CLOCK_BOOTTIME)
    else:  # pragma: no cover - not Linux
        BOOTTIME_NAME = "time.monotonic (does not count a suspend)"
        boottime = staticmethod(time.monotonic)

    monotonic = staticmethod(time.monotonic)


SYSTEM = SystemClocks()
_source: Clocks = SYSTEM


def monotonic() -> float:
    return _source.monotonic()


def boottime() -> float:
    return _source.boottime()


def use(source: Clocks) -> Clocks:
    """Read every clock of this package from ``source`` from now on; returns the previous one."""
    global _source
    previous, _source = _source, source
    return previous
