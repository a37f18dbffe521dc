"""Judge a fault run from its history alone: exclusion, fencing, accounting, cleanup.

Why independent of the harness and the library: a checker that shares code with what it
checks tends to share its bugs.  It takes plain data — the fenced store's events (see
``store.py``), the final state of every submitted task id, the lock nodes still present
after the workload — and returns every violation it finds, with figures for the report.
Its own tests (``test_checker.py``) feed it synthetic histories, including ones that must
fail.

Vocabulary.  A *run* is one acquisition of a key's lock by one task execution: the events
sharing (key, task id, token) — ``begin`` (fenced read), ``end`` (fenced write of the
value read + 1), ``return`` (the body returned) or ``interrupted`` (LockLost was raised
inside the body).  Events are ordered by ``seq``, the order
Redis executed them in.  A run's interval is [first event, last event]; it is *validly
fenced* when its begin and end were both accepted, and *complete* when it has a return.

Rules:

1. fencing: the fenced parts (begin to end) of validly fenced runs of one key never overlap;
2. no lost update: the accepted writes of a key are 1, 2, 3, ... (each read the previous);
3. exclusion: two overlapping runs of one key are allowed only if one of them belongs to a
   task reported as having lost its lock (``excused``, by default ``LockLost``) — the
   library must never report success for a run that was not exclusive;
4. accounting: every submitted task reached a final state; a SUCCESS ran to completion
   exactly once (or, where the scenario accepts at-least-once delivery, at least once),
   validly fenced; any other outcome has a reason the scenario allows; no
   run belongs to a task that was not submitted;
5. cleanup: no lock node is left once the workload is over.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping

FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "SKIPPED", "REVOKED"})
RUN_OPS = ("begin", "end", "return", "interrupted")  # other ops (e.g. "mark") are not runs


@dataclass
class Run:
    key: str
    task: str
    token: int
    events: list[dict] = field(default_factory=list)

    def _op(self, name: str) -> dict | None:
        return next((e for e in self.events if e["op"] == name), None)

    @property
    def begin(self) -> dict | None:
        return self._op("begin")

    @property
    def end(self) -> dict | None:
        return self._op("end")

    @property
    def first(self) -> int:
        return min(e["seq"] for e in self.events)

    @property
    def last(self) -> int:
        return max(e["seq"] for e in self.events)

    @property
    def fenced(self) -> bool:
        return bool(self.begin and self.begin["ok"] and self.end and self.end["ok"])

    @property
    def complete(self) -> bool:
        return self._op("return") is not None

    @property
    def rejected(self) -> int:
        return sum(1 for e in self.events if e["op"] in ("begin", "end") and not e["ok"])

    def overlaps(self, other: "Run") -> bool:
        return self.first < other.last and other.first < self.last

    def fence_overlaps(self, other: "Run") -> bool:
        """Do the fenced parts (begin to end) of two validly fenced runs overlap?"""
        return self.begin["seq"] < other.end["seq"] and other.begin["seq"] < self.end["seq"]

    def __str__(self) -> str:
        return f"run(task={self.task}, token={self.token}, seq {self.first}..{self.last})"


@dataclass
class Report:
    violations: list[str]
    figures: dict

    @property
    def ok(self) -> bool:
        return not self.violations

    def explain(self) -> str:
        lines = [f"{len(self.violations)} violation(s); figures: {self.figures}"]
        lines += [f"  - {v}" for v in self.violations[:40]]
        if len(self.violations) > 40:
            lines.append(f"  ... and {len(self.violations) - 40} more")
        return "\n".join(lines)


def runs_of(events: Iterable[dict]) -> list[Run]:
    """Group lock-run events (see :data:`RUN_OPS`) into runs, in order of first event."""
    grouped: dict[tuple, Run] = {}
    for e in sorted(events, key=lambda e: e["seq"]):
        if e["op"] not in RUN_OPS:
            continue
        ident = (e["key"], e["task"], int(e["token"]))
        grouped.setdefault(ident, Run(*ident)).events.append(e)
    return list(grouped.values())


def check(
    events: Iterable[dict],
    outcomes: Mapping[str, tuple[str, str | None]],
    *,
    allowed: Iterable[str] = (),
    excused: Iterable[str] = ("LockLost",),
    leftovers: Iterable[str] = (),
    reruns: bool = False,
    acked_lost: Iterable[str] = (),
) -> Report:
    """Check a history.

    ``outcomes`` maps every submitted task id to (final state, reason): the exception class
    name for FAILURE, else None.  ``allowed`` lists the states or failure reasons this
    scenario may produce besides SUCCESS (e.g. ``"LockLost"``, ``"WorkerLostError"``,
    ``"SKIPPED"``).  ``excused`` are the failure reasons that admit a run was not exclusive.
    ``acked_lost`` lists tasks that Celery itself loses in this scenario (their message was
    acknowledged when they started, and their worker was then killed whole): they need no
    final state, but none may have completed a run.
    """
    events = list(events)
    allowed, excused, acked_lost = set(allowed), set(excused), set(acked_lost)
    all_runs = runs_of(events)
    by_key: dict[str, list[Run]] = defaultdict(list)
    by_task: dict[str, list[Run]] = defaultdict(list)
    for r in all_runs:
        by_key[r.key].append(r)
        by_task[r.task].append(r)

    def outcome_label(task: str) -> str:
        state, reason = outcomes.get(task, ("UNKNOWN", None))
        return reason if state == "FAILURE" and reason else state

    violations: list[str] = []
    excused_overlaps = 0
    for key, runs in sorted(by_key.items()):
        fenced = [r for r in runs if r.fenced]
        for i, a in enumerate(fenced):
            for b in fenced[i + 1:]:
                if a.fence_overlaps(b):
                    violations.append(f"fencing: validly fenced runs of key {key!r} overlap: {a} and {b}")
        expected = 1
        for e in sorted((e for e in events if e["key"] == key and e["op"] == "end" and e["ok"]), key=lambda e: e["seq"]):
            if e["value"] != expected:
                violations.append(
                    f"lost update: key {key!r} write by task {e['task']} (seq {e['seq']}) stored {e['value']}, "
                    f"expected {expected}"
                )
            expected = e["value"] + 1
        for i, a in enumerate(runs):
            for b in runs[i + 1:]:
                if not a.overlaps(b):
                    continue
                if outcome_label(a.task) in excused or outcome_label(b.task) in excused:
                    excused_overlaps += 1
                    continue
                violations.append(
                    f"exclusion: runs of key {key!r} overlap and neither task was reported as having lost its "
                    f"lock: {a} -> {outcome_label(a.task)}, {b} -> {outcome_label(b.task)}"
                )

    failed: Counter = Counter()
    lost = duplicated = succeeded = 0
    for task, (state, reason) in sorted(outcomes.items()):
        complete = [r for r in by_task.get(task, []) if r.complete]
        if task in acked_lost and state not in FINAL_STATES:
            lost += 1
            if complete:
                violations.append(f"accounting: task {task} was to be lost with its worker, yet ran to completion")
            continue
        if state not in FINAL_STATES:
            lost += 1
            violations.append(f"accounting: task {task} never reached a final state (state {state})")
        elif state == "SUCCESS":
            succeeded += 1
            if len(complete) != 1 and not (reruns and complete):
                violations.append(f"accounting: task {task} reported SUCCESS but ran to completion {len(complete)} times")
            elif not all(r.fenced for r in complete):
                violations.append(
                    f"accounting: task {task} reported SUCCESS although the fence rejected its run {complete[0]}"
                )
        else:
            label = outcome_label(task)
            failed[label] += 1
            if label not in allowed:
                violations.append(f"accounting: task {task} ended {state} ({reason}), not an outcome this scenario allows")
        if len(complete) > 1:
            duplicated += 1
    for task in sorted(set(by_task) - set(outcomes)):
        violations.append(f"accounting: task {task} ran but was never submitted ({by_task[task][0]})")

    leftovers = sorted(leftovers)
    if leftovers:
        violations.append(f"cleanup: {len(leftovers)} lock node(s) left behind: {leftovers[:5]}")

    figures = {
        "submitted": len(outcomes),
        "succeeded": succeeded,
        "failed": dict(failed),
        "lost": lost,
        "duplicated": duplicated,
        "runs": len(all_runs),
        "complete_runs": sum(1 for r in all_runs if r.complete),
        "rejected_ops": sum(r.rejected for r in all_runs),
        "excused_overlaps": excused_overlaps,
        "leftover_nodes": len(leftovers),
    }
    return Report(violations, figures)
