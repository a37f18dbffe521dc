"""The rules of a Redis channel lost with its connection (celery_zklock.worker.dead_channel),
on fakes; the real worker across a real Redis outage is in test_held_aside."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_zklock.worker.dead_channel import DeadChannel, LostChannels


def _redis_channel():
    return SimpleNamespace(unacked_index_key="unacked_index", conn_or_acquire=lambda: None, do_restore=True)


def _connection(channel):
    return SimpleNamespace(_default_channel=channel, default_channel=channel)


def _request(channel, acknowledged=False):
    return SimpleNamespace(message=SimpleNamespace(channel=channel, acknowledged=acknowledged))


def test_at_loss_turns_the_restore_off_and_keeps_what_that_channel_still_owes():
    dead, other = _redis_channel(), _redis_channel()
    mine, acked, elsewhere, no_message = _request(dead), _request(dead, True), _request(other), SimpleNamespace()
    lost = DeadChannel.at_loss(_connection(dead), [mine, acked, elsewhere, no_message])
    assert lost is not None and lost.channel is dead and lost.requests == (mine,)
    assert dead.do_restore is False and other.do_restore is True


@pytest.mark.parametrize("channel", [None, SimpleNamespace(do_restore=True)], ids=["no-channel", "not-redis"])
def test_at_loss_leaves_other_brokers_alone(channel):
    assert DeadChannel.at_loss(_connection(channel), [_request(channel)]) is None
    if channel is not None:
        assert channel.do_restore is True


@pytest.mark.parametrize(
    ("acked_since", "moved_since", "moves"),
    [
        (False, False, True),  # running, or written to a pool process: its ack must reach Redis
        (True, False, False),  # acknowledged (or rejected) during the gap: nothing will ack it again
        (False, True, False),  # on another channel by now: not ours to move
    ],
)
def test_move_to_moves_what_the_dead_channel_still_owes(acked_since, moved_since, moves):
    dead, live, elsewhere = _redis_channel(), _redis_channel(), _redis_channel()
    req = _request(dead)
    lost = DeadChannel.at_loss(_connection(dead), [req])
    req.message.acknowledged = acked_since
    if moved_since:
        req.message.channel = elsewhere
    assert lost.move_to(live) == ([req] if moves else [])
    assert req.message.channel is (live if moves else elsewhere if moved_since else dead)


def test_a_second_loss_moves_again_what_the_first_moved_and_celery_forgot():
    """Written to a pool process at the first loss, its acceptance not read yet when the
    connection drops again: Celery's lists forgot it at the first loss, the second moves it."""
    first, second, third = _redis_channel(), _redis_channel(), _redis_channel()
    req = _request(first)
    channels = LostChannels()
    channels.lost(_connection(first), [req])
    assert channels.reconnected(_connection(second)) == 1 and req.message.channel is second
    channels.lost(_connection(second), [])  # no longer in Celery's reserved or active requests
    assert channels.reconnected(_connection(third)) == 1 and req.message.channel is third


def test_nothing_lost_nothing_read():
    """A reconnection after no Redis loss reads no channel (the connection may not be Redis)."""
    connection = SimpleNamespace()  # no default_channel: reading it would raise
    assert LostChannels().reconnected(connection) == 0
