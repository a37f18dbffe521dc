"""Enqueue-time singletons: one guard znode per key while a task for it is queued (or running).

Why a znode, and why ZooKeeper decides: two publishers at the same instant both see "nothing
queued" if they read first and write after (celery-once's Redis ``SET NX`` gets this right,
but pays with a TTL).  Here the publisher *creates* ``<root>/.enqueue/<task>/<key>`` — one
transaction for every key of the task — and the create that succeeds is the one message
published; the others find the node, read whose it is, and dedupe or refuse.

Why no stale guard and no TTL guesswork (the peers' hour):

* A queued task's guard is deleted when the task starts (``until="start"``), when it is
  revoked or expires at a worker, or when its lock wait ends without running it.
* A running task's guard (``until="finish"``) becomes, at its start and in one transaction,
  an *ephemeral* node of the session that runs it: it goes when the task finishes, and with
  the worker's session if the worker dies (the session timeout, not an hour).
* The one case no worker sees — the broker lost the message — is bounded by the message's
  own ``expires``: a guarded message is always published with one (the call's, the task's, or
  ``zklock_enqueue_expires``), its guard records it, and a publisher that finds an expired
  guard deletes it (version-checked) and takes the key.  A worker discards an expired message
  anyway, so the guard never outlives a message that could still run.  ZooKeeper's TTL nodes
  were the other choice; they need ``zookeeper.extendedTypesEnabled`` on every server (off by
  default, often not settable on a managed ensemble) and kazoo cannot create them.

A guard names its task id *and* its retry count: a retry republishes the same id, takes over
its own guard (never refused by it), and the run that retried can no longer delete it.

Everything here is plain kazoo calls on a started client, with no Celery import: the
publisher, a pool process, the worker's lock agent and the helper a prefork parent starts
(``python -m celery_zklock.engine.guards``, job on stdin) all use it.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError

from ..keys import encode_key
from . import kazoo_compat

#: The guards' folder under ``zklock_root``.  A leading dot: no key encodes to it
#: (:func:`celery_zklock.keys.encode_key` escapes one), so it never meets a lock path.
FOLDER = ".enqueue"

#: The message header (and so the request attribute) that carries a guarded task's guard.
HEADER = "zklock_guard"

UNTIL = ("start", "finish")
MODES = ("dedupe", "reject")

# Verdicts of :func:`verdict` on a guard found in place.
OWN = "own"  # it names this very task: a retry or a republish of it takes it over
STALE = "stale"  # its message's expires has passed: nobody can run it any more
HELD = "held"  # another task of the key is queued (or running): dedupe or refuse


def folder(root: str) -> str:
    return f"{root.rstrip('/')}/{FOLDER}"


def guard_path(root: str, task: str, key: str) -> str:
    """One guard per task name and key: ``refresh`` for user 42 does not dedupe into
    ``bill`` for user 42, even where both serialize on the same lock key."""
    return f"{folder(root)}/{encode_key(task)}/{encode_key(key)}"


@dataclass(frozen=True)
class Guard:
    """What a guard node holds: whose it is and until when it can matter."""

    id: str
    task: str
    until: str
    expires_at: float  # time.time() after which its message is discarded unrun
    retries: int = 0
    at: float = 0.0  # when it was published

    def dumps(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def loads(cls, data: bytes) -> "Guard | None":
        try:
            raw = json.loads(data.decode())
            return cls(id=str(raw["id"]), task=str(raw.get("task") or ""), until=str(raw.get("until") or "start"),
                       expires_at=float(raw["expires_at"]), retries=int(raw.get("retries") or 0),
                       at=float(raw.get("at") or 0.0))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def names(self, task_id: str, retries: int) -> bool:
        return self.id == task_id and self.retries == retries


def verdict(found: "Guard | None", task_id: str, now: float, running: bool = False) -> str:
    """What a publisher of ``task_id`` does about a guard it found in place (pure).

    ``running``: the guard is an ephemeral node (``lock_enqueue_until="finish"``, its task
    running): its bound is the running worker's session, not ``expires_at``, which bounds
    only a queued guard whose message the broker may have lost.  A node we cannot read as
    a guard is somebody else's: held, never deleted."""
    if found is None:
        return HELD
    if found.id == task_id:
        return OWN
    if now >= found.expires_at and not running:
        return STALE
    return HELD


@dataclass(frozen=True)
class Taken:
    """The outcome of :func:`take`: ``taken`` (published under our guard), or the guard in
    the way (``held``: dedupe or refuse; ``own``: ours already)."""

    outcome: str  # "taken", OWN or HELD
    path: str | None = None
    found: Guard | None = None


