"""FairLock against a real ZooKeeper: the single-client behaviours."""

from __future__ import annotations

import json
import threading
import time

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from celery_zklock import FairLock, LockLost, MultiLock, contenders
from celery_zklock.engine.znodes import fencing_token
from tests.lockutil import children, watching
from tests.polling import holds_for, wait_until


@pytest.fixture
def path(request):
    return f"/t/{request.node.name.replace('[', '_').replace(']', '')}"


def test_acquire_release_token_and_node(zk_client, path):
    lock = FairLock(zk_client, path)
    assert lock.token is None and not lock.is_held()
    assert lock.acquire() is True
    assert lock.is_held()
    stat = zk_client.exists(lock.node)
    assert stat is not None and lock.token == fencing_token(stat.czxid)
    assert stat.ephemeralOwner == zk_client.client_id[0]
    assert lock.node.rsplit("/", 1)[1].startswith("_c_") and "-lock-" in lock.node
    node = lock.node
    assert lock.release() is True
    assert zk_client.exists(node) is None
    assert lock.token is None and not lock.is_held()
    assert lock.release() is False  # nothing left to release


def test_timeout_is_bounded_and_leaves_no_node(zk_client, zk_server, path):
    holder = FairLock(zk_client, path)
    holder.acquire()
    other = KazooClient(hosts=zk_server.hosts)
    other.start()
    try:
        waiter = FairLock(other, path)
        t0 = time.monotonic()
        assert waiter.acquire(timeout=0.4) is False
        took = time.monotonic() - t0
        assert 0.4 <= took < 1.0, took
        assert waiter.node is None
        assert zk_client.get_children(path) == [holder.node.rsplit("/", 1)[1]]
    finally:
        other.stop()
        holder.release()


def test_nonblocking_tries_once(zk_client, path):
    a, b = FairLock(zk_client, path), FairLock(zk_client, path)
    assert a.acquire(blocking=False)
    t0 = time.monotonic()
    assert b.acquire(blocking=False) is False
    assert b.acquire(timeout=0) is False
    assert time.monotonic() - t0 < 0.5
    assert len(zk_client.get_children(path)) == 1
    a.release()
    assert b.acquire(blocking=False)
    b.release()


def test_try_once_remakes_a_reaped_container(zk_client, path):
    """timeout=0 is one try, and remaking a key's reaped container is part of it
    (it failed in CI: the container went between a release and the next try)."""
    lock = FairLock(zk_client, path)
    assert lock.acquire(blocking=False)
    lock.release()
    wait_until(lambda: zk_client.exists(path) is None, 5, interval=0.05,
               what="the empty container reaped (the test server reaps every 100 ms)")
    assert lock.acquire(blocking=False)
    lock.release()


def test_reentrant_as_curator_counts_and_frees_on_the_last_release(zk_client, zk_server, path):
    """The owner re-acquires at once (no new node); each acquire needs its release; an inner
    release never frees the key while the outermost hold goes on."""
    peer_client = KazooClient(hosts=zk_server.hosts)
    peer_client.start()
    try:
        peer = FairLock(peer_client, path)
        with FairLock(zk_client, path) as lock:
            token, node = lock.token, lock.node
            assert lock.acquire(timeout=0) is True  # would be False if it queued behind itself
            with lock:  # three deep
                assert lock.token == token and lock.node == node
                assert len(children(zk_client, path)) == 1
            assert lock.release() is True  # the re-entry's release: still held
            assert lock.is_held() and lock.node == node
            assert peer.acquire(timeout=0) is False
        assert not lock.is_held()
        assert children(zk_client, path) == []
        assert peer.acquire(timeout=0) is True
        peer.release()
    finally:
        peer_client.stop()
        peer_client.close()


def test_reentry_turned_off_raises_at_once(zk_client, path):
    from celery_zklock import LockReentered

    with FairLock(zk_client, path, reentrant=False) as lock:
        t0 = time.monotonic()
        with pytest.raises(LockReentered, match="re-entry is turned off"):
            lock.acquire(timeout=5)
        assert time.monotonic() - t0 < 1.0
        assert lock.is_held()
    with MultiLock(zk_client, [path + "-a", path + "-b"], reentrant=False) as multi:
        with pytest.raises(LockReentered):
            multi.acquire(timeout=5)
        assert multi.is_held()
    assert children(zk_client, path) == []


