"""A configuration error reads the same in the worker and in beat (issue 61, item 6): one
line, ``celery-zklock: configuration error: ...``, and a non-zero exit, never a traceback.

The in-process tests run beat's setup path (Celery's ``beat.Service`` building the scheduler
while the process starts); the last one starts a real ``celery worker`` and a real
``celery beat -S celery_zklock.beat:ZkScheduler`` on the same misconfigured app.  Neither
needs a broker or ZooKeeper: both stop before connecting anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from celery import Celery, signals
from celery.beat import Service

import celery_zklock.task  # noqa: F401  (installs the start-up hooks, as every `celery` command does)
from celery_zklock.worker import worker_hooks

SCHEDULER = "celery_zklock.beat:ZkScheduler"


def make_app(**conf) -> Celery:
    app = Celery("cfgerr", broker="memory://", set_as_current=False)
    app.conf.update({"beat_schedule": {}, **conf})
    return app


def worker_says(app: Celery) -> str:
    """What a starting worker stops with (its ``worker_init`` check)."""
    with pytest.raises(SystemExit) as info:
        worker_hooks.validate_app(app)
    return str(info.value)


def beat_says(app: Celery) -> str:
    """What a starting beat stops with: Celery's beat imports the task modules (the
    ``import_modules`` signal), then builds the scheduler for its banner, before ``beat_init``."""
    signals.import_modules.send(sender=app)
    try:
        with pytest.raises(SystemExit) as info:
            Service(app=app, scheduler_cls=SCHEDULER).get_scheduler(lazy=True)
    finally:
        worker_hooks._started()  # as beat_init does
    return str(info.value)


@pytest.mark.parametrize(
    "conf, line",
    [
        ({"zklock_host": "zk1:2181"}, "unknown setting 'zklock_host'. Did you mean 'zklock_hosts'?"),
        ({"zklock_timeout": -1}, "setting zklock_timeout: -1 is invalid"),
        ({"zklock_beat_grop": "sales"}, "unknown setting 'zklock_beat_grop'. Did you mean 'zklock_beat_group'?"),
    ],
)
def test_a_settings_mistake_is_the_same_line_in_beat_as_in_the_worker(conf, line):
    worker, beat = worker_says(make_app(**conf)), beat_says(make_app(**conf))
    assert worker.startswith(f"celery-zklock: configuration error: {line}"), worker
    assert beat == worker


def test_a_wrapped_scheduler_that_is_none_is_one_line_in_beat():
    said = beat_says(make_app(zklock_beat_scheduler="nowhere:Nothing"))
    assert said.startswith("celery-zklock: configuration error: zklock_beat_scheduler='nowhere:Nothing' cannot be "
                           "imported"), said


def test_outside_a_starting_beat_the_error_is_raised_as_it_is():
    from celery_zklock.beat import ZkScheduler
    from celery_zklock.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="zklock_hosts"):
        ZkScheduler(app=make_app(zklock_host="zk1:2181"), lazy=True)


APP = """
from celery import Celery

app = Celery("cfgerr", broker="memory://")
app.conf.beat_schedule = {}
app.conf.zklock_host = "zk1:2181"  # the typo: zklock_hosts
"""


def _run(argv: list[str], cwd: str) -> tuple[int, str]:
    from support.workers import python_path

    env = {**os.environ, "PYTHONPATH": python_path(cwd)}
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "cfgerr_app", *argv], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    return done.returncode, done.stdout


def test_a_settings_typo_stops_a_real_worker_and_a_real_beat_with_the_same_line(tmp_path):
    (tmp_path / "cfgerr_app.py").write_text(textwrap.dedent(APP))
    worker_rc, worker_out = _run(["worker", "-P", "solo", "--without-heartbeat", "--without-gossip",
                                  "--without-mingle", "-l", "warning"], str(tmp_path))
    beat_rc, beat_out = _run(["beat", "-S", SCHEDULER, "-s", str(tmp_path / "schedule"), "-l", "warning"],
                             str(tmp_path))
    said = [[line for line in out.splitlines() if line.startswith("celery-zklock: configuration error:")]
            for out in (worker_out, beat_out)]
    assert worker_rc != 0 and beat_rc != 0, (worker_out, beat_out)
    assert said[0] and said[0] == said[1], (worker_out, beat_out)
    assert "unknown setting 'zklock_host'. Did you mean 'zklock_hosts'?" in said[1][0]
    assert "Traceback" not in beat_out and "Traceback" not in worker_out, beat_out
