"""Helpers of the enqueue-guard tests (tests/test_enqueue*.py), which share the app
``tests.apps.enqueued``: fresh keys, reading a key's guard, the recorded runs, polling."""

from __future__ import annotations

import json
import uuid

from kazoo.exceptions import NoNodeError

from celery_zklock.engine import guards


def new_key() -> str:
    return uuid.uuid4().hex[:8]


def guard_of(zk, mod, task, key):
    """(guard, stat) of ``task``'s guard for ``user:<key>``, or None."""
    path = guards.guard_path(mod.app.conf.zklock_root, task.name, f"user:{key}")
    try:
        raw, stat = zk.get(path)
    except NoNodeError:
        return None
    return guards.Guard.loads(raw), stat


def runs(mod, key=None) -> list[dict]:
    """The runs the app's tasks recorded (in Redis), of one key or all."""
    rows = [json.loads(x) for x in mod._r.lrange("enq:runs", 0, -1)]
    return [r for r in rows if key is None or r["key"] == key]

