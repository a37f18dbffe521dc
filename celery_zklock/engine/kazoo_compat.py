"""Every use of kazoo internals, in one place.

Why: kazoo 2.x exposes neither the session id across a reconnection, nor the negotiated
session timeout, nor a way to send the ``createContainer`` request, nor a ``multi`` whose
creates answer with their stats.  The lock needs all four.  Reading them here, behind small
functions, means a kazoo upgrade that renames an attribute breaks one module — and its
tests say so — instead of the lock protocol.  So does working around kazoo's one callback
quirk the lock would otherwise trip on (:func:`on_ready`).
"""

from __future__ import annotations

import itertools
import socket
from typing import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import EXCEPTIONS
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.serialization import (
    CheckVersion,
    Create2,
    MultiHeader,
    Transaction,
    int_struct,
    read_string,
    stat_struct,
)
from kazoo.protocol.states import KeeperState, ZnodeStat
from kazoo.security import OPEN_ACL_UNSAFE

_CONTAINER_FLAG = 4  # CreateMode.CONTAINER.toFlag()
_EPHEMERAL_SEQUENTIAL_FLAG = 3  # CreateMode.EPHEMERAL_SEQUENTIAL.toFlag()


def session_id(client: KazooClient) -> int | None:
    """The session the client holds, kept across a reconnection (SUSPENDED included).

    ``client.client_id`` reads None while SUSPENDED, which is not what a lock means by
    "the session my node belongs to"; kazoo clears this one only when the session ends.
    """
    return client._session_id


def on_ready(result, callback: Callable) -> None:
    """Run ``callback(result)`` once, when ``result`` (a kazoo async result) is ready.

    Why not ``result.rawlink(callback)`` directly: kazoo's ``rawlink`` on a result that is
    already set dispatches *every* callback registered so far, not just the new one (kazoo
    2.11, ``AsyncResult._do_callbacks``).  A proof that the agent links to more than once
    (the handoff's write: the cohort's bookkeeping, the grant it waits for, the release's
    answer) could then run its first callbacks twice when its reply raced the later links
    — a second grant of an already passed node, or a delete under its new holder.  Every
    link in this package goes through here (``tests/test_structure.py`` checks it).
    """
    calls = itertools.count()  # next() is atomic under the GIL: the first call alone runs

    def once(ready) -> None:
        if next(calls) == 0:
            callback(ready)

    result.rawlink(once)


def on_all_ready(results, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once, when every one of ``results`` is ready (at once for none):
    the one countdown for a reply per node that is decided only when all have come."""
    results = list(results)
    if not results:
        return callback()
    left = itertools.count(len(results) - 1, -1)  # next() is atomic under the GIL

    def one(_ready) -> None:
        if next(left) == 0:
            callback()

    for result in results:
        on_ready(result, one)


def session_timeout(client: KazooClient) -> float:
    """The session timeout in seconds: the one the server *negotiated* once connected, the
    requested one before.

    Why: a server clamps the client's wish to [minSessionTimeout, maxSessionTimeout], and
    the lease (:func:`celery_zklock.worker.cohort_rules.fresh`) must not outlive the session
    the server actually keeps.  kazoo 2.11 keeps only the wish (``client._session_timeout``);
    the negotiated value is a local of ``ConnectionHandler._connect``, recorded by the
    wrapper below."""
    negotiated = getattr(client, _NEGOTIATED, None)
    return (negotiated if negotiated is not None else client._session_timeout) / 1000.0


_NEGOTIATED = "_zklock_negotiated_ms"


def _record_negotiated_timeout() -> None:
    """Wrap kazoo's ``ConnectionHandler._connect`` (once per process) to keep the session
    timeout each connection negotiates on its client.  It returns ``read_timeout``, which is
    ``negotiated * 2 / 3`` (kazoo 2.11, ``connection.py``): the negotiated milliseconds come
    back from it exactly.  Nothing else of kazoo's connect changes."""
    original = ConnectionHandler._connect
    if getattr(original, "_zklock_records", False):
        return

    def _connect(self, host, hostip, port):
        read_timeout, connect_timeout = original(self, host, hostip, port)
        setattr(self.client, _NEGOTIATED, round(read_timeout * 3 / 2))
        return read_timeout, connect_timeout

    _connect._zklock_records = True  # type: ignore[attr-defined]  # the mark of our patch
    ConnectionHandler._connect = _connect


_record_negotiated_timeout()


def oldest_unanswered(client: KazooClient):
    """The request ``client`` sent longest ago and still awaits the reply of (None: none).
    kazoo keeps sent requests in order in ``_pending``, and ZooKeeper answers a session's
    requests in order: while this one is unanswered, nothing later has been either."""
    pending = getattr(client, "_pending", None)
    try:
        return pending[0] if pending else None
    except IndexError:  # answered meanwhile, on kazoo's thread
        return None


def drop_connection(client: KazooClient) -> None:
    """Make kazoo see its connection broken now: it goes SUSPENDED and reconnects, on the
    same session if it can.  Why: kazoo learns of a silent partition only from a ping left
    unanswered, and it pings only after a spell with nothing to send (its connection loop
    resets the ping's deadline at every request): a client that keeps sending never sees
    one (:class:`celery_zklock.engine.session.SessionMonitor`)."""
    sock = getattr(getattr(client, "_connection", None), "_socket", None)
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)  # its select wakes, its read finds the end: ConnectionDropped
    except OSError:
        pass


def is_stopped(client: KazooClient) -> bool:
    """True for a client never started, or stopped: nothing sent through it is answered."""
    return client._stopped.is_set()


#: kazoo's states at a LOST that no reconnection follows (its connection loop ends just after).
_CLOSING_FOR_GOOD = (KeeperState.AUTH_FAILED,)


