"""Fencing tokens and the 2^53 bound (issue 35, finding 7).

Why: a token is ``czxid << 8 | grant``, and many of its readers hold numbers as IEEE
doubles (JSON in JavaScript, Lua in Redis): exact only below 2^53, i.e. while czxid < 2^45,
the first 8,192 leader epochs of an ensemble.  Past it, two holders' tokens could compare
equal downstream.  So a token nearing the bound is warned about (once, well before), and
one at it is refused with a clear error, never handed out inexact.
"""

from __future__ import annotations

import logging

import pytest

from celery_zklock.engine import znodes
from celery_zklock.engine.znodes import (
    MAX_GRANTS_PER_NODE,
    TOKEN_BOUND,
    TOKEN_WARN_AT,
    TokenOutOfRange,
    TokenRange,
    fencing_token,
    token_range,
)
from tests.lockutil import children


def _zxid(epoch: int, counter: int = 0) -> int:
    return (epoch << 32) | counter


@pytest.mark.parametrize(
    "czxid, grant, expected, why",
    [
        (1, 0, TokenRange.EXACT, "a young ensemble"),
        (_zxid(4095, 0xFFFF_FFFF), MAX_GRANTS_PER_NODE - 1, TokenRange.EXACT, "the last token of epoch 4,095"),
        (_zxid(4096), 0, TokenRange.NEARING, "epoch 4,096: half the epochs used, warn"),
        (_zxid(8191, 0xFFFF_FFFF), MAX_GRANTS_PER_NODE - 1, TokenRange.NEARING, "the last exact token"),
        (_zxid(8192), 0, TokenRange.INEXACT, "epoch 8,192: 2^53, not exact as a double"),
        (_zxid(10_000), 3, TokenRange.INEXACT, "far past the bound"),
    ],
)
def test_token_range(czxid, grant, expected, why):
    token = (czxid << znodes.STREAK_BITS) | grant
    assert token_range(token) is expected, why


def test_the_bounds():
    assert TOKEN_BOUND == 2 ** 53 and float(TOKEN_BOUND - 1) == TOKEN_BOUND - 1
    assert float(TOKEN_BOUND + 1) == float(TOKEN_BOUND)  # the first inexact neighbour
    assert TOKEN_WARN_AT <= TOKEN_BOUND // 2  # well before: half the epochs still ahead
    assert TOKEN_BOUND % MAX_GRANTS_PER_NODE == 0 == TOKEN_WARN_AT % MAX_GRANTS_PER_NODE  # a node's first token decides


def test_a_token_at_the_bound_is_refused():
    with pytest.raises(TokenOutOfRange, match=r"2\^53"):
        fencing_token(_zxid(8192))
    assert fencing_token(_zxid(8191, 0xFFFF_FFFF), MAX_GRANTS_PER_NODE - 1) == TOKEN_BOUND - 1


def test_a_token_nearing_the_bound_is_warned_about_once(caplog, monkeypatch):
    monkeypatch.setattr(znodes, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="celery_zklock.engine"):
        fencing_token(1)
        assert not caplog.records
        fencing_token(_zxid(5000))
        fencing_token(_zxid(5001))
    [record] = caplog.records
    assert "2^53" in record.getMessage() and "epoch" in record.getMessage()


def test_a_lock_whose_token_would_be_inexact_is_refused_and_its_node_goes(zk_client, monkeypatch):
    """The wiring, against a real ZooKeeper (whose zxids are far below 2^45): the bound is
    lowered below this server's tokens, and acquire fails with the clear error instead of
    handing out the token; the node it created is deleted."""
    from celery_zklock import FairLock

    monkeypatch.setattr(znodes, "TOKEN_BOUND", 1 << znodes.STREAK_BITS)
    monkeypatch.setattr(znodes, "TOKEN_WARN_AT", 1 << znodes.STREAK_BITS)
    zk_client.ensure_path("/token-bound")
    lock = FairLock(zk_client, "/token-bound/k")
    with pytest.raises(TokenOutOfRange):
        lock.acquire(timeout=5)
    assert not lock.is_held() and lock.token is None
    assert [c for c in children(zk_client, "/token-bound/k") if znodes.sequence_of(c) is not None] == []
