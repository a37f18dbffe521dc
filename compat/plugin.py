"""pytest plugin loaded into Celery's own integration suite by :mod:`compat.run` (``-p compat.plugin``).

What it does, driven by environment variables that :mod:`compat.run` sets:

``COMPAT_MODE``
    ``stock`` (the suite as Celery ships it) or ``locked``: every task the suite defines
    without an explicit ``base=`` becomes a :class:`LockedTask` (a ``ZkLockedTask`` with a
    fresh lock key per call), through the app's ``task_cls``.
``COMPAT_ZK_HOSTS`` / ``COMPAT_ZK_ROOT``
    The throwaway ZooKeeper of the locked run (``zklock_hosts`` / ``zklock_root``).
``COMPAT_COUNTER_URL``
    A Redis database where the counters below are kept.  The suite's worker uses the
    prefork pool: task bodies run in children forked from the pytest process, so counts
    kept in process memory would be lost.  Receivers are connected here, at import time,
    before the worker forks, and each process opens its own Redis connection.
``COMPAT_REPORT``
    Where the per-test outcomes are written (JSON), for the stock/locked comparison.

Counters (all under ``compat:``): ``acquired``, ``released``, ``released_proven`` (from
:mod:`celery_zklock.signals`), ``runs`` / ``locked_runs`` (every task execution seen by
``task_prerun``, and those of a ``ZkLockedTask``), hashes ``runs_by_task``,
``unlocked_by_task`` and ``acquired_by_test`` (the test running in the pytest process when
the lock was taken), and ``held`` (lock keys acquired and not released yet).

How the suite is reconfigured without editing it: its ``conftest.py`` defines
``celery_config`` itself (a plugin fixture cannot override a conftest fixture), and
Celery's ``celery_parameters`` is a plain ``{}``; both are session-scoped dicts, so the
``pytest_fixture_setup`` wrapper below adds our keys to the dict the fixture returned.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest

MODE = os.environ.get("COMPAT_MODE", "stock")
if MODE not in ("stock", "locked"):
    raise pytest.UsageError(f"COMPAT_MODE must be 'stock' or 'locked', not {MODE!r}")
LOCKED = MODE == "locked"
ZK_HOSTS = os.environ.get("COMPAT_ZK_HOSTS", "")
ZK_ROOT = os.environ.get("COMPAT_ZK_ROOT", "/celery-compat")
COUNTER_URL = os.environ.get("COMPAT_COUNTER_URL", "")
REPORT = os.environ.get("COMPAT_REPORT", "")
PREFIX = "compat:"

if LOCKED and not ZK_HOSTS:
    raise pytest.UsageError("COMPAT_MODE=locked needs COMPAT_ZK_HOSTS (run the harness with: python -m compat.run)")


# ----------------------------------------------------------------------------- counters
_client: Any = None
_client_pid: int | None = None


def _redis():
    """One Redis client per process: a connection must never be shared across a fork."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():
        import redis

        _client = redis.Redis.from_url(COUNTER_URL, socket_timeout=10, socket_connect_timeout=10)
        _client_pid = os.getpid()
    return _client


def _current_test() -> str:
    value = _redis().get(PREFIX + "current_test")
    return value.decode() if value else "(outside any test)"


def _task_name(task: Any) -> str:
    return getattr(task, "name", None) or type(task).__name__


def on_lock_acquired(sender: Any = None, key: Any = None, **_: Any) -> None:
    # Celery's Signal.send logs a receiver's exception and goes on: a lost increment then
    # shows up as acquired != released-with-proof, and the harness fails (never passes).
    r = _redis()
    test = _current_test()
    pipe = r.pipeline()
    pipe.incr(PREFIX + "acquired")
    pipe.hincrby(PREFIX + "acquired_by_task", _task_name(sender), 1)
    pipe.hincrby(PREFIX + "acquired_by_test", test, 1)
    pipe.hset(PREFIX + "held", str(key), json.dumps({"task": _task_name(sender), "test": test}))
    pipe.execute()


def on_lock_released(sender: Any = None, key: Any = None, proven: bool = False, **_: Any) -> None:
    pipe = _redis().pipeline()
    pipe.incr(PREFIX + "released")
    if proven is True:
        pipe.incr(PREFIX + "released_proven")
    pipe.hdel(PREFIX + "held", str(key))
    pipe.execute()


def on_task_prerun(sender: Any = None, task: Any = None, **_: Any) -> None:
    task = task or sender
    locked = _is_locked(task)
    pipe = _redis().pipeline()
    pipe.incr(PREFIX + "runs")
    pipe.hincrby(PREFIX + "runs_by_task", _task_name(task), 1)
    if locked:
        pipe.incr(PREFIX + "locked_runs")
    else:
        pipe.hincrby(PREFIX + "unlocked_by_task", _task_name(task), 1)
    pipe.execute()


