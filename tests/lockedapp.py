"""The locked-task app (tests/apps/locked.py) as a test reads it: what its tasks recorded in
Redis, and what its workers hold or run.  Its fixtures (``env``, ``mod``, ``workers``) are in
tests/conftest.py."""

from __future__ import annotations

import json
import socket

from tests.polling import wait_until


def history(mod, kind=None) -> list[dict]:
    """The runs the app's tasks recorded (``hold``, ``singleton``...), oldest first."""
    rows = [json.loads(x) for x in mod._r.lrange("history", 0, -1)]
    return [r for r in rows if kind is None or r["kind"] == kind]


def started(mod, tag) -> bool:
    """Whether the body of the hold tagged ``tag`` has begun (it holds its key from then on).
    ``arrivals`` outlives a module: its tests clear it first (a ``clean`` fixture), or tag uniquely."""
    return any(json.loads(a)["tag"] == tag for a in mod._r.lrange("arrivals", 0, -1))


def in_broker(mod, queue: str = "celery") -> int:
    """Messages still in the broker's queue (Redis: a list), not yet taken by a worker."""
    return mod._r.llen(queue)


def held_aside(worker, mod, app=None) -> int:
    """Requests the worker holds aside, waiting for their locks in its agent (``celery zklock
    status``'s source: the ``zklock_waiting`` inspect command).  ``app``: one on the worker's
    broker when that is not ``mod.app``'s (the command travels on the broker the worker consumes)."""
    return sum(len(rows) for rows in (_waiting(worker.name, app or mod.app) or {}).values())


def handed_over(worker, app, task_id: str) -> bool:
    """Has the worker answered, holding ``task_id`` aside for its lock no longer (its agent
    decided: it went to Celery)?  False without an answer.  Meaningful once it was held aside
    (e.g. its lock node is seen): the listing does not tell one not received yet."""
    waiting = _waiting(worker.name, app)
    return waiting is not None and all(row["task_id"] != task_id for rows in waiting.values() for row in rows)


def _waiting(worker_name: str, app) -> dict | None:
    """The worker's ``zklock_waiting`` answer (rows per lock path); None when it did not answer."""
    node = _node(worker_name)
    return (app.control.inspect(destination=[node], timeout=2.0)._request("zklock_waiting") or {}).get(node)


def started_pid(mod, key, timeout: float = 20) -> int:
    """The pid of the pool process running the task that recorded ``pid:<key>`` as it started."""
    return int(wait_until(lambda: mod._r.get(f"pid:{key}"), timeout, what=f"the task on {key!r} to start"))


def active_ids(mod, worker_name: str) -> set[str]:
    """Ids of the requests the worker has handed to its pool (Celery's ``inspect active``)."""
    return in_pool(mod.app, worker_name) or set()


def in_pool(app, worker_name: str) -> set[str] | None:
    """Ids of the requests in the worker's pool processes (taken: acknowledged, unless
    ``acks_late``; Celery drops one once the main process read its result); None when the
    worker did not answer."""
    node = _node(worker_name)
    replies = app.control.inspect(destination=[node], timeout=2.0).active() or {}
    return {t["id"] for t in replies[node]} if node in replies else None


def _node(worker_name: str) -> str:
    """The worker's node name, as Celery's remote control addresses it."""
    return f"{worker_name}@{socket.gethostname()}"


def learn_short_holds(mod, key: str, n: int = 3) -> None:
    """Run a few short tasks on ``key`` one after another: the agent learns its holds are
    short, so the next in line on it may wait in a pool process."""
    for i in range(n):
        mod.hold.delay(key, 10, f"warm{i}").get(timeout=30)
