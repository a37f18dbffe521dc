"""Prometheus metrics of a worker's locks (optional: ``pip install "celery-zklock[metrics]"``).

Why this shape: with prefork, locks are waited for in the worker's main process or its lock
agent and held in pool processes — separate processes whose numbers must add up.  So the
worker runs ``prometheus_client`` in multiprocess mode: every process writes its samples to
files in one directory (``PROMETHEUS_MULTIPROC_DIR``, set at worker start, before the pool
forks), and one small exec'd exporter process serves their sum on ``zklock_metrics_port``
(threads are fine there; in the forking parent they are not).  Labels are the task name and
the *key pattern* (the ``lock_key`` template, e.g. ``sku:{sku_id}``), never the raw key:
one series per order id would explode.

Metrics: ``zklock_wait_seconds`` and ``zklock_hold_seconds`` (histograms),
``zklock_acquired_total``, ``zklock_timeouts_total{policy}``, ``zklock_lost_total{reason}``,
``zklock_unavailable_total``, ``zklock_enqueue_unrun_deduped_total`` (publishes deduped into a
task that then ended unrun), and the gauges ``zklock_waiting`` and ``zklock_holding``.
An elected beat (:mod:`celery_zklock.beat`) serves ``zklock_beat_leader`` and
``zklock_beat_ticks_total{outcome}`` on ``zklock_beat_metrics_port``: one process, no pool.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
import time
from typing import Any

from .process_records import process_record, record_alive

ENV = "PROMETHEUS_MULTIPROC_DIR"
_metrics: dict[str, Any] | None = None
_exporter = None

#: The multiprocess directory a worker makes when ``PROMETHEUS_MULTIPROC_DIR`` is unset: its
#: name's start, and the record of the worker's main process in it ("<pid> <start time>"; not
#: a ``*.db``: the collector reads only those), which marks it as made here, to be removed
#: when that worker stops (by the worker, or by its exporter if the worker was killed), or by
#: a later start once that worker is gone.  A directory the environment names is never removed.
PREFIX, OWNER = "zklock-metrics-", "zklock-owner"
_made: tuple[str, int] | None = None  # (the directory start() made, the process that made it)

BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, float("inf"))


def pattern_of(task) -> str:
    """The label for a task's keys: its ``lock_key`` template(s), not the keys themselves."""
    key = getattr(task, "lock_key", None)
    if callable(key):
        return f"<{getattr(key, '__qualname__', 'callable')}>"
    if isinstance(key, (list, tuple)):
        return ",".join(map(str, key))
    return str(key if key is not None else task.name)


def start(settings) -> None:
    """At worker start, before the pool forks: multiprocess mode and the exporter process.

    Raises ConfigurationError when prometheus_client is missing or was imported before
    multiprocess mode could be chosen (the pool's numbers would be lost)."""
    global _metrics, _exporter
    from .errors import ConfigurationError

    if settings.metrics_port is None or _metrics is not None:
        return
    if not os.environ.get(ENV):
        os.environ[ENV] = _make_dir()
    try:
        import prometheus_client
        from prometheus_client import values
    except ImportError:
        raise ConfigurationError("zklock_metrics_port needs prometheus_client: pip install 'celery-zklock[metrics]'") from None
    if "MultiProcessValue" not in getattr(values.ValueClass, "__qualname__", ""):
        raise ConfigurationError(
            "zklock_metrics_port: prometheus_client was imported before the worker started, so it is not in "
            f"multiprocess mode and the pool processes' numbers would be lost; set {ENV} to an empty directory "
            "in the worker's environment")
    labels = ("task", "key")
    _metrics = {
        "wait": prometheus_client.Histogram("zklock_wait_seconds", "Time a task waited for its lock", labels, buckets=BUCKETS),
        "hold": prometheus_client.Histogram("zklock_hold_seconds", "Time a task held its lock", labels, buckets=BUCKETS),
        "acquired": prometheus_client.Counter("zklock_acquired", "Locks acquired", labels),
        "timeout": prometheus_client.Counter("zklock_timeouts", "Lock waits that timed out", (*labels, "policy")),
        "lost": prometheus_client.Counter("zklock_lost", "Locks lost while held", (*labels, "reason")),
        "unavailable": prometheus_client.Counter("zklock_unavailable", "Tasks not run: ZooKeeper unreachable", labels),
        "deduped": prometheus_client.Counter("zklock_enqueue_deduped", "Publishes deduped into a queued task (lock_enqueue)", labels),
        "rejected": prometheus_client.Counter("zklock_enqueue_rejected", "Publishes refused with AlreadyQueued (lock_enqueue)", labels),
        "unrun": prometheus_client.Counter("zklock_enqueue_unrun_deduped", "Publishes deduped into a task that then ended unrun (lock_enqueue)", labels),
        "waiting": prometheus_client.Gauge("zklock_waiting", "Tasks waiting for their lock", labels, multiprocess_mode="livesum"),
        "holding": prometheus_client.Gauge("zklock_holding", "Tasks holding their lock", labels, multiprocess_mode="livesum"),
        "tick_dropped": prometheus_client.Counter("zklock_beat_ticks_dropped", "Beat ticks not run at the worker: "
                                                  "already run, or overtaken by a later tick (the tick fence)",
                                                  ("task", "reason")),
    }
    import subprocess

    _exporter = subprocess.Popen(
        [sys.executable, "-m", "celery_zklock.metrics", os.environ[ENV], str(settings.metrics_port), str(os.getpid())],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True,
    )
    said = _first_line(_exporter, EXPORTER_START)
    if said != READY:
        _exporter.kill()
        _exporter.wait()
        _exporter, _metrics = None, None
        raise ConfigurationError(
            f"zklock_metrics_port {settings.metrics_port!r}: cannot serve metrics there ({said or 'no answer'}). "
            "Each worker on a host needs its own port: set zklock_metrics_port per worker (for example from an "
            "environment variable in its config), or leave it unset")


