"""How much code one locked task walks through: the files and functions of ``celery_zklock``
that run in each process, from ``apply_async`` to the grant, the body, the release and the
next task's grant (the default mode: waiting in the worker).

Why measured rather than read: a reader following one task counts what the code calls, and
the count of files and functions is how long that walk is (docs/architecture.md's "One
request, step by step" walks it by hand).  Every process is traced with ``sys.setprofile``
from a ``sitecustomize`` on ``PYTHONPATH``: the publisher (this process), the worker's main
process, its pool processes (forked: they inherit the tracer) and its lock agent (exec'd: it
loads it again).  A first task (another key) runs before: first use (connecting, registering)
is not counted; nor is what runs while the worker idles for as long (heartbeats, timers), so
the count is the task's own.

``python -m bench.walkthrough`` prints the counts and, with ``--list``, every function.
Run it before and after a restructure; the numbers go into the closing note.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time

#: The tracer each process loads: records, per package function, the tenths of a second in
#: which it was called, and writes them to ``<dir>/<pid>.json`` every half second.
TRACER = r'''
import json, os, sys, threading, time
_DIR = os.environ.get("ZKLOCK_WALK_DIR")
if _DIR:
    _PKG = os.sep + "celery_zklock" + os.sep
    _seen = {}

    def _profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if _PKG in code.co_filename and "<" not in code.co_name:
                name = getattr(code, "co_qualname", code.co_name)
                key = code.co_filename.split(_PKG, 1)[1] + ":" + name
                _seen.setdefault(key, set()).add(int(time.time() * 10))

    def _dump():
        while True:
            time.sleep(0.5)
            try:
                data = {"argv": sys.argv, "ppid": os.getppid(), "seen": {k: sorted(v) for k, v in list(_seen.items())}}
                with open(os.path.join(_DIR, f"{os.getpid()}.json.tmp"), "w") as f:
                    json.dump(data, f)
                os.replace(os.path.join(_DIR, f"{os.getpid()}.json.tmp"), os.path.join(_DIR, f"{os.getpid()}.json"))
            except Exception:
                pass

    def _start():
        threading.Thread(target=_dump, daemon=True, name="zklock-walk").start()

    def _in_child():
        _seen.clear()
        _start()

    sys.setprofile(_profile)
    threading.setprofile(_profile)
    os.register_at_fork(after_in_child=_in_child)
    _start()
'''


#: The ZooKeeper client framework under the lock: what kazoo's count of its lock (``lock.py``)
#: and Curator's (three classes) leave out, as their clients (kazoo's ``client.py`` and
#: handlers, Curator's ``CuratorFramework`` and ``ConnectionStateManager``).  Counted apart,
#: so our count can be set beside theirs; the totals include it.
FRAMEWORK = frozenset({"engine/session.py", "engine/client.py", "engine/group_commit.py",
                       "engine/kazoo_compat.py", "engine/clock.py"})


def _role(argv: list[str]) -> str:
    text = " ".join(argv)
    if "celery_zklock.worker.agent" in text or "celery_zklock/worker/agent" in text:
        return "agent"
    if "worker" in argv:
        return "worker"
    return "publisher"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.walkthrough", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print every function, by process and file")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="zklock-walk-")
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(TRACER)
    os.environ["ZKLOCK_WALK_DIR"] = folder
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)

    from bench.infra import Services, Workers

    services = Services().start()
    try:
        os.environ.update(services.env())
        from bench import app as bench_app

        workers = Workers(services.env(), count=1, concurrency=2).start(bench_app.app)
        try:
            task = bench_app.task("zklock", "hold")
            task.apply_async(("warm",), {"ms": 0, "tag": "warm"})  # first use: connect, register
            _records("warm", 1)
            time.sleep(3.0)  # settled: what runs from here while idle is housekeeping
            idle_start = time.time()
            time.sleep(4.0)
            idle_end = start = time.time()
            exec(compile(TRACER, "<walk-tracer>", "exec"), {"__name__": "walk"})  # trace this publisher too
            first = task.apply_async(("walk",), {"ms": 200, "tag": "walk"})
            second = task.apply_async(("walk",), {"ms": 200, "tag": "walk"})
            records = _records("walk", 2)
            sys.setprofile(None)
            end = time.time() + 0.5
            if len(records) < 2:
                print(f"walkthrough: the two tasks did not finish ({first.id}, {second.id})", file=sys.stderr)
                return 1
            time.sleep(1.5)  # the last dumps
        finally:
            workers.stop()
    finally:
        services.close()
    return _report(folder, (idle_start, idle_end), (start, end), args.list)


def _records(tag: str, count: int, timeout: float = 60.0) -> list:
    from bench import app as bench_app

    deadline = time.time() + timeout
    while True:
        records = bench_app._redis.lrange(f"bench:rec:{tag}", 0, -1)
        if len(records) >= count or time.time() > deadline:
            return records
        time.sleep(0.2)


def _report(folder: str, idle: tuple[float, float], run: tuple[float, float], listing: bool) -> int:
    per_role: dict[str, set[str]] = {}
    dumps = {}
    for path in glob.glob(os.path.join(folder, "*.json")):
        with open(path) as f:
            dumps[int(os.path.basename(path).split(".")[0])] = json.load(f)
    for data in dumps.values():
        role = _role(data["argv"])
        if role == "worker" and data["ppid"] in dumps and _role(dumps[data["ppid"]]["argv"]) == "worker":
            role = "pool"  # forked by the worker's main process
        for key, tenths in data["seen"].items():
            in_run = any(int(run[0] * 10) <= t <= run[1] * 10 for t in tenths)
            in_idle = any(idle[0] * 10 <= t < int(idle[1] * 10) for t in tenths)
            if in_run and not in_idle:
                per_role.setdefault(role, set()).add(key)
    everything = set().union(*per_role.values()) if per_role else set()
    files = {k.split(":", 1)[0] for k in everything}
    for role in ("publisher", "worker", "agent", "pool"):
        keys = per_role.get(role, set())
        print(f"{role:>9}: {len({k.split(':', 1)[0] for k in keys}):3d} files, {len(keys):3d} functions")
    print(f"{'all':>9}: {len(files):3d} files, {len(everything):3d} functions "
          f"(one locked task and the next one's grant, waiting in the worker)")
    framework = files & FRAMEWORK
    print(f"{'':>9}  {len(files) - len(framework):3d} files without the ZooKeeper client framework "
          f"({len(framework)}: {', '.join(sorted(framework))})")
    if listing:
        for role, keys in sorted(per_role.items()):
            print(f"\n[{role}]")
            for key in sorted(keys):
                print("   ", key)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