def _is_locked(task: Any) -> bool:
    try:
        from celery_zklock import ZkLockedTask
    except ImportError:
        return False
    return isinstance(task, ZkLockedTask)


# Connected at import time (before the session worker forks its pool), strongly referenced.
if COUNTER_URL:
    from celery.signals import task_prerun

    task_prerun.connect(on_task_prerun, weak=False, dispatch_uid="compat.task_prerun")
    if LOCKED:
        try:
            from celery_zklock import signals as zk_signals
        except ImportError as exc:  # the harness must not pass without a way to count
            raise pytest.UsageError(
                f"celery_zklock.signals is missing ({exc}): cannot count lock acquisitions") from exc
        zk_signals.lock_acquired.connect(on_lock_acquired, weak=False, dispatch_uid="compat.lock_acquired")
        zk_signals.lock_released.connect(on_lock_released, weak=False, dispatch_uid="compat.lock_released")


# ----------------------------------------------------------------------------- the locked task class
def unique_lock_key(*args: Any, **kwargs: Any) -> str:
    """A fresh key per call: unrelated calls never wait for each other."""
    return "compat-" + uuid.uuid4().hex


if LOCKED:
    from celery_zklock import ZkLockedTask

    class LockedTask(ZkLockedTask):
        """The ``task_cls`` of the locked run: ``ZkLockedTask`` with a unique key per call."""

        lock_key = staticmethod(unique_lock_key)


def _zk_settings() -> dict[str, Any]:
    return {"zklock_hosts": ZK_HOSTS, "zklock_root": ZK_ROOT}


# ----------------------------------------------------------------------------- hooks
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "celery(**overrides): override celery configuration for a test case")
    import celery

    # Reported so the harness can show which Celery ran (the installed one: compat.run
    # extracts only t/ from the sdist, so its celery/ source cannot shadow it).
    _CELERY[:] = [celery.__version__, os.path.dirname(celery.__file__)]
    if COUNTER_URL:
        _redis().hset(PREFIX + "meta", mapping={"mode": MODE, "celery": celery.__version__,
                                                "celery_path": os.path.dirname(celery.__file__)})


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any):
    result = yield
    name = fixturedef.argname
    if LOCKED and name == "celery_parameters" and isinstance(result, dict):
        if result.get("task_cls") not in (None, LockedTask):
            raise pytest.UsageError(f"the suite sets its own task_cls ({result['task_cls']!r}): cannot lock every task")
        result["task_cls"] = LockedTask
    elif LOCKED and name == "celery_config" and isinstance(result, dict):
        result.update(_zk_settings())
    elif LOCKED and name == "celery_session_app":
        # Proof that the worker's app really builds locked tasks (and where they lock).
        if not issubclass(result.Task, ZkLockedTask):
            raise pytest.UsageError(f"celery_session_app.Task is {result.Task!r}, not a ZkLockedTask")
        if COUNTER_URL:
            _redis().hset(PREFIX + "meta", mapping={"session_task_cls": repr(result.Task.__mro__[1]),
                                                    "zklock_hosts": result.conf.get("zklock_hosts", "")})
    return result


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if COUNTER_URL:
        _redis().set(PREFIX + "current_test", item.nodeid)


_CELERY: list[str] = []
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 4}
_OUTCOMES: dict[str, dict[str, Any]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's worst outcome over its phases and subtests; reruns are counted apart."""
    entry = _OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "reruns": 0, "duration": 0.0, "message": ""})
    entry["duration"] = round(entry["duration"] + (getattr(report, "duration", 0.0) or 0.0), 3)
    if report.outcome == "rerun":  # pytest-rerunfailures: a failed try that will be run again
        entry["reruns"] += 1
        entry["rerun_message"] = _message(report)
        return
    if hasattr(report, "wasxfail"):
        outcome = "xpassed" if report.passed else "xfailed"
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
    elif report.skipped:
        outcome = "skipped"
    else:
        outcome = "passed"
    if report.when != "call" and outcome == "passed":
        return  # a passing setup/teardown says nothing about the test
    if _RANK[outcome] >= _RANK[entry["outcome"]]:
        entry["outcome"] = outcome
        if outcome in ("failed", "error"):
            entry["message"] = _message(report)
            entry["where"] = report.when


def _message(report: pytest.TestReport) -> str:
    text = getattr(report, "longreprtext", "") or ""
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-3:]
    return "\n".join(lines[:12])


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    # Written after every test too: a run stopped for going over its time budget (SIGTERM,
    # no session finish) still tells which tests had passed or failed.
    _write_report(None)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write_report(int(exitstatus))


def _write_report(exitstatus: int | None) -> None:
    if not REPORT:
        return
    data = {"mode": MODE, "exitstatus": exitstatus, "celery": _CELERY, "tests": _OUTCOMES}
    tmp = REPORT + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, REPORT)