def take(client, paths: list[str], guard: Guard, attempts: int = 20) -> Taken:
    """Create the guard at every path, all or none.  A stale guard in the way is deleted
    (only the version we read) and the create tried again; our own is taken over."""
    data = guard.dumps()
    acl = kazoo_compat.acl_for(client, paths[0])
    # A read first: a storm of duplicates (the case this exists for) is answered without a
    # write through the leader and its fsync.  ``sync`` first, so the read is not older than
    # a guard's deletion at its task's start (a follower may lag): a publish after the start
    # is never deduped into it.  The create below decides between racing publishers.
    client.sync(paths[0])
    for path in paths:
        seen = _read(client, path)
        if seen is not None and verdict(seen[0], guard.id, time.time(), bool(seen[1].ephemeralOwner)) == HELD:
            return Taken(HELD, path, seen[0])
    for _ in range(attempts):
        txn = client.transaction()
        for path in paths:
            txn.create(path, data, acl=acl)
        results = txn.commit()
        failed = [(p, r) for p, r in zip(paths, results)
                  if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
        if not failed:
            return Taken("taken")
        path, error = failed[0]
        if isinstance(error, NoNodeError):
            client.ensure_path(folder_of(path), acl=kazoo_compat.acl_for(client, folder_of(path)))
            continue
        if not isinstance(error, NodeExistsError):
            raise error
        read = _read(client, path)
        if read is None:
            continue  # gone meanwhile: try again
        found, stat = read
        seen = verdict(found, guard.id, time.time(), bool(stat.ephemeralOwner))
        if seen == STALE:
            _delete(client, path, stat.version)
            continue
        if seen == OWN:
            if _take_over(client, path, stat, guard, acl):
                rest = [p for p in paths if p != path]
                if not rest:
                    return Taken(OWN, path, found)
                paths = rest
                continue
            continue
        return Taken(HELD, path, found)
    raise RuntimeError(f"could not take the enqueue guard {paths}: it kept changing under us")


def _take_over(client, path: str, stat, guard: Guard, acl) -> bool:
    """Our own guard (a retry of the same task id): name the new message in it, as a
    persistent node — the run that retried ends, or dies, without taking it along."""
    txn = client.transaction()
    txn.delete(path, version=stat.version)
    txn.create(path, guard.dumps(), acl=acl)
    return not any(isinstance(r, Exception) for r in txn.commit())


def _read(client, path: str):
    """The guard at ``path`` (None if unreadable) and its stat; None when there is no node."""
    try:
        raw, stat = client.get(path)
    except NoNodeError:
        return None
    return Guard.loads(raw), stat


def folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _delete(client, path: str, version: int) -> bool:
    try:
        client.delete(path, version=version)
        return True
    except (NoNodeError, BadVersionError):
        return False


def release(client, paths: list[str], task_id: str, retries: int, running: bool = False) -> int:
    """Delete the guards that name this run (task id and retry count); with ``running``,
    only an ephemeral one of this client's session (a retry's persistent guard stays).
    Returns how many went."""
    gone = 0
    session = kazoo_compat.session_id(client)
    for path in paths:
        read = _read(client, path)
        if read is None:
            continue
        found, stat = read
        if found is None or not found.names(task_id, retries):
            continue
        if running and stat.ephemeralOwner != session:
            continue
        gone += _delete(client, path, stat.version)
    return gone


def start(client, paths: list[str], task_id: str, retries: int, until: str) -> None:
    """The guarded task starts: ``start`` ends its guard now; ``finish`` turns it into an
    ephemeral node of this session in one transaction (no instant without a guard)."""
    if until != "finish":
        release(client, paths, task_id, retries)
        return
    acl = kazoo_compat.acl_for(client, paths[0]) if paths else None
    for path in paths:
        read = _read(client, path)
        if read is None:
            # A redelivered copy whose first run's worker died (its ephemeral guard went
            # with it): guard this run again, unless another task of the key queued since.
            # (expires_at bounds only a queued guard: a running one lasts as our session.)
            guard = Guard(task_id, "", "finish", time.time(), retries, time.time())
            try:
                client.create(path, guard.dumps(), acl=acl, ephemeral=True, makepath=True)
            except NodeExistsError:
                pass
            continue
        found, stat = read
        if found is None or not found.names(task_id, retries) or stat.ephemeralOwner:
            continue
        txn = client.transaction()
        txn.delete(path, version=stat.version)
        txn.create(path, found.dumps(), acl=acl, ephemeral=True)
        txn.commit()  # a failure means the guard changed meanwhile: it is not ours to move


def guarded(request_or_headers: Any) -> dict | None:
    """The guard header of a request (a Celery Request, a task's request Context, or a
    message's headers dict), if its task was published under a guard."""
    if isinstance(request_or_headers, dict):
        value = request_or_headers.get(HEADER)
    else:
        value = getattr(request_or_headers, HEADER, None)
        if value is None:
            headers = getattr(request_or_headers, "request_dict", None) or getattr(request_or_headers, "headers", None)
            value = headers.get(HEADER) if isinstance(headers, dict) else None
    if isinstance(value, dict) and isinstance(value.get("paths"), list) and value.get("until") in UNTIL:
        return value
    return None


def main() -> int:
    """``python -m celery_zklock.engine.guards``: end the guard of a request a prefork parent
    discarded (revoked or expired) when no lock agent can (waiting in the pool).  The job,
    on stdin: ``{"settings": wire settings, "paths": [...], "id": ..., "retries": n}``."""
    import logging

    from .client import connect, disconnect
    from ..config import from_wire

    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s: %(levelname)s/zklock-guards] %(message)s")
    job = json.loads(sys.stdin.readline())
    client = connect(from_wire(job["settings"]))
    try:
        release(client, list(job["paths"]), str(job["id"]), int(job.get("retries") or 0))
    finally:
        disconnect(client)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
