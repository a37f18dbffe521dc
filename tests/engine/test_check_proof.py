"""A proof that changes nothing: ``kazoo_compat.check_async`` (a ``multi`` of one ``check``),
against a real ZooKeeper, plain and under a chroot."""

from __future__ import annotations

import threading
import uuid

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock.engine import kazoo_compat


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


def test_a_check_of_a_gone_node_fails_with_no_node(zk_client):
    zk_client.ensure_path("/check-proof")
    with pytest.raises(NoNodeError):
        kazoo_compat.check_async(zk_client, f"/check-proof/{uuid.uuid4().hex[:8]}").get(timeout=10)


def test_a_check_under_a_chroot(zk_server):
    root = KazooClient(hosts=zk_server.hosts)
    root.start()
    root.ensure_path("/chrooted-check")
    client = KazooClient(hosts=zk_server.hosts + "/chrooted-check")
    client.start()
    try:
        node = client.create("/n", b"", ephemeral=True)
        assert kazoo_compat.check_async(client, node).get(timeout=10) is True
        client.delete(node)
        with pytest.raises(NoNodeError):
            kazoo_compat.check_async(client, node).get(timeout=10)
    finally:
        client.stop()
        client.close()
        root.stop()
        root.close()
