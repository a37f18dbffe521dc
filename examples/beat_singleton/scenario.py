"""Run the beat singleton end to end: two workers, two ``celery beat`` processes sending the
same 2.2 s job every second, for a fixed window; then stop the beats, let the queue drain
and check: runs never overlapped, every surplus tick was skipped (SUCCESS, result None) and
accounted for (sent == ran + skipped), both beats really sent.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from itertools import pairwise

from examples.runtime import Report, run_standalone, wait_until
from support.console import say
from support.workers import Procs, wait_ready

NAME = "beat_singleton"
APP = "examples.beat_singleton.app"


def run(report: Report, procs: Procs, window: float = 9.0, workers: int = 2, concurrency: int = 2) -> Report:
    from examples.beat_singleton import app as m

    m.store.reset()
    r = m.store.r
    say(f"{NAME}: starting {workers} workers (-c {concurrency}); job takes {m.DURATION}s, period {m.PERIOD}s")
    ws = [procs.worker(APP, f"beatw{i + 1}", concurrency, loglevel="info") for i in range(workers)]
    wait_ready(m.app, ws)
    say(f"{NAME}: starting 2 celery beat processes (the misconfiguration) for {window:.0f}s")
    beats = [procs.beat(APP, f"beat{i + 1}-{procs.tag}") for i in range(2)]
    beat_names = {b.pid: b.name.split("-")[0] for b in beats}

    def counts():
        sent = sum(int(v) for v in r.hvals(m.store.key("sent")))
        return sent, r.llen(m.store.key("runs")), int(r.get(m.store.key("skipped")) or 0)

    def progress():
        sent, ran, skipped = counts()
        say(f"{NAME}: ticks sent {sent}, runs finished {ran}, ticks skipped {skipped}")

    wait_until(lambda: any(not b.alive() for b in beats), window, progress=progress)
    for b in beats:
        if not b.alive():
            raise RuntimeError(f"{b.name} exited with {b.proc.returncode}:\n{b.log_tail()}")
    say(f"{NAME}: stopping the beats (pids {', '.join(str(b.pid) for b in beats)}); draining the queue")
    procs.stop(beats)
    def settled() -> bool:
        sent, ran, skipped = counts()
        return sent == ran + skipped

    drained = wait_until(settled, 3 * m.DURATION + 10, progress=progress)
    sent, ran, skipped = counts()

    runs = sorted((json.loads(x) for x in r.lrange(m.store.key("runs"), 0, -1)), key=lambda x: x["start"])
    overlaps = sum(1 for a, b in pairwise(runs) if b["start"] < a["end"])
    max_concurrent = max((x["concurrent"] for x in runs), default=0)
    per_beat = {}
    for who, n in r.hgetall(m.store.key("sent")).items():
        pid = int(who.decode().rsplit(":", 1)[1])
        per_beat[beat_names.get(pid, f"pid {pid}")] = int(n)
    ids = [x.decode() for x in r.lrange(m.store.key("sent_ids"), 0, -1)]

    def final_states() -> Counter:
        """SUCCESS split by result: a run returns its token, a skipped tick None."""
        found = Counter()
        for i in ids:
            res = m.app.AsyncResult(i)
            found[res.state if res.state != "SUCCESS" else ("SUCCESS (None)" if res.result is None else "SUCCESS")] += 1
        return found

    # A run is counted when its body ends; its SUCCESS is stored a moment later, after its
    # lock is let go: wait for every state to be final before comparing.
    wait_until(lambda: sum(final_states()[s] for s in ("SUCCESS", "SUCCESS (None)", "FAILURE")) >= len(ids), 10)
    states = final_states()
    tokens = [x["token"] for x in runs]
    by_worker = Counter(x["worker"].split("@")[0].split("-")[0] for x in runs)

    report.metric(NAME, "window / period / job duration", f"{window:.0f} s / {m.PERIOD} s / {m.DURATION} s")
    report.check(NAME, "ticks sent per beat", ", ".join(f"{k}: {v}" for k, v in sorted(per_beat.items())),
                 len(per_beat) == 2 and all(v > 0 for v in per_beat.values()))
    report.check(NAME, "runs overlapping (max concurrent runs)", f"{overlaps} ({max_concurrent})",
                 overlaps == 0 and max_concurrent == 1 and len(runs) > 0)
    report.metric(NAME, "runs (per worker)", f"{len(runs)} ({', '.join(f'{k}: {v}' for k, v in sorted(by_worker.items()))})")
    report.check(NAME, "surplus ticks skipped", skipped, skipped > 0)
    report.check(NAME, "sent == ran + skipped", f"{sent} == {ran} + {skipped}", drained and sent == ran + skipped)
    report.check(NAME, "results (a token / None: skipped)", f"{states.get('SUCCESS', 0)} / {states.get('SUCCESS (None)', 0)}",
                 states.get("SUCCESS", 0) == ran and states.get("SUCCESS (None)", 0) == skipped)
    report.check(NAME, "tokens strictly increasing", "yes" if all(a < b for a, b in pairwise(tokens)) else "no",
                 all(a < b for a, b in pairwise(tokens)))
    say(f"{NAME}: {sent} ticks: {ran} ran one at a time, {skipped} skipped")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.beat_singleton", description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=9.0)
    args = parser.parse_args(argv)
    return run_standalone(lambda report, procs: run(report, procs, args.window))


if __name__ == "__main__":
    sys.exit(main())