def test_another_thread_is_not_the_owner(zk_client, path):
    """Another thread's acquire of the same instance waits like anyone else's: it gives up
    at its timeout while the owner holds, and gets the lock once the owner lets go."""
    lock = FairLock(zk_client, path)
    lock.acquire()
    got: list = []
    t = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.3)))
    t.start()
    t.join()
    assert got == [False] and lock.is_held()
    t = threading.Thread(target=lambda: (got.append(lock.acquire(timeout=10)), got.append(lock.token), lock.release()))
    t.start()
    holds_for(t.is_alive, 0.2, what="the other thread waiting for the owner")
    first = lock.token
    lock.release()
    t.join(10)
    assert got[1:] == [True, got[2]] and got[2] > first
    assert children(zk_client, path) == []


def test_multilock_reentry_counts_per_path(zk_client, path):
    paths = [path + "-a", path + "-b"]
    multi = MultiLock(zk_client, paths)
    assert multi.acquire(timeout=5)
    tokens = dict(multi.tokens)
    assert multi.acquire(timeout=0)
    assert multi.release() is True and multi.is_held() and multi.tokens == tokens
    assert multi.release() is True and not multi.is_held()
    assert all(children(zk_client, p) == [] for p in paths)


def test_cancel_wakes_a_blocked_acquire(zk_client, path):
    holder = FairLock(zk_client, path)
    holder.acquire()
    waiter = FairLock(zk_client, path)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("got", waiter.acquire()))
    t.start()
    wait_until(lambda: len(zk_client.get_children(path)) == 2, 5, what="the waiter queued")
    waiter.cancel()
    t.join(5)
    assert result["got"] is False
    assert len(zk_client.get_children(path)) == 1
    holder.release()


def test_cancel_while_the_create_reply_is_unread_still_leaves_no_node(zk_client, zk_server, path):
    """The create ran on the server, its reply waits in the client's completion queue, and
    the acquire is cancelled: acquire must not return before our node is deleted (kazoo's
    test_lock_cancel caught this in CI, with contenders() still listing the cancelled one)."""
    holder = FairLock(zk_client, path)
    holder.acquire()
    other = KazooClient(hosts=zk_server.hosts)
    other.start()
    unblock = threading.Event()
    other.handler.completion_queue.put(unblock.wait)  # every reply's callback waits behind this
    waiter = FairLock(other, path)
    seen = {}

    def acquire():
        seen["got"] = waiter.acquire()
        seen["children"] = len(zk_client.get_children(path))

    t = threading.Thread(target=acquire, daemon=True)
    try:
        t.start()
        wait_until(lambda: len(zk_client.get_children(path)) == 2, 5, interval=0.01,
                   what="the waiter's node created on the server (its reply unread)")
        waiter.cancel()
        t.join(0.5)  # the bug: acquire returned False here, its node still queued
        unblock.set()
        t.join(10)
        assert seen["got"] is False
        assert seen["children"] == 1  # ours was gone by the time acquire returned
    finally:
        unblock.set()
        holder.release()
        other.stop()
        other.close()


def test_contenders_lists_holders_then_waiters_with_identifiers(zk_client, path):
    a = FairLock(zk_client, path, identifier="worker-a", max_holders=2)
    b = FairLock(zk_client, path, identifier=json.dumps({"task": "b"}), max_holders=2)
    c = FairLock(zk_client, path, identifier="worker-c", max_holders=2)
    assert a.acquire() and b.acquire()
    t = threading.Thread(target=c.acquire)
    t.start()
    wait_until(lambda: len(zk_client.get_children(path)) == 3, 5, interval=0.01, what="c queued")
    found = contenders(zk_client, path, max_holders=2)
    assert [x.identifier for x in found] == ["worker-a", '{"task": "b"}', "worker-c"]
    assert [x.holder for x in found] == [True, True, False]
    assert [x.sequence for x in found] == sorted(x.sequence for x in found)
    a.release()
    t.join(5)
    assert c.is_held()
    b.release(), c.release()


def test_release_without_wait_still_deletes(zk_client, path):
    lock = FairLock(zk_client, path)
    lock.acquire()
    node = lock.node
    assert lock.release(wait=False) is True
    wait_until(lambda: zk_client.exists(node) is None, 5, interval=0.01, what="the node deleted")


def test_node_deleted_behind_our_back_is_detected_as_lost(zk_client, zk_server, path):
    lost = threading.Event()
    lock = FairLock(zk_client, path, on_lost=lambda lk: lost.set())
    lock.acquire()
    other = KazooClient(hosts=zk_server.hosts)
    other.start()
    other.delete(lock.node)  # an operator's forced unlock
    other.stop()
    assert lost.wait(5)
    assert not lock.is_held()
    with pytest.raises(LockLost, match="deleted"):
        lock.ensure()
    lock.release()


