"""How many publishes were deduped into a queued enqueue guard: a counter node beside it.

Why not in the guard: every count would change the guard's version, and the guard's own
moves (confirmed, ended or moved at its task's start) are version-checked writes, which a
storm of dedupes on the key would starve (a test of 10,000 publishes saw the start lose
that race).  So the count lives in ``<guard>#deduped`` (``#`` never occurs in an encoded
key), names the guard it counts by czxid, and is read and deleted with the guard at its end
(:func:`take`).  Best effort throughout: a count is a lower bound, never a reason to fail.
"""

from __future__ import annotations

import json

from kazoo.exceptions import NoNodeError

from . import kazoo_compat
from .kazoo_compat import on_ready


def counter_path(path: str) -> str:
    """The deduped-publish counter beside the guard at ``path``."""
    return f"{path}#deduped"


def count_dedupe(client, path: str, stat) -> None:
    """One more publish served by the queued guard at ``path`` (``stat``: the guard's).  Sent
    and not waited for: the dedupe costs its publisher no round trip more (a lost race or an
    exit before it is sent drops one count).  A running guard counts nothing."""
    if stat.ephemeralOwner:
        return
    where = counter_path(path)

    def read(result) -> None:
        try:
            raw, cstat = result.get(block=False)
        except NoNodeError:
            client.create_async(where, _count(stat.czxid, 1), acl=kazoo_compat.acl_for(client, where))
            return
        except Exception:
            return
        counted_zxid, n = _read_count(raw)
        # A counter of an older guard of the key starts over.
        client.set_async(where, _count(stat.czxid, n + 1 if counted_zxid == stat.czxid else 1), version=cstat.version)

    on_ready(client.get_async(where), read)


def dedupes(client, path: str, timeout: float = 10.0) -> int:
    """How many publishes were deduped into the queued guard at ``path`` so far (0 if none)."""
    try:
        _raw, stat = client.get_async(path).get(timeout=timeout)
        counted_zxid, n = _read_count(client.get_async(counter_path(path)).get(timeout=timeout)[0])
    except NoNodeError:
        return 0
    return n if counted_zxid == stat.czxid else 0


def take(client, path: str, guard_zxid: int, timeout: float) -> int:
    """The count of the guard (czxid ``guard_zxid``) just ended at ``path``; its counter goes
    unless it already counts a newer guard of the key."""
    where = counter_path(path)
    try:
        raw, cstat = client.get_async(where).get(timeout=timeout)
        counted_zxid, n = _read_count(raw)
        if counted_zxid <= guard_zxid:
            client.delete_async(where, version=cstat.version).get(timeout=timeout)
        return n if counted_zxid == guard_zxid else 0
    except Exception:
        return 0


def _count(guard_zxid: int, n: int) -> bytes:
    return json.dumps({"guard": guard_zxid, "n": n}, separators=(",", ":")).encode()


def _read_count(raw: bytes) -> tuple[int, int]:
    try:
        data = json.loads(raw.decode())
        return int(data["guard"]), int(data["n"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return -1, 0
