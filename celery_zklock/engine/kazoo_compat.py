"""Every use of kazoo internals, in one place.

Why: kazoo 2.x exposes neither the session id across a reconnection, nor the negotiated
session timeout, nor a way to send the ``createContainer`` request.  The lock needs all
three.  Reading them here, behind small functions, means a kazoo upgrade that renames an
attribute breaks one module — and its tests say so — instead of the lock protocol.
"""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.protocol.serialization import Create2
from kazoo.security import OPEN_ACL_UNSAFE

_CONTAINER_FLAG = 4  # CreateMode.CONTAINER.toFlag()


def session_id(client: KazooClient) -> int | None:
    """The session the client holds, kept across a reconnection (SUSPENDED included).

    ``client.client_id`` reads None while SUSPENDED, which is not what a lock means by
    "the session my node belongs to"; kazoo clears this one only when the session ends.
    """
    return client._session_id


def session_timeout(client: KazooClient) -> float:
    """The session timeout in seconds (negotiated with the server once connected)."""
    return client._session_timeout / 1000.0


def is_stopped(client: KazooClient) -> bool:
    """True for a client never started, or stopped: nothing sent through it is answered."""
    return client._stopped.is_set()


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


def acl_for(client: KazooClient, path: str):
    """The ACL for a node we create at ``path``: the client's ACL provider's answer (Curator's
    ``getAclForPath``, set by :func:`celery_zklock.engine.client.new_client` from ``zklock_acl``),
    or None for the client's ``default_acl``."""
    provider = getattr(client, "zklock_acl_provider", None)
    return list(provider(path)) if provider is not None else None
