"""How many publishes were deduped into a queued enqueue guard: a counter node beside it.

Why not in the guard: every count would change the guard's version, and the guard's own
moves (confirmed, ended or moved at its task's start) are version-checked writes, which a
storm of dedupes on the key would starve (a test of 10,000 publishes saw the start lose
that race).  So the count lives in ``<guard>#deduped`` (``#`` never occurs in an encoded
key), names the guard it counts by czxid and task id, and is read and deleted with the guard
at its end (:func:`take`).  The task id: a retry takes its own guard over by deleting and
re-creating it (a new czxid), and the publishes deduped into the try before still wait for
the retry's run.  Best effort throughout: a count is a lower bound, never a reason to fail.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from kazoo.exceptions import NoNodeError

from . import kazoo_compat
from .guard_rules import Guard
from .kazoo_compat import on_ready


class Count(NamedTuple):
    """What a counter node holds: the guard it counts (czxid, task id) and how many."""

    zxid: int
    task_id: str
    n: int

    def of(self, guard_zxid: int, task_id: str) -> bool:
        """It counts that guard, or one of the same task the guard took over (a retry's)."""
        return self.zxid == guard_zxid or (bool(task_id) and self.task_id == task_id)


def counter_path(path: str) -> str:
    """The deduped-publish counter beside the guard at ``path``."""
    return f"{path}#deduped"


def count_dedupe(client, path: str, stat, task_id: str) -> None:
    """One more publish served by the queued guard at ``path`` (``stat``: the guard's; ``task_id``:
    the task it names).  Sent and not waited for: the dedupe costs its publisher no round trip
    more (a lost race or an exit before it is sent drops one count).  A running guard counts
    nothing."""
    if stat.ephemeralOwner:
        return
    where = counter_path(path)

    def read(result) -> None:
        try:
            raw, cstat = result.get(block=False)
        except NoNodeError:
            client.create_async(where, _count(Count(stat.czxid, task_id, 1)), acl=kazoo_compat.acl_for(client, where))
            return
        except Exception:
            return
        counted = _read_count(raw)
        if counted.of(stat.czxid, task_id):
            now = Count(max(counted.zxid, stat.czxid), task_id, counted.n + 1)
        elif counted.zxid < stat.czxid:
            now = Count(stat.czxid, task_id, 1)  # a counter of an older guard of the key starts over
        else:
            return  # it counts a newer guard: this one is gone (its task started)
        client.set_async(where, _count(now), version=cstat.version)

    on_ready(client.get_async(where), read)


def dedupes(client, path: str, timeout: float = 10.0) -> int:
    """How many publishes were deduped into the queued guard at ``path`` so far (0 if none)."""
    try:
        raw, stat = client.get_async(path).get(timeout=timeout)
        counted = _read_count(client.get_async(counter_path(path)).get(timeout=timeout)[0])
    except NoNodeError:
        return 0
    guard = Guard.loads(raw)
    return counted.n if counted.of(stat.czxid, guard.id if guard else "") else 0


def take(client, path: str, guard_zxid: int, timeout: float, task_id: str = "") -> int:
    """The count of the guard (czxid ``guard_zxid``, naming ``task_id``) just ended at ``path``;
    its counter goes unless it already counts a newer guard of the key."""
    where = counter_path(path)
    try:
        raw, cstat = client.get_async(where).get(timeout=timeout)
        counted = _read_count(raw)
        if counted.zxid > guard_zxid:
            return 0
        client.delete_async(where, version=cstat.version).get(timeout=timeout)
        return counted.n if counted.of(guard_zxid, task_id) else 0
    except Exception:
        return 0


def _count(count: Count) -> bytes:
    return json.dumps({"guard": count.zxid, "id": count.task_id, "n": count.n}, separators=(",", ":")).encode()


def _read_count(raw: bytes) -> Count:
    """A counter of an older version names no task id: only its czxid can match."""
    try:
        data = json.loads(raw.decode())
        return Count(int(data["guard"]), str(data.get("id") or ""), int(data["n"]))
    except (ValueError, KeyError, TypeError, AttributeError):
        return Count(-1, "", 0)
