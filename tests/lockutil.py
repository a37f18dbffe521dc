"""Helpers shared by lock tests: hold-interval recording and an overlap checker."""

from __future__ import annotations

import itertools


def overlapping(intervals, max_holders: int = 1):
    """Return a point in time where more than ``max_holders`` intervals overlap, else None.

    ``intervals`` are (start, end) pairs; a sweep over sorted endpoints counts live holds.
    Ends sort before starts at the same instant (a release then an acquire is not overlap).
    """
    events = sorted(itertools.chain(((s, 1) for s, _ in intervals), ((e, -1) for _, e in intervals)),
                    key=lambda ev: (ev[0], ev[1]))
    live = 0
    for t, delta in events:
        live += delta
        if live > max_holders:
            return t
    return None


def children(zk, path):
    """Children of a lock parent; [] when the container is absent (it comes and goes)."""
    from kazoo.exceptions import NoNodeError

    try:
        return zk.get_children(path)
    except NoNodeError:
        return []
