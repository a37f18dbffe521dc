"""A ZkScheduler in this test process (Celery's in-memory broker): its app and the thread it
ticks on, as beat's Service loop runs it.  The ``sends`` fixture (what it published) is in
tests/conftest.py."""

from __future__ import annotations

import threading

from celery import Celery

from celery_zklock.beat import ZkScheduler

#: The one scheduled task of :func:`make_app` (every 0.5 s).
TASK = "tests.beat.job"


def make_app(hosts: str, root: str, **conf) -> Celery:
    app = Celery("beat-inprocess", set_as_current=False)
    app.conf.update({"broker_url": "memory://", "result_backend": None, "beat_max_loop_interval": 0.3,
                     "beat_schedule": {"job": {"task": TASK, "schedule": 0.5}},
                     "zklock_hosts": hosts, "zklock_root": root, "zklock_session_timeout": 2.0,
                     "zklock_connect_timeout": 5.0, "zklock_beat_scheduler": "celery.beat:Scheduler", **conf})
    @app.task(name=TASK)
    def job() -> None:  # a def, not a lambda: Celery compiles the task's signature from its name
        pass

    return app


class Running:
    """A scheduler ticking on a thread of its own, as beat's Service loop does."""

    def __init__(self, app: Celery) -> None:
        self.scheduler = ZkScheduler(app=app)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.is_set():
            interval = self.scheduler.tick()
            if interval:
                self.stop.wait(interval)

    @property
    def ident(self) -> int:
        return self.thread.ident

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.scheduler.close()
