"""Broker models for the held-aside scenarios: Redis as kombu's Redis transport uses it, and
RabbitMQ as AMQP defines it.

Redis (:class:`RedisBroker`, kombu/transport/redis.py): one queue (a list: published at one
end, consumed at the other, a message swept back goes where it is consumed next); the
``unacked`` hash and the ``unacked_index`` sorted set, scored by delivery time, that
``restore_visible`` sweeps: every entry scored at or below ``now - visibility_timeout``
goes back to the queue, flagged ``redelivered``, with the delivery tag it was published
with (kombu assigns the tag at publish: a redelivery, here or elsewhere, carries the same
tag).  An ack removes the tag from both, whoever's delivery it is now.  Each Redis call
is atomic (one MULTI/EXEC, or a single command); the server's clock is the world's.  A
lost connection leaves its unacknowledged messages in ``unacked``, scored as they were
(their leases, held_lease), for a sweep, unless kombu's channel restores them as it closes
(``do_restore``, which the step turns off: ``no_restore_on_a_dead_channel``).

RabbitMQ (:class:`RabbitBroker`): one queue; delivery tags per channel (1, 2, 3 ... on
each channel: a message delivered again, on a new channel, has a new tag); a channel's
unacknowledged deliveries limited by its ``basic_qos`` prefetch count; a reject with requeue
puts the message back at the head, flagged ``redelivered``; a lost connection requeues all
its unacknowledged messages at once, flagged ``redelivered``.  No visibility timeout, no
sweep.

On both, an ack or reject sent on a channel whose connection is gone is lost (kombu raises
a connection error, which Celery logs).

What they record, for the invariants (:mod:`sim.checks`): every delivery of every message
(which worker, when fetched, handed to the pool, acknowledged, swept back or requeued, cut
off with its connection), every run of a task's body, and the result store.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager

#: The world's time 0 on the wall clock (kombu scores with time.time(); Redis ranges from 0).
EPOCH = 1_000_000.0
INDEX = "unacked_index"


class ConnectionLost(ConnectionError):
    """An ack, reject or command sent on a channel whose connection is gone."""


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

    def __init__(self, msg: Message, channel: "Channel", now: float, turn: int, tag) -> None:
        self.msg = msg
        self.channel = channel
        self.worker = channel.worker
        self.tag = tag  # its delivery tag (Redis: the message's; RabbitMQ: the channel's next)
        self.redelivered = msg.redelivered  # the flag it was delivered with
        self.fetched_at = now
        self.turn = turn  # the worker's event-loop turn that fetched it
        self.leased = False  # a renewal moved its score (held_lease)
        self.handed_at: float | None = None  # handed to Celery's pool path (the lease check passed)
        self.acked_at: float | None = None
        self.restored_at: float | None = None  # swept back (Redis) or requeued (RabbitMQ) to the queue
        self.restored_while_handed = False  # swept back after its hand-over, before its ack: the stated window
        self.forgotten_at: float | None = None  # dropped locally as swept back (held_lease.forget_delivery)
        self.cut_at: float | None = None  # its connection was lost while it was unacknowledged
        self.handed_when_cut = False  # ... handed to the pool by the time its worker learnt of it (its
        # ack lost, or never sent)
        self.req = None  # the worker's request for it

    def __repr__(self) -> str:
        return (f"<{self.msg.task_id} delivery {self.msg.deliveries.index(self) + 1} to {self.worker.name} at "
                f"{self.fetched_at:.3f}{' (redelivered)' if self.redelivered else ''}: handed {_t(self.handed_at)}, "
                f"acked {_t(self.acked_at)}, back {_t(self.restored_at)}, forgotten {_t(self.forgotten_at)}, "
                f"cut {_t(self.cut_at)}, leased {self.leased}>")


def _t(value) -> str:
    return "-" if value is None else f"{value:.3f}"


class BodyRun:
    """One run of a task's body in a pool process."""

    def __init__(self, at: float, pool: str, delivery: Delivery) -> None:
        self.at = at
        self.pool = pool
        self.delivery = delivery
        self.released_at: float | None = None  # its lock's release sent
        self.stored_at: float | None = None  # its final state stored (just after the release)

    def __repr__(self) -> str:
        return f"<run on {self.pool} at {self.at:.3f}, released {_t(self.released_at)}, stored {_t(self.stored_at)}>"


