"""The simulated ZooKeeper: the tree, sessions, watches and ``multi``, on virtual time.

It keeps what the lock relies on, and no more (docs/simulation.md lists it): ephemeral,
sequential and container nodes (swept some time after their last child goes);
czxid/mzxid/zxid; one-shot data, exists and child watches; ``multi`` all or nothing in one
zxid; session expiry only after the *negotiated* timeout of silence, on the server's clock;
leader failover (every connection dropped, every session's timer restarted); an operator's
delete from outside any client.  Clients reach it through :mod:`sim.zk`'s links.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kazoo.exceptions import (
    BadVersionError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    RolledBackError,
    RuntimeInconsistency,
)
from kazoo.protocol.states import EventType, ZnodeStat

from .world import World

TICK = 0.05  # how often the server checks its sessions (and a client its connection)


@dataclass
class ZNode:
    data: bytes
    czxid: int
    mzxid: int
    ctime: float
    owner: int = 0  # the session of an ephemeral node
    container: bool = False
    version: int = 0
    cversion: int = 0
    children: dict = field(default_factory=dict)  # name -> None, in creation order
    pzxid: int = 0

    def stat(self) -> ZnodeStat:
        ms = int(self.ctime * 1000)
        return ZnodeStat(self.czxid, self.mzxid, ms, ms, self.version, self.cversion, 0, self.owner,
                         len(self.data), len(self.children), self.pzxid)


class SessionLink(Protocol):
    """What the server needs of a client's connection (sim/zk.py's Link), declared here so
    the server does not import its clients."""

    def heard_by_server(self) -> bool: ...

    def server_closed(self) -> None: ...

    def to_client(self, item) -> None: ...


@dataclass(eq=False)
class ServerSession:
    id: int
    timeout: float  # negotiated
    last_heard: float
    alive: bool = True
    link: SessionLink | None = None


def parent_of(path: str) -> str:
    head = path.rsplit("/", 1)[0]
    return head or "/"


def _name(path: str) -> str:
    return path.rsplit("/", 1)[1]


class Server:
    """One ZooKeeper ensemble, seen as one server (a failover is a pause with every
    connection dropped and every session's timer restarted, as a new leader does)."""

    def __init__(self, world: World, tick_time: float = 2.0) -> None:
        self.world = world
        self.rng = world.rng("zk.server")
        self.nodes: dict[str, ZNode] = {"/": ZNode(b"", 0, 0, 0.0)}
        self.zxid = 1 << 32  # leader epoch 1
        self.sessions: dict[int, ServerSession] = {}
        self._next_session = 0x1000
        self.min_timeout, self.max_timeout = 2 * tick_time, 20 * tick_time
        self.down_until = -1.0
        # A new node's child count (and so its children's sequence numbers) starts here: 0 in
        # ZooKeeper; near 2**31 or -1, a directed scenario reaches the counter's wraps.
        self.cversion_start = 0
        # path -> {session id: None}: who is told of a change (one-shot)
        self.watches: dict[str, dict[str, dict[int, None]]] = {"data": {}, "exist": {}, "child": {}}
        self.gone: dict[tuple[str, int], tuple[float, str]] = {}  # (path, czxid) -> (when, why)
        self.on_change = []  # observers: fn(kind, path, node) after each applied change
        world.at(TICK, "zk.server.tick", self._tick)

    # -------------------------------------------------------------- sessions
    def open_session(self, requested: float) -> ServerSession:
        self._next_session += 1
        timeout = min(max(requested, self.min_timeout), self.max_timeout)
        session = ServerSession(self._next_session, timeout, self.world.now)
        self.sessions[session.id] = session
        return session

    @property
    def up(self) -> bool:
        return self.world.now >= self.down_until

    def _tick(self) -> None:
        now = self.world.now
        for session in list(self.sessions.values()):
            if not session.alive:
                continue
            if session.link is not None and session.link.heard_by_server():
                session.last_heard = now
            elif self.up and now - session.last_heard >= session.timeout:
                self.expire(session)
        self.world.at(now + TICK, "zk.server.tick", self._tick)

    def expire(self, session: ServerSession) -> None:
        session.alive = False
        self.world.log(f"zk: session {session.id:#x} expired")
        zxid = self._next_zxid()
        for path in [p for p, n in self.nodes.items() if n.owner == session.id]:
            if path in self.nodes:
                self._delete(path, zxid, "expired")
        for kind in self.watches.values():
            for holders in kind.values():
                holders.pop(session.id, None)
        if session.link is not None:
            session.link.server_closed()

    def failover(self, pause: float) -> None:
        self.world.log(f"zk: leader failover ({pause:.2f} s)")
        self.down_until = self.world.now + pause
        for session in self.sessions.values():
            if session.alive and session.link is not None:
                session.link.server_closed()
        self.world.at(self.down_until, "zk.server.elected", self._elected)

    def _elected(self) -> None:
        for session in self.sessions.values():  # a new leader restarts every session's timer
            session.last_heard = self.world.now

    # -------------------------------------------------------------- the tree
    def _next_zxid(self) -> int:
        self.zxid += 1
        return self.zxid

    def _fire(self, kind: str, path: str, event: str) -> None:
        holders = self.watches[kind].pop(path, None)
        if not holders:
            return
        for sid in holders:
            session = self.sessions.get(sid)
            if session is not None and session.alive and session.link is not None:
                session.link.to_client(("watch", event, path))

    def _create(self, path: str, data: bytes, ephemeral: int, sequence: bool, container: bool, zxid: int):
        parent = self.nodes.get(parent_of(path))
        if parent is None:
            raise NoNodeError()
        if parent.owner:
            raise NoNodeError()  # NoChildrenForEphemerals, near enough
        if sequence:
            path = f"{path}{parent.cversion:010d}"
        if path in self.nodes:
            raise NodeExistsError()
        node = ZNode(data, zxid, zxid, self.world.now, owner=ephemeral, container=container,
                     cversion=self.cversion_start)
        self.nodes[path] = node
        parent.children[_name(path)] = None
        parent.cversion = _int32(parent.cversion + 1)
        parent.pzxid = zxid
        self._fire("exist", path, EventType.CREATED)
        self._fire("data", path, EventType.CREATED)
        self._fire("child", parent_of(path), EventType.CHILD)
        for fn in self.on_change:
            fn("create", path, node)
        return path, node

    def _delete(self, path: str, zxid: int, why: str) -> None:
        node = self.nodes.pop(path)
        parent = self.nodes.get(parent_of(path))
        if parent is not None:
            parent.children.pop(_name(path), None)
            parent.cversion = _int32(parent.cversion + 1)
            parent.pzxid = zxid
            if parent.container and not parent.children:
                self._sweep_later(parent_of(path))
        self.gone[(path, node.czxid)] = (self.world.now, why)
        self._fire("data", path, EventType.DELETED)
        self._fire("exist", path, EventType.DELETED)
        self._fire("child", path, EventType.DELETED)
        self._fire("child", parent_of(path), EventType.CHILD)
        for fn in self.on_change:
            fn("delete", path, node)

    def _sweep_later(self, path: str) -> None:
        def sweep() -> None:
            node = self.nodes.get(path)
            if node is not None and node.container and not node.children and node.cversion > 0:
                self._delete(path, self._next_zxid(), "container swept")

        self.world.at(self.world.now + self.rng.uniform(0.5, 3.0), "zk.server.sweep", sweep)

    def force_delete(self, path: str) -> bool:
        """An operator's delete (``celery zklock release --node``), from outside any client."""
        if path not in self.nodes or self.nodes[path].children:
            return False
        self.world.log(f"zk: operator deletes {path}")
        self._delete(path, self._next_zxid(), "operator")
        return True

    # -------------------------------------------------------------- requests
    def apply(self, sid: int, op: tuple):
        """Run one request for session ``sid``; returns the reply value or raises its error."""
        kind = op[0]
        if kind == "multi":
            return self._multi(sid, op[1])
        if kind in ("get", "exists", "children"):
            _, path, watch = op
            node = self.nodes.get(path)
            if node is None:
                if kind == "exists":
                    if watch:
                        self.watches["exist"].setdefault(path, {})[sid] = None
                    return None
                raise NoNodeError()
            if watch:
                self.watches["child" if kind == "children" else "data"].setdefault(path, {})[sid] = None
            if kind == "get":
                return node.data, node.stat()
            if kind == "exists":
                return node.stat()
            return list(node.children)
        if kind == "sync":
            return op[1]
        if kind == "ensure":
            return self._ensure(op[1])
        zxid = self._next_zxid()
        return self._write(sid, op, zxid)

    def _write(self, sid: int, op: tuple, zxid: int):
        kind = op[0]
        if kind == "create":
            _, path, data, ephemeral, sequence, container = op
            made, node = self._create(path, data, sid if ephemeral else 0, sequence, container, zxid)
            return made, node.stat()
        if kind == "delete":
            _, path, version = op
            node = self.nodes.get(path)
            if node is None:
                raise NoNodeError()
            if version not in (-1, node.version):
                raise BadVersionError()
            if node.children:
                raise NotEmptyError()
            self._delete(path, zxid, "deleted")
            return True
        if kind == "set":
            _, path, data, version = op
            node = self.nodes.get(path)
            if node is None:
                raise NoNodeError()
            if version not in (-1, node.version):
                raise BadVersionError()
            node.data, node.mzxid = data, zxid
            node.version += 1
            self._fire("data", path, EventType.CHANGED)
            for fn in self.on_change:
                fn("set", path, node)
            return node.stat()
        if kind == "check":  # checked by _check: it changes nothing and fires no watch
            return True
        raise ValueError(f"unknown op {op!r}")

    def _ensure(self, path: str):
        parts = [p for p in path.split("/") if p]
        for i in range(1, len(parts) + 1):
            here = "/" + "/".join(parts[:i])
            if here not in self.nodes:
                self._create(here, b"", 0, False, False, self._next_zxid())
        return True

    def _multi(self, sid: int, ops: list):
        """All or nothing, in one zxid: a failed op fails the lot, ops before it read
        RolledBackError and ops after it RuntimeInconsistency, as ZooKeeper answers."""
        error_at, error = None, None
        for i, op in enumerate(ops):
            try:
                self._check(op, i, ops)
            except Exception as exc:
                error_at, error = i, exc
                break
        if error is not None:
            return [RolledBackError() if i < error_at else error if i == error_at else RuntimeInconsistency()
                    for i in range(len(ops))]
        zxid = self._next_zxid()
        return [self._write(sid, op, zxid) for op in ops]

    def _check(self, op: tuple, index: int, ops: list) -> None:
        """Would ``op`` succeed after the ops before it?  (Enough for creates, deletes and
        checks of distinct paths, which is what the lock sends in one multi.)"""
        kind = op[0]
        earlier = ops[:index]
        made = {o[1] for o in earlier if o[0] == "create"}
        gone = {o[1] for o in earlier if o[0] == "delete"}
        if kind == "create":
            path = op[1]
            parent = parent_of(path)
            if (parent not in self.nodes and parent not in made) or parent in gone:
                raise NoNodeError()
            if not op[4] and (path in self.nodes or path in made) and path not in gone:
                raise NodeExistsError()
        elif kind in ("delete", "check"):
            path, version = op[1], op[2]
            node = self.nodes.get(path)
            if node is None or path in gone:
                raise NoNodeError()
            if version not in (-1, node.version):
                raise BadVersionError()
            if kind == "delete" and node.children:
                raise NotEmptyError()


def _int32(n: int) -> int:
    """ZooKeeper's cversion is a Java int: it wraps from 2**31 - 1 to -2**31."""
    return (n + 2**31) % 2**32 - 2**31
