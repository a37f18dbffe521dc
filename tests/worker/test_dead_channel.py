"""The rules of a Redis channel lost with its connection (celery_zklock.worker.dead_channel),
on fakes; the real worker across a real Redis outage is in test_held_aside."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from celery_zklock.worker.dead_channel import DeadChannel


def _redis_channel():
    return SimpleNamespace(unacked_index_key="unacked_index", conn_or_acquire=lambda: None, do_restore=True)


def _request(channel, acknowledged=False):
    return SimpleNamespace(message=SimpleNamespace(channel=channel, acknowledged=acknowledged))


def test_at_loss_turns_the_restore_off_and_keeps_only_that_channels_requests():
    dead, other = _redis_channel(), _redis_channel()
    mine, elsewhere, no_message = _request(dead), _request(other), SimpleNamespace()
    lost = DeadChannel.at_loss(SimpleNamespace(_default_channel=dead), [mine, elsewhere, no_message])
    assert lost is not None and lost.channel is dead and lost.requests == (mine,)
    assert dead.do_restore is False and other.do_restore is True


@pytest.mark.parametrize("channel", [None, SimpleNamespace(do_restore=True)], ids=["no-channel", "not-redis"])
def test_at_loss_leaves_other_brokers_alone(channel):
    assert DeadChannel.at_loss(SimpleNamespace(_default_channel=channel), [_request(channel)]) is None
    if channel is not None:
        assert channel.do_restore is True


@pytest.mark.parametrize(
    ("acknowledged", "moved_since", "moves"),
    [
        (False, False, True),  # running, or written to a pool process: its ack must reach Redis
        (True, False, False),  # acknowledged (or rejected) already: nothing will ack it again
        (False, True, False),  # on another channel by now: not ours to move
    ],
)
def test_move_to_moves_what_the_dead_channel_still_owes(acknowledged, moved_since, moves):
    dead, live, elsewhere = _redis_channel(), _redis_channel(), _redis_channel()
    req = _request(dead, acknowledged)
    lost = DeadChannel.at_loss(SimpleNamespace(_default_channel=dead), [req])
    if moved_since:
        req.message.channel = elsewhere
    assert lost.move_to(live) == int(moves)
    assert req.message.channel is (live if moves else elsewhere if moved_since else dead)
