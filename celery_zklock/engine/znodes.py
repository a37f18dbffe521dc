"""Znode naming, ordering and parent creation — the pure parts of the lock protocol.

Why a module of its own: interoperability lives here.  Our children are named like Apache
Curator's protected ``InterProcessMutex`` nodes (``_c_<uuid>-lock-<seq>``) and we order
every child that carries a ``-lock-`` (Curator) or ``__lock__`` (kazoo ``Lock``) sequence,
so a Java service using Curator and a kazoo ``Lock(..., extra_lock_patterns=["-lock-"])``
on the same path queue in one FIFO line with us.  Children of any other shape are ignored,
as Curator and kazoo ignore them.

Parents are created as CONTAINER znodes (ZooKeeper >= 3.5.3): the server deletes a
container once its last child is gone, so one parent per lock key (order ids, SKUs) never
accumulates.  kazoo 2.x cannot create containers (its ``create`` only sends the ephemeral
and sequence flags): :mod:`celery_zklock.engine.kazoo_compat` sends the ``createContainer`` request.
"""

from __future__ import annotations

import logging
import threading
import uuid
from enum import Enum
from typing import Iterable, NamedTuple

from kazoo.exceptions import NoAuthError, NodeExistsError

from ..errors import ZkLockError
from . import kazoo_compat

logger = logging.getLogger("celery_zklock.engine")

class NodeKind(Enum):
    """What a node of ours asks for, named as the peer that asks for it the same way names it
    (the value is the marker before the sequence): Curator's ``InterProcessMutex``, or the
    write or read side of its ``InterProcessReadWriteLock``."""

    MUTEX = "lock-"
    WRITE = "__WRIT__"
    READ = "__READ__"


def exclusive_kind(curator_interop: str) -> "NodeKind":
    """The kind of a task's exclusive nodes (a writer's, a semaphore's) under the setting
    ``zklock_curator_interop``: named for Curator's mutex, or for its read/write lock.  Why a
    choice: Curator's mutex orders only ``-lock-`` nodes and its read/write lock only
    ``__READ__``/``__WRIT__`` ones (any other name sorts after every one of its own), so a
    key shared with Curator must carry the names of the recipe that shares it."""
    return NodeKind.WRITE if curator_interop == "read-write" else NodeKind.MUTEX


#: Markers of a node that shares the lock with readers: ours and Curator's read nodes, and
#: kazoo's ``ReadLock`` (``__rlock__``).  Every other marker is exclusive.
SHARED_MARKERS = ("__READ__", "__rlock__")

#: Sequence markers we order by: Curator's mutex (``-lock-``), kazoo's ``Lock`` and
#: ``WriteLock`` (``__lock__``), Curator's read/write lock, kazoo's ``ReadLock``.
LOCK_MARKERS = ("-lock-", "__lock__", "__WRIT__") + SHARED_MARKERS


#: Low bits of a fencing token that number the local grants made on one node (lock
#: cohorting: the worker's agent passes a held lock among its own tasks).  A token is
#: ``czxid << STREAK_BITS | grant``; see :func:`fencing_token`.
STREAK_BITS = 8

#: Grants one node can carry before the agent must queue a new one (the token space).
MAX_GRANTS_PER_NODE = 1 << STREAK_BITS


def fencing_token(czxid: int, grant: int = 0) -> int:
    """The fencing token of the ``grant``-th holder (0 = the first) through a node created at ``czxid``.

    Why this is strictly increasing per key, with no ZooKeeper write per grant: a key's
    lock passes between nodes in sequence order, and sequence order is creation order, so a
    later node has a larger czxid (also after the parent was deleted and recreated: zxids
    only grow).  A node's grants are numbered 0..MAX_GRANTS_PER_NODE-1 in the low bits, so
    every token of a later node, ``czxid' << 8 >= (czxid + 1) << 8``, exceeds every token
    of an earlier one.  Exact as a double (Lua, JSON) while czxid < 2^45, i.e. for the
    first 8,192 leader epochs of an ensemble.
    """
    if not 0 <= grant < MAX_GRANTS_PER_NODE:
        raise ValueError(f"grant must be in [0, {MAX_GRANTS_PER_NODE}), got {grant}")
    token = (czxid << STREAK_BITS) | grant
    checked = token_range(token)
    if checked is TokenRange.INEXACT:
        raise TokenOutOfRange(
            f"fencing token {token} (czxid {czxid:#x}, leader epoch {czxid >> 32}) is not below 2^53: "
            "a reader holding it as a double (JSON, Lua) could not tell it from its neighbours, so no "
            "lock is granted on it.  The ensemble has used its 8,192 leader epochs: reset its zxids "
            "(a new ensemble) before locking again.")
    if checked is TokenRange.NEARING:
        _warn_nearing(token, czxid)
    return token


