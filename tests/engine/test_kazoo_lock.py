"""KazooLock where it differs from kazoo's Lock on purpose, and what it adds (kazoo's own
suite, in test_kazoo_suite.py, covers where it is the same)."""

from __future__ import annotations

import time

import pytest
from kazoo.exceptions import LockTimeout, NoNodeError
from kazoo.recipe.lock import Lock

from celery_zklock import KazooLock, KazooReadLock, KazooWriteLock
from celery_zklock.engine.rwlock import ReadLock, WriteLock
from tests.lockutil import children
from tests.polling import holds_for, wait_until


@pytest.fixture
def path(request):
    return f"/t/{request.node.name.replace('[', '_').replace(']', '')}"


def test_no_persistent_locks_and_no_unknown_patterns(zk_client, path):
    lock = KazooLock(zk_client, path, "me")
    with pytest.raises(ValueError, match="no persistent locks"):
        lock.acquire(ephemeral=False)
    assert children(zk_client, path) == [] and not lock.is_acquired
    with pytest.raises(ValueError, match="not supported"):
        KazooLock(zk_client, path, extra_lock_patterns=["__mine__"])
    KazooLock(zk_client, path, extra_lock_patterns=["-lock-", "__lock__", "__rlock__"])  # ordered anyway


def test_what_it_adds_token_is_held_and_the_release_proof(zk_client, path):
    lock = KazooLock(zk_client, path, "me")
    assert lock.token is None and not lock.is_held and lock.contenders() == []
    with lock as held:
        assert held is lock and lock.is_acquired and lock.is_held
        first = lock.token
        assert lock.contenders() == ["me"] and lock.node.endswith("-lock-0000000000")
    assert not lock.is_acquired and lock.token is None
    assert lock.acquire() and lock.token > first
    zk_client.delete(f"{path}/{lock.node}")  # an operator (or an expired session) took it away
    wait_until(lambda: not lock.is_acquired, 5, interval=0.01, what="is_acquired to turn False")
    assert lock.lost_reason  # kazoo's would still say True
    assert lock.release() is False  # not held to the end: the work was not exclusive


def test_the_holders_second_acquire_is_false_at_once(zk_client, path):
    """kazoo's Lock waits out the timeout (or forever) for a release that cannot come."""
    lock = KazooLock(zk_client, path)
    assert lock.acquire()
    started = time.monotonic()
    assert lock.acquire(timeout=5) is False and lock.acquire() is False
    assert time.monotonic() - started < 1 and lock.is_acquired
    assert lock.release() and not lock.is_acquired


def test_read_and_write_locks_are_kazoo_locks_on_the_sides_of_a_read_write_lock(zk_client, path):
    """KazooLock's interface and differences, on ReadWriteLock's sides (kazoo's suite, in
    test_kazoo_suite.py, covers how they share and exclude)."""
    reader, writer = KazooReadLock(zk_client, path, "r"), KazooWriteLock(zk_client, path, "w")
    assert isinstance(reader, KazooLock) and isinstance(writer, KazooLock)
    assert isinstance(reader.fair_lock, ReadLock) and isinstance(writer.fair_lock, WriteLock)
    with pytest.raises(ValueError, match="no persistent locks"):
        reader.acquire(ephemeral=False)
    with pytest.raises(ValueError, match="KazooWriteLock always orders"):
        KazooWriteLock(zk_client, path, extra_lock_patterns=["__mine__"])
    assert reader.acquire() and "__READ__" in reader.node and reader.is_held
    assert reader.acquire(timeout=5) is False  # the holder's second acquire, at once
    read_token = reader.token
    with pytest.raises(LockTimeout):
        writer.acquire(timeout=0.3)
    assert reader.contenders() == ["r"]
    assert reader.release() and not reader.is_acquired
    with writer:
        assert "__WRIT__" in writer.node and writer.token > read_token
        assert reader.acquire(blocking=False) is False
    assert repr(writer).startswith("<KazooWriteLock ") and children(zk_client, path) == []


def test_timeout_bounds_the_whole_acquire_and_leaves_no_node(zk_client, path):
    holder = KazooLock(zk_client, path, "holder")
    assert holder.acquire()
    waiter = KazooLock(zk_client, path, "waiter")
    started = time.monotonic()
    with pytest.raises(LockTimeout):
        waiter.acquire(timeout=0.5)
    assert 0.4 < time.monotonic() - started < 2
    assert waiter.acquire(blocking=False) is False
    assert holder.contenders() == ["holder"]
    holder.release()


def test_kazoo_locks_on_the_same_path_need_the_curator_pattern(zk_client, path):
    """Switching some processes only: kazoo's Lock sees our (Curator-named) nodes when given
    extra_lock_patterns=["-lock-"]; without it, it does not (docs/engine.md says so)."""
    zk_client.ensure_path(path)  # persistent, as docs/engine.md asks of a path kazoo's Lock shares
    ours = KazooLock(zk_client, path, "ours")
    assert ours.acquire()
    assert Lock(zk_client, path, "aware", extra_lock_patterns=["-lock-"]).acquire(blocking=False) is False
    blind = Lock(zk_client, path, "blind")
    assert blind.acquire(blocking=False) is True  # the hazard: both "hold"
    blind.release()
    ours.release()
    theirs = Lock(zk_client, path, "theirs")
    assert theirs.acquire()
    assert KazooLock(zk_client, path).acquire(blocking=False) is False  # we always see kazoo's
    theirs.release()


def test_a_kazoo_lock_sharing_our_path_needs_it_persistent(zk_client, path):
    """kazoo's Lock makes sure of its path once per Lock object; ours makes the path a
    container, which ZooKeeper deletes once its last node goes.  That kazoo Lock's next
    acquire then fails with NoNodeError (a fresh-clone CI run met it as a flaky test); a path
    created persistent first, as docs/engine.md says, is never swept."""
    ours = KazooLock(zk_client, path, "ours")
    assert ours.acquire()  # the path is our container now
    theirs = Lock(zk_client, path, "theirs", extra_lock_patterns=["-lock-"])
    assert theirs.acquire(blocking=False) is False  # it found the path there: never again looks
    ours.release()
    wait_until(lambda: zk_client.exists(path) is None, 10, what="the empty container swept")
    with pytest.raises(NoNodeError):
        theirs.acquire(blocking=False)
    zk_client.ensure_path(path)
    assert theirs.acquire(blocking=False)
    theirs.release()
    assert ours.acquire()
    ours.release()
    holds_for(lambda: zk_client.exists(path) is not None, 0.5,  # several sweeps of the test server (every 100 ms)
              what="the path kept: not a container")
