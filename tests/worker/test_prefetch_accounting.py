"""The prefetch window a worker's main process raises for requests that wait for their lock
comes back exactly (issue 39), whatever Celery does to its own window meanwhile.

Why: the raise is kept apart from Celery's window (``qos.value``) and added only as the
window is sent.  Folded into it, it was lost or shrank the window for good: kombu's
``increment_eventually`` does nothing at ``worker_eta_task_limit`` while
``decrement_eventually`` always takes one off, and Celery's restore after a broker
reconnection writes the value outright.  These tests read what the broker is told.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery.worker.consumer.consumer import Consumer
from kombu.common import QoS

from celery_zklock.config import ZkSettings
from celery_zklock.worker.agent_connection import AgentConnection
from celery_zklock.worker.prefetch_window import MAX_HELD, WINDOW_BAND_MAX, PrefetchWindow, window_change, window_sent
from tests.versions import needs

#: ``worker_eta_task_limit`` reaches the window as ``QoS(max_prefetch=...)``, which kombu
#: added in 5.6; before, there is no limit, and the band's cap reads none.
ETA_LIMIT = needs("QoS(max_prefetch=...), the worker_eta_task_limit cap", kombu=(5, 6))


def _qos(send, initial: int, limit: int | None = None) -> QoS:
    """kombu's QoS, with ``max_prefetch`` only when there is a limit (kombu < 5.6 has none)."""
    return QoS(send, initial, max_prefetch=limit) if limit is not None else QoS(send, initial)


def _window(qos: QoS, pool: int = 1) -> PrefetchWindow:
    """The consumer step's prefetch window (no worker, no agent), with a pool of ``pool``."""
    return PrefetchWindow(SimpleNamespace(qos=qos, pool=SimpleNamespace(limit=pool)))


@pytest.mark.parametrize(
    "initial, limit, pool, least, most",
    [
        (4, None, 1, 9, 11),  # no limit: raised for every waiting request, within the band
        (4, None, 3, 9, 15),
        pytest.param(4, 6, 1, 6, 6, marks=ETA_LIMIT),  # worker_eta_task_limit: raised up to the limit, no further
        pytest.param(4, 4, 1, 4, 4, marks=ETA_LIMIT),  # already at the limit: never raised
        (0, None, 1, 0, 0),  # no window (prefetch multiplier 0): nothing to raise
    ],
)
def test_the_window_comes_back_exactly(initial, limit, pool, least, most):
    sent: list = []
    qos = _qos(lambda **kw: sent.append(kw["prefetch_count"]), initial, limit)
    window = _window(qos, pool)
    ids = [f"r{i}" for i in range(5)]
    for request_id in ids:
        window.outside(request_id)
        window.outside(request_id)  # told twice (known behind ours, then queued): counted once
    assert least <= _sent_window(qos, sent) <= most
    for request_id in ids:
        window.inside(request_id)
        window.inside(request_id)
    assert _sent_window(qos, sent) == initial and qos.value == initial
    assert not window.counted and window.band.raised == 0


def _sent_window(qos: QoS, sent: list) -> int:
    """What the broker was last told, after the turn of the event loop that follows (asynloop
    sends the window when ``qos.prev != qos.value``)."""
    if qos.prev != qos.value:
        qos.update()
    return sent[-1]


@pytest.mark.parametrize(
    "value, raised, limit, sent, why",
    [
        (4, 0, None, 4, "nothing added"),
        (4, 6, None, 10, "Celery's window and the band"),
        (0, 6, None, 0, "no window (multiplier 0) stays none"),
        (4, 6, 8, 8, "capped by worker_eta_task_limit"),
        (8, 6, 4, 8, "over the limit already: Celery's own value, never lowered"),
        (4, -3, None, 4, "never below Celery's own value"),
        (0xFFF0, 100, None, 0xFFFF, "at most what AMQP can say"),
    ],
)
def test_window_sent(value, raised, limit, sent, why):
    assert window_sent(value, raised, limit) == sent, why


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
    window = _window(qos, pool=3)
    for i in range(50):  # each in a loop turn of its own: a message comes, a grant comes
        window.outside(f"t{i + 1}")
        assert _sent_window(qos, sent) >= 4 + len(window.counted)  # the held never take Celery's window
        window.inside(f"t{i}")
        assert _sent_window(qos, sent) >= 4 + len(window.counted)
    assert len(sent) <= 2, sent


def test_beyond_max_held_waiting_requests_take_places_in_the_window():
    sent: list = []
    qos = QoS(lambda **kw: sent.append(kw["prefetch_count"]), 4)
    window = _window(qos)
    for i in range(MAX_HELD):
        window.outside(f"held{i}")
    window.outside("one more")
    assert "one more" not in window.counted and len(window.counted) == MAX_HELD
    window.inside("held0")
    window.outside("one more")  # a place freed: out of the window again
    assert "one more" in window.counted


