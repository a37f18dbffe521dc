"""What a lock wait decided, and acting on it (celery_zklock.decision): the pure rules as
tables, and ``act``'s order of effects for every outcome, against recording fakes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from celery.exceptions import Ignore, Retry

from celery_zklock import decision
from celery_zklock.decision import GuardOwner, LockDecision, Outcome, Reentry, guard_end, in_process, reentry
from celery_zklock.errors import LockTimeout, LockUnavailable
from celery_zklock.worker.agent_protocol import Verdict


# ------------------------------------------------------------------ the pure rules
def test_every_verdict_has_its_outcome():
    assert {v: decision.OF_VERDICT[v] for v in Verdict} == {
        Verdict.GRANTED: Outcome.GRANTED, Verdict.TIMEOUT: Outcome.TIMED_OUT, Verdict.UNAVAILABLE: Outcome.UNAVAILABLE,
        Verdict.REVOKED: Outcome.REVOKED, Verdict.SHUTDOWN: Outcome.SHUTDOWN}


@pytest.mark.parametrize("acquired, give_back, connected, outcome", [
    (True, False, True, Outcome.GRANTED),
    (True, True, True, Outcome.GRANTED),
    (True, False, False, Outcome.GRANTED),  # held: what the connection does next is the hold's business
    (False, True, True, Outcome.GIVEN_BACK),
    (False, True, False, Outcome.UNAVAILABLE),  # cannot give back a try that never reached ZooKeeper
    (False, False, False, Outcome.UNAVAILABLE),
    (False, False, True, Outcome.TIMED_OUT),
])
def test_a_wait_in_process_decides(acquired, give_back, connected, outcome):
    assert in_process(acquired, give_back, connected) is outcome


class Odd(Exception):
    pass


@pytest.mark.parametrize("guard, decided, raised, why", [
    # no guard here: never ended
    (GuardOwner.NONE, None, Odd(), None),
    (GuardOwner.NONE, Outcome.TIMED_OUT, None, None),
    # waited here: every unrun ending ends it, but a retry or a request given back carries it on
    (GuardOwner.RUN, None, Odd(), "Odd"),
    (GuardOwner.RUN, Outcome.TIMED_OUT, None, "not run"),
    (GuardOwner.RUN, Outcome.TIMED_OUT, LockTimeout("k", 1.0), "LockTimeout"),
    (GuardOwner.RUN, Outcome.UNAVAILABLE, LockUnavailable("x"), "LockUnavailable"),
    (GuardOwner.RUN, Outcome.UNAVAILABLE, Retry(), None),
    (GuardOwner.RUN, Outcome.GIVEN_BACK, decision.GivenBack(), None),
    (GuardOwner.RUN, Outcome.GRANTED, Ignore(), "Ignore"),  # a copy whose first delivery finished
    (GuardOwner.RUN, Outcome.GRANTED, LockUnavailable("x"), "LockUnavailable"),  # the guard could not start
    # claimed: the agent's, left here with a timeout or unavailable verdict only
    (GuardOwner.VERDICT, None, Odd(), None),
    (GuardOwner.VERDICT, Outcome.TIMED_OUT, None, "timeout: skipped"),
    (GuardOwner.VERDICT, Outcome.TIMED_OUT, LockTimeout("k", 1.0), "timeout: LockTimeout"),
    (GuardOwner.VERDICT, Outcome.TIMED_OUT, Retry(), None),
    (GuardOwner.VERDICT, Outcome.UNAVAILABLE, LockUnavailable("x"), "unavailable: LockUnavailable"),
    (GuardOwner.VERDICT, Outcome.UNAVAILABLE, Retry(), None),
    (GuardOwner.VERDICT, Outcome.REVOKED, Ignore(), None),
    (GuardOwner.VERDICT, Outcome.SHUTDOWN, Ignore(), None),
    (GuardOwner.VERDICT, Outcome.GRANTED, Ignore(), None),  # a claimed copy whose first delivery finished
    (GuardOwner.VERDICT, Outcome.GRANTED, LockUnavailable("x"), None),  # a grant never confirmed
])
def test_who_ends_the_enqueue_guard(guard, decided, raised, why):
    assert guard_end(guard, decided, raised) == why


@pytest.mark.parametrize("outer, outer_read, paths, read, reentrant, entry", [
    ({"a"}, set(), ["a"], set(), True, Reentry.UNDER_OUTER),
    ({"a"}, set(), ["a"], set(), False, Reentry.REFUSED),
    ({"a"}, set(), ["a", "b"], set(), True, Reentry.TAKES_THE_REST),
    ({"a"}, set(), ["a", "b"], set(), False, Reentry.REFUSED),
    ({"a"}, {"a"}, ["a"], {"a"}, True, Reentry.UNDER_OUTER),  # a reader inside a reader
    ({"a"}, set(), ["a"], {"a"}, True, Reentry.UNDER_OUTER),  # a reader inside a writer
    ({"a"}, {"a"}, ["a"], set(), True, Reentry.UPGRADE_REFUSED),  # a writer inside a reader
    ({"a"}, {"a"}, ["a"], set(), False, Reentry.UPGRADE_REFUSED),  # refused first for the upgrade
    ({"a"}, {"a"}, ["a", "b"], set(), True, Reentry.UPGRADE_REFUSED),
    ({"a"}, set(), ["a", "b"], {"b"}, True, Reentry.TAKES_THE_REST),  # b is not the outer's: no upgrade
])
def test_how_a_call_reenters_an_outer_hold(outer, outer_read, paths, read, reentrant, entry):
    assert reentry(outer, outer_read, paths, read, reentrant) is entry


# ------------------------------------------------------------------ act, against recording fakes
class Lock:
    def __init__(self, seen, suspended=None, lost=None, confirms=True):
        self.seen, self.suspended_reason, self.lost_reason, self.confirms = seen, suspended, lost, confirms

    def release(self):
        self.seen.append("release")
        return True

    def abandon(self):
        self.seen.append("abandon")

    def confirmed(self, timeout):
        self.seen.append(f"confirm {timeout}")
        return self.confirms


class Copies:
    def __init__(self, seen, finished):
        self.seen, self.finished = seen, finished

    def finished_elsewhere(self):
        self.seen.append("copy read")
        return self.finished


@pytest.fixture
def seen(monkeypatch):
    """What act did, in order; the policies' behaviour set by ``policy`` ("skip": return)."""
    log: list = []
    monkeypatch.setattr(decision, "fire_prerun", lambda task: log.append("prerun"))
    monkeypatch.setattr(decision.enqueue, "finished", lambda task, req, opts, ran=True, why="": log.append(f"guard end {why}"))

    def started(task, req, opts):
        log.append("guard start")
        if getattr(task, "guard_fails", False):
            raise LockUnavailable("guard")

    monkeypatch.setattr(decision.enqueue, "started", started)

    def timed_out(task, exc, opts, waited):
        log.append(f"timed out {exc.holders} {waited}")
        if opts.on_timeout == "skip":
            return None
        raise Retry() if opts.on_timeout == "retry" else exc

    def unavailable(task, exc, opts, label, direct):
        log.append(f"unavailable {exc}")
        raise Retry() if opts.on_unavailable == "retry" else exc

    monkeypatch.setattr(decision, "timed_out", timed_out)
    monkeypatch.setattr(decision, "unavailable", unavailable)
    for name, exc in (("revoked", Ignore), ("shut_down", Ignore), ("given_back", decision.GivenBack),
                      ("duplicate", Ignore)):
        monkeypatch.setattr(decision, name, lambda task, label, name=name, exc=exc: (log.append(name), _raise(exc())))
    monkeypatch.setattr(decision, "_store_started", lambda task: log.append("STARTED"))
    return log


