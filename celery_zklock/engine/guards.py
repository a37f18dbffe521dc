"""Enqueue-time singletons: one guard znode per key while a task for it is queued (or running).

The publisher *creates* ``<root>/.enqueue/<task>/<key>`` (one transaction for every key of
the task): the create that succeeds is the one message published; the others dedupe into
it or are refused.  A guard is confirmed once the broker took its message, ends at its
task's start (or, ``until="finish"``, becomes an ephemeral node of the run), and is bounded
by ``bound`` when no worker ever sees it.  Plain kazoo calls, each bounded by ``timeout``;
no Celery import.  Why no work is lost, case by case: docs/design.md, "Enqueue guards".
"""

from __future__ import annotations

import enum
import json
import sys
import time
from dataclasses import dataclass, replace

from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError

from . import guard_counts, kazoo_compat
from .guard_counts import dedupes  # noqa: F401  (re-exported)
from .guard_rules import (  # noqa: F401  (the rules, re-exported: callers know one module)
    FOLDER,
    HEADER,
    HELD,
    MODES,
    OWN,
    PUBLISH_WINDOW,
    STALE,
    UNCONFIRMED,
    UNTIL,
    Guard,
    GuardVerdict,
    bound,
    folder,
    guard_path,
    guarded,
    misplaced,
    verdict,
)

#: Bounds every ZooKeeper call of a guard when the caller gives none (seconds).
DEFAULT_TIMEOUT = 10.0


class TakeOutcome(enum.Enum):
    """What :func:`take` did."""

    TAKEN = "taken"  # the guard is ours: publish
    OWN = "own"  # ours already (a retry of the same id took it over)
    HELD = "held"  # another's: dedupe or refuse


@dataclass(frozen=True)
class TakeResult:
    """The outcome of :func:`take`, the guard in the way when it is another's, and when the
    guard is ours, the czxid of each node we made (what :func:`confirm` names)."""

    outcome: TakeOutcome
    path: str | None = None
    found: Guard | None = None
    nodes: dict | None = None


def _judge(found: Guard | None, task_id: str, stat) -> GuardVerdict:
    return verdict(found, task_id, time.time(), bool(stat.ephemeralOwner), stat.czxid)


class _Calls:
    """Blocking kazoo calls, each bounded by one timeout (kazoo's own wait forever while the
    client reconnects: a publish must fail within ``zklock_connect_timeout`` instead)."""

    def __init__(self, client, timeout: float | None) -> None:
        self.client, self.timeout = client, DEFAULT_TIMEOUT if timeout is None else timeout

    def get(self, path: str, watch=None):
        return self.client.get_async(path, watch=watch).get(timeout=self.timeout)

    def commit(self, txn) -> list:
        return txn.commit_async().get(timeout=self.timeout)

    def delete(self, path: str, version: int) -> None:
        self.client.delete_async(path, version=version).get(timeout=self.timeout)

    def ensure(self, path: str, acl) -> None:
        self.client.ensure_path_async(path, acl=acl).get(timeout=self.timeout)

    def read(self, path: str, watch=None):
        """The guard at ``path`` (None if unreadable) and its stat; None when there is no node."""
        try:
            raw, stat = self.get(path, watch)
        except NoNodeError:
            return None
        return Guard.loads(raw), stat