#: Tokens are exact as IEEE doubles (how JSON in JavaScript and Lua in Redis hold numbers)
#: only below this: czxid < 2^45, the first 8,192 leader epochs of an ensemble.
TOKEN_BOUND = 1 << 53

#: Tokens from here on are warned about: leader epoch 4,096, half of the epochs used, so an
#: operator has the other half (years, at one election a day) to plan a new ensemble.
TOKEN_WARN_AT = 1 << 52


class TokenRange(Enum):
    """Where a fencing token stands against :data:`TOKEN_BOUND`."""

    EXACT = "exact"
    NEARING = "exact, past half of the leader epochs below 2^53"
    INEXACT = "not exact as a double: refused"


def token_range(token: int) -> TokenRange:
    """Where ``token`` stands: pure, table-tested (``tests/engine/test_token_bound.py``).
    Both bounds are multiples of :data:`MAX_GRANTS_PER_NODE`, so a node's first token
    decides for every grant through it."""
    if token >= TOKEN_BOUND:
        return TokenRange.INEXACT
    if token >= TOKEN_WARN_AT:
        return TokenRange.NEARING
    return TokenRange.EXACT


class TokenOutOfRange(ZkLockError, ValueError):
    """A fencing token would be 2^53 or more: not exact as a double, so never handed out."""


_warned = False


def _warn_nearing(token: int, czxid: int) -> None:
    global _warned
    if not _warned:  # once per process: every grant from here on is past the mark
        _warned = True
        logger.warning(
            "celery-zklock: fencing token %d (leader epoch %d of 8,192) is past 2^52; tokens stop being exact "
            "as doubles at 2^53 (epoch 8,192), and locks are then refused: plan a new ZooKeeper ensemble "
            "(fresh zxids) before then", token, czxid >> 32)


def node_prefix(uuid_hex: str, kind: NodeKind = NodeKind.MUTEX) -> str:
    """The name we give ``create(..., sequence=True)`` (Curator's protected name for ``kind``);
    the server appends the parent's ``cversion`` as ``%010d`` (10 digits, or a sign and 9 or
    10 past the wrap)."""
    return f"_c_{uuid_hex}-{kind.value}"


#: ZooKeeper names a sequential child after its parent's ``cversion``, a signed 32-bit count of
#: child changes formatted ``%010d``: after 2**31 - 1 it goes on from -2**31 ("-2147483648"),
#: and later from -1 to 0.  A queue that never empties (a hot key, waiting in the pool) gets
#: there in days.  Queue order is therefore modulo 2**32: the live nodes of one queue span far
#: less than half of it.
SEQUENCE_WRAP = 2**32
HALF_WRAP = 2**31


def _marked(name: str, end: int) -> bool:
    return name.endswith(LOCK_MARKERS, 0, end)


def is_shared(name: str) -> bool:
    """Does the lock node ``name`` read (share the lock with other readers)?  A node of any
    other marker excludes everyone (a writer, a mutex's holder)."""
    # The sequence is 10 characters, or 11 past the wrap ("-2147483648"); no marker ends
    # in a digit, so testing both ends cannot misread one name.
    return name.endswith(SHARED_MARKERS, 0, -10) or name.endswith(SHARED_MARKERS, 0, -11)


def sequence_of(name: str) -> int | None:
    """The sequence number of a lock child (negative past the wrap), or None when the child is
    not a lock node.

    Slices, not a regular expression: this runs for every child at every look at a queue,
    and long queues are where a look costs."""
    tail = name[-10:]
    if tail.isdigit() and tail.isascii() and len(name) > 10:
        if _marked(name, -10):
            return int(tail)
        if name[-11:-10] == "-" and _marked(name, -11):
            return -int(tail)  # -1000000000 .. -2147483648
        return None
    if tail[:1] == "-" and tail[1:].isdigit() and tail[1:].isascii() and _marked(name, -10):
        return -int(tail[1:])  # -000000001 .. -999999999
    return None


def queue_distance(seq: int, origin: int) -> int:
    """Where ``seq`` queues relative to ``origin``: negative ahead, positive behind, modulo
    :data:`SEQUENCE_WRAP`."""
    return (seq - origin + HALF_WRAP) % SEQUENCE_WRAP - HALF_WRAP


def sort_contenders(children: Iterable[str]) -> list[str]:
    """Lock children in queue order (sequence, modulo the wrap); others dropped."""
    keyed = []
    for name in children:
        seq = sequence_of(name)
        if seq is not None:
            keyed.append((seq, name))
    if keyed and max(keyed)[0] - min(keyed)[0] > HALF_WRAP:  # they span the wrap at 2**31
        keyed = [(seq % SEQUENCE_WRAP, name) for seq, name in keyed]
    keyed.sort()
    return [name for _, name in keyed]