class Broker:
    """What both models share: the producer, the queue, the records."""

    kind = "?"

    def __init__(self, world) -> None:
        self.world = world
        self.queue: deque[Message] = deque()  # left: consumed next
        self.messages: dict[str, Message] = {}  # task id -> its message
        self.bodies: dict[str, list[BodyRun]] = {}  # task id -> its body's runs
        self.results: dict[str, tuple[str, float]] = {}  # the result backend: task id -> (state, stored at)
        self.keeps_results = True  # False: the task keeps no result (ignore_result), nothing is stored
        self.channels: list[Channel] = []  # live ones
        self.restores = 0
        self.published = 0
        self.requeued = 0  # rejects with requeue the broker took

    def publish(self, task_id: str, path: str, copy: bool = False) -> None:
        """``copy``: published again from a delivery that may be a copy; the new message carries
        that mark (redelivery.COPY_HEADER), which the pool reads as it reads the broker's flag."""
        self.published += 1
        again = f".{self.published}" if task_id in self.messages else ""  # published back: a message of its own
        msg = Message(task_id, path, f"tag-{task_id}{again}", self.world.now)
        msg.redelivered = copy
        self.messages[task_id] = msg
        self.queue.append(msg)
        self._wake()

    def _wake(self) -> None:
        for channel in self.channels:
            channel.wake()

    def store(self, task_id: str, state: str) -> None:
        self.results[task_id] = (state, self.world.now)

    def state_of(self, task_id: str):
        entry = self.results.get(task_id)
        return entry[0] if entry is not None else None

    def unacked_deliveries(self) -> list[Delivery]:
        raise NotImplementedError


class RedisBroker(Broker):
    kind = "redis"

    def __init__(self, world, visibility_timeout: float) -> None:
        super().__init__(world)
        self.visibility_timeout = visibility_timeout
        self.unacked: dict[str, Message] = {}
        self.index: dict[str, float] = {}
        self.current: dict[str, Delivery] = {}  # tag -> its delivery now in ``unacked``

    def wall(self) -> float:
        return EPOCH + self.world.now

    def channel(self, worker) -> "Channel":
        return Channel(self, worker)

    def unacked_deliveries(self) -> list[Delivery]:
        return list(self.current.values())

    # ------------------------------------------------------------------ a consumer
    def fetch(self, channel: "Channel", room: int, turn: int) -> list[Delivery]:
        """BRPOP (and kombu's QoS.append: the tag into ``unacked`` and the index, scored now)."""
        out = []
        while self.queue and room > 0:
            msg = self.queue.popleft()
            room -= 1
            delivery = Delivery(msg, channel, self.world.now, turn, msg.tag)
            msg.deliveries.append(delivery)
            self.unacked[msg.tag] = msg
            self.index[msg.tag] = self.wall()
            self.current[msg.tag] = delivery
            out.append(delivery)
        return out

    def ack(self, delivery: Delivery) -> None:
        tag = delivery.tag
        delivery.acked_at = self.world.now
        self.unacked.pop(tag, None)
        self.index.pop(tag, None)
        self.current.pop(tag, None)

    def requeue(self, delivery: Delivery) -> None:
        """A reject with requeue (kombu's Redis QoS.reject): out of unacked, back to the queue."""
        tag = delivery.tag
        if self.unacked.pop(tag, None) is not None:
            self.index.pop(tag, None)
            self.current.pop(tag, None)
            delivery.restored_at = self.world.now
            delivery.msg.redelivered = True
            self.queue.appendleft(delivery.msg)
            self._wake()

    def restore_visible(self) -> None:
        """kombu's sweep: every entry scored at or below now - visibility_timeout goes back."""
        ceil = self.wall() - self.visibility_timeout
        lapsed = sorted((score, tag) for tag, score in self.index.items() if 0 <= score <= ceil)
        for _score, tag in reversed(lapsed):  # ZRANGE ... REV: the newest first, each pushed to the head
            self._restore(tag)
        if lapsed:
            self.world.log(f"redis: swept {len(lapsed)} lapsed message(s) back to the queue")
            self._wake()

    def _restore(self, tag: str) -> None:
        msg = self.unacked.pop(tag)
        del self.index[tag]
        delivery = self.current.pop(tag)
        delivery.restored_at = self.world.now
        if delivery.handed_at is not None and delivery.acked_at is None:
            delivery.restored_while_handed = True
        msg.redelivered = True
        self.queue.appendleft(msg)
        self.restores += 1

    def cut(self, channel: "Channel") -> None:
        """The channel's connection is lost: its unacknowledged messages stay in ``unacked``,
        scored as they were (a sweep returns them once their scores lapse)."""
        _cut(self, channel)

    def closed(self, channel: "Channel") -> None:
        """kombu closes the dead channel: with ``do_restore`` it puts back every message it
        delivered and that was not acknowledged (``QoS.restore_unacked_once``), which happens
        to leave the channel a client; without it the channel keeps none (see ``Channel.closed``)."""
        channel.closed = not channel.do_restore
        if channel.do_restore:
            mine = [d for d in self.current.values() if d.channel is channel]
            for delivery in sorted(mine, key=lambda d: -d.fetched_at):
                self._restore(delivery.tag)
            if mine:
                self.world.log(f"redis: {channel.worker.name}'s closing channel restored {len(mine)} message(s)")
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