def take(client, paths: list[str], guard: Guard, attempts: int = 20, timeout: float | None = None,
         count: bool = True) -> TakeResult:
    """Create the guard (unconfirmed: :func:`confirm` once published) at every path, all or
    none.  A stale guard in the way is deleted (only the version we read) and the create
    tried again; our own is taken over; an unconfirmed one is waited for; another's held
    guard counts one more deduped publish (unless not ``count``: a publish sent all the same)."""
    calls = _Calls(client, timeout)
    guard = replace(guard, confirmed=False, publish_by=time.time() + PUBLISH_WINDOW, deduped=0)
    data = guard.dumps()
    acl = kazoo_compat.acl_for(client, paths[0])
    # A read first: a storm of duplicates (the case this exists for) is answered without a
    # create through the leader and its fsync.  ``sync`` first, so the read is not older than
    # a guard's deletion at its task's start (a follower may lag): a publish after the start
    # is never deduped into it.  The create below decides between racing publishers.
    # The sync and the reads are pipelined (one round trip): a session's requests are
    # answered in order, so the reads see what the sync saw.
    synced = client.sync_async(paths[0])
    reads = [client.get_async(path) for path in paths]
    synced.get(timeout=calls.timeout)
    for path, pending in zip(paths, reads, strict=True):
        try:
            raw, stat = pending.get(timeout=calls.timeout)
        except NoNodeError:
            continue
        found = Guard.loads(raw)
        seen = _judge(found, guard.id, stat)
        if seen is HELD:
            _count(client, path, stat, found, count)
            return TakeResult(TakeOutcome.HELD, path, found)
        if seen is UNCONFIRMED:
            held = _settled(calls, path, guard.id, count)
            if held is not None:
                return held
    nodes: dict[str, int] = {}  # the czxid of each node we made (or took over)
    for _ in range(attempts):
        txn = client.transaction()
        for path in paths:
            txn.create(path, data, acl=acl)
        results, made = _commit_reading(calls, txn, paths)
        failed = [(p, r) for p, r in zip(paths, results, strict=True)
                  if isinstance(r, Exception) and not isinstance(r, RolledBackError)]
        if not failed:
            ours = _made(calls, paths, made, guard.id)
            if ours is None:
                continue  # a node we made was gone before we read it: make it again
            return TakeResult(TakeOutcome.TAKEN, nodes={**nodes, **ours})
        path, error = failed[0]
        if isinstance(error, NoNodeError):
            calls.ensure(folder_of(path), kazoo_compat.acl_for(client, folder_of(path)))
            continue
        if not isinstance(error, NodeExistsError):
            raise error
        read = calls.read(path)
        if read is None:
            continue  # gone meanwhile: try again
        found, stat = read
        seen = _judge(found, guard.id, stat)
        if seen is STALE:
            _delete(calls, path, stat.version)
        elif seen is OWN:
            node = _take_over(client, calls, path, stat, guard, acl)
            if node:
                nodes[path] = node
                paths = [p for p in paths if p != path]
                if not paths:
                    return TakeResult(TakeOutcome.OWN, path, found, nodes)
        elif seen is UNCONFIRMED:
            held = _settled(calls, path, guard.id, count)
            if held is not None:
                return held
        else:
            _count(client, path, stat, found, count)
            return TakeResult(TakeOutcome.HELD, path, found)
    raise RuntimeError(f"could not take the enqueue guard {paths}: it kept changing under us")


def _count(client, path: str, stat, found: Guard | None, count: bool) -> None:
    """One more publish deduped into the held guard ``found`` (a publish sent anyway is none)."""
    if count:
        guard_counts.count_dedupe(client, path, stat, found.id if found else "")


def _settled(calls: _Calls, path: str, task_id: str, count: bool) -> TakeResult | None:
    """Another's guard at ``path`` once its publish is settled: HELD (counted as deduped into),
    or None when there is none in our way (no node, stale, or our own).

    Waited for one :data:`PUBLISH_WINDOW` of our own clock at most: its ``publish_by`` is
    its publisher's clock, which may run far ahead of ours (an hour ahead, and every publish
    of the key waited an hour for a publisher that had died)."""
    seen_first: tuple[int, float] | None = None  # (the node's czxid, our deadline for it)
    while True:
        changed = calls.client.handler.event_object()
        # Bound now: a watch left by an earlier turn sets its own turn's event, not this one's.
        read = calls.read(path, watch=lambda _event, changed=changed: changed.set())
        if read is None:
            return None
        found, stat = read
        now = time.time()
        seen = _judge(found, task_id, stat)
        if seen is HELD:
            _count(calls.client, path, stat, found, count)
            return TakeResult(TakeOutcome.HELD, path, found)
        if seen is not UNCONFIRMED:
            return None
        if seen_first is None or seen_first[0] != stat.czxid:
            seen_first = (stat.czxid, time.monotonic() + PUBLISH_WINDOW)
        left = seen_first[1] - time.monotonic()
        if left <= 0:
            # Unconfirmed for a whole window of ours: its publisher is gone (or as slow as a
            # stale one).  Only the version we read: a confirmation meanwhile keeps it.
            _delete(calls, path, stat.version)
            return None
        # Its publisher is between its create and the broker's answer: dedupe into it only
        # once it is confirmed (its message may never be sent), take over if it never is.
        changed.wait(max(0.0, min(found.publish_by - now, left, calls.timeout)) + 0.01)


