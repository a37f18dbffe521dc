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


def test_overlapping_detects_overlap():
    assert overlapping([(0, 2), (1, 3)]) == 1
    assert overlapping([(0, 1), (1, 2)]) is None
    assert overlapping([(0, 3), (1, 2), (1.5, 4)], max_holders=2) == 1.5