def _raise(exc):
    raise exc


def _task(track_started=False, guard_fails=False):
    return SimpleNamespace(request=SimpleNamespace(id="t1", hostname="w"), track_started=track_started,
                           ignore_result=False, guard_fails=guard_fails)


def _opts(on_timeout="skip", on_unavailable="fail"):
    return SimpleNamespace(on_timeout=on_timeout, on_unavailable=on_unavailable, timeout=1.0)


def _act(task, opts, claimed=None, here=None, guard_here=GuardOwner.RUN, direct=False):
    return decision.act(task, opts, "k", direct, claim=lambda: claimed, wait_here=lambda: here, guard_here=guard_here)


def test_a_grant_waited_for_here(seen):
    lock = Lock(seen)
    taken = _act(_task(track_started=True), _opts(),
                 here=LockDecision(Outcome.GRANTED, 0.5, lock=lock, said_waiting=True, copies=Copies(seen, False), own_node=True))
    assert seen == ["prerun", "STARTED", "copy read", "guard start"]
    assert taken == decision.Taken(lock, 0.5, None, GuardOwner.RUN)


def test_a_grant_that_said_nothing_of_waiting_keeps_the_tracers_started(seen):
    _act(_task(track_started=True), _opts(), here=LockDecision(Outcome.GRANTED, 0.0, lock=Lock(seen), own_node=True))
    assert seen == ["prerun", "guard start"]


def test_a_claimed_grant(seen):
    lock = Lock(seen)
    taken = _act(_task(), _opts(), claimed=LockDecision(Outcome.GRANTED, 0.2, lock=lock, confirm_within=5.0))
    assert seen == ["prerun"] and taken == decision.Taken(lock, 0.2, None, GuardOwner.VERDICT)


@pytest.mark.parametrize("confirms, then", [(True, []), (False, ["abandon", "unavailable lock 'k' could not be confirmed "
                                                                               "before the run: gone", "raised"])])