def _settle(calls: _Calls, path: str, step, what: str) -> None:
    """Apply ``step`` to the guard at ``path`` (its read: (guard, stat), or None) until it says
    it is done; a version-checked write that lost to another writer (BadVersion, or False
    from ``step``) is tried again on a fresh read.  Raises when it never settles."""
    for _ in range(20):
        try:
            if step(calls.read(path)):
                return
        except BadVersionError:
            continue
    raise RuntimeError(f"could not {what} the enqueue guard {path}: it kept changing under us")


def confirm(client, taken: TakeResult, guard: Guard, timeout: float | None = None) -> None:
    """Our message is with the broker: publishers that find the guard may now dedupe into it.
    One write per node :func:`take` made (``taken.nodes``: path -> czxid), conditional on
    version 0, all pipelined, each naming its node.  The condition alone cannot tell our node
    from a newer one: a confirm that arrives after our task started (its node gone) and
    another publisher took the key lands on that publisher's node, also at version 0.  It
    then names a node it is not on, which readers take for stale (:func:`misplaced`), never
    for a run to dedupe into: a late confirm costs a duplicate, never a loss."""
    writes = [client.set_async(path, replace(guard, confirmed=True, publish_by=0.0, node=node).dumps(), version=0)
              for path, node in (taken.nodes or {}).items()]
    for pending in writes:
        try:
            pending.get(timeout=DEFAULT_TIMEOUT if timeout is None else timeout)
        except (BadVersionError, NoNodeError):
            pass  # its task started (and its guard moved on) meanwhile


def _take_over(client, calls: _Calls, path: str, stat, guard: Guard, acl) -> int:
    """Our own guard (a retry of the same task id): name the new message in it, as a
    persistent node — the run that retried ends, or dies, without taking it along.
    Returns the new node's czxid (0 when the guard changed meanwhile).  The new node keeps
    the old one's deduped count: the counter names the task id too (:mod:`.guard_counts`)."""
    txn = client.transaction()
    txn.delete(path, version=stat.version)
    txn.create(path, guard.dumps(), acl=acl)
    results, made = _commit_reading(calls, txn, [path])
    if any(isinstance(r, Exception) for r in results):
        return 0
    ours = _made(calls, [path], made, guard.id)
    return ours[path] if ours else 0


def _commit_reading(calls: _Calls, txn, paths: list[str]) -> tuple[list, list]:
    """Commit ``txn`` and read ``paths`` in the same pipeline (a session's requests are
    answered in order: the reads see the commit): its results, and the pending reads that
    :func:`_made` turns into the czxid of each node we made."""
    committed = txn.commit_async()
    reads = [calls.client.get_async(path) for path in paths]
    return committed.get(timeout=calls.timeout), reads


def _made(calls: _Calls, paths: list[str], reads: list, task_id: str) -> dict[str, int] | None:
    """The czxid of each node we just made, from the reads sent after the commit (a session's
    requests are answered in order); None if one is no longer ours (deleted as stale and
    taken by another publisher meanwhile: only a publish slower than PUBLISH_WINDOW)."""
    nodes = {}
    for path, pending in zip(paths, reads, strict=True):
        try:
            raw, stat = pending.get(timeout=calls.timeout)
        except NoNodeError:
            return None
        found = Guard.loads(raw)
        if found is None or found.id != task_id or found.confirmed:
            return None
        nodes[path] = stat.czxid
    return nodes


def folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0]


def _delete(calls: _Calls, path: str, version: int) -> bool:
    try:
        calls.delete(path, version=version)
        return True
    except (NoNodeError, BadVersionError):
        return False


