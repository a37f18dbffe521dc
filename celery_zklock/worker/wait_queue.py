"""A cohort's local queue: our requests waiting for the key's node, in arrival order.

Why not a ``deque``: leaving it (timeout, cancel, revoke, a process gone) and asking a
waiter's place were linear in the backlog.  When the worker's main process goes, thousands
of its requests leave in one event of the agent's one thread, in any order: out of order,
5,000 leaves cost 12.5M comparisons (0.25 s measured; quadratic, so 10,000 cost about
1 s), and an event thread that busy stops its heartbeats and is killed as frozen
(``agent.STUCK_AFTER``).  An insertion-ordered dict keyed by identity joins, leaves,
and finds the first and last in O(1); :meth:`WaitQueue.within` answers the one position
question the cohort asks (among the first ``k``? ``k`` is a handful of fresh nodes) in
O(k).  Waiters are compared by identity only: a request is itself, never an equal copy.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Any, Iterator


class WaitQueue:
    """FIFO of waiters with O(1) join, leave and put-back-first."""

    __slots__ = ("_waits",)

    def __init__(self) -> None:
        self._waits: OrderedDict[int, Any] = OrderedDict()

    def append(self, wait) -> None:
        """Join at the back (a waiter already queued stays where it is)."""
        self._waits.setdefault(id(wait), wait)

    def appendleft(self, wait) -> None:
        """Put back at the front (a reserved waiter whose node was lost: first in line still)."""
        self._waits[id(wait)] = wait
        self._waits.move_to_end(id(wait), last=False)

    def remove(self, wait) -> bool:
        """Leave; False if it was not queued."""
        return self._waits.pop(id(wait), None) is not None

    def first(self):
        """The first in line, or None."""
        return next(iter(self._waits.values()), None)

    def last(self):
        """The last in line, or None."""
        return next(reversed(self._waits.values()), None)

    def within(self, wait, k: int) -> bool:
        """Is ``wait`` among the first ``k`` in line?  O(k), whatever the backlog."""
        return id(wait) in self._waits and any(w is wait for w in islice(self._waits.values(), k))

    def __contains__(self, wait) -> bool:
        return id(wait) in self._waits

    def __len__(self) -> int:
        return len(self._waits)

    def __iter__(self) -> Iterator:
        return iter(self._waits.values())
