"""The prefetch window a worker's main process raises for requests that wait for their lock
comes back exactly (issue 39): every raise is taken back once, and only a raise that took
effect.

Why: kombu's ``QoS.increment_eventually`` does nothing at ``worker_eta_task_limit`` (its
``max_prefetch``) or with no window at all (0), while ``decrement_eventually`` always takes
one off (down to 1).  Taking back a raise that never happened shrinks the window for good:
with the limit set, every waiting request used to cost the worker one place, down to a
window of one message.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from kombu.common import QoS

from celery_zklock.worker.worker_queue import MAX_HELD, WaitOutsidePool


def _step(qos: QoS) -> WaitOutsidePool:
    """The consumer step's bookkeeping alone (no worker, no agent)."""
    step = WaitOutsidePool.__new__(WaitOutsidePool)
    step.c = SimpleNamespace(qos=qos)
    step.counted, step.counted_waiting, step.early, step.paths, step.on_path = set(), set(), {}, {}, Counter()
    return step


@pytest.mark.parametrize(
    "initial, limit, raised",
    [
        (4, None, 9),  # no limit: each waiting request raises it
        (4, 6, 6),  # worker_eta_task_limit: raised up to the limit, no further
        (4, 4, 4),  # already at the limit: never raised
        (0, None, 0),  # no window (prefetch multiplier 0): nothing to raise
    ],
)
def test_the_window_comes_back_exactly(initial, limit, raised):
    qos = QoS(lambda **kw: None, initial, max_prefetch=limit)
    step = _step(qos)
    ids = [f"r{i}" for i in range(5)]
    for request_id in ids:
        step._outside_window(request_id)
        step._outside_window(request_id)  # told twice (known behind ours, then "queued"): raised once
    assert qos.value == raised
    for request_id in ids:
        step._not_waiting(request_id, SimpleNamespace())
        step._not_waiting(request_id, SimpleNamespace())
    assert qos.value == initial and not step.counted


def test_beyond_max_held_waiting_requests_take_places_in_the_window():
    qos = QoS(lambda **kw: None, 4)
    step = _step(qos)
    step.counted = {f"held{i}" for i in range(MAX_HELD)}
    step._outside_window("one more")
    assert qos.value == 4 and "one more" not in step.counted


def test_the_agents_reader_is_registered_again_at_every_start_of_the_event_loop():
    """A broker reconnection resets the hub, which forgets every reader; Celery then calls
    each consumer step's ``register_with_event_loop`` as the loop starts again.  Without the
    step's, the agent's grants were read only by the 0.4 s liveness check (a review found it)."""
    import socket

    from kombu.asynchronous import Hub

    ours, theirs = socket.socketpair()
    hub = Hub()
    try:
        step = _step(QoS(lambda **kw: None, 4))
        step.active, step.sock = True, ours
        step.register_with_event_loop(step.c, hub)
        assert ours.fileno() in hub.readers
        hub.reset()  # what asynloop does as the broker connection goes
        assert ours.fileno() not in hub.readers
        step.register_with_event_loop(step.c, hub)
        assert hub.readers[ours.fileno()][0] == step._readable
    finally:
        hub.close()
        ours.close()
        theirs.close()
