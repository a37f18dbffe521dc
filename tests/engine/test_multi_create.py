"""One request for a new key: the container and our node in one ``multi``, against a real
ZooKeeper (kazoo's own Transaction cannot carry createContainer nor read create2 stats)."""

from __future__ import annotations

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError, RuntimeInconsistency

from celery_zklock import FairLock
from celery_zklock.engine import kazoo_compat, znodes
from celery_zklock.engine.internals import RECENT
from celery_zklock.engine.znodes import fencing_token
from tests.polling import wait_until
from tests.zkclients import chrooted


def _wait_reaped(client, path: str) -> None:
    """A container goes once empty (the test server checks every 100 ms); a persistent node stays."""
    wait_until(lambda: client.exists(path) is None, 5, interval=0.05, what=f"{path} reaped: the parent is a container")


@pytest.fixture
def path(request):
    return f"/m/{request.node.name.replace('[', '_').replace(']', '')}"


def _children(client, path: str) -> list[str]:
    """The children of ``path``; none once its container is reaped (any moment when empty)."""
    try:
        return client.get_children(path)
    except NoNodeError:
        return []


def _sent(client, monkeypatch) -> list[str]:
    """The type of every request the client sends (observing kazoo's queue, not replacing it),
    but for a holder's watch on its own node (``Exists``, 20 ms after the grant, whenever a
    loaded machine gets to it)."""
    sent: list[str] = []
    real = client._call

    def spy(request, async_object):
        if type(request).__name__ != "Exists":
            sent.append(type(request).__name__)
        return real(request, async_object)

    monkeypatch.setattr(client, "_call", spy)
    return sent


def test_the_multi_makes_a_container_and_our_node_with_its_stat(zk_client, path):
    zk_client.ensure_path("/m")
    pairs = [(path, f"{path}/_c_x-lock-", b"me", None, None)]
    replies = kazoo_compat.create_in_new_containers_async(zk_client, pairs).get(timeout=5)
    [((cpath, cstat), (npath, nstat))] = replies
    assert cpath == path and npath == f"{path}/_c_x-lock-0000000000"
    # A create in a multi answers with its path only; the container's stat carries the
    # transaction's zxid, which is every created node's czxid (the lock's fencing token).
    stat = zk_client.exists(npath)
    assert (cstat or nstat).czxid == stat.czxid and stat.ephemeralOwner == zk_client.client_id[0]
    assert zk_client.get(npath)[0] == b"me"
    zk_client.delete(npath)
    _wait_reaped(zk_client, path)


def test_the_multi_fails_whole_when_the_container_exists(zk_client, path):
    zk_client.ensure_path(path)
    pairs = [(path, f"{path}/n-", b"", None, None)]
    [(container, ours)] = kazoo_compat.create_in_new_containers_async(zk_client, pairs).get(timeout=5)
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
    _wait_reaped(zk_client, f"{path}/fresh")


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
    with chrooted(zk_server, "/chrooted") as (root, client):
        znodes.mark_containers_work(client)
        client.ensure_path("/k")
        sent = _sent(client, monkeypatch)
        lock = FairLock(client, "/k/new")
        assert lock.acquire(timeout=5)
        assert sent == ["MultiCreate"]
        assert lock.node.startswith("/k/new/") and client.exists(lock.node) is not None
        assert lock.release()
        _wait_reaped(root, "/chrooted/k/new")


def _start_new_keys(client, keys):
    """Start an attempt per key from one thread, as the worker's lock agent does in a burst."""
    from celery_zklock.engine.internals import LockInternals

    return [LockInternals(client, k, identifier=b"me").attempt(None) for k in keys]


def test_a_burst_of_new_keys_is_group_committed(zk_client, path, monkeypatch):
    """While one new key's multi is in flight the next ones wait and go together: fewer
    requests than keys, and every node still gets its own exact token."""
    znodes.mark_containers_work(zk_client)
    zk_client.ensure_path(path)
    sent = _sent(zk_client, monkeypatch)
    keys = [f"{path}/k{i}" for i in range(60)]
    attempts = _start_new_keys(zk_client, keys)
    assert all(a.result.get(timeout=10) for a in attempts)
    multis = sent.count("MultiCreate")
    assert 1 < multis < len(keys), sent  # the first alone, the rest batched behind it
    # No createContainer, no children read.  A holder's watch on its own node (a GetData,
    # set soon after the hold: engine/attempt.py, HoldWatch) may already have gone out on a
    # slow machine: it is not part of joining the queue.
    assert set(sent) - {"GetData"} == {"MultiCreate"}
    for a in attempts:
        stat = zk_client.exists(f"{a.lk.path}/{a.node}")
        assert a.token == fencing_token(stat.czxid) and stat.ephemeralOwner == zk_client.client_id[0]
    for a in attempts:
        assert a.release()[1].get(timeout=5) == "deleted"


