"""The prefetch window of a worker's main process, raised for the requests it holds aside.

Why: a request held aside while its lock agent queues for it is an unacknowledged message, and
Celery counts each one in the consumer's prefetch window; held requests would use it all up,
and the worker would take no other work (a hot key's backlog beside free keys).  So requests
known to wait leave the window, as ETA tasks do, up to :data:`MAX_HELD`; the window moves in a
band (:func:`window_change`) kept apart from Celery's own value (:class:`WindowBand`).  Which
request waits is the consumer step's to say (:mod:`celery_zklock.worker.wait_outside_pool`).
"""

from __future__ import annotations

from kombu.common import PREFETCH_COUNT_MAX

from .next_in_line import pool_size

#: Requests one worker holds aside for their locks beyond its prefetch window (unacknowledged;
#: a few KB of memory each).  Why a bound: a burst of 100,000 on one key must stay in the
#: broker, not in one worker, where a crash would leave it to the broker's visibility timeout
#: (Redis: 1 hour).  Beyond it, held requests count against the prefetch window, and the
#: worker takes new messages only as grants free the window.
MAX_HELD = 5000

#: The most messages the band of :func:`window_change` adds to the prefetch window beyond the
#: requests held aside (twice this, before it is lowered).
WINDOW_BAND_MAX = 64


class PrefetchWindow:
    """The requests kept out of the consumer's prefetch window (it was raised for them), and
    the band that raises it."""

    def __init__(self, c) -> None:
        self.c = c  # Celery's consumer: its QoS (a new one per consumer start) and pool
        self.counted: set[str] = set()
        self.band = WindowBand()

    def outside(self, request_id: str) -> None:
        """A request that waits for its lock must not use up the prefetch window (as Celery
        does for ETA tasks) -- up to MAX_HELD of them; beyond, each held request takes a
        place in the window, so the worker stops taking messages until grants free some.

        Only one that waits: known when another of ours waits for its key, or when the agent
        says it is queued.  Until then it counts against the window, as any message does until
        a pool process takes it: a burst's requests granted at once (keys nobody holds) are
        not taken past the window by whichever worker reads first, then to queue for a
        process there behind a hot key's streak (issue 39).  The band of
        :func:`window_change` still lets a worker holding requests aside take up to twice
        its step more: the price of not moving the window once per task."""
        if request_id not in self.counted and len(self.counted) < MAX_HELD:
            self.counted.add(request_id)  # taken back in inside()
            self._fit()

    def inside(self, request_id: str) -> None:
        """It no longer waits here: it counts in the window again (until a pool process takes it)."""
        if request_id in self.counted:
            self.counted.discard(request_id)
            self._fit()

    def clear(self) -> None:
        """The consumer stops: the next start makes a new window (and QoS)."""
        self.counted.clear()
        self.band.clear()

    def _fit(self) -> None:
        self.band.fit(self.c.qos, len(self.counted), pool_size(self.c))


def window_change(counted: int, raised: int, pool: int) -> int:
    """How much to raise (> 0) or lower (< 0) the prefetch window that ``raised`` messages were
    added to, for ``counted`` requests held aside outside it: raised to ``counted + step`` when
    short, lowered back to that once more than ``2 * step`` over, all of it once none is held;
    ``step`` is an eighth of ``counted``, at most :data:`WINDOW_BAND_MAX`, but at least the
    ``pool``'s size (so a pool of more than 64 processes has a wider band).

    Why a band and not one message per request: kombu sends each change of the window to the
    broker, and on RabbitMQ that is a ``basic.qos`` round trip in the worker's main process;
    on a hot key every request is held and handed over in turn, so the window went up and
    down about once per task (one RPC per order on the flash sale, 0.2 ms of the main
    process's time each).  The price: while requests wait aside, the worker may take up to
    ``2 * step`` more messages than its window.  Raising exactly to ``counted`` would not lower
    that bound (the lowering's band is what allows it), only cost a round trip per request
    while a backlog grows."""
    if counted <= 0:
        return -raised
    step = max(pool, min(counted // 8, WINDOW_BAND_MAX))
    if counted > raised:
        return counted + step - raised
    if raised - counted > 2 * step:
        return counted + step - raised
    return 0


class WindowBand:
    """The messages the prefetch window is raised by for requests held aside, kept apart from
    Celery's own window (``qos.value``): they are added only as the window is sent to the
    broker.  Why apart: Celery writes its value outright (its restore after a broker
    reconnection) and moves it for ETA tasks up to ``worker_eta_task_limit``; a raise folded
    into it was overwritten or took Celery's room, and taking it back then shrank the window
    for good (a review found a window of 16 ending at 2)."""

    def __init__(self) -> None:
        self.raised = 0
        self.qos = None  # the consumer's QoS whose sends add ``raised`` (a new one per consumer start)

    def fit(self, qos, counted: int, pool: int) -> None:
        """Move the band for ``counted`` requests held aside (:func:`window_change`); the event
        loop's next turn sends the window, as it does for Celery's own changes."""
        if qos is None:
            return  # no consumer (stopped): the next start makes a new window
        if qos is not self.qos:
            self._wrap(qos)
        change = window_change(counted, self.raised, pool)
        if change:
            self.raised += change
            qos.prev = None  # asynloop sends the window when qos.prev != qos.value

    def clear(self) -> None:
        self.raised = 0
        if self.qos is not None:
            self.qos.prev = None

    def _wrap(self, qos) -> None:
        send = qos.callback

        def callback(prefetch_count):
            # ``max_prefetch`` (``worker_eta_task_limit``): kombu >= 5.6; before, no limit.
            return send(prefetch_count=window_sent(prefetch_count, self.raised, getattr(qos, "max_prefetch", None)))

        qos.callback = callback
        self.qos, self.raised = qos, 0  # a new consumer start's window holds none of ours


def window_sent(value: int, raised: int, limit: int | None) -> int:
    """The window the broker is told: Celery's ``value`` and the band's ``raised`` messages,
    the band capped by ``worker_eta_task_limit`` (``limit``: a bound on what one worker holds
    in memory) and by the most AMQP can say; a window of 0 (no limit) stays 0, and the band
    never lowers Celery's own value."""
    if not value or raised <= 0:
        return value
    top = min(limit, PREFETCH_COUNT_MAX) if limit else PREFETCH_COUNT_MAX
    return value + max(0, min(raised, top - value))
