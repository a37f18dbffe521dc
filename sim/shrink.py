"""Shrinking a failing seed: the fewest faults and the shortest load that still fail.

Why: a seed's scenario is drawn whole (workers, keys, load, up to six faults), and most of
it is usually irrelevant to the violation.  Delta debugging over what the seed drew, not
over events (an event list does not replay once anything before it changes): drop each
fault in turn and keep it dropped while the run still fails with the *same* invariant; then
cut the load in half while it still fails.  Each try is one run, so shrinking costs a few
dozen schedules.  The result replays with ``make sim SEED=n DROP=i,j LOAD=t``.
"""

from __future__ import annotations


def _invariant(violation: str | None) -> str | None:
    """A violation's kind: its message up to the first detail that varies between runs."""
    if violation is None:
        return None
    for marker in (" tokens must increase", " in a row", " kept ", " hands ", " still believes", " deletes ",
                   "two holders", "at quiescence", "writes in flight", "already done", "logged an error",
                   "orphan", "agent still runs", "crashed", "second verdict", "never had", "write hold overlaps",
                   "queues ahead of it", "(a reader) still waits", "(a writer) still waits", "starved"):
        if marker in violation:
            return marker.strip()
    return violation.split(":")[0]


def shrink(seed: int, violation: str, run_seed, tries: int = 40) -> tuple[dict, str]:
    """The smallest shape found that still fails like ``violation``: (shape, its violation)."""
    kind = _invariant(violation)
    _, first = run_seed(seed)
    faults = len(first.faults)
    shape: dict = {"drop": frozenset()}
    best = violation
    budget = [tries]

    def fails(candidate: dict):
        if budget[0] <= 0:
            return None
        budget[0] -= 1
        found, _run = run_seed(seed, shape=candidate)
        return found if _invariant(found) == kind else None

    for index in range(faults):
        candidate = {**shape, "drop": shape["drop"] | {index}}
        found = fails(candidate)
        if found:
            shape, best = candidate, found
    load = first.load
    while load > 0.25:
        candidate = {**shape, "load": round(load / 2, 3)}
        found = fails(candidate)
        if not found:
            break
        shape, best, load = candidate, found, load / 2
    return shape, best


def replay_line(seed: int, shape: dict) -> str:
    parts = [f"make sim SEED={seed}"]
    if shape.get("drop"):
        parts.append("DROP=" + ",".join(str(i) for i in sorted(shape["drop"])))
    if shape.get("load") is not None:
        parts.append(f"LOAD={shape['load']}")
    return " ".join(parts)
