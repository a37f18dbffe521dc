"""Real ``celery worker`` / ``celery beat`` subprocesses for the tests, the examples and the
benchmark: one implementation of starting, waiting until ready and stopping them.

* :class:`Proc` -- one subprocess in a session (and process group) of its own, output to
  a log file.  A terminal's Ctrl-C reaches only the program that started it, which then
  stops it: SIGTERM (a worker's warm shutdown), then SIGKILL of its process group (the
  pool children too) after a grace period, and never anything it did not start.
* :class:`Worker` -- one ``celery worker`` as the integration tests use it
  (``Worker(env, name).start(app)``; log in ``/tmp/zklock-worker-NAME-PID.log``).
* :class:`Procs` -- the workers and beats of one example or benchmark run, under a unique
  node-name tag and a log directory; stops exactly those.
* :func:`wait_ready` -- block until workers answer a broadcast ping (their consumer runs).

Every process runs from the repository root with it on ``PYTHONPATH``, so ``-A
tests.apps.locked``, ``examples.flash_sale.app`` or ``bench.app`` import.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from support.console import check_stop

__all__ = ["ROOT", "Proc", "Worker", "Procs", "wait_ready", "worker_argv", "children_of"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: A mutated copy of the package (``make sim-mutants`` sets it for a killer test,
#: :mod:`sim.mutants`): the processes start there and import it before the repository's,
#: so the test's workers and their agents run the mutant, not the checkout.
COPY = os.environ.get("ZKLOCK_PACKAGE_COPY") or None
HOME = COPY or ROOT  # where every process starts (``python -m`` puts it first on sys.path)


def python_path(*more: str | None) -> str:
    """``PYTHONPATH`` for a process of ours: the copy under test if any, the repository, then ``more``."""
    return os.pathsep.join(p for p in (COPY, ROOT, *more) if p)


def worker_argv(app: str, name: str, pool: str = "prefork", concurrency: int = 2, loglevel: str = "info",
                extra: list[str] | None = None) -> list[str]:
    """``python -m celery -A app worker ...`` with node name ``name@%h``; no heartbeat,
    gossip or mingle (nothing here needs them, and they slow every start)."""
    return [sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool, "-c", str(concurrency),
            "-n", f"{name}@%h", "--without-heartbeat", "--without-gossip", "--without-mingle", "-l", loglevel,
            *(extra or [])]


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (read from /proc; no psutil needed)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return sorted(out)


class Proc:
    """One subprocess in its own session (so a Ctrl-C in the terminal reaches only us)."""

    #: characters of the log that :meth:`log_tail` returns by default
    tail_chars = 4000

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: str) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> "Proc":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=HOME, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM to the process only (a worker then stops its pool itself); no wait."""
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        """Send ``sig`` (SIGTERM: warm shutdown), wait up to ``timeout``, then SIGKILL the group."""
        if not self.alive():
            return
        self.proc.send_signal(sig)
        self.wait_or_kill(timeout)

    def wait_or_kill(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._reap_group()

    def kill(self) -> None:
        """SIGKILL this process and the process group it leads (its pool children)."""
        if not self.alive():
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def _reap_group(self) -> None:
        # A worker's pool children are in its group; after a clean exit none should remain,
        # but never leave one behind if the parent exited without them.
        try:
            os.killpg(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def child_pids(self) -> list[int]:
        """The live children of this process (a worker's pool processes)."""
        return children_of(self.pid)

    def agent_pid(self) -> int | None:
        """The pid of this worker's lock agent (``celery_zklock.worker.agent``), if it runs one."""
        for pid in self.child_pids():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"celery_zklock.worker.agent" in f.read():
                        return pid
            except OSError:
                continue
        return None

    def log_tail(self, chars: int | None = None) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-(chars or self.tail_chars):]
        except OSError:
            return ""


class Worker(Proc):
    """One ``celery worker`` of ``app`` (by default the integration tests' app).

    The environment is ours plus ``env``, with ``PYTHONPATH`` set to the repository root
    only; the log goes to ``/tmp/zklock-worker-NAME-PID.log`` and is kept.
    """

    tail_chars = 6000

    def __init__(self, env: dict, name: str, pool: str = "prefork", concurrency: int = 2, app: str = "tests.apps.locked",
                 extra: list[str] | None = None) -> None:
        super().__init__(name, worker_argv(app, name, pool, concurrency, "info", extra),
                         {**os.environ, **env, "PYTHONPATH": python_path()}, f"/tmp/zklock-worker-{name}-{os.getpid()}.log")

    def start(self, app=None, timeout: float = 30.0) -> "Worker":
        """Start; with ``app`` (a Celery app on the same broker), also wait until it is ready."""
        super().start()
        if app is not None:
            self.wait_ready(app, timeout)
        return self

    def wait_ready(self, app, timeout: float = 30.0) -> None:
        wait_ready(app, [self], timeout)

    def log(self) -> str:
        return self.log_tail()


class Procs:
    """The worker and beat processes started by an example or benchmark run; stops exactly those."""

    def __init__(self, env: dict[str, str], logdir: str | None = None, tag: str | None = None) -> None:
        self.tag = tag or uuid.uuid4().hex[:6]  # node names are unique per run: name-tag@host
        self.env = {**os.environ, **env}
        self.env["PYTHONPATH"] = python_path(os.environ.get("PYTHONPATH"))
        self._own_logdir = logdir is None
        self.logdir = logdir or tempfile.mkdtemp(prefix="zklock-demo-logs-")
        self.items: list[Proc] = []

    def remove_logs(self) -> None:
        """Delete the log directory if this object created it (call once all is well)."""
        if self._own_logdir:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def spawn(self, name: str, argv: list[str]) -> Proc:
        proc = Proc(name, argv, self.env, os.path.join(self.logdir, f"{name}.log")).start()
        self.items.append(proc)
        return proc

    def worker(self, app_module: str, name: str, concurrency: int, loglevel: str = "warning",
               extra: list[str] | None = None) -> Proc:
        name = f"{name}-{self.tag}"
        return self.spawn(name, worker_argv(app_module, name, "prefork", concurrency, loglevel, extra))

    def beat(self, app_module: str, name: str, loglevel: str = "info") -> Proc:
        schedule = os.path.join(self.logdir, f"{name}-schedule")
        argv = [sys.executable, "-m", "celery", "-A", app_module, "beat", "-s", schedule, "-l", loglevel,
                "--pidfile", os.path.join(self.logdir, f"{name}.pid")]
        return self.spawn(name, argv)

    def stop(self, items: list[Proc] | None = None, timeout: float = 20.0) -> None:
        """SIGTERM all (warm shutdown: running tasks finish), then wait; SIGKILL laggards."""
        items = list(self.items if items is None else items)
        for p in items:
            p.terminate()
        deadline = time.monotonic() + timeout
        for p in items:
            p.wait_or_kill(max(0.1, deadline - time.monotonic()))

    def stop_all(self, timeout: float = 20.0) -> None:
        self.stop(None, timeout)

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def wait_ready(app, workers: list[Proc], timeout: float = 60.0, connection=None) -> None:
    """Block until every worker answers a broadcast ping (its consumer is running).

    Raises RuntimeError (with the log tail) when one exits first, TimeoutError after
    ``timeout``, KeyboardInterrupt once :data:`support.console.STOP` is set.  ``connection``:
    the broker the workers consume from, when it is not ``app``'s own.
    """
    host = os.uname().nodename
    pending = {f"{w.name}@{host}": w for w in workers}
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        check_stop()
        for w in pending.values():
            if not w.alive():
                raise RuntimeError(f"{w.name} exited with {w.proc.returncode}:\n{w.log_tail()}")
        for reply in app.control.ping(destination=list(pending), timeout=0.5, connection=connection) or []:
            for name in reply:
                pending.pop(name, None)
    if pending:
        w = next(iter(pending.values()))
        raise TimeoutError(f"{', '.join(pending)} not ready after {timeout}s:\n{w.log_tail()}")
