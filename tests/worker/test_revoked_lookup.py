"""Which held requests were revoked: looked up from the smaller side (``wait_outside_pool.among``).

Why: the main process checks every 0.1 s; a hot key's backlog holds up to ``MAX_HELD``
requests aside, and walking all of them for the few ids Celery revoked was a cost per
held request per tick (the revoke itself is tested with real workers in
``test_wait_outside_pool``)."""

from __future__ import annotations

import pytest
from celery.utils.collections import LimitedSet

from celery_zklock.worker.wait_outside_pool import among


def _limited(ids) -> LimitedSet:
    revoked = LimitedSet(maxlen=50000)
    for i in ids:
        revoked.add(i)
    return revoked


@pytest.mark.parametrize(
    "held, revoked, found",
    [
        ({}, [], []),
        ({"a": 1, "b": 2}, [], []),
        ({}, ["a"], []),
        ({"a": 1, "b": 2, "c": 3}, ["b"], ["b"]),  # fewer revoked than held: walks the revoked
        ({"a": 1}, ["x", "y", "a", "z"], ["a"]),  # more revoked than held: walks the held
        ({"a": 1, "b": 2}, ["a", "b"], ["a", "b"]),
        ({f"t{i}": i for i in range(5000)}, ["t17", "gone", "t4999"], ["t17", "t4999"]),
    ],
)
def test_among(held, revoked, found):
    assert sorted(among(held, _limited(revoked))) == found


def test_among_walks_the_smaller_side():
    class Counting(dict):
        def __iter__(self):
            raise AssertionError("walked the held requests, though fewer were revoked")

    assert among(Counting({f"t{i}": i for i in range(100)}), _limited(["t5"])) == ["t5"]
