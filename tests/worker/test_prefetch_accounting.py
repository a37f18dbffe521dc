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

from celery_zklock.worker.worker_queue import MAX_HELD, WINDOW_BAND_MAX, WaitOutsidePool, window_change


def _step(qos: QoS, pool: int = 1) -> WaitOutsidePool:
    """The consumer step's bookkeeping alone (no worker, no agent), with a pool of ``pool``."""
    step = WaitOutsidePool.__new__(WaitOutsidePool)
    step.c = SimpleNamespace(qos=qos, pool=SimpleNamespace(limit=pool))
    step.counted, step.counted_waiting, step.early, step.paths, step.on_path = set(), set(), {}, {}, Counter()
    step.raised = 0
    return step


@pytest.mark.parametrize(
    "initial, limit, pool, least, most",
    [
        (4, None, 1, 9, 11),  # no limit: raised for every waiting request, within the band
        (4, None, 3, 9, 15),
        (4, 6, 1, 6, 6),  # worker_eta_task_limit: raised up to the limit, no further
        (4, 4, 1, 4, 4),  # already at the limit: never raised
        (0, None, 1, 0, 0),  # no window (prefetch multiplier 0): nothing to raise
    ],
)
def test_the_window_comes_back_exactly(initial, limit, pool, least, most):
    qos = QoS(lambda **kw: None, initial, max_prefetch=limit)
    step = _step(qos, pool)
    ids = [f"r{i}" for i in range(5)]
    for request_id in ids:
        step._outside_window(request_id)
        step._outside_window(request_id)  # told twice (known behind ours, then "queued"): counted once
    assert least <= qos.value <= most
    for request_id in ids:
        step._not_waiting(request_id, SimpleNamespace())
        step._not_waiting(request_id, SimpleNamespace())
    assert qos.value == initial and not step.counted and step.raised == 0


@pytest.mark.parametrize(
    "counted, raised, pool, change, why",
    [
        (0, 0, 3, 0, "nothing held, nothing added"),
        (0, 7, 3, -7, "none held: all of it back, exactly"),
        (1, 0, 3, 4, "short: raised to counted + step (the pool's size)"),
        (4, 4, 3, 0, "within the band"),
        (2, 4, 3, 0, "over by 2: within 2 * step"),
        (1, 8, 3, -4, "over by 7 > 2 * step: lowered to counted + step"),
        (5, 4, 3, 4, "short by one: raised to counted + step"),
        (80, 79, 3, 11, "a backlog: the step is an eighth of it"),
        (80, 100, 3, 0, "over by 20 <= 2 * 10"),
        (80, 101, 3, -11, "over by 21 > 2 * 10"),
        (4000, 3999, 3, 1 + WINDOW_BAND_MAX, "a large backlog: the step is at most WINDOW_BAND_MAX"),
        (3, 3, 0, 0, "a pool of 0 and a small backlog: exact"),
        (2, 3, 0, -1, "a pool of 0 and a small backlog: exact"),
    ],
)
def test_window_change(counted, raised, pool, change, why):
    assert window_change(counted, raised, pool) == change, why


def test_a_hot_keys_requests_held_and_handed_over_in_turn_seldom_move_the_window():
    """One request held aside and one handed over per task, as on a hot key: the window (a
    basic.qos round trip each time it moves, on RabbitMQ) moved once per task before."""
    sent: list = []
    qos = QoS(lambda **kw: sent.append(kw["prefetch_count"]), 4)
    step = _step(qos, pool=3)
    for i in range(50):  # each in a loop turn of its own: a message comes, a grant comes
        step._outside_window(f"t{i + 1}")
        qos.update()  # what asynloop does at each turn whose window changed
        step._not_waiting(f"t{i}", SimpleNamespace())
        qos.update()
    assert len(sent) <= 2, sent


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
