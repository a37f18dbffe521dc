"""The lock's one decision, as a pure function (Curator's ``StandardLockInternalsDriver``).

Why pure: every way a contender can advance — a create reply, a children listing, a watch
firing — ends in the same question: given the children of the lock path and our node, do
we hold, and if not, which nodes must we watch?  Answering it without I/O makes it
testable from a table and keeps the event-driven core (:mod:`celery_zklock.engine.internals`) free
of ordering rules.
"""

from __future__ import annotations

import heapq
from typing import Iterable, NamedTuple

from .znodes import HALF_WRAP, SEQUENCE_WRAP, is_shared, sequence_of


class Decision(NamedTuple):
    """What one look at the children tells a contender.

    ``index`` is our place in the queue (None when our node is not among the children:
    it was deleted, or died with our session).  ``watch`` lists the nodes whose departure
    can free a slot for us; ``handoff`` says that ``watch`` holds *everyone* ahead of us,
    so the deletion of any one of them makes us a holder without reading the children again.
    ``soon`` is the node just ahead of ``watch``: nodes leave in queue order, so when it
    has left, so has everyone ahead of it, and we are *next in line* (only holders ahead).
    A caller that acts on that moment (the worker's agent hands the request to the pool
    early) watches it too and looks again when it goes; others ignore it.
    """

    holds: bool
    index: int | None  # type: ignore[assignment]  # shadows tuple.index, which nobody calls on it
    watch: tuple[str, ...]
    handoff: bool
    soon: tuple[str, ...] = ()


def gets_the_lock(children: Iterable[str], node: str, max_holders: int) -> Decision:
    """Do we hold (``node`` among the ``max_holders`` lowest sequences), and whom to watch.

    Why the window of ``max_holders`` nodes directly ahead and not only "the node N places
    ahead": holders release and waiters time out in any order; watching only the node N
    ahead misses the departure of the nodes between, and can wait forever while a slot is
    free (N=2, queue A B C D me: D times out, B releases — C and I now both hold, yet C
    watches A and I watch C).  The window is the smallest set whose changes can free a
    slot for us; with N=1 it is exactly one node, so a release wakes one waiter (no herd).
    """
    # Without sorting the queue: only the nodes ahead of ours count, and of them only the
    # max_holders + 1 nearest (a look at a long queue is the engine's hottest loop).  Ahead
    # is modulo the sequence's wrap (znodes.SEQUENCE_WRAP); the sequence is unique per parent.
    if not isinstance(children, (list, tuple, set, frozenset)):
        children = list(children)
    mine = sequence_of(node)
    if mine is None or node not in children:
        return Decision(False, None, (), False)
    ahead = []
    origin = mine - HALF_WRAP  # queue_distance, inlined: this loop is the engine's hottest
    for name in children:
        seq = sequence_of(name)
        if seq is not None:
            distance = (seq - origin) % SEQUENCE_WRAP - HALF_WRAP
            if distance < 0:
                ahead.append((distance, name))
    index = len(ahead)
    if index < max_holders:
        return Decision(True, index, (), False)
    nearest = heapq.nlargest(max_holders + 1, ahead)  # nearest first
    window = tuple(name for _, name in reversed(nearest[:max_holders]))
    soon = (nearest[max_holders][1],) if index > max_holders else ()
    return Decision(False, index, window, index == max_holders, soon)


def reader_gets_the_lock(children: Iterable[str], node: str) -> Decision:
    """Does the reader ``node`` hold (no exclusive node queues ahead of it), and whom to watch
    (Curator's ``readLockPredicate``, kazoo's ``ReadLock``).

    Readers ahead never block a reader: they share.  Every other node ahead does: a writer,
    a mutex's holder or waiter, of any of the peers.  Why the *nearest* exclusive node
    ahead, where Curator watches the first: it holds only once everyone ahead of it has
    gone, so its departure usually frees us in one wake-up; watching the first wakes the
    reader once per writer ahead.  One node watched, never the queue: no herd.  ``handoff``
    when that node is the only one ahead, so that it holds and its departure frees us.
    """
    if not isinstance(children, (list, tuple, set, frozenset)):
        children = list(children)
    mine = sequence_of(node)
    if mine is None or node not in children:
        return Decision(False, None, (), False)
    index, nearest = 0, None
    origin = mine - HALF_WRAP
    for name in children:
        seq = sequence_of(name)
        if seq is None:
            continue
        distance = (seq - origin) % SEQUENCE_WRAP - HALF_WRAP
        if distance < 0:
            index += 1
            if not is_shared(name) and (nearest is None or distance > nearest[0]):
                nearest = (distance, name)
    if nearest is None:
        return Decision(True, index, (), False)
    return Decision(False, index, (nearest[1],), index == 1)
