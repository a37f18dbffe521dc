"""The cohort's lease against a clock that counts a suspend (issue 35, finding 2).

Finding 2: the lease's age was read from ``time.monotonic()``, which stops while the host is
suspended; ZooKeeper's clock does not.  Here the cohort runs on an injected clock that
jumps as a suspend does, and a handoff after the jump must wait for a ZooKeeper reply.
Against a real ZooKeeper: the write proofs are real.
"""

from __future__ import annotations

import sys
import time

import pytest

from celery_zklock.engine.session import LEASED, WRITTEN
from celery_zklock.worker.cohort import Cohort
from celery_zklock.worker.cohort_rules import FRESH_MAX
from celery_zklock.worker.lease_clock import LEASE_CLOCK_NAME, lease_clock
from tests.worker.cohort_host import LeaseClock, held_with_a_young_proof


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
    clock = LeaseClock()
    host, cohort, second, third = held_with_a_young_proof(zk_client, clock)
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