def closed_for_good(client: KazooClient) -> bool:
    """True for a started client that stopped connecting on its own: its authentication
    failed (kazoo also says so when a connection merely drops mid-SASL-handshake, as in a
    rolling restart of ZooKeeper) or its ``connection_retry`` ran out.  kazoo never connects
    it again, and a lock waiting for it to connect would wait for good: only a new client
    will do."""
    if client._stopped.is_set():
        return False
    state = client._state
    # AUTH_FAILED at once (its connection loop ends just after: a lock made in between would
    # wait for good); CLOSED only once that loop has ended (a client starting up is CLOSED too).
    return state in _CLOSING_FOR_GOOD or (
        state == KeeperState.CLOSED and client._connection.connection_stopped.is_set())


class CreateContainer(Create2):
    """ZooKeeper ``createContainer`` (opcode 19); same request and reply as ``Create2``."""

    type = 19


def create_container_async(client: KazooClient, path: str, acl=None):
    """Send ``createContainer`` for ``path``; returns kazoo's async result.

    kazoo's ``create`` only sends the ephemeral and sequence flags, so the request goes
    through kazoo's own serialisation and queue, exactly as its public calls do.
    """
    full = client.chroot + path if client.chroot else path
    result = client.handler.async_result()
    client._call(CreateContainer(full, b"", acl or client.default_acl or OPEN_ACL_UNSAFE, _CONTAINER_FLAG), result)
    return result


class MultiCreate(Transaction):
    """A ``multi`` (kazoo's ``Transaction``, sent as kazoo sends it) of creates whose replies
    carry path *and* stat.

    kazoo's ``Transaction`` reads a create's reply as a path only, and knows neither
    ``createContainer`` nor ``create2`` inside a multi; the lock needs the stat (its czxid is
    the fencing token).  Replies: one ``(path, stat)`` per create (stat None where the server
    sends a path only, as it does for any create but a container's: every node a multi
    creates has the transaction's zxid as its czxid), or the exception of an op
    that failed (ops before it read ``RolledBackError``, ops after it ``RuntimeInconsistency``).
    """

    @classmethod
    def deserialize(cls, bytes, offset):
        results = []
        header, offset = MultiHeader.deserialize(bytes, offset)
        while not header.done:
            if header.type == -1:
                err = int_struct.unpack_from(bytes, offset)[0]
                offset += int_struct.size
                results.append(EXCEPTIONS[err]())
            elif header.type == 1:  # create: the path only
                path, offset = read_string(bytes, offset)
                results.append((path, None))
            else:  # create2 / createContainer: path and stat
                path, offset = read_string(bytes, offset)
                results.append((path, ZnodeStat._make(stat_struct.unpack_from(bytes, offset))))
                offset += stat_struct.size
            header, offset = MultiHeader.deserialize(bytes, offset)
        return results


def create_in_new_containers_async(client: KazooClient, pairs):
    """One ``multi``: for each ``(container, node, data, container_acl, node_acl)`` of
    ``pairs``, create the container and our EPHEMERAL_SEQUENTIAL ``node`` under it, all or
    nothing; resolves to one ``(container_reply, node_reply)`` per pair, each reply
    ``(path, stat)`` or an exception instance.

    Why: a key not locked lately usually has no container (they are reaped when empty), and
    one request instead of two (createContainer, then create) is half the server's work.
    Only for a server known to have containers: an old server drops the connection on a
    multi with an op it cannot read, where a lone ``createContainer`` gets UNIMPLEMENTED.
    """
    chroot = client.chroot or ""
    default = client.default_acl or OPEN_ACL_UNSAFE
    ops = []
    for container, node, data, container_acl, node_acl in pairs:
        ops.append(CreateContainer(chroot + container, b"", container_acl or default, _CONTAINER_FLAG))
        ops.append(Create2(chroot + node, data, node_acl or default, _EPHEMERAL_SEQUENTIAL_FLAG))
    result = client.handler.async_result()
    client._call(MultiCreate(ops), result)
    paired = client.handler.async_result()

    def pair(r) -> None:
        try:
            flat = [(client.unchroot(x[0]), x[1]) if isinstance(x, tuple) and chroot else x for x in r.get()]
        except Exception as exc:
            return paired.set_exception(exc)
        paired.set([(flat[2 * i], flat[2 * i + 1]) for i in range(len(pairs))])

    on_ready(result, pair)
    return paired


def check_async(client: KazooClient, path: str):
    """A ``multi`` of one ``check`` of ``path`` (any version); resolves to True, or fails
    with the check's error (``NoNodeError`` once the node is gone), as ``set_async`` would.

    Why: it goes through the leader and is committed like a write, so its success proves
    the node (and the session that owns it) alive as of the send, as a ``setData`` does;
    but it changes nothing, so it fires no watch.  A ``setData`` woke every contender
    watching the node and the holder's own watch, each of which then set its watch again:
    two or three requests per renewal of a hot key's lease (issue 39).
    """
    full = client.chroot + path if client.chroot else path
    result = client.handler.async_result()
    client._call(Transaction([CheckVersion(full, -1)]), result)
    checked = client.handler.async_result()

    def unpack(r) -> None:
        try:
            [reply] = r.get()
        except Exception as exc:
            return checked.set_exception(exc)
        if isinstance(reply, Exception):
            return checked.set_exception(reply)
        checked.set(True)

    on_ready(result, unpack)
    return checked


def acl_for(client: KazooClient, path: str):
    """The ACL for a node we create at ``path``: the client's ACL provider's answer (Curator's
    ``getAclForPath``, set by :func:`celery_zklock.engine.client.new_client` from ``zklock_acl``),
    or None for the client's ``default_acl``."""
    provider = getattr(client, "zklock_acl_provider", None)
    return list(provider(path)) if provider is not None else None