def _make_dir() -> str:
    """A new multiprocess directory, marked as this process's; first, remove those of workers
    that were killed before they or their exporter could."""
    global _made
    import atexit

    sweep()
    path = tempfile.mkdtemp(prefix=PREFIX)
    with open(os.path.join(path, OWNER), "w") as f:
        f.write(process_record())
    if _made is None:
        atexit.register(leave_nothing_behind)  # a cold stop sends no worker_shutdown; a failed start neither
    _made = (path, os.getpid())
    return path


def leave_nothing_behind() -> None:
    """The worker stops (warm: ``worker_shutdown``; cold, or a failed start: at exit): remove
    the directory :func:`start` made (its exporter, about to exit too, then serves nothing)."""
    if _made is not None and _made[1] == os.getpid():
        shutil.rmtree(_made[0], ignore_errors=True)


def _owner_of(path: str) -> tuple[int, str] | None:
    """The owner record (pid, start time) of a directory a worker made here, this user's; None
    for any other (none from before records, nor one being made): never removed."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        with open(os.path.join(path, OWNER)) as f:
            record = f.read()
        pid, _ = record.split()
        return int(pid), record
    except (OSError, ValueError):
        return None


def sweep() -> None:
    """Remove the multiprocess directories of workers killed along with their exporters."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        owner = _owner_of(os.path.join(root, name))
        if owner is not None and owner[0] > 0 and not record_alive(owner[1]):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


#: How long (s) the worker waits for its exporter to say it serves (or why it cannot).
EXPORTER_START = 10.0
READY = "ready"


def _first_line(proc, timeout: float) -> str:
    """The exporter's one line on its stdout ("ready", or why not), or "" if none came in time.
    Why a line and not a port probe: a port taken by another worker also answers a probe."""
    import select

    out = proc.stdout
    try:
        if not select.select([out], [], [], timeout)[0]:
            return ""
        return out.readline().decode("utf-8", "replace").strip()
    finally:
        out.close()  # the exporter writes nothing after its one line


def tick_dropped(task_name: str, reason: str) -> None:
    """A beat tick the worker's fence did not run (``reason``: duplicate or stale)."""
    if _metrics is not None:
        try:
            _metrics["tick_dropped"].labels(task_name, reason).inc()
        except Exception:  # monitoring must never break a task
            pass


def enabled() -> bool:
    """Are this process's lock metrics being collected (``zklock_metrics_port``)?"""
    return _metrics is not None


