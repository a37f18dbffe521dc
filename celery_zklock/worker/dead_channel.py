"""A worker's Redis channel that died with its broker connection: what it must not do as it
closes, and where the acknowledgements of its deliveries go after the reconnection.

Why the restore is off: as Celery closes the lost connection, kombu would give the
channel's unacknowledged messages back to their queues (``do_restore``).  Celery 5.7
closes it after ``collect()`` has let go of its transport, and that restore raised
AttributeError, which Celery does not ignore: the worker exited at every Redis outage with
messages held aside.  Nothing is lost without it: the restore could not reach Redis anyway,
held messages come back as their leases lapse (:mod:`.held_lease`), the others at the
visibility timeout.

Why deliveries move: tasks running in pool processes as the connection went still end, and
Celery acknowledges each through its message's channel, the dead one.  That channel has
neither transport nor client any more, kombu raised AttributeError again, and the worker
exited with every queued task unrun (plain Celery's restore, run as the channel closed,
happens to leave it a client).  So at the reconnection their messages move to the live
channel: Redis's ``unacked`` hash and index belong to the transport, not to a channel, so the
acknowledgement reaches them and the message is not delivered again at the visibility
timeout.  An acknowledgement sent before Celery noticed the loss is lost, as in plain Celery.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .held_lease import redis_channel


@dataclass(frozen=True)
class DeadChannel:
    """A Redis channel lost with its connection, and the requests it delivered that Celery may
    still acknowledge: those running, and those already written to a pool process, whose
    acceptance the main process reads only after the reconnection (Celery's own lists forget
    the latter as the connection closes, so they are taken before it does)."""

    channel: Any
    requests: tuple[Any, ...]

    @classmethod
    def at_loss(cls, connection: Any, requests: Iterable[Any]) -> DeadChannel | None:
        """Turn kombu's restore on close off on the lost ``connection``'s Redis channel, and keep
        the ``requests`` it delivered (None: not Redis, or no channel).  Reads kombu's
        ``Connection._default_channel``: the public ``default_channel`` would open a new
        channel on the dead connection."""
        channel = redis_channel(getattr(connection, "_default_channel", None))
        if channel is None:
            return None
        channel.do_restore = False
        return cls(channel, tuple(r for r in requests if _owed(r, channel)))

    def move_to(self, live: Any) -> list[Any]:
        """Point the messages of the requests not acknowledged yet at ``live``; returns their
        requests.  Not into ``live``'s prefetch books: plain Celery's do not count them after a
        reconnection either.  Their acknowledgement on ``live`` is of a tag its books do not
        hold, as kombu's own is after a restore: the tag counts as acked until the books' next
        flush (the channel may fetch one message more meanwhile), and Redis's reject with
        requeue reads the message from Redis, not from the books."""
        moved = []
        for req in self.requests:
            if _owed(req, self.channel):
                req.message.channel = live
                moved.append(req)
        return moved


class LostChannels:
    """The Redis channels this worker lost with its broker connection, until the reconnection
    moves their deliveries to the live one.

    The requests moved at the last reconnection are kept until the next loss: one whose
    acceptance the event loop had not read yet is in none of Celery's lists by then (Celery's
    close forgot it at the first loss), and a second loss before it is acknowledged must move
    it again."""

    def __init__(self) -> None:
        self._dead: list[DeadChannel] = []
        self._moved: tuple[Any, ...] = ()

    def lost(self, connection: Any, requests: Iterable[Any]) -> None:
        """The broker ``connection`` is lost; ``requests``: Celery's reserved and active ones."""
        dead = DeadChannel.at_loss(connection, (*requests, *self._moved))
        if dead is not None:
            self._dead.append(dead)
            self._moved = ()

    def reconnected(self, connection: Any) -> int:
        """The consumer reconnected on ``connection``: move what the lost channels delivered and
        may still be acknowledged; returns how many moved.  Kept if the new channel cannot be
        had (a connection error: Celery starts again, and so does this)."""
        if not self._dead:
            return 0
        live = redis_channel(connection.default_channel)
        moved = [req for dead in self._dead for req in dead.move_to(live)] if live is not None else []
        self._dead, self._moved = [], tuple(moved)
        return len(moved)


def _owed(req: Any, channel: Any) -> bool:
    """Does ``channel`` still owe ``req``'s message an acknowledgement?"""
    message = getattr(req, "message", None)
    return message is not None and message.channel is channel and not message.acknowledged
