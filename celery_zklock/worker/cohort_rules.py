"""The cohort's rules, as pure functions: when a held node passes to our next task, when a
handoff may skip ZooKeeper's round trip (the lease), and when it writes to renew it.

Why apart from :mod:`celery_zklock.worker.cohort`: these decide safety and fairness, so
they take plain numbers and are tested table by table (``tests/worker/test_cohort_rules.py``),
as Curator's ``getsTheLock`` is; the cohort only feeds them its clocks and counts.
"""

from __future__ import annotations

from ..engine.znodes import MAX_GRANTS_PER_NODE

#: How old (s) the newest proof that a node is ours may be for a local handoff to skip the
#: round trip.  The proof's strength comes from the session, not from this number: ZooKeeper
#: expires a session only after hearing nothing from it for the negotiated session timeout,
#: and :func:`fresh` also keeps the lease under a tenth of that, so a holder granted on it
#: has at least 90% of it, as one granted on a reply nearly has.  0.2 s is a twentieth of the
#: shortest default session (2 ticks: 4 s).  Why not shorter: each renewal
#: (:data:`RENEW_AFTER`) is a ZooKeeper write, and a data-change event for each watcher; at
#: 50 ms a flash sale's five hot keys cost about one write per task, in ZooKeeper's CPU and
#: the agent's (issue 39, docs/waiting.md).  What a longer lease costs: after a silent
#: partition, handoffs go on for up to this long (each within its session), and a holder of
#: 0.2 s or more waits for its own write, which then costs under 3% of its hold.
FRESH_MAX = 0.2


def fresh(confirmed: float | None, now: float, session_timeout: float) -> bool:
    """May a local handoff grant at once on a write sent at ``confirmed`` that succeeded?

    Only while that proof is younger than :data:`FRESH_MAX` and than a tenth of the session
    timeout (a short one keeps nearly all of it for the holder).  ``session_timeout`` is the
    one the server negotiated (:func:`celery_zklock.engine.kazoo_compat.session_timeout`),
    not the one asked for: a server's ``maxSessionTimeout`` may have granted less."""
    if confirmed is None:
        return False
    return 0.0 <= now - confirmed < lease_window(session_timeout)


def lease_window(session_timeout: float) -> float:
    """How long (s) after its send a successful write proves the node ours: :data:`FRESH_MAX`,
    or a tenth of the negotiated session timeout when that is shorter (see :func:`fresh`).
    The pool process reads the same window for a grant that travels with its task
    (:func:`celery_zklock.worker.agent_client.claim`), and the agent keeps such a grant for it
    at least this long."""
    return min(FRESH_MAX, session_timeout / 10)


#: A handoff on a young proof renews it (a check of the node through the leader) only when
#: that proof is at least this old (s) and no proof is in flight: the renewal is what keeps
#: the proof young, and one per handoff was a ZooKeeper request per task of a hot key.
RENEW_AFTER = FRESH_MAX / 2


def renews(confirmed: float | None, now: float, proving: bool) -> bool:
    """Should a handoff granted on a young proof check the node again, to renew that proof?

    Not while a proof is in flight (its reply renews it), nor while the proof is younger
    than :data:`RENEW_AFTER`: a hot key's handoffs then renew about once per
    ``RENEW_AFTER``, not once per task, and the proof never ages past :data:`FRESH_MAX`
    while they keep coming."""
    if proving:
        return False
    return confirmed is None or now - confirmed >= RENEW_AFTER


def passes_locally(grants: int, since: float, now: float, foreign: bool, max_grants: int, max_hold: float) -> bool:
    """May a node one of our tasks just let go of pass to our next waiting task?

    ``grants``: holders the node has had; ``since``: when it was first granted; ``foreign``:
    another contender queues for the key.  Nobody else waiting: always (until the node's
    token space is used up).  Someone waiting: only within the streak bound.
    """
    if grants >= MAX_GRANTS_PER_NODE:
        return False
    if not foreign:
        return True
    return grants < max_grants and now - since < max_hold


def streak_left(grants: int, since: float, now: float, foreign: bool, max_grants: int, max_hold: float) -> float | None:
    """How long (s) the node's current holder may still hold and pass it on locally, as
    :func:`passes_locally` will judge at its release: None while nobody else waits (no
    bound), 0 once the bound is reached (its release ends the streak, whenever it comes).

    Why: a request told "next" behind a holder whose release ends the streak does not get
    the node; it waits behind the other contender's whole streak, and if it was handed to
    a pool process early, that process idles through it (issue 39)."""
    if not foreign:
        return None
    if grants >= max_grants:
        return 0.0
    return max(0.0, max_hold - (now - since))