def record(event: str, task, **fields: Any) -> None:
    """One lock event of ``task`` (the ``task-lock-*`` name without its prefix)."""
    m = _metrics
    if m is None:
        return
    try:
        labels = (task.name, pattern_of(task))
        if event == "acquired":
            m["acquired"].labels(*labels).inc()
            m["wait"].labels(*labels).observe(float(fields.get("wait") or 0.0))
            m["holding"].labels(*labels).inc()
        elif event == "released":
            m["holding"].labels(*labels).dec()
            m["hold"].labels(*labels).observe(float(fields.get("held") or 0.0))
        elif event == "timeout":
            m["timeout"].labels(*labels, str(fields.get("policy"))).inc()
        elif event == "lost":
            m["lost"].labels(*labels, _reason(fields.get("reason"))).inc()
        elif event in ("unavailable", "deduped", "rejected"):
            m[event].labels(*labels).inc()
        elif event == "unrun":
            m["unrun"].labels(*labels).inc(int(fields.get("deduped") or 0))
        elif event in ("waiting", "waited"):
            m["waiting"].labels(*labels).inc(1 if event == "waiting" else -1)
    except Exception:  # monitoring must never break a task
        pass


_beat: dict[str, Any] | None = None


def start_beat(port, group: str) -> None:
    """In ``celery beat`` (one process: a plain registry and an HTTP thread are fine)."""
    global _beat
    if port is None or _beat is not None:
        return
    from .errors import ConfigurationError

    try:
        import prometheus_client
    except ImportError:
        raise ConfigurationError("zklock_beat_metrics_port needs prometheus_client: pip install 'celery-zklock[metrics]'") from None
    registry = prometheus_client.CollectorRegistry()
    _beat = {
        "leader": prometheus_client.Gauge("zklock_beat_leader", "1 while this beat is its group's active scheduler, else 0",
                                          ("group",), registry=registry),
        "ticks": prometheus_client.Counter("zklock_beat_ticks", "Beat ticks by outcome: sent; withheld (recorded but not "
                                           "proven in time: kept due); skipped (due times missed during a handover)",
                                           ("group", "outcome"), registry=registry),
        "unknown": prometheus_client.Gauge("zklock_beat_entries_unknown_to_leader", "Schedule entries another beat "
                                           "of the group has and the leader does not (not sent)", ("group",),
                                           registry=registry),
        "skew": prometheus_client.Gauge("zklock_beat_clock_skew_seconds", "This beat's clock minus ZooKeeper's, "
                                        "measured at its last tick record", ("group",), registry=registry),
    }
    _beat["leader"].labels(group).set(0)
    host, _, port_s = str(port).rpartition(":")
    prometheus_client.start_http_server(int(port_s), addr=host or "127.0.0.1", registry=registry)


def beat_role(group: str, leader: bool) -> None:
    if _beat is not None:
        _beat["leader"].labels(group).set(1 if leader else 0)


def beat_unknown_entries(group: str, n: int) -> None:
    """Entries other beats of the group have and the leader does not."""
    if _beat is not None:
        _beat["unknown"].labels(group).set(n)


def beat_clock_skew(group: str, skew: float | None) -> None:
    """This beat's clock minus ZooKeeper's, as its last tick record measured it."""
    if _beat is not None and skew is not None:
        _beat["skew"].labels(group).set(skew)


def beat_tick(group: str, outcome: str, n: int = 1) -> None:
    if _beat is not None:
        _beat["ticks"].labels(group, outcome).inc(n)


def _reason(reason: Any) -> str:
    """A bounded label: the kind of loss, not its free text."""
    text = str(reason or "").lower()
    for kind in ("expired", "suspended", "deleted", "agent", "release", "connection"):
        if kind in text:
            return kind
    return "other"


def main() -> int:
    """The exporter: serve the sum of the worker's processes until the worker is gone."""
    path, port, parent = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    host, _, port_s = port.rpartition(":")
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)
    try:
        start_http_server(int(port_s), addr=host or "127.0.0.1", registry=registry)
    except OSError as exc:  # the worker stops with this line (a port taken by another worker)
        print(f"{host or '127.0.0.1'}:{port_s}: {exc.strerror or exc}", flush=True)
        return 1
    print(READY, flush=True)
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            owner = _owner_of(path)
            if owner is not None and owner[0] == parent:  # made by the worker, which is gone (killed?)
                shutil.rmtree(path, ignore_errors=True)
            return 0
        try:
            names = os.listdir(path)
        except FileNotFoundError:  # the worker removed it as it stopped
            return 0
        for name in names:  # gauges of pool processes that died: not "live" any more
            pid = name.rsplit("_", 1)[-1].split(".")[0]
            if name.startswith("gauge_live") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                multiprocess.mark_process_dead(int(pid), path)


if __name__ == "__main__":
    raise SystemExit(main())