def validate_path(path: object) -> str:
    """Return ``path`` if it is a usable absolute znode path, else raise ``ValueError``.

    Rules are ZooKeeper's own (PathUtils.validatePath) so the error surfaces here with a
    readable message instead of as a server-side ``BadArgumentsError`` mid-acquire.
    """
    if not isinstance(path, str):
        raise ValueError(f"lock path must be a str, got {type(path).__name__}: {path!r}")
    if not path.startswith("/") or path == "/":
        raise ValueError(f"lock path must be absolute and not the root, e.g. '/locks/orders'; got {path!r}")
    if path.endswith("/"):
        raise ValueError(f"lock path must not end with '/': {path!r}")
    for part in path[1:].split("/"):
        if part == "":
            raise ValueError(f"lock path has an empty component ('//'): {path!r}")
        if part in (".", ".."):
            raise ValueError(f"lock path must not contain '.' or '..' components: {path!r}")
    for ch in path:
        c = ord(ch)
        if c == 0 or 0x01 <= c <= 0x1F or 0x7F <= c <= 0x9F or 0xD800 <= c <= 0xF8FF or 0xFFF0 <= c <= 0xFFFF:
            raise ValueError(f"lock path contains a character ZooKeeper rejects (U+{c:04X}): {path!r}")
    return path


# Servers that answered UNIMPLEMENTED to createContainer (pre-3.5.3): we fall back to a
# persistent parent and delete it best-effort after release.  Servers that answered one
# (created, or exists): a multi may carry a createContainer.
_NO_CONTAINERS: set[str] = set()
_CONTAINERS_WORK: set[str] = set()


def client_key(client) -> str:
    return repr(getattr(client, "hosts", client))


def no_auth_error(path: str, action: str):
    """The error for a ZooKeeper NoAuth reply: say which znode and which setting to fix."""
    from ..errors import ConfigurationError

    return ConfigurationError(
        f"ZooKeeper denied {action} on {path!r} (NoAuth): the ACL of that znode (under zklock_root) does not "
        f"grant this client CREATE/DELETE/READ. Give the credentials with the zklock_auth_secret setting, e.g. "
        f"[('digest', 'user:password')], or point zklock_root at a znode this client may write."
    )


def probe_permissions(client, root: str) -> None:
    """Prove at worker start that this client may lock under ``root``; raise ConfigurationError.

    Creates ``root`` if missing, then creates and deletes one ephemeral probe node below
    it — exactly the rights the lock needs (key containers are created under ``root``) —
    so a wrong ACL stops the worker instead of failing every task.  Leaves nothing behind.
    """
    try:
        if client.exists(root) is None:
            try:
                client.create(root, b"", acl=kazoo_compat.acl_for(client, root), makepath=True)
            except NodeExistsError:
                pass
        probe_path = f"{root}/_zklock-probe-{uuid.uuid4().hex}"
        probe = client.create(probe_path, b"", acl=kazoo_compat.acl_for(client, probe_path), ephemeral=True)
        client.delete(probe)
    except NoAuthError:
        raise no_auth_error(root, "creating and deleting a lock node") from None


class RecentPaths:
    """A small LRU of lock paths whose parent this process saw exist lately.

    Why a guess is enough: a container is reaped once empty, so the set can be stale; a
    stale entry costs one failed create and the slow path, a missing one costs one
    redundant createContainer in the same round trip.
    """

    def __init__(self, size: int = 4096) -> None:
        from collections import OrderedDict

        self.size = size
        self._paths: "OrderedDict[str, None]" = OrderedDict()
        self._guard = threading.Lock()  # many threads may share one client and this cache

    def __contains__(self, path: str) -> bool:
        return path in self._paths

    def add(self, path: str) -> None:
        with self._guard:
            self._paths[path] = None
            self._paths.move_to_end(path)
            while len(self._paths) > self.size:
                self._paths.popitem(last=False)

    def discard(self, path: str) -> None:
        with self._guard:
            self._paths.pop(path, None)


def mark_no_containers(client) -> None:
    _NO_CONTAINERS.add(client_key(client))


def uses_containers(client) -> bool:
    return client_key(client) not in _NO_CONTAINERS


def mark_containers_work(client) -> None:
    _CONTAINERS_WORK.add(client_key(client))


def containers_known_to_work(client) -> bool:
    """The server answered a ``createContainer``: a multi carrying one is safe to send."""
    return client_key(client) in _CONTAINERS_WORK


class Contender(NamedTuple):
    """One node in a lock's queue, as :meth:`FairLock.contenders` reports it."""

    node: str
    sequence: int
    identifier: str
    holder: bool
    created: float | None = None  # the node's creation time (s since the epoch): queued since
    reader: bool = False  # a read node (ours, Curator's, kazoo's): shares the lock with readers