def test_node_deleted_after_writes_to_it_is_detected_as_lost(zk_client, zk_server, path):
    """A data watch is one-shot and a write to the node fires it too (the cohort's lease
    writes to a held node): the holder sets it again, so a delete after writes is seen
    (issue 35, finding 1: before, the first write used the watch up)."""
    lost = threading.Event()
    lock = FairLock(zk_client, path, on_lost=lambda lk: lost.set())
    lock.acquire()
    wait_until(lambda: watching(zk_client, lock.node), 5, what="the holder's watch on its node (set within OWN_WATCH_WITHIN)")
    other = KazooClient(hosts=zk_server.hosts)
    other.start()
    try:
        for i in range(3):
            other.set(lock.node, b"write %d" % i)
            time.sleep(0.05)  # the holder sets its watch again (the write fired it)
        assert not lost.is_set()
        other.delete(lock.node)  # an operator's forced unlock
        assert lost.wait(1.0), "the holder was not told its node was deleted"
    finally:
        other.stop()
        other.close()
    assert not lock.is_held()
    lock.release()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"path": "relative"}, "absolute"),
        ({"path": "/a/"}, "end with"),
        ({"max_holders": 0}, "max_holders"),
        ({"max_holders": "2"}, "max_holders"),
        ({"identifier": 5}, "identifier"),
    ],
)
def test_bad_arguments_are_value_errors(zk_client, kwargs, message):
    args = {"path": "/t/ok", **kwargs}
    path = args.pop("path")
    with pytest.raises(ValueError, match=message):
        FairLock(zk_client, path, **args)


def test_unstarted_client_is_a_clear_error():
    client = KazooClient(hosts="127.0.0.1:1")
    with pytest.raises(ValueError, match="client.start"):
        FairLock(client, "/t/x").acquire(timeout=0.1)
    with pytest.raises(ValueError, match="KazooClient"):
        FairLock(object(), "/t/x")


def test_negative_timeout_rejected(zk_client):
    with pytest.raises(ValueError, match="timeout"):
        FairLock(zk_client, "/t/neg").acquire(timeout=-1)


def test_multilock_all_or_nothing(zk_client, path):
    blocker = FairLock(zk_client, f"{path}/b")
    blocker.acquire()
    multi = MultiLock(zk_client, [f"{path}/c", f"{path}/a", f"{path}/b", f"{path}/a"])
    assert multi.paths == [f"{path}/a", f"{path}/b", f"{path}/c"]
    assert multi.acquire(timeout=0.3) is False
    assert multi.failed.path == f"{path}/b"
    # nothing left held on the other paths
    for p in (f"{path}/a", f"{path}/c"):
        assert children(zk_client, p) == []
    blocker.release()
    assert multi.acquire(timeout=2)
    assert multi.is_held() and all(multi.tokens.values())
    multi.release()
    assert not multi.is_held()


def _count_children_reads(client, monkeypatch) -> list[str]:
    """Record every get_children the client sends (observing, not replacing, the call)."""
    reads: list[str] = []
    real = client.get_children_async

    def spy(path, *args, **kwargs):
        reads.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(client, "get_children_async", spy)
    return reads


def test_new_key_is_held_without_reading_the_children(zk_client, path, monkeypatch):
    warm = FairLock(zk_client, f"{path}/warm")  # the client learns the server knows containers
    assert warm.acquire(timeout=5)
    warm.release()
    reads = _count_children_reads(zk_client, monkeypatch)
    lock = FairLock(zk_client, f"{path}/fresh")
    assert lock.acquire(timeout=5)
    assert lock.node.endswith("-lock-0000000000")
    assert reads == []  # made in one multi with its container: nobody can be ahead
    assert lock.release()


def test_new_key_already_held_by_another_kind_of_lock_is_waited_for(zk_client, zk_server, path, monkeypatch):
    """The shortcut must not fire when the parent exists with a holder we never saw."""
    from kazoo.recipe.lock import Lock

    other = KazooClient(hosts=zk_server.hosts)
    other.start()
    try:
        kazoo_lock = Lock(other, f"{path}/shared", extra_lock_patterns=["-lock-"])
        assert kazoo_lock.acquire(timeout=5)
        reads = _count_children_reads(zk_client, monkeypatch)
        ours = FairLock(zk_client, f"{path}/shared")
        assert ours.acquire(timeout=0.3) is False
        assert reads  # sequence > 0: the children were read, and the holder seen
        kazoo_lock.release()
        assert ours.acquire(timeout=5)
        ours.release()
    finally:
        other.stop()
        other.close()


