"""A throwaway Redis server on a free loopback port, for tests, the demo and benchmarks.

Why: tests must not depend on (or dirty) a Redis someone else runs on 6379, and the demo
must work on a machine with none running.  Uses the ``redis-server`` binary on PATH.
Repository-only (in :mod:`support`, not the installed package): it needs redis-py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

from celery_zklock.testing import free_port

__all__ = ["RedisServer"]


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.workdir: str | None = None
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0, new_session: bool = False) -> "RedisServer":
        """Start redis-server; ``new_session=True`` keeps a terminal's Ctrl-C from reaching it."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server not found: install it with 'apt-get install -y redis-server'")
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="zklock-redis-")
        self.proc = subprocess.Popen(
            [binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--logfile", os.path.join(self.workdir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=new_session,
        )
        import redis

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=0.5).ping():
                    return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
