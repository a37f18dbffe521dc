"""Real ``celery worker`` subprocesses for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Worker:
    def __init__(self, env: dict, name: str, pool: str = "prefork", concurrency: int = 2, app: str = "tests.apps.locked",
                 extra: list[str] | None = None) -> None:
        self.name = name
        self.env = {**os.environ, **env, "PYTHONPATH": ROOT}
        self.cmd = [
            sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool, "-c", str(concurrency),
            "-n", f"{name}@%h", "--without-heartbeat", "--without-gossip", "--without-mingle", "-l", "info",
            *(extra or []),
        ]
        self.log_path = f"/tmp/zklock-worker-{name}-{os.getpid()}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, app=None, timeout: float = 30.0) -> "Worker":
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        if app is not None:
            self.wait_ready(app, timeout)
        return self

    def wait_ready(self, app, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited {self.proc.returncode}:\n{self.log()}")
            replies = app.control.ping(destination=[f"{self.name}@{os.uname().nodename}"], timeout=0.5)
            if replies:
                return
        raise TimeoutError(f"worker {self.name} not ready:\n{self.log()}")

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-6000:]
        except OSError:
            return ""

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def kill(self) -> None:
        """SIGKILL the whole worker (parent and children)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