def _cut(broker: Broker, channel: "Channel") -> None:
    channel.dead = True
    channel.dead_at = broker.world.now
    if channel in broker.channels:
        broker.channels.remove(channel)
    channel.cut_deliveries = list(channel.delivered.values())
    for delivery in channel.cut_deliveries:
        delivery.cut_at = broker.world.now
        delivery.handed_when_cut = delivery.handed_at is not None


def noticed(channel: "Channel") -> None:
    """The worker's main process learns that the connection is gone (Celery's side runs):
    a delivery it handed to the pool in between (a grant read before the error) counts as
    handed when the connection was lost."""
    for delivery in channel.cut_deliveries:
        delivery.handed_when_cut = delivery.handed_at is not None


class RabbitBroker(Broker):
    kind = "rabbitmq"

    def channel(self, worker) -> "RabbitChannel":
        return RabbitChannel(self, worker)

    def unacked_deliveries(self) -> list[Delivery]:
        return [d for channel in self.channels for d in channel.delivered.values()]

    def fetch(self, channel: "RabbitChannel", room: int, turn: int) -> list[Delivery]:
        """basic.deliver while the channel's unacknowledged count is below its prefetch."""
        out = []
        while self.queue and room > 0:
            msg = self.queue.popleft()
            room -= 1
            channel.next_tag += 1
            delivery = Delivery(msg, channel, self.world.now, turn, channel.next_tag)
            msg.deliveries.append(delivery)
            out.append(delivery)
        return out

    def ack(self, delivery: Delivery) -> None:
        delivery.acked_at = self.world.now

    def requeue(self, delivery: Delivery) -> None:
        self._back([delivery])

    def _back(self, deliveries: list[Delivery]) -> None:
        for delivery in sorted(deliveries, key=lambda d: -d.tag):  # the oldest ends at the head
            delivery.restored_at = self.world.now
            delivery.msg.redelivered = True
            self.queue.appendleft(delivery.msg)
            self.restores += 1
        if deliveries:
            self._wake()

    def cut(self, channel: "RabbitChannel") -> None:
        """The connection is lost: RabbitMQ requeues its unacknowledged messages at once."""
        unacked = list(channel.delivered.values())
        _cut(self, channel)
        channel.delivered.clear()
        self._back(unacked)
        if unacked:
            self.world.log(f"rabbitmq: {channel.worker.name}'s connection closed: {len(unacked)} unacknowledged "
                           "message(s) requeued")

    def closed(self, channel) -> None:
        pass

    def drained(self) -> bool:
        return not self.queue and not self.unacked_deliveries()


# ---------------------------------------------------------------------- what kombu shows
class _Pipeline:
    def __init__(self, channel: "Channel") -> None:
        self.channel = channel
        self.ops: list = []

    def zscore(self, *args, **kwargs):
        self.ops.append(("zscore", args, kwargs))
        return self

    def zadd(self, *args, **kwargs):
        self.ops.append(("zadd", args, kwargs))
        return self

    def execute(self) -> list:
        if self.channel.dead:
            raise ConnectionLost("the channel's connection is gone")
        ops, self.ops = self.ops, []
        return self.channel.broker.execute(ops)


