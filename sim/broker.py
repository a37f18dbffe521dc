"""A Redis broker, as kombu's Redis transport uses it, for the held-aside scenarios.

What it keeps (kombu/transport/redis.py): one queue (a list: published at one end,
consumed at the other, a message swept back goes where it is consumed next); the
``unacked`` hash and the ``unacked_index`` sorted set, scored by delivery time, that
``restore_visible`` sweeps: every entry scored at or below ``now - visibility_timeout``
goes back to the queue, flagged ``redelivered``, with the delivery tag it was published
with (kombu assigns the tag at publish: a redelivery, here or elsewhere, carries the same
tag).  An ack removes the tag from both, whoever's delivery it is now.  Each Redis call
is atomic (one MULTI/EXEC, or a single command); the server's clock is the world's.

What it records, for the invariants (:mod:`sim.checks`): every delivery of every message
(which worker, when fetched, handed to the pool, acknowledged, swept back), and every
start of a task's body.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

#: The world's time 0 on the wall clock (kombu scores with time.time(); Redis ranges from 0).
EPOCH = 1_000_000.0
INDEX = "unacked_index"


class Message:
    def __init__(self, task_id: str, path: str, tag: str, published: float) -> None:
        self.task_id = task_id
        self.path = path
        self.tag = tag
        self.published = published
        self.redelivered = False
        self.deliveries: list[Delivery] = []


class Delivery:
    """One delivery of a message to a worker's channel."""

    def __init__(self, msg: Message, channel: "Channel", now: float, turn: int) -> None:
        self.msg = msg
        self.channel = channel
        self.worker = channel.worker
        self.fetched_at = now
        self.turn = turn  # the worker's event-loop turn that fetched it
        self.leased = False  # a renewal moved its score (held_lease)
        self.handed_at: float | None = None  # handed to Celery's pool path (the lease check passed)
        self.acked_at: float | None = None
        self.restored_at: float | None = None  # swept back to the queue
        self.restored_while_handed = False  # swept back after its hand-over, before its ack: the stated window
        self.forgotten_at: float | None = None  # dropped locally as swept back (held_lease.forget_delivery)
        self.req = None  # the worker's request for it

    def __repr__(self) -> str:
        return (f"<{self.msg.task_id} delivery {self.msg.deliveries.index(self) + 1} to {self.worker.name} at "
                f"{self.fetched_at:.3f}: handed {_t(self.handed_at)}, acked {_t(self.acked_at)}, "
                f"swept back {_t(self.restored_at)}, forgotten {_t(self.forgotten_at)}, leased {self.leased}>")


def _t(value) -> str:
    return "-" if value is None else f"{value:.3f}"