def release(client, paths: list[str], task_id: str, retries: int, running: bool = False,
            timeout: float | None = None) -> list[Guard]:
    """Delete the guards this run ends (:meth:`Guard.ended_by`); with ``running``, only an
    ephemeral one of this client's session (a retry's persistent guard stays).  Returns the
    guards that went, with ``deduped``: how many publishes each one served.  Raises when
    ZooKeeper cannot say it is done."""
    calls = _Calls(client, timeout)
    gone: list[Guard] = []
    session = kazoo_compat.session_id(client)

    def step(read) -> bool:
        if read is None:  # no guard there
            return True
        found, stat = read
        if misplaced(found, stat.czxid):
            _delete(calls, path, stat.version)  # names nobody: cleared by whoever finds it
            return True
        if found is None or not found.ended_by(task_id, retries) or (running and stat.ephemeralOwner != session):
            return True
        try:
            calls.delete(path, version=stat.version)  # BadVersion: its publisher confirmed it meanwhile
        except NoNodeError:
            return True
        deduped = 0 if stat.ephemeralOwner else guard_counts.take(client, path, stat.czxid, calls.timeout, found.id)
        gone.append(replace(found, deduped=deduped))
        return True

    for path in paths:
        _settle(calls, path, step, "end")
    return gone


def start(client, paths: list[str], task_id: str, retries: int, until: str, timeout: float | None = None) -> None:
    """The guarded task starts: ``start`` ends its guard now; ``finish`` turns it into an
    ephemeral node of this session in one transaction (no instant without a guard).
    Raises when ZooKeeper cannot say it is done: the body must not run past a guard that
    would swallow the work arriving during the run."""
    if until != "finish":
        release(client, paths, task_id, retries, timeout=timeout)
        return
    calls = _Calls(client, timeout)
    acl = kazoo_compat.acl_for(client, paths[0]) if paths else None

    def step(read) -> bool:
        if read is None:
            # A redelivered copy whose first run's worker died (its ephemeral guard went
            # with it): guard this run again, unless another task of the key queued since.
            # (expires_at bounds only a queued guard: a running one lasts as our session.)
            txn = client.transaction()
            _running(txn, path, Guard(task_id, "", "finish", time.time(), retries, time.time()).dumps(), acl)
            made = calls.commit(txn)[0]
            if isinstance(made, NoNodeError):
                calls.ensure(folder_of(path), kazoo_compat.acl_for(client, folder_of(path)))
                return False
            if isinstance(made, Exception) and not isinstance(made, NodeExistsError):
                raise made
            return True
        found, stat = read
        if misplaced(found, stat.czxid):
            _delete(calls, path, stat.version)  # names nobody: cleared, then this run guarded
            return False
        if found is None or not found.ended_by(task_id, retries) or stat.ephemeralOwner:
            return True
        txn = client.transaction()
        txn.delete(path, version=stat.version)
        # node=0: a running guard's identity is its session, not the czxid its confirm named.
        _running(txn, path, replace(found, confirmed=True, retries=retries, node=0).dumps(), acl)
        if any(isinstance(r, Exception) for r in calls.commit(txn)):
            return False  # the guard changed meanwhile (its publisher confirmed it): read again
        guard_counts.take(client, path, stat.czxid, calls.timeout, found.id)  # the queued guard's: its work runs now
        return True

    for path in paths:
        _settle(calls, path, step, "move")


def _running(txn, path: str, data: bytes, acl) -> None:
    """Add a running guard to ``txn``: an ephemeral node of this session, at version 1.
    Why 1: a confirm still on its way (a write conditional on version 0, ours or that of a
    publisher whose task started before ours) can then never land on a running guard."""
    txn.create(path, data, acl=acl, ephemeral=True)
    txn.set_data(path, data, version=0)


def main() -> int:
    """``python -m celery_zklock.engine.guards``: end the guard of a request a prefork parent
    discarded (revoked or expired) when no lock agent can (waiting in the pool).  The job,
    on stdin: ``{"settings": wire settings, "paths": [...], "id": ..., "retries": n}``."""
    import logging

    from ..config import from_wire
    from .client import connect, disconnect

    logging.basicConfig(level=logging.WARNING, format="[%(asctime)s: %(levelname)s/zklock-guards] %(message)s")
    job = json.loads(sys.stdin.readline())
    client = connect(from_wire(job["settings"]))
    try:
        for gone in release(client, list(job["paths"]), str(job["id"]), int(job.get("retries") or 0)):
            if gone.deduped:
                logging.getLogger("celery_zklock.enqueue").warning(
                    "celery-zklock: task %s ended unrun; %d publish(es) deduped into it went with it",
                    gone.id, gone.deduped)
    finally:
        disconnect(client)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