def test_the_agents_reader_is_registered_again_at_every_start_of_the_event_loop():
    """A broker reconnection resets the hub, which forgets every reader; Celery then calls
    each consumer step's ``register_with_event_loop`` as the loop starts again.  Without the
    step's, the agent's grants were read only by the 0.4 s liveness check (a review found it)."""
    import os
    import socket
    import tempfile

    from kombu.asynchronous import Hub

    path = os.path.join(tempfile.mkdtemp(prefix="zklock-test-"), "agent.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(1)
    hub = Hub()
    agent = AgentConnection(SimpleNamespace(path=path, settings=ZkSettings()), answers=None)
    try:
        agent.open(hub)  # the consumer's first start
        fd = agent.sock.fileno()
        assert fd in hub.readers
        hub.reset()  # what asynloop does as the broker connection goes
        assert fd not in hub.readers
        agent.register(hub)  # the step's register_with_event_loop
        assert hub.readers[fd][0] == agent._readable
    finally:
        hub.close()
        agent.sock.close()
        listening.close()
        os.unlink(path)


class _Restoring:
    """Celery's own restore of the window after a broker reconnection (the consumer's code,
    run on a stand-in with the attributes it reads): each acknowledgement raises the window by
    the multiplier, up to concurrency x multiplier, overwriting whatever the value held."""

    restore = Consumer._restore_prefetch_count_after_connection_restart
    max_prefetch_count = Consumer.max_prefetch_count
    _new_prefetch_count = Consumer._new_prefetch_count

    def __init__(self, qos: QoS, concurrency: int, multiplier: int):
        self.qos, self.prefetch_multiplier = qos, multiplier
        self.pool = SimpleNamespace(num_processes=concurrency)
        self.app = SimpleNamespace(conf=SimpleNamespace(worker_enable_prefetch_count_reduction=True))
        self._maximum_prefetch_restored = False



def test_celerys_restore_after_a_reconnection_does_not_shrink_the_window_for_good():
    """Concurrency 4, multiplier 4: after a reconnection Celery starts from a reduced window
    and restores it ack by ack to 16, writing its own value.  Requests held aside meanwhile
    must not make the window end below 16 once they are gone (a review found it ending at 2:
    the restore overwrote the raise, and its taking back then undershot)."""
    sent: list = []
    qos = QoS(lambda **kw: sent.append(kw["prefetch_count"]), 4)
    consumer = _Restoring(qos, concurrency=4, multiplier=4)
    window = _window(qos, pool=4)
    held = [f"r{i}" for i in range(10)]
    for request_id in held:
        window.outside(request_id)
    assert _sent_window(qos, sent) >= 4 + len(held)
    while not consumer._maximum_prefetch_restored:
        consumer.restore(None)  # an acknowledgement's promise
        assert _sent_window(qos, sent) >= qos.value + len(held)  # Celery's window, and the held besides
    for request_id in held:
        window.inside(request_id)
    assert _sent_window(qos, sent) == 16


@ETA_LIMIT
def test_eta_tasks_at_the_eta_limit_do_not_shrink_the_window_for_good():
    """worker_eta_task_limit 8, window 4.  Celery raises the window by one for each ETA task it
    holds (a no-op at the limit) and lowers it by one as the task is sent to the pool (always).
    Requests held aside must not take the room below the limit that Celery's raise needs: the
    window ended one place smaller for every ETA task that came while they were held."""
    sent: list = []
    qos = QoS(lambda **kw: sent.append(kw["prefetch_count"]), 4, max_prefetch=8)
    window = _window(qos, pool=1)
    held = [f"r{i}" for i in range(5)]
    for request_id in held:
        window.outside(request_id)
    for _ in range(3):
        qos.increment_eventually()  # an ETA task comes (celery.worker.strategy)
    for _ in range(3):
        qos.decrement_eventually()  # ... and goes to the pool at its time
    for request_id in held:
        window.inside(request_id)
    assert _sent_window(qos, sent) == 4 and qos.value == 4


@ETA_LIMIT
def test_a_window_above_the_eta_limit_is_never_lowered_by_what_we_add():
    """The limit only caps raises: a window of 8 with a limit of 4 (Celery does not cap its
    initial value) must stay 8 while requests are held, and after."""
    sent: list = []
    qos = QoS(lambda **kw: sent.append(kw["prefetch_count"]), 8, max_prefetch=4)
    window = _window(qos, pool=1)
    window.outside("r0")
    assert _sent_window(qos, sent) == 8
    window.inside("r0")
    assert _sent_window(qos, sent) == 8