class RedisBroker:
    def __init__(self, world, visibility_timeout: float) -> None:
        self.world = world
        self.visibility_timeout = visibility_timeout
        self.queue: deque[Message] = deque()  # left: consumed next
        self.unacked: dict[str, Message] = {}
        self.index: dict[str, float] = {}
        self.current: dict[str, Delivery] = {}  # tag -> its delivery now in ``unacked``
        self.messages: dict[str, Message] = {}  # task id -> its message
        self.bodies: dict[str, list] = {}  # task id -> [(time, pool process name, delivery)]
        self.channels: list[Channel] = []
        self.restores = 0
        self.published = 0

    def wall(self) -> float:
        return EPOCH + self.world.now

    # ------------------------------------------------------------------ the producer
    def publish(self, task_id: str, path: str) -> None:
        self.published += 1
        msg = Message(task_id, path, f"tag-{task_id}", self.world.now)
        self.messages[task_id] = msg
        self.queue.append(msg)
        self._wake()

    def _wake(self) -> None:
        for channel in self.channels:
            channel.wake()

    # ------------------------------------------------------------------ a consumer
    def fetch(self, channel: "Channel", room: int, turn: int) -> list[Delivery]:
        """BRPOP (and kombu's QoS.append: the tag into ``unacked`` and the index, scored now)."""
        out = []
        while self.queue and room > 0:
            msg = self.queue.popleft()
            room -= 1
            delivery = Delivery(msg, channel, self.world.now, turn)
            msg.deliveries.append(delivery)
            self.unacked[msg.tag] = msg
            self.index[msg.tag] = self.wall()
            self.current[msg.tag] = delivery
            out.append(delivery)
        return out

    def ack(self, tag: str, delivery: Delivery) -> None:
        delivery.acked_at = self.world.now
        self.unacked.pop(tag, None)
        self.index.pop(tag, None)
        self.current.pop(tag, None)

    def requeue(self, tag: str, delivery: Delivery) -> None:
        """A reject with requeue (kombu's Redis QoS.reject): out of unacked, back to the queue."""
        if self.unacked.pop(tag, None) is not None:
            self.index.pop(tag, None)
            self.current.pop(tag, None)
            delivery.msg.redelivered = True
            self.queue.appendleft(delivery.msg)
            self._wake()

    def restore_visible(self) -> None:
        """kombu's sweep: every entry scored at or below now - visibility_timeout goes back."""
        ceil = self.wall() - self.visibility_timeout
        lapsed = sorted((score, tag) for tag, score in self.index.items() if 0 <= score <= ceil)
        for _score, tag in reversed(lapsed):  # ZRANGE ... REV: the newest first, each pushed to the head
            msg = self.unacked.pop(tag)
            del self.index[tag]
            delivery = self.current.pop(tag)
            delivery.restored_at = self.world.now
            if delivery.handed_at is not None and delivery.acked_at is None:
                delivery.restored_while_handed = True
            msg.redelivered = True
            self.queue.appendleft(msg)
            self.restores += 1
        if lapsed:
            self.world.log(f"redis: swept {len(lapsed)} lapsed message(s) back to the queue")
            self._wake()

    # ------------------------------------------------------------------ commands
    def execute(self, ops: list) -> list:
        """One MULTI/EXEC of the sorted-set commands held_lease sends."""
        replies = []
        for op, args, kwargs in ops:
            if op == "zscore":
                _key, tag = args
                replies.append(self.index.get(tag))
            elif op == "zadd":
                _key, mapping = args
                added = 0
                for tag, score in mapping.items():
                    old = self.index.get(tag)
                    if old is None and kwargs.get("xx"):
                        continue
                    if old is not None and kwargs.get("nx"):
                        continue
                    if old is not None and kwargs.get("gt") and score <= old:
                        continue
                    if old is not None and kwargs.get("lt") and score >= old:
                        continue
                    self.index[tag] = score
                    if old is None or (kwargs.get("ch") and score != old):
                        added += 1  # Redis's reply: added, or with CH added or changed
                    if old is not None and tag in self.current:
                        self.current[tag].leased = True
                replies.append(added)
            else:
                raise NotImplementedError(op)
        return replies

    def drained(self) -> bool:
        return not self.queue and not self.unacked


# ---------------------------------------------------------------------- what kombu shows
class _Pipeline:
    def __init__(self, broker: RedisBroker) -> None:
        self.broker = broker
        self.ops: list = []

    def zscore(self, *args, **kwargs):
        self.ops.append(("zscore", args, kwargs))
        return self

    def zadd(self, *args, **kwargs):
        self.ops.append(("zadd", args, kwargs))
        return self

    def execute(self) -> list:
        ops, self.ops = self.ops, []
        return self.broker.execute(ops)


class _Client:
    def __init__(self, broker: RedisBroker) -> None:
        self.broker = broker

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self.broker)


class _QoS:
    """The channel's QoS: kombu's local prefetch books (``_delivered``) and its sweep."""

    def __init__(self, channel: "Channel") -> None:
        self.channel = channel

    def _quick_ack(self, tag: str) -> None:  # kombu.transport.virtual.QoS.ack (local only)
        self.channel.delivered.pop(tag, None)

    def restore_visible(self, start=0, num=None, interval=1) -> None:
        self.channel.broker.restore_visible()


class Channel:
    """A worker's kombu Redis channel: what ``held_lease`` reads (``unacked_index_key``,
    ``visibility_timeout``, ``conn_or_acquire``, ``qos``) and the local prefetch books."""

    unacked_index_key = INDEX
    unacked_restore_limit = None

    def __init__(self, broker: RedisBroker, worker) -> None:
        self.broker = broker
        self.worker = worker
        self.visibility_timeout = broker.visibility_timeout
        self.qos = _QoS(self)
        self.delivered: dict[str, Delivery] = {}  # tag -> delivery (kombu's QoS._delivered)
        self.prefetch = 0  # what basic_qos last said (0: no limit)
        self.on_wake = None
        broker.channels.append(self)

    @contextmanager
    def conn_or_acquire(self):
        yield _Client(self.broker)

    def wake(self) -> None:
        if self.on_wake is not None:
            self.on_wake()

    def room(self) -> int:
        return (self.prefetch or 1000) - len(self.delivered)

    def fetch(self, turn: int) -> list[Delivery]:
        out = self.broker.fetch(self, self.room(), turn)
        for delivery in out:
            self.delivered[delivery.msg.tag] = delivery
        return out
