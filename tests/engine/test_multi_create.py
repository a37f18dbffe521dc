"""One request for a new key: the container and our node in one ``multi``, against a real
ZooKeeper (kazoo's own Transaction cannot carry createContainer nor read create2 stats)."""

from __future__ import annotations

import time

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, RuntimeInconsistency

from celery_zklock import FairLock
from celery_zklock.engine import kazoo_compat, znodes
from celery_zklock.engine.internals import RECENT
from celery_zklock.engine.znodes import fencing_token



def _reaped(client, path: str, timeout: float = 5.0) -> bool:
    """A container goes once empty (the test server checks every 100 ms); a persistent node stays."""
    deadline = time.monotonic() + timeout
    while client.exists(path) is not None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def path(request):
    return f"/m/{request.node.name.replace('[', '_').replace(']', '')}"


def _sent(client, monkeypatch) -> list[str]:
    """The type of every request the client sends (observing kazoo's queue, not replacing it)."""
    sent: list[str] = []
    real = client._call

    def spy(request, async_object):
        sent.append(type(request).__name__)
        return real(request, async_object)

    monkeypatch.setattr(client, "_call", spy)
    return sent


def test_the_multi_makes_a_container_and_our_node_with_its_stat(zk_client, path):
    zk_client.ensure_path("/m")
    replies = kazoo_compat.create_in_new_container_async(zk_client, path, f"{path}/_c_x-lock-", b"me").get(timeout=5)
    (cpath, cstat), (npath, nstat) = replies
    assert cpath == path and npath == f"{path}/_c_x-lock-0000000000"
    # A create in a multi answers with its path only; the container's stat carries the
    # transaction's zxid, which is every created node's czxid (the lock's fencing token).
    stat = zk_client.exists(npath)
    assert (cstat or nstat).czxid == stat.czxid and stat.ephemeralOwner == zk_client.client_id[0]
    assert zk_client.get(npath)[0] == b"me"
    zk_client.delete(npath)
    assert _reaped(zk_client, path), "the parent is a container"


def test_the_multi_fails_whole_when_the_container_exists(zk_client, path):
    zk_client.ensure_path(path)
    container, ours = kazoo_compat.create_in_new_container_async(zk_client, path, f"{path}/n-", b"").get(timeout=5)
    assert isinstance(container, NodeExistsError) and isinstance(ours, RuntimeInconsistency)  # not run
    assert zk_client.get_children(path) == []


def test_a_new_key_costs_one_request_once_the_server_is_known_to_have_containers(zk_client, path, monkeypatch):
    znodes.mark_containers_work(zk_client)
    zk_client.ensure_path(path)  # the ancestors exist: only the key's container is new
    sent = _sent(zk_client, monkeypatch)
    lock = FairLock(zk_client, f"{path}/fresh")
    assert lock.acquire(timeout=5)
    assert sent == ["MultiCreate"]  # no createContainer beside it, no children read
    assert lock.token == fencing_token(zk_client.exists(lock.node).czxid)
    assert lock.release()
    assert _reaped(zk_client, f"{path}/fresh"), "the parent is a container"


def test_a_key_whose_container_another_process_made_falls_back_and_queues(zk_client, zk_server, path, monkeypatch):
    """The multi fails whole; the pipelined create and children read follow, and our
    node queues behind the other process's holder (no shortcut on a container we did not make)."""
    znodes.mark_containers_work(zk_client)
    other = KazooClient(hosts=zk_server.hosts)
    other.start()
    try:
        holder = FairLock(other, f"{path}/shared")
        assert holder.acquire(timeout=5)
        RECENT.discard(f"{path}/shared")  # this process's memory of the key, as in another process
        sent = _sent(zk_client, monkeypatch)
        ours = FairLock(zk_client, f"{path}/shared")
        assert ours.acquire(timeout=0.3) is False
        assert sent[:3] == ["MultiCreate", "Create2", "GetChildren"]
        holder.release()
        assert ours.acquire(timeout=5)
        assert ours.token > fencing_token(0) and ours.release()
    finally:
        other.stop()
        other.close()


def test_the_multi_under_a_chroot(zk_server, monkeypatch):
    root = KazooClient(hosts=zk_server.hosts)
    root.start()
    root.ensure_path("/chrooted")
    client = KazooClient(hosts=zk_server.hosts + "/chrooted")
    client.start()
    try:
        znodes.mark_containers_work(client)
        client.ensure_path("/k")
        sent = _sent(client, monkeypatch)
        lock = FairLock(client, "/k/new")
        assert lock.acquire(timeout=5)
        assert sent == ["MultiCreate"]
        assert lock.node.startswith("/k/new/") and client.exists(lock.node) is not None
        assert lock.release()
        assert _reaped(root, "/chrooted/k/new"), "the parent is a container"
    finally:
        client.stop()
        client.close()
        root.stop()
        root.close()
