"""The cohort's lease against a clock that counts a suspend (issue 35, finding 2).

Finding 2: the lease's age was read from ``time.monotonic()``, which stops while the host is
suspended; ZooKeeper's clock does not.  Here the cohort runs on an injected clock that
jumps as a suspend does, and a handoff after the jump must wait for a ZooKeeper reply.
Against a real ZooKeeper: the write proofs are real.
"""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from celery_zklock.engine.session import LEASED, WRITTEN
from celery_zklock.worker.cohort import Cohort
from celery_zklock.worker.cohort_rules import FRESH_MAX
from celery_zklock.worker.lease_clock import LEASE_CLOCK_NAME, lease_clock
from tests.worker.test_cohort_replies import Host, _wait


class Clock:
    """A lease clock the test moves: time passes only when told (a suspend is one jump)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _held_with_a_young_proof(client, clock: Clock):
    """A cohort whose node has a proof written at ``clock.now`` (the first one, written when
    one of ours queued behind its holder) and passed once on it, held by ``second``, with
    ``third`` waiting behind it."""
    host = Host(client)
    client.ensure_path("/lease-clock")
    cohort = Cohort(host, f"/lease-clock/{uuid.uuid4().hex[:8]}", 1, clock=clock)
    first, second, third = (_wait(cohort, n) for n in ("first", "second", "third"))
    cohort.join(first)
    host.run(lambda: host.grants)
    cohort.join(second)
    # The first proof's reply, before the release: else the release waits for it (CI: a
    # reply that came within one turn made the handoff a leased one, on a loaded machine).
    host.run(lambda: cohort.slots[0].confirmed is not None)
    assert cohort.release(first) is LEASED
    host.run(lambda: len(host.grants) == 2)
    [slot] = cohort.slots
    assert slot.confirmed == clock.now and slot.holder is second
    cohort.join(third)
    host.run(lambda: True)
    return host, cohort, second, third


@pytest.mark.parametrize(
    "jump, leased, why",
    [
        (0.0, True, "no time passed: the proof is young, the handoff skips the round trip"),
        (FRESH_MAX / 2, True, "within the lease"),
        (FRESH_MAX * 2, False, "the lease aged out: wait for the write"),
        (30.0, False, "a suspend longer than the session timeout: the session may be gone"),
    ],
)
def test_a_handoff_reads_the_lease_age_from_the_lease_clock(zk_client, jump, leased, why):
    clock = Clock()
    host, cohort, second, third = _held_with_a_young_proof(zk_client, clock)
    clock.now += jump
    proof = cohort.release(second)
    assert (proof is LEASED) is leased, why
    if not leased:
        assert proof.get(timeout=10) == WRITTEN  # granted on ZooKeeper's reply instead
    host.run(lambda: len(host.grants) == 3)
    assert host.grants[2][0] == "third"
    cohort.release(third)
    host.run(lambda: cohort.idle)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CLOCK_BOOTTIME is Linux's")
def test_the_lease_clock_counts_suspended_time():
    """CLOCK_BOOTTIME goes on through a suspend (monotonic does not); cannot suspend here, so:
    the lease clock *is* CLOCK_BOOTTIME, and the cohort uses it unless told otherwise."""
    assert LEASE_CLOCK_NAME == "CLOCK_BOOTTIME"
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    now = lease_clock()
    assert before <= now <= time.clock_gettime(time.CLOCK_BOOTTIME)
    assert Cohort(None, "/x", 1).clock is lease_clock
