"""Worker-side hooks: validation at worker start and fast release when a child dies.

Why a custom ``Request`` class: when a prefork child is SIGKILLed (OOM killer, hard time
limit) nothing runs in the child, and its ZooKeeper session — with its lock node — would
survive until the session timeout (10 s by default), stalling every task queued on that
key.  The parent learns of the loss in ``Request.on_failure`` (``WorkerLostError``) or
``Request.on_timeout`` (hard limit), knows the child's pid (``worker_pid``) and the task's
arguments, so it can compute the task's lock paths and have a short-lived reaper process
(:mod:`celery_zklock.worker.reaper`) delete exactly the nodes whose data names this host, that pid
and that task id — once the pid is confirmed dead.  Celery
documents per-task ``Request`` classes for this purpose.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys

from celery import bootsteps, signals
from celery.exceptions import WorkerLostError
from celery.utils.log import get_logger
from celery.worker.request import Request

from .. import metrics
from . import agent_supervisor, wait_outside_pool

logger = get_logger("celery_zklock.worker")

_installed = False


# Reaper processes still running or not yet waited for (never a thread in the parent: a
# thread alive while the pool forks a replacement child can leave a lock held in the child).
_reapers: list[subprocess.Popen] = []


def reap_finished_reapers() -> None:
    """Wait for reaper processes that have exited, so none lingers as a zombie."""
    _reapers[:] = [p for p in _reapers if p.poll() is None]


def _reap_async(request: Request) -> None:
    """Start a reaper process for a lost request; the parent does no ZooKeeper I/O itself."""
    from ..config import cached_settings, to_wire

    reap_finished_reapers()
    task, pid = request.task, request.worker_pid
    try:
        settings = cached_settings(task.app)
        if not settings.release_on_worker_loss or not pid or wait_outside_pool.waits_in_agent(task):
            return  # the agent frees it when the dead process's socket closes
        paths = task.lock_paths(tuple(request.args or ()), dict(request.kwargs or {}), settings)
    except Exception as exc:
        logger.warning("zklock: cannot compute lock paths of lost task %s: %r", request.id, exc)
        return
    job = {"settings": to_wire(settings), "paths": paths, "task_id": request.id, "pid": pid,
           "host": socket.gethostname()}
    # The job goes through stdin, not argv: it may carry zklock_auth_secret credentials.
    proc = subprocess.Popen([sys.executable, "-m", "celery_zklock.worker.reaper"], stdin=subprocess.PIPE, close_fds=True)
    stdin = proc.stdin
    assert stdin is not None  # PIPE
    try:
        stdin.write(json.dumps(job).encode())
        stdin.close()
    except OSError as exc:
        logger.warning("zklock: could not hand lost task %s to the reaper: %r", request.id, exc)
    _reapers.append(proc)


class LockAwareRequest(Request):
    """Celery ``Request`` that frees a dead child's lock nodes from the parent at once.

    No ``on_success``: Celery's dispatch subclasses this per task and overrides it without
    calling ours (``create_request_cls``), and a task that succeeded claimed and released its
    lock itself."""

    def on_failure(self, exc_info, send_failed_event=True, return_ok=False):
        try:
            exc = getattr(exc_info.exception, "exc", exc_info.exception)  # ExceptionWithTraceback
            if isinstance(exc, WorkerLostError):
                _reap_async(self)
        finally:
            try:
                super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
            finally:
                wait_outside_pool.request_finished(self)

    def _announce_revoked(self, reason, terminated, signum, expired):
        """Celery drops this request unrun (revoked, or expired, as it reaches a pool process):
        a grant it got after waiting for its lock must go with it, or no process ever claims
        it and the key stays held by nobody until the worker stops.  Every drop passes here
        (``task_revoked`` is sent from here too); the grant goes even if Celery's own
        bookkeeping raises (a result backend that is down)."""
        try:
            super()._announce_revoked(reason, terminated, signum, expired)
        finally:
            wait_outside_pool.request_finished(self)

    def on_timeout(self, soft, timeout):
        try:
            super().on_timeout(soft, timeout)
        finally:
            if not soft:
                _reap_async(self)  # waits for the pool to kill the child first


#: True while a worker or beat imports its task modules and finalizes its app (Celery's
#: ``import_modules`` signal until ``worker_init``/``beat_init``): a task's bad option there
#: ends the process with the message alone (:func:`configuration_exits`).
_starting = False


@contextlib.contextmanager
def configuration_exits():
    """While a worker starts, turn a ConfigurationError (a task's ``lock_key`` naming no
    parameter, a bad option) into SystemExit with its message: Celery builds the tasks
    inside ``app.finalize()`` deep in ``WorkController.__init__``, before any signal we
    could answer with a clean exit, and the bare exception would bury the one useful line
    at the end of a 40-line traceback (Celery's own ImproperlyConfigured does the same).
    Outside a worker's start the error is raised as it is."""
    from ..errors import ConfigurationError

    try:
        yield
    except ConfigurationError as exc:
        if _starting:
            raise SystemExit(f"celery-zklock: configuration error: {exc}") from None
        raise


def _on_import_modules(sender=None, **_):
    global _starting
    _starting = True


def _started(**_):
    global _starting
    _starting = False


#: Called with the app at worker start, before validation (``by_config`` locks the tasks
#: ``zklock_tasks`` names): a ConfigurationError there stops the worker like any other.
before_validation: list = []


def validate_app(app) -> bool:
    """Check settings, every locked task's options, that ZooKeeper answers and lets us lock.

    Raises SystemExit with a message saying what to fix: Celery logs and swallows
    ordinary exceptions from signal receivers, which would let a misconfigured worker
    start and run tasks it cannot protect.
    """
    from ..config import load_settings
    from ..engine.client import connect, disconnect
    from ..engine.znodes import probe_permissions
    from ..errors import ConfigurationError, LockUnavailable
    from ..options import is_locked_task

    try:
        for hook in before_validation:
            hook(app)
        settings = load_settings(app.conf)
        app._zklock_settings = settings
        locked = [t for t in app.tasks.values() if is_locked_task(t)]
        for t in locked:
            t.__dict__.pop("_zk_options", None)
            t.lock_options()
        metrics.start(settings)  # before the pool forks
    except ConfigurationError as exc:
        raise SystemExit(f"celery-zklock: configuration error: {exc}") from None
    fences = fences_beat_ticks(app, settings)
    if not locked and not fences:
        return False
    what = f"{len(locked)} locked task(s)" if locked else "the elected beat's ticks"
    try:
        client = connect(settings, summarize_retries=True)
    except LockUnavailable as exc:
        raise SystemExit(f"celery-zklock: {exc}; {what} would otherwise run unprotected.") from None
    try:
        try:
            probe_permissions(client, settings.root)
        except ConfigurationError as exc:
            raise SystemExit(f"celery-zklock: {exc}") from None
        except Exception as exc:  # e.g. the connection dropped right after it opened
            raise SystemExit(
                f"celery-zklock: could not check that this worker may lock under zklock_root={settings.root!r} "
                f"on {settings.hosts!r} ({type(exc).__name__}: {exc}); refusing to start rather than run "
                f"{what} unprotected."
            ) from None
    finally:
        disconnect(client)
    app._zklock_locked_count = len(locked)
    return True


def fences_beat_ticks(app, settings) -> bool:
    """Does this worker fence the elected beat's ticks (:mod:`~..engine.tick_fence`), so that it
    needs its lock agent even with no locked task?  When its app names ``ZkScheduler`` as
    ``beat_scheduler`` (the worker and the beats share the app's configuration) and
    ``zklock_beat_fence`` is on: the elected beat's own use is plain tasks, run once a tick."""
    scheduler = app.conf.get("beat_scheduler")
    name = scheduler if isinstance(scheduler, str) else f"{getattr(scheduler, '__module__', '')}:" \
                                                          f"{getattr(scheduler, '__name__', '')}"
    return bool(settings.beat_fence) and name.startswith("celery_zklock.beat") and name.endswith("ZkScheduler")


def start_line(settings, locked: int, agent_pid: int | None) -> str:
    """The worker's one INFO line at start: what it locks, where, and how its tasks wait.
    Hosts strings carry no credentials; the auth settings are never printed."""
    if agent_pid is not None:
        waits = f"zklock_wait_in='worker' (the lock agent, pid {agent_pid})"
    elif settings.wait_in == "worker":
        waits = "zklock_wait_in='worker' (no agent for this pool: each task waits in its own thread or greenlet)"
    else:
        waits = f"zklock_wait_in={settings.wait_in!r} (in the pool process)"
    return (f"celery-zklock: {locked} locked task(s); ZooKeeper {settings.hosts} reachable, root {settings.root}, "
            f"session timeout {settings.session_timeout:g}s; waiting mode {waits}")


class FastChildLossStep(bootsteps.StartStopStep):
    """Consumer step: notice a dead prefork child within a fraction of a second.

    Celery learns of a child's death when its sentinel pipe becomes readable, but the
    pipe closes while the child is still exiting; if the pool looks before the kernel has
    made it reapable, the death is only noticed by the pool's next 5-second maintenance
    timer — and the dead child's lock blocks its key until then.  Running the same
    maintenance every 0.2 s bounds that delay (it is cheap: a scan of the pool's jobs).
    """

    label = "zklock fast child loss"
    requires = ("celery.worker.consumer.tasks:Tasks",)
    interval = 0.2

    def __init__(self, c, **kwargs):
        super().__init__(c, **kwargs)
        self.tref = None

    def start(self, c):
        maintain = getattr(getattr(c.pool, "_pool", None), "maintain_pool", None)  # prefork only
        hub = getattr(c, "hub", None) or getattr(getattr(c, "controller", None), "hub", None)
        if maintain is None or hub is None or self.tref is not None:
            return

        def tick() -> None:
            maintain()
            reap_finished_reapers()

        self.tref = hub.call_repeatedly(self.interval, tick)

    def stop(self, c):
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None

    shutdown = stop


def _on_worker_init(sender=None, **_):
    _started()
    app = getattr(sender, "app", None)
    if app is not None:
        if FastChildLossStep not in app.steps["consumer"]:
            app.steps["consumer"].add(FastChildLossStep)  # the blueprint is built after worker_init
        if getattr(sender, "task_events", False):
            # `-E` reaches the WorkController, not app.conf; pool children read app.conf.
            app.conf.worker_send_task_events = True
        if not validate_app(app):
            return
        if agent_supervisor.start_agent(sender, app._zklock_settings):
            if wait_outside_pool.WaitOutsidePool not in app.steps["consumer"]:
                app.steps["consumer"].add(wait_outside_pool.WaitOutsidePool)
        agent = agent_supervisor.running()
        app._zklock_start_line = start_line(app._zklock_settings, app._zklock_locked_count,
                                            agent.proc.pid if agent else None)


def _after_setup(sender=None, instance=None, **_):
    """Logged here, not at ``worker_init``: Celery sets up the worker's logging in between."""
    line = getattr(getattr(instance, "app", None), "_zklock_start_line", None)
    if line:
        logger.info(line)


def _on_shutdown(**_):
    from ..engine.client import close_clients

    close_clients()


def _on_worker_shutdown(**_):
    """The worker's main process stops (warm; a cold stop and a failed start do the same at
    exit): it leaves nothing behind, neither its agent's socket and directory nor the metrics
    directory it made (the agent and the exporter exit once this process has gone)."""
    try:
        _on_shutdown()
    finally:
        try:
            agent_supervisor.leave_nothing_behind()
        finally:
            metrics.leave_nothing_behind()


def install() -> None:
    """Connect receivers at import time (works for fork and spawn start methods)."""
    global _installed
    if _installed:
        return
    _installed = True
    signals.import_modules.connect(_on_import_modules, weak=False)
    signals.beat_init.connect(_started, weak=False)
    signals.worker_init.connect(_on_worker_init, weak=False)
    signals.celeryd_after_setup.connect(_after_setup, weak=False)
    signals.worker_process_shutdown.connect(_on_shutdown, weak=False)
    signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