def test_a_claimed_grant_not_safe_at_its_start_waits_for_zookeeper(seen, confirms, then):
    lock = Lock(seen, suspended="gone", confirms=confirms)
    try:
        _act(_task(), _opts(), claimed=LockDecision(Outcome.GRANTED, 0.2, lock=lock, confirm_within=5.0))
    except LockUnavailable:
        seen.append("raised")
    assert seen == ["prerun", "confirm 5.0", *then]  # no guard end: a grant's guard is the agent's


@pytest.mark.parametrize("guard, own, then", [
    (GuardOwner.RUN, True, ["guard end Ignore"]),
    (GuardOwner.VERDICT, False, []),
])
def test_a_copy_whose_first_delivery_finished(seen, guard, own, then):
    grant = LockDecision(Outcome.GRANTED, 0.0, lock=Lock(seen), copies=Copies(seen, True), own_node=own)
    with pytest.raises(Ignore):
        if guard is GuardOwner.RUN:
            _act(_task(), _opts(), here=grant)
        else:
            _act(_task(), _opts(), claimed=grant)
    assert seen == ["prerun", "copy read", "release", "duplicate", *then]


def test_a_guard_that_cannot_start_runs_nothing(seen):
    with pytest.raises(LockUnavailable):
        _act(_task(guard_fails=True), _opts(), here=LockDecision(Outcome.GRANTED, 0.0, lock=Lock(seen), own_node=True))
    assert seen == ["prerun", "guard start", "release", "unavailable guard", "guard end LockUnavailable"]


@pytest.mark.parametrize("on_timeout, raises, end", [
    ("skip", None, "not run"), ("fail", LockTimeout, "LockTimeout"), ("retry", Retry, None)])
def test_a_timeout_here(seen, on_timeout, raises, end):
    here = LockDecision(Outcome.TIMED_OUT, 1.5, holders=["h"])
    if raises is None:
        assert _act(_task(), _opts(on_timeout), here=here) == decision.Taken(None, 1.5, None, GuardOwner.RUN)
    else:
        with pytest.raises(raises):
            _act(_task(), _opts(on_timeout), here=here)
    assert seen == ["prerun", "timed out ['h'] 1.5", *([f"guard end {end}"] if end else [])]


@pytest.mark.parametrize("on_timeout, end", [("skip", "timeout: skipped"), ("fail", "timeout: LockTimeout")])
def test_a_timeout_verdict(seen, on_timeout, end):
    try:
        _act(_task(), _opts(on_timeout), claimed=LockDecision(Outcome.TIMED_OUT, 2.0, holders=None))
    except LockTimeout:
        pass
    assert seen == ["prerun", "timed out None 2.0", f"guard end {end}"]


@pytest.mark.parametrize("claimed, guard_here, end", [
    (True, GuardOwner.RUN, "unavailable: LockUnavailable"), (False, GuardOwner.RUN, "LockUnavailable"), (False, GuardOwner.NONE, None)])
def test_unavailable(seen, claimed, guard_here, end):
    unavailable = LockDecision(Outcome.UNAVAILABLE, 0.0, error=LockUnavailable("no zk"))
    with pytest.raises(LockUnavailable):
        _act(_task(), _opts(), claimed=unavailable if claimed else None, here=unavailable, guard_here=guard_here)
    assert seen == ["prerun", "unavailable no zk", *([f"guard end {end}"] if end else [])]


@pytest.mark.parametrize("outcome, step, raises, claimed", [
    (Outcome.REVOKED, "revoked", Ignore, True),
    (Outcome.SHUTDOWN, "shut_down", Ignore, True),
    (Outcome.GIVEN_BACK, "given_back", decision.GivenBack, False),
])
def test_ends_unrun_with_no_guard_end(seen, outcome, step, raises, claimed):
    with pytest.raises(raises):
        _act(_task(), _opts(), claimed=LockDecision(outcome) if claimed else None, here=LockDecision(outcome))
    assert seen == ["prerun", step]


@pytest.mark.parametrize("guard_here, end", [(GuardOwner.RUN, ["guard end Odd"]), (GuardOwner.NONE, [])])
def test_a_failed_wait_ends_its_guard_then_sends_prerun(seen, guard_here, end):
    def fails():
        raise Odd()

    with pytest.raises(Odd):
        decision.act(_task(), _opts(), "k", False, claim=lambda: None, wait_here=fails, guard_here=guard_here)
    assert seen == [*end, "prerun"]


def test_a_failed_claim_ends_no_guard(seen):
    def fails():
        raise Odd()

    with pytest.raises(Odd):
        decision.act(_task(), _opts(), "k", False, claim=fails, wait_here=lambda: None, guard_here=GuardOwner.RUN)
    assert seen == ["prerun"]


def test_an_error_before_the_body_lets_go_of_a_node_of_ours(seen, monkeypatch):
    monkeypatch.setattr(decision.enqueue, "started", lambda *a: _raise(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        _act(_task(), _opts(), here=LockDecision(Outcome.GRANTED, 0.0, lock=Lock(seen), own_node=True))
    assert seen == ["prerun", "release", "guard end KeyboardInterrupt"]
