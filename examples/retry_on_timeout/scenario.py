"""Run the retry policy end to end: a 7 s ``reconcile`` holds ``account:7``; ``sync_account(7)``
(lock timeout 0.5 s, retry policy) is sent while it runs, and ``sync_account(8)`` as a
control.  Checks: account 8 ran at once; account 7 retried with the policy's growing
countdowns (0.25, 0.5, 1, 2, then capped at 2 s), each attempt's lock decision at least
``lock timeout + countdown`` after the previous one's, and it ran once the reconcile released.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import pairwise

from examples.runtime import Report, run_standalone, wait_until
from support.console import say
from support.workers import Procs, wait_ready

NAME = "retry_on_timeout"
APP = "examples.retry_on_timeout.app"


def run(report: Report, procs: Procs, hold: float = 7.0, workers: int = 2, concurrency: int = 2) -> Report:
    from examples.retry_on_timeout import app as m

    m.store.reset()
    r = m.store.r
    say(f"{NAME}: starting {workers} workers (-c {concurrency})")
    ws = [procs.worker(APP, f"retryw{i + 1}", concurrency, loglevel="info") for i in range(workers)]
    wait_ready(m.app, ws)

    blocker = m.reconcile.delay(7, hold)
    if not wait_until(lambda: r.exists(m.store.key("reconcile", 7, "start")), 30):
        raise RuntimeError(f"reconcile never started:\n{ws[0].log_tail()}")
    say(f"{NAME}: reconcile(7) holds account:7 for {hold:.0f}s; sending sync_account(7) and sync_account(8) "
        f"(lock_timeout={m.LOCK_TIMEOUT}s, on_lock_timeout='retry')")
    t0 = time.time()
    contended, control = m.sync_account.delay(7), m.sync_account.delay(8)

    seen = {"n": 0}

    def show_new_retries():
        retries = [json.loads(x) for x in r.lrange(m.store.key("retries", 7), seen["n"], -1)]
        for x in retries:
            say(f"{NAME}: sync_account(7) attempt {x['retries'] + 1}: lock busy after {m.LOCK_TIMEOUT}s, "
                f"retry {x['retries'] + 1} in {x['countdown']}s")
        seen["n"] += len(retries)

    def done():
        show_new_retries()
        return contended.ready()

    wait_until(done, hold + 30, interval=0.1)
    value = contended.get(timeout=5, propagate=False)
    control_value = control.get(timeout=10, propagate=False)
    blocker.get(timeout=10, propagate=False)

    attempts = [json.loads(x) for x in r.lrange(m.store.key("attempts", 7), 0, -1)]
    retries = [json.loads(x) for x in r.lrange(m.store.key("retries", 7), 0, -1)]
    runs = [json.loads(x) for x in r.lrange(m.store.key("runs", 7), 0, -1)]
    control_runs = [json.loads(x) for x in r.lrange(m.store.key("runs", 8), 0, -1)]
    reconcile_end = float(r.get(m.store.key("reconcile", 7, "end")) or 0)
    countdowns = [x["countdown"] for x in retries]
    expected = m.expected_countdowns(len(retries))
    gaps = [b["at"] - a["at"] for a, b in pairwise(attempts)]
    # Attempts are stamped at their lock decision (task_prerun): a retry is published right
    # after a decision with countdown c, and the next attempt is decided no sooner than its
    # ETA plus lock_timeout when it times out again, or its ETA when it gets the lock (the
    # last one).  Timer slack: 20 ms.
    floors = [c + (m.LOCK_TIMEOUT if i < len(countdowns) - 1 else 0.0) for i, c in enumerate(countdowns)]
    gaps_ok = len(gaps) == len(countdowns) and all(g >= f - 0.02 for g, f in zip(gaps, floors, strict=True))
    grows = all(b > a or b == m.BACKOFF_MAX for a, b in pairwise(countdowns)) and len(set(countdowns)) >= 3

    say(f"{NAME}: sync_account(7) ran after {len(retries)} retries, {runs[0]['at'] - t0:.2f}s after it was sent"
        if runs else f"{NAME}: sync_account(7) did not run")
    for i, a in enumerate(attempts):
        what = (f"lock busy {m.LOCK_TIMEOUT}s -> retry in {countdowns[i]}s" if i < len(countdowns)
                else "got the lock, ran")
        report.metric(NAME, f"attempt {i + 1} decided at +{a['at'] - t0:.2f} s", what)
    report.check(NAME, "uncontended sync_account(8) retries", control_value,
                 control_value == 0 and len(control_runs) == 1)
    report.check(NAME, "sync_account(7) retries (attempts)", f"{len(retries)} ({len(attempts)})",
                 len(retries) >= 3 and len(attempts) == len(retries) + 1 and value == len(retries))
    report.check(NAME, "countdowns grow x2 up to the cap", " -> ".join(f"{c:g}" for c in countdowns) + " s",
                 countdowns == expected and grows)
    # Shown even when the counts differ (gaps_ok is then false): the pairs there are.
    report.check(NAME, "decisions apart >= countdown (+ timeout)",
                 " / ".join(f"{g:.2f}>={f:.2f}" for g, f in zip(gaps, floors, strict=False)) + " s", gaps_ok)
    report.check(NAME, "ran once, after reconcile released",
                 f"{(runs[0]['at'] - reconcile_end):+.2f} s after release" if runs and reconcile_end else "no",
                 len(runs) == 1 and contended.state == "SUCCESS" and reconcile_end > 0 and runs[0]["at"] >= reconcile_end)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.retry_on_timeout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold", type=float, default=7.0)
    args = parser.parse_args(argv)
    return run_standalone(lambda report, procs: run(report, procs, args.hold))


if __name__ == "__main__":
    sys.exit(main())
