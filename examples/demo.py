"""``make demo``: the three examples with real ``celery worker`` and ``celery beat`` processes.

1. uses the ZooKeeper at ``$ZKLOCK_HOSTS`` and the Redis at ``$REDIS_URL`` (defaults
   ``127.0.0.1:2181`` and ``redis://127.0.0.1:6379/0``) when they answer — then under a
   unique znode root, a unique Redis key prefix and a separate Redis DB — and otherwise
   starts a local ZooKeeper and Redis on free loopback ports;
2. runs ``flash_sale``, ``beat_singleton``, ``beat_elected`` and ``retry_on_timeout`` (each starts its own
   workers, and beats, and stops them when it is done), printing progress lines;
3. prints a results table, stops every process it started (by pid, also on Ctrl-C, SIGTERM
   or an error) and exits 1 if any invariant failed (130 when interrupted).

Options: ``--only NAME`` (repeatable), ``--orders N`` (flash-sale burst, default 1200).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

from examples.runtime import Report
from support.console import STOP, check_stop, install_interrupt_handlers, say
from support.services import Services
from support.workers import Procs

EXAMPLES = ("flash_sale", "beat_singleton", "beat_elected", "retry_on_timeout")


def _run_example(name: str, report: Report, procs: Procs, args: argparse.Namespace) -> None:
    if name == "flash_sale":
        from examples.flash_sale.scenario import run

        run(report, procs, orders=args.orders, workers=2, concurrency=3)
    elif name == "beat_singleton":
        from examples.beat_singleton.scenario import run

        run(report, procs, window=9.0, workers=2, concurrency=2)
    elif name == "beat_elected":
        from examples.beat_elected.scenario import run

        run(report, procs, faults=("sigkill", "sigstop"), session=4.0, granularity=2.0)  # tickTime 2000 ms
    else:
        from examples.retry_on_timeout.scenario import run

        run(report, procs, hold=7.0, workers=2, concurrency=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=EXAMPLES, help="run only this example (repeatable)")
    parser.add_argument("--orders", type=int, default=1200, help="flash-sale burst size (default 1200)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the worker/beat logs even when all passes")
    args = parser.parse_args(argv)
    selected = [e for e in EXAMPLES if not args.only or e in args.only]

    install_interrupt_handlers()  # Ctrl-C and SIGTERM unwind into the cleanup below
    started = time.monotonic()
    report = Report()
    services = Services(tick_ms=2000)
    logdir = tempfile.mkdtemp(prefix="zklock-demo-")
    all_procs: list[Procs] = []
    interrupted = False
    try:
        say(f"celery-zklock demo: {', '.join(selected)} with real workers, ZooKeeper and Redis")
        endpoints = services.start()
        for note in endpoints.notes:
            say(note)
        say(f"znode root {endpoints.zk_root}, Redis key prefix {endpoints.prefix!r}, logs in {logdir}")
        os.environ.update(endpoints.env())  # the example apps read these when imported
        for name in selected:
            check_stop()
            procs = Procs(endpoints.env(), logdir, tag=services.run_id)
            all_procs.append(procs)
            try:
                _run_example(name, report, procs, args)
            except Exception as exc:
                if STOP.is_set():  # an interrupt that a library turned into another error
                    raise KeyboardInterrupt from exc
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                report.check(name, "example ran to completion", f"{type(exc).__name__}: {first}"[:90], False)
                say(f"{name}: ERROR {type(exc).__name__}: {exc}")
            finally:
                if procs.items:
                    say(f"{name}: stopping its processes (pids {', '.join(str(p.pid) for p in procs.items)})")
                procs.stop_all()
    except KeyboardInterrupt:
        interrupted = True
        print(file=sys.stderr)
        say("interrupted: stopping every process the demo started")
    finally:
        # a second Ctrl-C (or SIGTERM) must not cut the cleanup short
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for procs in all_procs:
                procs.stop_all(timeout=10 if interrupted else 20)
            services.close()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    elapsed = time.monotonic() - started
    if interrupted:
        say(f"stopped after {elapsed:.0f}s; logs kept in {logdir}")
        return 130
    print()
    print(report.render())
    checks = [r for r in report.rows if r.ok is not None]
    failed = report.failures()
    if failed:
        print(f"\nFAILED: {len(failed)} of {len(checks)} invariant checks ({', '.join(f'{r.example}: {r.metric}' for r in failed)})"
              f"; worker and beat logs kept in {logdir}")
        return 1
    print(f"\nAll {len(checks)} invariant checks hold; demo took {elapsed:.0f}s.")
    if args.keep_logs:
        print(f"Logs: {logdir}")
    else:
        shutil.rmtree(logdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
