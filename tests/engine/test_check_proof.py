"""A proof that changes nothing: ``kazoo_compat.check_async`` (a ``multi`` of one ``check``),
against a real ZooKeeper, plain and under a chroot."""

from __future__ import annotations

import threading
import uuid

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock.engine import kazoo_compat
from tests.zkclients import chrooted


def test_a_check_proves_the_node_without_changing_it_or_waking_its_watchers(zk_client):
    path = f"/check-proof/{uuid.uuid4().hex[:8]}"
    zk_client.ensure_path("/check-proof")
    node = zk_client.create(path, b"owner", ephemeral=True)
    woken = threading.Event()
    zk_client.get(node, watch=lambda event: woken.set())
    for _ in range(3):
        assert kazoo_compat.check_async(zk_client, node).get(timeout=10) is True
    data, stat = zk_client.get(node)
    assert (data, stat.version) == (b"owner", 0)
    assert not woken.wait(0.3), "a check fired a data watch"


def test_a_check_is_committed_through_the_leader_as_a_write_is(zk_client):
    """The proof's strength is that the leader commits it (a new zxid), as a write; a read
    (``exists``, a ``multiRead``) is answered by the server the client talks to, with the
    zxid it last saw, and would prove nothing about the session at the leader."""
    zk_client.ensure_path("/check-proof")
    node = zk_client.create(f"/check-proof/{uuid.uuid4().hex[:8]}", b"", ephemeral=True)
    for _ in range(3):
        zk_client.exists(node)
        seen = zk_client.last_zxid  # a read's reply carries the server's last zxid
        assert kazoo_compat.check_async(zk_client, node).get(timeout=10) is True
        assert zk_client.last_zxid > seen, "the check was answered without a transaction"


def test_a_check_of_a_gone_node_fails_with_no_node(zk_client):
    zk_client.ensure_path("/check-proof")
    with pytest.raises(NoNodeError):
        kazoo_compat.check_async(zk_client, f"/check-proof/{uuid.uuid4().hex[:8]}").get(timeout=10)


def test_a_check_under_a_chroot(zk_server):
    with chrooted(zk_server, "/chrooted-check") as (_root, client):
        node = client.create("/n", b"", ephemeral=True)
        assert kazoo_compat.check_async(client, node).get(timeout=10) is True
        client.delete(node)
        with pytest.raises(NoNodeError):
            kazoo_compat.check_async(client, node).get(timeout=10)


def test_a_check_refused_for_a_moved_session_drops_the_connection_and_proves_again(zk_server, monkeypatch):
    """ZooKeeper 3.5 answers a check inside a multi from a server the session moved away from
    with SessionMoved and keeps the connection open (3.6 closes it, as for a plain request).
    That is no loss of the node: the connection is dropped and the check sent again."""
    from kazoo.exceptions import SessionMovedError

    from celery_zklock.engine import session

    client = KazooClient(hosts=zk_server.hosts)
    client.start()
    try:
        client.ensure_path("/check-proof")
        node = client.create(f"/check-proof/{uuid.uuid4().hex[:8]}", b"", ephemeral=True)
        states: list = []
        client.add_listener(states.append)
        real, refused = kazoo_compat.check_async, []

        def moved_once(c, path):
            if refused:
                return real(c, path)
            refused.append(path)
            result = c.handler.async_result()
            result.set_exception(SessionMovedError())
            return result

        monkeypatch.setattr(kazoo_compat, "check_async", moved_once)
        monitor = session.monitor_for(client)
        proof = session.guaranteed_proof(monitor, node, kazoo_compat.session_id(client))
        assert proof.get(timeout=20) == session.WRITTEN
        assert refused == [node] and "SUSPENDED" in states, states
        assert client.exists(node) is not None
    finally:
        client.stop()
        client.close()
