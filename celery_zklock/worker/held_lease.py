"""Leases on the Redis messages a worker holds aside: never delivered twice while it lives,
never stranded for an hour when it dies.

Why: kombu's Redis transport keeps a delivered, unacknowledged message in its ``unacked``
hash, scored in ``unacked_index`` by its delivery time, and any worker's sweep puts it back
in its queue once that score is older than ``visibility_timeout`` (default 1 hour).  A
request held aside for its lock is such a message.  Held longer than the timeout, it was
delivered again and ran twice; held by a worker that was SIGKILLed, it waited the whole
timeout before running anywhere.

So the score of each held message is a lease: while the worker lives, its main process
keeps the score at ``now - visibility_timeout + lease`` (renewed every quarter lease), and
every worker sweeps for lapsed ones each second (kombu's own sweep runs every 100 s by
default).  A dead worker's held messages are back in their queue within one lease and a
second.  A message whose lease lapsed (the worker stalled, or lost Redis, for a lease) may
have been delivered elsewhere: it is no longer this worker's to run, and before a held
request goes to the pool its lease is checked (renewed first if it is older than half a
lease), so that both copies never run.

The window that remains: a worker that stalls for a whole lease between that check and
the pool's acknowledgement (a few milliseconds), or hosts whose clocks differ by more than
half a lease (the score is one host's clock, the sweep another's).  kombu internals used:
the Redis channel's ``unacked_index_key``, ``visibility_timeout``, ``conn_or_acquire`` and
``qos.restore_visible`` (its own sweep), and the virtual transport's ``QoS.ack`` to forget
a delivery locally without touching Redis (another worker may hold its new delivery).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Union

from celery.utils.log import get_logger

if TYPE_CHECKING:
    from kombu.message import Message

logger = get_logger("celery_zklock.worker")

#: Seconds between this worker's sweeps for lapsed leases (any worker's).
SWEEP_EVERY = 1.0

#: A delivery's tag: Redis's are strings (kept across a sweep back to the queue), AMQP's numbers.
Tag = Union[str, int]


def redis_channel(channel):
    """``channel`` if it is a kombu Redis channel, else None (another broker, or none)."""
    if channel is None or not hasattr(channel, "unacked_index_key") or not hasattr(channel, "conn_or_acquire"):
        return None
    return channel


class HeldLeases:
    """The leases of the messages this worker holds aside, by delivery tag."""

    def __init__(self, lease: float) -> None:
        self.lease = lease
        self.held: dict[Tag, tuple[Any, float, Message]] = {}  # tag -> (channel, monotonic time leased (0: not
        # yet), message): kept until the message is acknowledged, not only while it waits aside
        self.failing = False  # the last renewal failed (logged once until one succeeds)
        self.fresh: list[Tag] = []  # tags held since the last renewal_new (it is due while any)
        self.last_score = 0.0  # the score of the last renewal: each one's is higher

    def hold(self, req) -> bool:
        """Lease ``req``'s message from the next :meth:`renew` on; True if it is a Redis one."""
        channel = redis_channel(getattr(getattr(req, "message", None), "channel", None))
        if channel is None:
            return False
        self.held[req.message.delivery_tag] = (channel, 0.0, req.message)
        self.fresh.append(req.message.delivery_tag)
        return True

    @property
    def new(self) -> bool:
        """Messages held since the last :meth:`renew_new`: it is due."""
        return bool(self.fresh)

    def renew_new(self) -> set[Tag]:
        """Lease the messages held since the last renewal (one transaction for all that came
        in a turn of the event loop): until then a SIGKILL strands them for the timeout."""
        fresh, self.fresh = self.fresh, []
        return self.renew(fresh)  # not a walk over every held message: this runs on the event loop's hot path

    def clear(self) -> None:
        """The connection is gone (or stopping): its deliveries' leases end with it."""
        self.held.clear()
        self.fresh = []

    def let_go(self, req) -> None:
        tag = delivery_tag(req)
        if tag is not None:
            self.held.pop(tag, None)

    def renew(self, tags: list[Tag] | None = None) -> set[Tag]:
        """Renew the leases of ``tags`` (all held, by default) in one transaction per channel;
        returns the tags Redis no longer holds as unacknowledged (swept back to their queue:
        no longer ours).  On a Redis error nothing is renewed, and nothing is said lost."""
        if tags is None:  # the periodic renewal of all: drop what a pool process took (or was revoked)
            for tag, (_channel, _leased, message) in list(self.held.items()):
                if message.acknowledged:
                    del self.held[tag]
            tags = list(self.held)
        else:  # a few, on the event loop's hot path: no walk over every held message
            tags = [t for t in tags if t in self.held]
        by_channel: dict[int, tuple[Any, list[Tag]]] = {}
        for tag in tags:
            channel = self.held[tag][0]
            by_channel.setdefault(id(channel), (channel, []))[1].append(tag)
        lost: set[Tag] = set()
        for channel, group in by_channel.values():
            now = time.monotonic()
            try:
                scores = self._renew(channel, group)
            except Exception as exc:
                if not self.failing:
                    logger.warning("celery-zklock: cannot renew the leases of %d request(s) held aside (%r); they go "
                                   "back to the broker's queue if this lasts %.0fs", len(group), exc, self.lease)
                self.failing = True
                continue
            self.failing = False
            for tag, score in zip(group, scores, strict=True):  # one reply per command
                if score is None:
                    lost.add(tag)
                else:
                    self.held[tag] = (channel, now, self.held[tag][2])
        return lost

    def _renew(self, channel: Any, tags: list[Tag]) -> list[float | None]:
        """One ``ZADD XX CH`` per tag, in one round trip: 1 where the message is still held
        unacknowledged (its score moved), 0 where Redis no longer has it (XX adds nothing).
        Why ZADD and no read: kombu prefixes the keys of the commands it uses itself
        (``global_keyprefix``), ZADD among them, and ZSCORE not.  The score grows at every
        renewal, so CH never reads an unchanged score as a missing member."""
        score = self.last_score = max(time.time() - channel.visibility_timeout + self.lease, self.last_score + 0.001)
        key = channel.unacked_index_key
        with channel.conn_or_acquire() as client:
            pipe = client.pipeline(transaction=False)
            for tag in tags:
                pipe.zadd(key, {tag: score}, xx=True, ch=True)
            replies = pipe.execute()
        return [None if not changed else score for changed in replies]

    def ours(self, req) -> bool:
        """May ``req``, held aside, still run here?  Yes if its lease was renewed within half a
        lease, or is renewed now; no if Redis swept it back, or cannot say (its lease then
        lapses and the sweep returns it to its queue: it runs once, elsewhere or here)."""
        tag = delivery_tag(req)
        entry = None if tag is None else self.held.get(tag)
        if tag is None or entry is None:
            return True  # not a Redis message (or not leased here): the broker's own rules
        if entry[1] and time.monotonic() - entry[1] < self.lease / 2:
            return True
        lost = self.renew([tag])
        entry = self.held.get(tag)
        return tag not in lost and entry is not None and entry[1] > 0 and time.monotonic() - entry[1] < self.lease / 2

    def sweep(self, channel) -> None:
        """Return lapsed messages (any worker's) to their queues now, with kombu's own sweep."""
        try:
            channel.qos.restore_visible(start=0, num=getattr(channel, "unacked_restore_limit", None), interval=1)
        except Exception as exc:  # the broker is down: kombu's reconnection deals with it
            logger.debug("celery-zklock: sweep for lapsed leases failed: %r", exc)


def delivery_tag(req: Any) -> Tag | None:
    """The delivery tag of ``req``'s message (None: it has none)."""
    return getattr(getattr(req, "message", None), "delivery_tag", None)


def forget_delivery(req, redelivered_here: bool = False) -> None:
    """Forget ``req``'s delivery in this worker only: out of the channel's prefetch count and
    Celery's reserved requests, without acknowledging it in Redis (its message is back in
    its queue, and its next delivery, elsewhere or here, carries the same tag).  With
    ``redelivered_here``, that next delivery came here already and took its place in the
    channel's count (same tag): the count stays."""
    from celery.worker import state as worker_state
    from kombu.transport.virtual import QoS

    message = req.message
    if not redelivered_here:
        try:
            QoS.ack(message.channel.qos, message.delivery_tag)
        except Exception:
            pass
    message._state = "REJECTED"  # nothing may acknowledge it later
    worker_state.reserved_requests.discard(req)
