"""How long an elected beat's handover takes, against the session timeout: three beats, the
active one SIGKILLed, then the next SIGSTOPped past its session, then the next cut off from
ZooKeeper (a TCP proxy per beat), at each session timeout given.  ``python -m
bench.beat_handover`` prints a markdown table (bench/results/beat.md).

Why against the session timeout: a dead leader's node goes when ZooKeeper expires its session,
which it does on tickTime boundaries after the timeout; the rest (the standby's watch, reading
the tick records, the first send) is the part that is ours."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import uuid


def run_once(session: float, tick_ms: int) -> dict[str, float]:
    from examples.beat_elected import scenario
    from examples.runtime import Report
    from support.services import Services
    from support.workers import Procs
    from tests.tcpproxy import TcpProxy

    services = Services(zk_hosts="127.0.0.1:1", tick_ms=tick_ms)  # always our own ZooKeeper: its tickTime is known
    endpoints = services.start()
    env = {**endpoints.env(), "ZKLOCK_ROOT": f"/bench-beat-{uuid.uuid4().hex[:6]}"}
    os.environ.update(env)
    import importlib

    import examples.beat_elected.app as app_module

    importlib.reload(app_module)
    proxies = [TcpProxy.to(endpoints.zk_hosts) for _ in range(3)]
    procs = Procs(env, tempfile.mkdtemp(prefix="zklock-bench-beat-"))
    report = Report()
    try:
        scenario.run(report, procs, faults=scenario.FAULTS, session=session, granularity=tick_ms / 1000,
                     proxies=proxies)
    finally:
        procs.stop_all()
        for p in proxies:
            p.close()
        services.close()
    if not report.ok:
        raise SystemExit(report.render())
    return {k.removeprefix("handover_").removesuffix("_s"): v for k, v in report.figures.get("beat_elected", {}).items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.beat_handover", description=__doc__.split("\n\n")[0])
    parser.add_argument("--session", type=float, action="append", help="session timeouts (s), repeatable (default 2, 4, 10)")
    parser.add_argument("--tick-ms", type=int, help="ZooKeeper's tickTime (default: 200 ms, or more where the session "
                        "timeout exceeds ZooKeeper's cap of 20 ticks)")
    args = parser.parse_args(argv)
    rows = []
    for session in args.session or [2.0, 4.0, 10.0]:
        tick_ms = args.tick_ms or max(200, math.ceil(session * 1000 / 20))  # ZooKeeper caps a session at 20 ticks
        rows.append((session, tick_ms, run_once(session, tick_ms)))
    print("| session timeout | ZooKeeper tickTime | SIGKILL | SIGSTOP past the session | network cut | bound (session + tickTime + period 1 s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for session, tick_ms, found in rows:
        cells = " | ".join(f"{found.get(f, float('nan')):.2f} s" for f in ("sigkill", "sigstop", "cut"))
        print(f"| {session:.0f} s | {tick_ms} ms | {cells} | {session + tick_ms / 1000 + 1:.1f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
