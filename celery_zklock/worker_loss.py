"""Worker-side hooks: validation at worker start and fast release when a child dies.

Why a custom ``Request`` class: when a prefork child is SIGKILLed (OOM killer, hard time
limit) nothing runs in the child, and its ZooKeeper session — with its lock node — would
survive until the session timeout (10 s by default), stalling every task queued on that
key.  The parent learns of the loss in ``Request.on_failure`` (``WorkerLostError``) or
``Request.on_timeout`` (hard limit), knows the child's pid (``worker_pid``) and the task's
arguments, so it can compute the task's lock paths and delete exactly the nodes whose data
names this host, that pid and that task id — once the pid is confirmed dead.  Celery
documents per-task ``Request`` classes for this purpose.
"""

from __future__ import annotations

import json
import os
import socket
import threading
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


def reap(task, task_id: str, pid: int | None, args, kwargs, wait_dead: float = 5.0) -> int:
    """Delete lock nodes of ``task_id`` held by dead ``pid`` on this host; return how many."""
    from kazoo.exceptions import NoNodeError

    from .client import get_client
    from .config import cached_settings

    if not pid:
        return 0
    deadline = time.monotonic() + wait_dead
    while not _pid_dead(pid):
        if time.monotonic() > deadline:
            logger.warning("zklock: child %s still alive; leaving its locks to its session timeout", pid)
            return 0
        time.sleep(0.01)
    settings = cached_settings(task.app)
    if not settings.release_on_worker_loss:
        return 0
    try:
        paths = task.lock_paths(tuple(args or ()), dict(kwargs or {}), settings)
    except Exception as exc:
        logger.warning("zklock: cannot compute lock keys of lost task %s: %r", task_id, exc)
        return 0
    client = get_client(settings)
    host = socket.gethostname()
    removed = 0
    for path in paths:
        try:
            children = client.get_children(path)
        except NoNodeError:
            continue
        for name in children:
            try:
                data, _ = client.get(f"{path}/{name}")
                info = json.loads(data)
            except (NoNodeError, ValueError):
                continue
            if info.get("task_id") == task_id and info.get("pid") == pid and info.get("host") == host:
                try:
                    client.delete(f"{path}/{name}")
                    removed += 1
                except NoNodeError:
                    pass
    if removed:
        logger.warning("zklock: released %d lock node(s) of task %s after its worker process %s died", removed, task_id, pid)
    return removed


def _reap_async(request: Request) -> None:
    task, tid, pid = request.task, request.id, request.worker_pid
    args, kwargs = request.args, request.kwargs
    threading.Thread(target=_safe_reap, args=(task, tid, pid, args, kwargs), daemon=True, name="zklock-reaper").start()


def _safe_reap(*a) -> None:
    try:
        reap(*a)
    except Exception as exc:  # the session timeout remains the bound
        logger.warning("zklock: could not release a lost worker's lock: %r", exc)


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
