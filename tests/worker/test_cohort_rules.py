"""The cohort's pure rules, table-driven: when a held node passes to our next task, when a
handoff may skip ZooKeeper's round trip (the lease), and the fencing token of each grant."""

from __future__ import annotations

import pytest

from celery_zklock.engine.znodes import MAX_GRANTS_PER_NODE, fencing_token
from celery_zklock.worker.cohort_rules import FRESH_MAX, RENEW_AFTER, fresh, passes_locally, renews, streak_left

N, T = 4, 0.5  # zklock_cohort_handoffs, zklock_cohort_hold


@pytest.mark.parametrize(
    "grants, elapsed, foreign, passes, why",
    [
        (1, 0.0, False, True, "nobody else waits: keep it"),
        (100, 60.0, False, True, "nobody else waits: no streak bound"),
        (MAX_GRANTS_PER_NODE - 1, 0.0, False, True, "the node's last token"),
        (MAX_GRANTS_PER_NODE, 0.0, False, False, "token space used up: queue a new node"),
        (1, 0.0, True, True, "someone waits, streak young"),
        (N - 1, 0.1, True, True, "someone waits, last local grant within the bound"),
        (N, 0.1, True, False, "someone waits, N holds done: pass it on"),
        (1, T, True, False, "someone waits, held T already: pass it on"),
        (2, T - 0.01, True, True, "someone waits, just within T"),
    ],
)
def test_passes_locally(grants, elapsed, foreign, passes, why):
    assert passes_locally(grants, 10.0, 10.0 + elapsed, foreign, N, T) is passes, why


@pytest.mark.parametrize(
    "confirmed, age, session_timeout, young, why",
    [
        (None, 0.0, 10.0, False, "no write has succeeded yet: wait for one"),
        (5.0, 0.0, 10.0, True, "sent just now and answered"),
        (5.0, FRESH_MAX - 0.001, 10.0, True, "just within the lease"),
        (5.0, FRESH_MAX + 0.001, 10.0, False, "the lease has aged out: wait for the write"),
        (5.0, 30.0, 10.0, False, "long ago (a partition stops the replies)"),
        (5.0, 0.03, 0.2, False, "a tiny session timeout shortens the lease to a tenth of it"),
        (5.0, 0.01, 0.2, True, "within a tenth of a tiny session timeout"),
        (5.0, -0.001, 10.0, False, "a proof from the future: never trusted"),
    ],
)
def test_fresh(confirmed, age, session_timeout, young, why):
    now = (confirmed or 0.0) + age
    assert fresh(confirmed, now, session_timeout) is young, why


@pytest.mark.parametrize(
    "confirmed, age, proving, renewed, why",
    [
        (None, 0.0, False, True, "no proof yet: prove"),
        (5.0, 0.0, False, False, "proof just renewed: this handoff needs no request"),
        (5.0, RENEW_AFTER - 0.001, False, False, "still younger than RENEW_AFTER"),
        (5.0, RENEW_AFTER + 1e-6, False, True, "RENEW_AFTER old: renew it before it ages out"),
        (5.0, RENEW_AFTER + 0.01, True, False, "a proof is in flight: its reply renews it"),
        (None, 0.0, True, False, "the first proof is in flight"),
    ],
)
def test_renews(confirmed, age, proving, renewed, why):
    assert renews(confirmed, (confirmed or 0.0) + age, proving) is renewed, why


def test_a_renewing_write_comes_well_before_the_lease_ages_out():
    assert 0 < RENEW_AFTER < FRESH_MAX


@pytest.mark.parametrize("czxid_a, czxid_b", [(1, 2), (0x1_0000_0001, 0x1_0000_0002), (0x7FF_FFFF_FFFF, 0x800_0000_0000)])
def test_every_token_of_a_later_node_exceeds_every_token_of_an_earlier_one(czxid_a, czxid_b):
    earlier = [fencing_token(czxid_a, g) for g in range(MAX_GRANTS_PER_NODE)]
    later = [fencing_token(czxid_b, g) for g in range(MAX_GRANTS_PER_NODE)]
    assert earlier == sorted(set(earlier)) and max(earlier) < min(later)


def test_tokens_stay_exact_as_doubles_for_8192_epochs():
    czxid = (8191 << 32) | 0xFFFF_FFFF  # the last zxid of epoch 8191
    token = fencing_token(czxid, MAX_GRANTS_PER_NODE - 1)
    assert token < 2 ** 53 and float(token) == token


def test_grant_outside_the_token_space_is_an_error():
    with pytest.raises(ValueError):
        fencing_token(5, MAX_GRANTS_PER_NODE)


@pytest.mark.parametrize(
    "grants, elapsed, foreign, left, why",
    [
        (1, 0.0, False, None, "nobody else waits: no bound, the node passes on"),
        (N - 1, T + 1.0, False, None, "nobody else waits, however long"),
        (1, 0.0, True, T, "someone waits, streak young: all of T left"),
        (2, 0.2, True, T - 0.2, "someone waits: what is left of T"),
        (N, 0.0, True, 0.0, "the N-th holder holds: its release ends the streak"),
        (1, T + 0.1, True, 0.0, "past T: its release ends the streak"),
    ],
)
def test_streak_left(grants, elapsed, foreign, left, why):
    got = streak_left(grants, 10.0, 10.0 + elapsed, foreign, N, T)
    assert got == (None if left is None else pytest.approx(left)), why


@pytest.mark.parametrize("grants", range(1, N + 2))
@pytest.mark.parametrize("elapsed", [0.0, 0.2, T - 0.01, T, T + 0.2])
@pytest.mark.parametrize("hold", [0.0, 0.05, 0.25, 0.35])  # no hold lands on the boundary
def test_streak_left_agrees_with_passes_locally(grants, elapsed, hold):
    """A release ``hold`` s from now passes the node on exactly when that hold is shorter
    than the streak left (the agent withholds "next" otherwise)."""
    left = streak_left(grants, 10.0, 10.0 + elapsed, True, N, T)
    passes = passes_locally(grants, 10.0, 10.0 + elapsed + hold, True, N, T)
    assert passes is (hold < left), (grants, elapsed, hold, left)