def test_attempts_on_a_key_being_made_queue_in_the_order_they_came(zk_client, path, monkeypatch):
    """Six readers then a writer on one new key, started together: the first makes the key
    with its node, the others wait for that answer and then create in the order they came,
    in one multi at most (before: each sent a multi that failed on the container the first
    made, and their retries went after the writer's create, which found the key made: it
    held before readers that had come first)."""
    from celery_zklock.engine.internals import LockInternals
    from celery_zklock.engine.znodes import NodeKind

    znodes.mark_containers_work(zk_client)
    zk_client.ensure_path(path)
    sent = _sent(zk_client, monkeypatch)
    key = f"{path}/catalog"
    kinds = [NodeKind.READ] * 6 + [NodeKind.WRITE]
    attempts = [LockInternals(zk_client, key, identifier=str(i).encode(), kind=kind).attempt(None)
                for i, kind in enumerate(kinds)]
    assert all(a.result.get(timeout=10) for a in attempts[:6])  # the readers share
    order = [zk_client.get(f"{key}/{name}")[0] for name in znodes.sort_contenders(zk_client.get_children(key))]
    assert order == [str(i).encode() for i in range(7)]
    assert sent.count("MultiCreate") == 1, sent
    for a in attempts[:6]:
        a.release()
    assert attempts[6].result.get(timeout=10)
    attempts[6].release()


def test_a_batch_rolled_back_by_one_key_still_gets_every_key(zk_client, zk_server, path, monkeypatch):
    """One key's container exists (another process holds it): the batch fails whole; that
    key queues behind its holder, every other key is sent again and held."""
    znodes.mark_containers_work(zk_client)
    zk_client.ensure_path(path)
    other = KazooClient(hosts=zk_server.hosts)
    other.start()
    try:
        keys = [f"{path}/k{i}" for i in range(20)]
        holder = FairLock(other, keys[7])
        assert holder.acquire(timeout=5)
        RECENT.discard(keys[7])  # as in another process
        sent = _sent(zk_client, monkeypatch)
        attempts = _start_new_keys(zk_client, keys)
        others = [a for i, a in enumerate(attempts) if i != 7]
        assert all(a.result.get(timeout=10) for a in others)
        # Its own fallback (create + children) may still be in flight.
        wait_until(lambda: attempts[7].state.value == "waiting", 5, interval=0.01, what="key 7 waiting")
        assert not attempts[7].result.ready()
        assert "GetChildren" in sent  # the key whose container existed took the pipelined path
        assert sent.count("MultiCreate") >= 3  # key 0 alone, the batch key 7 failed, that batch again
        holder.release()
        assert attempts[7].result.get(timeout=5) is True
        for a in attempts:
            assert a.release()[1].get(timeout=5) == "deleted"
    finally:
        other.stop()
        other.close()


def test_releases_together_are_group_committed_and_each_keeps_its_proof(zk_client, path, monkeypatch):
    """60 releases from one thread: fewer requests than nodes; each outcome is still its
    own node's: 'deleted', except the one an operator deleted first, which reads 'gone'."""
    zk_client.ensure_path(path)
    keys = [f"{path}/k{i}" for i in range(60)]
    attempts = _start_new_keys(zk_client, keys)
    assert all(a.result.get(timeout=10) for a in attempts)
    zk_client.delete(f"{attempts[30].lk.path}/{attempts[30].node}")  # behind its holder's back
    sent = _sent(zk_client, monkeypatch)
    outcomes = [a.release()[1] for a in attempts]
    got = [o.get(timeout=10) for o in outcomes]
    assert got[30] == "gone" and got[:30] + got[31:] == ["deleted"] * 59
    deletes = sent.count("Delete") + sent.count("Transaction")
    assert deletes < len(keys), sent
    assert all(_children(zk_client, k) == [] for k in keys)