class _Client:
    def __init__(self, channel: "Channel") -> None:
        self.channel = channel

    def pipeline(self, transaction: bool = True) -> _Pipeline:
        return _Pipeline(self.channel)


class _QoS:
    """The channel's QoS: kombu's local prefetch books (``_delivered``) and its sweep."""

    def __init__(self, channel: "Channel") -> None:
        self.channel = channel

    def _quick_ack(self, tag: str) -> None:  # kombu.transport.virtual.QoS.ack (local only)
        self.channel.delivered.pop(tag, None)

    def restore_visible(self, start=0, num=None, interval=1) -> None:
        if self.channel.dead:
            raise ConnectionLost("the channel's connection is gone")
        self.channel.broker.restore_visible()


class _Base:
    def __init__(self, broker: Broker, worker) -> None:
        self.broker = broker
        self.worker = worker
        self.delivered: dict = {}  # tag -> delivery, unacknowledged (kombu's QoS._delivered; RabbitMQ's unacked)
        self.prefetch = 0  # what basic_qos last said (0: no limit)
        self.on_wake = None
        self.dead = False
        self.dead_at: float | None = None
        self.turns_at_cut: int | None = None
        self.cut_deliveries: list = []  # unacknowledged when the connection was lost
        broker.channels.append(self)

    def wake(self) -> None:
        if self.on_wake is not None and not self.dead:
            self.on_wake()

    def room(self) -> int:
        return (self.prefetch or 1000) - len(self.delivered)

    def fetch(self, turn: int) -> list[Delivery]:
        if self.dead:
            return []
        out = self.broker.fetch(self, self.room(), turn)
        for delivery in out:
            self.delivered[delivery.tag] = delivery
        return out

    def ack(self, delivery: Delivery) -> None:
        if self.dead:
            raise ConnectionLost("ack on a channel whose connection is gone")
        self.delivered.pop(delivery.tag, None)
        self.broker.ack(delivery)

    def reject(self, delivery: Delivery, requeue: bool) -> None:
        if self.dead:
            raise ConnectionLost("reject on a channel whose connection is gone")
        self.delivered.pop(delivery.tag, None)
        if requeue:
            self.broker.requeued += 1  # the broker took the reject (a swept-back message is back already)
            self.broker.requeue(delivery)
        else:
            self.broker.ack(delivery)


class Channel(_Base):
    """A worker's kombu Redis channel: what ``held_lease`` reads (``unacked_index_key``,
    ``visibility_timeout``, ``conn_or_acquire``, ``qos``) and the local prefetch books."""

    unacked_index_key = INDEX
    unacked_restore_limit = None

    def __init__(self, broker: RedisBroker, worker) -> None:
        super().__init__(broker, worker)
        self.visibility_timeout = broker.visibility_timeout
        self.qos = _QoS(self)
        self.do_restore = True  # kombu's flag: restore the unacknowledged as the channel closes
        # Closed without its restore: kombu let go of its pool and its connection, and an ack,
        # reject or command on it raises AttributeError (``_connparams``), which Celery does not
        # catch: the worker exits.  Before the close, a dead connection raises a connection error.
        self.closed = False

    def _usable(self) -> None:
        if self.closed:
            raise AttributeError("'NoneType' object has no attribute 'client' (kombu: a channel closed without its "
                                 "restore has no connection)")

    def ack(self, delivery: Delivery) -> None:
        self._usable()
        super().ack(delivery)

    def reject(self, delivery: Delivery, requeue: bool) -> None:
        self._usable()
        super().reject(delivery, requeue)

    @contextmanager
    def conn_or_acquire(self):
        self._usable()
        if self.dead:
            raise ConnectionLost("the channel's connection is gone")
        yield _Client(self)


class RabbitChannel(_Base):
    """A worker's AMQP channel: tags numbered per channel, the prefetch window enforced by
    the broker (``basic_qos``).  Not a Redis channel: no leases (held_lease.redis_channel)."""

    def __init__(self, broker: RabbitBroker, worker) -> None:
        super().__init__(broker, worker)
        self.next_tag = 0