def test_new_key_whose_parent_had_children_before_reads_them(zk_client, path, monkeypatch):
    """A parent whose earlier children are gone: sequence > 0, nobody ahead, still held."""
    zk_client.create(f"{path}/used/x-lock-", b"", sequence=True, makepath=True)
    for name in zk_client.get_children(f"{path}/used"):
        zk_client.delete(f"{path}/used/{name}")
    reads = _count_children_reads(zk_client, monkeypatch)
    lock = FairLock(zk_client, f"{path}/used")
    assert lock.acquire(timeout=5)
    assert not lock.node.endswith("-lock-0000000000") and reads == [f"{path}/used"]
    lock.release()


def test_a_change_to_the_watched_node_rearms_its_watch_without_a_children_read(zk_client, zk_server, path):
    """A peer writes its held node (a cohort's agent did, to renew its lease, until issue 39);
    a waiter watching that node watches it again (one read) and keeps waiting — no children
    read per change."""
    holder = FairLock(zk_client, path)
    assert holder.acquire()
    other = KazooClient(hosts=zk_server.hosts)
    other.start()
    try:
        sent: list[str] = []
        real = other._call

        def spy(request, async_object):
            sent.append(type(request).__name__)
            return real(request, async_object)

        other._call = spy
        waiter = FairLock(other, path)
        got = []
        t = threading.Thread(target=lambda: got.append(waiter.acquire(timeout=30)))
        t.start()
        wait_until(lambda: len(children(zk_client, path)) == 2 and watching(other, holder.node), 5, interval=0.01,
                   what="the waiter queued, watching the holder's node")
        before = list(sent)
        for i in range(20):
            zk_client.set(holder.node, b"renewed %d" % i)
            # Its watch fired and is set again (read sent, and its reply in) before the next change.
            wait_until(lambda i=i: sent[len(before):].count("GetData") > i and watching(other, holder.node), 5,
                       interval=0.005, what=f"the waiter's watch set again after change {i}")
        holds_for(lambda: not {"GetChildren", "GetChildren2"} & set(sent[len(before):]), 0.2,
                  what="no read of the queue for a data change")
        during = sent[len(before):]
        assert not got and t.is_alive(), "a data change is no release"
        assert "GetChildren" not in during and "GetChildren2" not in during, during
        assert during.count("GetData") == 20, during  # one watch set again per change
        holder.release()
        t.join(10)
        assert got == [True] and waiter.is_held()
        waiter.release()
    finally:
        other.stop()
        other.close()


def test_a_cancel_that_comes_as_the_acquire_starts_is_not_lost(zk_client, path):
    """cancel() between acquire's check of the flag and its new attempt used to reach only
    the previous (finished) attempt, and the flag was then cleared unread: the acquire
    waited for the holder however long it held (kazoo's own cancel is never lost)."""
    holder = FairLock(zk_client, path)
    holder.acquire()
    waiter = FairLock(zk_client, path)
    start = waiter._internals.attempt

    def attempt_then_cancelled(*args, **kwargs):
        made = start(*args, **kwargs)
        waiter.cancel()  # as if from another thread, just before the attempt is assigned
        return made

    waiter._internals.attempt = attempt_then_cancelled
    try:
        t0 = time.monotonic()
        assert waiter.acquire(timeout=3) is False
        assert time.monotonic() - t0 < 2, "the cancel was lost: the acquire ran to its timeout"
        assert len(zk_client.get_children(path)) == 1  # the holder's alone
    finally:
        holder.release()


def test_an_exception_as_the_lock_is_granted_leaves_no_node_held_by_nobody(zk_client, path):
    """An exception that lands in acquire() after the grant (here from the on_wait callback,
    as a KeyboardInterrupt or a gevent Timeout could) used to leave the node held, with no
    owner to release it: the same thread's next acquire queued behind it for good."""
    holder = FairLock(zk_client, path)
    holder.acquire()

    def on_wait(lock, _index):
        holder.release()
        wait_until(lock.is_held, 5, interval=0.01, what="the grant")
        raise KeyboardInterrupt("landed after the grant")

    waiter = FairLock(zk_client, path, on_wait=on_wait)
    with pytest.raises(KeyboardInterrupt):
        waiter.acquire(timeout=5)
    def children() -> list[str]:  # the emptied lock node is a container: ZooKeeper may reap it
        try:
            return zk_client.get_children(path)
        except NoNodeError:
            return []

    wait_until(lambda: children() == [], 3, what=lambda: f"the granted node, held by nobody, deleted: {children()}")
    other = FairLock(zk_client, path)
    assert other.acquire(timeout=3)
    other.release()
    assert waiter.acquire(timeout=3)
    waiter.release()
