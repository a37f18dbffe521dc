"""The checker on synthetic histories: clean ones pass, and each kind of broken one fails.

Why: a checker that never fails proves nothing.  Each bad history below is the trace a
specific lock or library bug would leave (two holders at once, a frozen holder reported as
successful, a redelivered copy run twice or not at all, a leaked node...), and the test
asserts the checker names it.
"""

from __future__ import annotations

import pytest

from tests.faults.checker import check, runs_of


class History:
    """Builds events in execution order, the way the fenced store would record them."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.last_token: dict[str, int] = {}
        self.value: dict[str, int] = {}

    def _add(self, op, key, task, token, ok=1, value=None):
        self.events.append(dict(op=op, key=key, task=task, token=token, worker="w@h", pid=1, ok=ok,
                                value=self.value.get(key, 0) if value is None else value,
                                t=len(self.events) / 1000, seq=len(self.events)))

    def fenced(self, op, key, task, token, write=None):
        """A begin/end through a correct fence."""
        ok = int(token >= self.last_token.get(key, -1))
        if ok:
            self.last_token[key] = token
            if op == "end":
                self.value[key] = write
        self._add(op, key, task, token, ok)
        return self

    def begin(self, key, task, token):
        return self.fenced("begin", key, task, token)

    def end(self, key, task, token, read):
        return self.fenced("end", key, task, token, write=read + 1)

    def ret(self, key, task, token):
        self._add("return", key, task, token)
        return self

    def run(self, key, task, token):
        """A whole, undisturbed run: read the counter, write it + 1, return."""
        read = self.value.get(key, 0)
        return self.begin(key, task, token).end(key, task, token, read).ret(key, task, token)


OK = ("SUCCESS", None)


def test_serial_runs_on_two_keys_pass():
    h = History().run("a", "t1", 10).run("b", "t2", 11).run("a", "t3", 12).run("a", "t4", 13)
    report = check(h.events, {"t1": OK, "t2": OK, "t3": OK, "t4": OK})
    assert report.ok, report.explain()
    assert report.figures["succeeded"] == 4 and report.figures["complete_runs"] == 4
    assert report.figures["duplicated"] == report.figures["lost"] == report.figures["rejected_ops"] == 0


def test_runs_are_grouped_by_key_task_and_token():
    h = History().begin("a", "t1", 10).begin("b", "t2", 11).end("a", "t1", 10, 0).ret("a", "t1", 10)
    runs = runs_of(h.events)
    assert [(r.key, r.task, r.token, r.fenced, r.complete) for r in runs] == [
        ("a", "t1", 10, True, True), ("b", "t2", 11, False, False)]


def test_two_holders_at_once_with_a_broken_fence_fail():
    """Both runs read 0 and write 1 (a fence that accepts anything): overlap and lost update."""
    h = History()
    for op, task in (("begin", "t1"), ("begin", "t2"), ("end", "t1"), ("end", "t2")):
        h._add(op, "a", task, 10 if task == "t1" else 11, ok=1, value=0 if op == "begin" else 1)
    report = check(h.events, {"t1": OK, "t2": OK})
    kinds = {v.split(":")[0] for v in report.violations}
    assert {"fencing", "lost update", "exclusion"} <= kinds, report.explain()


def test_lost_update_alone_is_caught():
    h = History().run("a", "t1", 10)
    h._add("begin", "a", "t2", 11, value=1)
    h._add("end", "a", "t2", 11, value=5)  # a write that did not read the previous value
    h._add("return", "a", "t2", 11)
    report = check(h.events, {"t1": OK, "t2": OK})
    assert [v for v in report.violations if v.startswith("lost update")], report.explain()


def test_frozen_holder_reported_lock_lost_is_excused():
    """The zombie's late write is rejected and it ends LockLost: the history is legal."""
    h = History().begin("a", "zombie", 10)
    h.run("a", "taker", 20)
    h.end("a", "zombie", 10, 0).ret("a", "zombie", 10)
    report = check(h.events, {"zombie": ("FAILURE", "LockLost"), "taker": OK}, allowed={"LockLost"})
    assert report.ok, report.explain()
    assert report.figures["rejected_ops"] == 1 and report.figures["excused_overlaps"] == 1


def test_holder_frozen_after_its_write_and_reported_lock_lost_is_legal():
    """Its fenced part ended before the taker began; only its tail overlaps, excused."""
    h = History().begin("a", "zombie", 10).end("a", "zombie", 10, 0)
    h.run("a", "taker", 20)
    h.ret("a", "zombie", 10)
    report = check(h.events, {"zombie": ("FAILURE", "LockLost"), "taker": OK}, allowed={"LockLost"})
    assert report.ok, report.explain()


