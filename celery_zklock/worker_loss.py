"""Worker-side hooks: validation at worker start and fast release when a child dies.

Why a custom ``Request`` class: when a prefork child is SIGKILLed (OOM killer, hard time
limit) nothing runs in the child, and its ZooKeeper session — with its lock node — would
survive until the session timeout (10 s by default), stalling every task queued on that
key.  The parent learns of the loss in ``Request.on_failure`` (``WorkerLostError``) or
``Request.on_timeout`` (hard limit), knows the child's pid (``worker_pid``) and the task's
arguments, so it can compute the task's lock paths and have a short-lived reaper process delete exactly the nodes whose data
names this host, that pid and that task id — once the pid is confirmed dead.  Celery
documents per-task ``Request`` classes for this purpose.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from celery import signals
from celery.exceptions import WorkerLostError
from celery.utils.log import get_logger
from celery.worker.request import Request

logger = get_logger("celery_zklock.worker")

_installed = False


def _pid_dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def reap_nodes(hosts: str, session_timeout: float, paths: list[str], task_id: str, pid: int, host: str,
               wait_dead: float = 5.0) -> int:
    """Delete the lock nodes under ``paths`` owned by ``task_id`` in dead ``pid`` on ``host``."""
    from kazoo.client import KazooClient
    from kazoo.exceptions import NoNodeError

    deadline = time.monotonic() + wait_dead
    while not _pid_dead(pid):
        if time.monotonic() > deadline:
            logger.warning("zklock: child %s still alive; leaving its locks to its session timeout", pid)
            return 0
        time.sleep(0.005)
    client = KazooClient(hosts=hosts, timeout=session_timeout)
    client.start(timeout=session_timeout)
    removed = 0
    try:
        for path in paths:
            try:
                children = client.get_children(path)
            except NoNodeError:
                continue
            pending = [(name, client.get_async(f"{path}/{name}")) for name in children]
            for name, result in pending:
                try:
                    info = json.loads(result.get()[0])
                except (NoNodeError, ValueError):
                    continue
                if info.get("task_id") == task_id and info.get("pid") == pid and info.get("host") == host:
                    try:
                        client.delete(f"{path}/{name}")
                        removed += 1
                    except NoNodeError:
                        pass
    finally:
        client.stop()
        client.close()
    return removed


# Reaper processes still running or not yet waited for (never a thread in the parent: a
# thread alive while the pool forks a replacement child can leave a lock held in the child).
_reapers: list[subprocess.Popen] = []


def _reap_async(request: Request) -> None:
    """Start a reaper process for a lost request; the parent does no ZooKeeper I/O itself."""
    from .config import cached_settings

    _reapers[:] = [p for p in _reapers if p.poll() is None]
    task, pid = request.task, request.worker_pid
    try:
        settings = cached_settings(task.app)
        if not settings.release_on_worker_loss or not pid:
            return
        paths = task.lock_paths(tuple(request.args or ()), dict(request.kwargs or {}), settings)
    except Exception as exc:
        logger.warning("zklock: cannot compute lock paths of lost task %s: %r", request.id, exc)
        return
    job = {"hosts": settings.hosts, "session_timeout": settings.session_timeout, "paths": paths,
           "task_id": request.id, "pid": pid, "host": socket.gethostname()}
    _reapers.append(subprocess.Popen([sys.executable, "-m", "celery_zklock.worker_loss", json.dumps(job)],
                                     stdin=subprocess.DEVNULL, close_fds=True))


class LockAwareRequest(Request):
    """Celery ``Request`` that frees a dead child's lock nodes from the parent at once."""

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        try:
            exc = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback
            if isinstance(exc, WorkerLostError):
                _reap_async(self)
        finally:
            super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft, timeout):
        try:
            super().on_timeout(soft, timeout)
        finally:
            if not soft:
                _reap_async(self)  # waits for the pool to kill the child first


def validate_app(app) -> None:
    """Check settings, every locked task's options, and that ZooKeeper answers.

    Raises SystemExit with a message saying what to fix: Celery logs and swallows
    ordinary exceptions from signal receivers, which would let a misconfigured worker
    start and run tasks it cannot protect.
    """
    from kazoo.client import KazooClient

    from .config import load_settings
    from .errors import ConfigurationError
    from .task import ZkLockedTask

    try:
        settings = load_settings(app.conf)
        app._zklock_settings = settings
        locked = [t for t in app.tasks.values() if isinstance(t, ZkLockedTask)]
        for t in locked:
            t.__dict__.pop("_zk_options", None)
            t.lock_options()
    except ConfigurationError as exc:
        raise SystemExit(f"celery-zklock: configuration error: {exc}") from None
    if not locked:
        return
    client = KazooClient(hosts=settings.hosts, timeout=settings.session_timeout)
    try:
        client.start(timeout=settings.connect_timeout)
    except Exception as exc:
        raise SystemExit(
            f"celery-zklock: cannot reach ZooKeeper at zklock_hosts={settings.hosts!r} within "
            f"{settings.connect_timeout}s ({type(exc).__name__}). Start the ensemble or fix zklock_hosts; "
            f"{len(locked)} locked task(s) would otherwise run unprotected."
        ) from None
    finally:
        try:
            client.stop()
            client.close()
        except Exception:
            pass
    logger.info("celery-zklock: %d locked task(s), ZooKeeper %s reachable", len(locked), settings.hosts)


def _on_worker_init(sender=None, **_):
    app = getattr(sender, "app", None)
    if app is not None:
        if getattr(sender, "task_events", False):
            # `-E` reaches the WorkController, not app.conf; pool children read app.conf.
            app.conf.worker_send_task_events = True
        validate_app(app)


def _on_shutdown(**_):
    from .client import close_clients

    close_clients()


def install() -> None:
    """Connect receivers at import time (works for fork and spawn start methods)."""
    global _installed
    if _installed:
        return
    _installed = True
    signals.worker_init.connect(_on_worker_init, weak=False)
    signals.worker_process_shutdown.connect(_on_shutdown, weak=False)
    signals.worker_shutdown.connect(_on_shutdown, weak=False)


def main(argv: list[str]) -> int:
    """Reaper process entry point: ``python -m celery_zklock.worker_loss '<json job>'``."""
    import logging

    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s: %(levelname)s/zklock-reaper] %(message)s")
    job = json.loads(argv[0])
    try:
        removed = reap_nodes(**job)
    except Exception as exc:  # the session timeout remains the bound
        logger.warning("could not release lost task %s's lock: %r", job.get("task_id"), exc)
        return 1
    if removed:
        logger.warning("released %d lock node(s) of task %s after its worker process %s died",
                       removed, job["task_id"], job["pid"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
