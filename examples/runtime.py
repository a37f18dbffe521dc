"""What the examples share to run end to end: the results table and ``run_standalone``.

* :class:`Report` collects metric rows and invariant checks and prints the results table.
* :func:`run_standalone` runs one example on its own: services, processes, table.

The process and service plumbing is shared with the tests and the benchmark and lives in
the repository's ``support`` package: :class:`support.services.Services` (reuse a reachable
ZooKeeper/Redis or start local ones), :class:`support.workers.Procs` (``celery worker`` /
``celery beat`` subprocesses, each in its own session, stopped by pid and process group),
:func:`support.workers.wait_ready` and :mod:`support.console` (progress lines, Ctrl-C).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Callable

from support.console import check_stop, install_interrupt_handlers
from support.services import Services
from support.workers import Procs


# --------------------------------------------------------------------------- waiting
def wait_until(predicate, timeout: float, interval: float = 0.1, progress=None, every: float = 2.0) -> bool:
    """Poll ``predicate`` until true or ``timeout``; call ``progress()`` every ``every`` s."""
    deadline = time.monotonic() + timeout
    next_report = time.monotonic() + every
    while True:
        check_stop()
        if predicate():
            return True
        now = time.monotonic()
        if now >= deadline:
            return False
        if progress is not None and now >= next_report:
            progress()
            next_report = now + every
        time.sleep(interval)


# --------------------------------------------------------------------------- reporting
def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (``p`` in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def ms(seconds: float) -> str:
    return "n/a" if seconds != seconds else f"{seconds * 1000:.1f} ms"


@dataclass
class Row:
    example: str
    metric: str
    value: str
    ok: bool | None = None  # None: a measurement, not an invariant

    @property
    def status(self) -> str:
        return "" if self.ok is None else ("PASS" if self.ok else "FAIL")


class Report:
    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.figures: dict[str, dict[str, float]] = {}  # example -> name -> number (for --json)

    def figure(self, example: str, name: str, value: float) -> None:
        """A number for machines (``--json``; the benchmark reads them), beside the table."""
        self.figures.setdefault(example, {})[name] = value

    def metric(self, example: str, metric: str, value: object) -> None:
        self.rows.append(Row(example, metric, str(value)))

    def check(self, example: str, metric: str, value: object, ok: bool) -> bool:
        self.rows.append(Row(example, metric, str(value), bool(ok)))
        return bool(ok)

    def extend(self, other: "Report") -> None:
        self.rows.extend(other.rows)

    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.ok is False]

    @property
    def ok(self) -> bool:
        return not self.failures()

    def render(self) -> str:
        head = ("example", "metric", "value", "check")
        cells = [head] + [(r.example, r.metric, r.value, r.status) for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(4)]
        sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
        header = "| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |"
        lines = [sep, header, sep.replace("-", "=")]
        previous = None
        for r in self.rows:
            if previous is not None and r.example != previous:
                lines.append(sep)
            previous = r.example
            vals = (r.example, r.metric, r.value, r.status)
            lines.append("| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths, strict=True)) + " |")
        lines.append(sep)
        return "\n".join(lines)


def run_standalone(run: Callable[["Report", "Procs | None"], object], spawn: bool = True,
                   json_out: str | None = None) -> int:
    """Run one example on its own (``python -m examples.NAME``): services, processes, table.

    Why one helper: every example's command line must start (or reuse) ZooKeeper and
    Redis, stop exactly the processes it started, also on Ctrl-C, print the same table and
    keep the logs only when an invariant broke.  ``spawn=False`` runs against workers that
    are already up (``run`` then gets ``procs=None``).
    """
    install_interrupt_handlers()
    report = Report()
    procs = None
    if not spawn:
        run(report, None)
    else:
        services = Services()
        try:
            os.environ.update(services.start().env())
            procs = Procs(services.endpoints.env())
            run(report, procs)
        finally:
            if procs is not None:
                procs.stop_all()
            services.close()
    print(report.render())
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"ok": report.ok, "figures": report.figures,
                       "failures": [f"{r.example}: {r.metric} = {r.value}" for r in report.failures()]}, f)
    if procs is not None:
        if report.ok:
            procs.remove_logs()
        else:
            print(f"worker/beat logs kept in {procs.logdir}")
    return 0 if report.ok else 1