def test_frozen_holder_reported_success_fails():
    """Known bug (a): the body returned after a freeze past the session timeout and the
    run was reported SUCCESS although another task held the lock meanwhile."""
    h = History().begin("a", "zombie", 10).end("a", "zombie", 10, 0)  # write accepted before the freeze
    h.run("a", "taker", 20)
    h.ret("a", "zombie", 10)  # the tail ends after the taker's whole run
    report = check(h.events, {"zombie": OK, "taker": OK})
    assert [v for v in report.violations if v.startswith("exclusion")], report.explain()


def test_success_with_a_rejected_write_fails():
    h = History().begin("a", "zombie", 10).run("a", "taker", 20).end("a", "zombie", 10, 0).ret("a", "zombie", 10)
    report = check(h.events, {"zombie": OK, "taker": OK})
    assert any("fence rejected" in v for v in report.violations), report.explain()


def test_task_that_never_finished_is_lost():
    h = History().run("a", "t1", 10)
    report = check(h.events, {"t1": OK, "t2": ("PENDING", None)})
    assert report.figures["lost"] == 1
    assert any("never reached a final state" in v for v in report.violations)


def test_redelivered_copies_that_both_ran_are_duplicated():
    """Known bug (b), one way: the original and its redelivered copy both ran to completion."""
    h = History().run("a", "t1", 10).run("a", "t1", 11)
    report = check(h.events, {"t1": OK})
    assert report.figures["duplicated"] == 1
    assert any("ran to completion 2 times" in v for v in report.violations)


def test_serial_reruns_pass_only_where_at_least_once_is_accepted():
    h = History().run("a", "t1", 10).run("a", "t1", 11)
    report = check(h.events, {"t1": OK}, reruns=True)
    assert report.ok and report.figures["duplicated"] == 1


def test_overlapping_copies_fail_even_where_reruns_are_accepted():
    h = History().begin("a", "t1", 10).begin("a", "t1", 11).end("a", "t1", 11, 0).ret("a", "t1", 11)
    h.end("a", "t1", 10, 0).ret("a", "t1", 10)
    report = check(h.events, {"t1": OK}, reruns=True)
    assert [v for v in report.violations if v.startswith("exclusion")], report.explain()


def test_redelivered_copies_that_both_stood_aside_are_caught():
    """Known bug (b), the other way: each copy yields to the other and neither runs; the
    task id is left without a run (and with no final state, or a bogus SUCCESS)."""
    assert not check([], {"t1": ("STARTED", None)}).ok
    assert any("0 times" in v for v in check([], {"t1": OK}).violations)


def test_failure_reasons_must_be_allowed_by_the_scenario():
    h = History().begin("a", "t1", 10)
    outcomes = {"t1": ("FAILURE", "WorkerLostError")}
    assert not check(h.events, outcomes, allowed={"LockLost"}).ok
    report = check(h.events, outcomes, allowed={"WorkerLostError"})
    assert report.ok and report.figures["failed"] == {"WorkerLostError": 1}


def test_killed_run_overlapping_a_successful_one_fails():
    """A SIGKILLed holder is not excused: if its lock was freed while it still ran (a reaper
    deleting a live child's node), the overlap is a real breach of exclusion."""
    h = History().begin("a", "killed", 10).begin("a", "next", 20).end("a", "next", 20, 0)
    h._add("mark", "a", "killed", 10)  # not a run event: ignored
    h.end("a", "killed", 10, 0)  # still writing after the next holder began
    h.ret("a", "next", 20)
    report = check(h.events, {"killed": ("FAILURE", "WorkerLostError"), "next": OK}, allowed={"WorkerLostError"})
    assert [v for v in report.violations if v.startswith("exclusion")], report.explain()


def test_run_of_a_task_never_submitted_fails():
    h = History().run("a", "stray", 10)
    assert any("never submitted" in v for v in check(h.events, {}).violations)


@pytest.mark.parametrize("leftovers, ok", [((), True), (("/root/a/_c_x-lock-0000000001",), False)])
def test_leftover_lock_nodes_fail(leftovers, ok):
    h = History().run("a", "t1", 10)
    report = check(h.events, {"t1": OK}, leftovers=leftovers)
    assert report.ok is ok and report.figures["leftover_nodes"] == len(leftovers)


def test_skipped_is_an_outcome_only_where_allowed():
    assert not check([], {"t1": ("SKIPPED", None)}).ok
    assert check([], {"t1": ("SKIPPED", None)}, allowed={"SKIPPED"}).ok
