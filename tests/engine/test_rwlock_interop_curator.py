"""ReadWriteLock sharing a path with Apache Curator's ``InterProcessReadWriteLock``.

Our nodes are named as Curator names its own (``_c_<uuid>-__READ__<seq>``,
``_c_<uuid>-__WRIT__<seq>``), so the two form one FIFO queue: readers of either share, a
writer of either is alone, and nobody passes a node queued ahead of it.  Also what
Curator's lock does not see (mutex nodes: ours, kazoo's) and where its downgrade differs
from ours (docs/engine.md, "Read/write locks").  A real ZooKeeper; Curator in a real JVM
(tests/curator.py: ``CuratorHolder ... rw``, one thread, so its re-entry rules apply).
"""

from __future__ import annotations

import re
import threading
import time

import pytest
from kazoo.recipe.lock import ReadLock as KazooReadLock
from kazoo.recipe.lock import WriteLock as KazooWriteLock

from celery_zklock import FairLock, contenders
from celery_zklock.engine.rwlock import ReadWriteLock
from tests.lockutil import children, hold_for, in_threads, reads_shared, side_of, write_overlaps
from tests.polling import holds_for, wait_until

CURATOR_NODE = re.compile(r"_c_[0-9a-f-]{36}-__(READ|WRIT)__\d{10}")


@pytest.fixture
def path(request):
    return f"/t/rw-curator/{request.node.name.replace('[', '_').replace(']', '')}"


@pytest.fixture
def curator(curators, path):
    """Curator's InterProcessReadWriteLock on the test's path: ``acquire read``, ``hold 5 write``..."""
    return curators(path, "rw")


def _name(lock) -> str:
    """The name of our lock's node in its parent (``lock.node`` is the full path)."""
    return lock.node.rsplit("/", 1)[1]


def _queued(zk, path, n):
    wait_until(lambda: len(children(zk, path)) >= n, 10, what=f"{n} nodes queued on {path}")


class Waiter:
    """One of our sides acquiring in a thread: when it got the lock, and (once let go) when
    it let go, both in time.monotonic()."""

    def __init__(self, side) -> None:
        self.side, self.got, self.acquired, self.released = side, None, None, None
        self.go = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self) -> None:
        self.got = self.side.acquire(timeout=30)
        self.acquired = time.monotonic()
        self.go.wait(30)
        if self.got:
            self.released = time.monotonic()
            self.side.release()

    def wait_held(self) -> None:
        wait_until(lambda: self.got is not None, 15, what="our waiter to hold")
        assert self.got is True

    def finish(self) -> None:
        self.go.set()
        self.thread.join(30)


def test_readers_share_across_and_writers_wait_for_them(curator, zk_client, path):
    first = ReadWriteLock(zk_client, path)
    assert first.read.acquire(timeout=5)
    curator.send("try 5000 read")  # our reader holds: Curator's reader shares at once
    curator.expect("ACQUIRING")
    curator.expect("ACQUIRED")
    (cnode,) = [n for n in children(zk_client, path) if n != _name(first.read)]
    assert CURATOR_NODE.fullmatch(cnode) and "__READ__" in cnode, cnode
    second = ReadWriteLock(zk_client, path)
    assert second.read.acquire(timeout=5)  # and ours after Curator's, too
    assert [c.holder for c in contenders(zk_client, path)] == [True, True, True]

    writer = ReadWriteLock(zk_client, path)
    assert writer.write.acquire(timeout=0.5) is False  # three readers ahead, one of them Curator's
    first.read.release()
    second.read.release()
    assert writer.write.acquire(timeout=0.5) is False  # Curator's reader still holds
    assert children(zk_client, path) == [cnode]  # the timed-out writers left nothing queued
    curator.release("read")
    assert writer.write.acquire(timeout=5)
    writer.write.release()


def test_a_writer_of_either_excludes_everyone(curator, zk_client, path):
    curator.acquire("write")
    (cnode,) = children(zk_client, path)
    assert CURATOR_NODE.fullmatch(cnode) and "__WRIT__" in cnode, cnode
    rw = ReadWriteLock(zk_client, path)
    assert rw.read.acquire(timeout=0.5) is False
    assert rw.write.acquire(timeout=0.5) is False
    curator.release("write")

    assert rw.write.acquire(timeout=5)
    for side in ("read", "write"):
        curator.send(f"try 500 {side}")
        curator.expect("ACQUIRING")
        curator.expect("TIMEOUT", timeout=10)
    assert children(zk_client, path) == [_name(rw.write)]
    curator.send("acquire read")
    curator.expect("ACQUIRING")
    curator.assert_silent(0.5)
    released_at = time.monotonic()
    rw.write.release()
    assert curator.expect("ACQUIRED", timeout=10) > released_at
    curator.release("read")


def test_no_write_overlaps_any_hold_and_readers_share_across(curator, clients, path):
    """Curator holds 24 times (two reads, a write, ...) while three threads of ours, each its
    own session and lock, hold 10 times each, a third of them writes; hold intervals from
    both processes, on one clock: no write overlaps any hold, and readers of both shared."""
    spans: list[tuple] = []
    sessions = [clients() for _ in range(3)]

    def ours(i: int) -> None:
        rw = ReadWriteLock(sessions[i], path)
        for j in range(10):
            side = side_of(i, j)
            spans.append((side, *hold_for(getattr(rw, side), 0.01), "ours"))

    plan = ["read", "read", "write"] * 8
    curator.hold_each(plan, 10)
    in_threads(ours, 3)
    spans += curator.holds(plan)
    assert len(spans) == 54
    broken = write_overlaps(spans)
    assert not broken, f"a write overlapped another hold: {broken[:3]}"
    assert reads_shared(spans, "curator", "ours"), "no reader of ours ever shared the lock with a reader of Curator's"


def test_a_curator_writer_queued_ahead_of_our_reader_is_waited_for(curator, zk_client, path):
    """Queue: our reader (holding), Curator's writer, our reader.  The second reader does not
    share past the queued writer: it holds after Curator's write."""
    first = ReadWriteLock(zk_client, path)
    assert first.read.acquire(timeout=5)
    curator.send("acquire write")
    curator.expect("ACQUIRING")
    _queued(zk_client, path, 2)
    late = Waiter(ReadWriteLock(zk_client, path).read)
    try:
        _queued(zk_client, path, 3)
        holds_for(lambda: late.got is None, 0.3, what="our reader waiting behind Curator's queued writer")
        released_at = time.monotonic()
        first.read.release()
        assert curator.expect("ACQUIRED", timeout=10) > released_at
        holds_for(lambda: late.got is None, 0.3, what="our reader waiting while Curator's writer holds")
        written = curator.release("write")
        late.wait_held()
        assert late.acquired > written
    finally:
        late.finish()


def test_our_writer_queued_ahead_of_a_curator_reader_is_waited_for(curator, zk_client, path):
    """Queue: our reader (holding), our writer, Curator's reader.  Curator's reader does not
    share past our queued writer: it holds after our write."""
    first = ReadWriteLock(zk_client, path)
    assert first.read.acquire(timeout=5)
    writer = Waiter(ReadWriteLock(zk_client, path).write)
    try:
        _queued(zk_client, path, 2)
        curator.send("acquire read")
        curator.expect("ACQUIRING")
        _queued(zk_client, path, 3)
        curator.assert_silent(0.5)  # a reader holds, but our writer is ahead of Curator's reader
        first.read.release()
        writer.wait_held()
        curator.assert_silent(0.3)
        writer.finish()
        assert curator.expect("ACQUIRED", timeout=10) > writer.released
        curator.release("read")
    finally:
        writer.finish()


def test_our_downgrade_holds_off_a_queued_curator_writer(curator, zk_client, path):
    """Ours: the downgraded read rides on the write node, so Curator's writer queued during
    the write waits for the read too."""
    rw = ReadWriteLock(zk_client, path)
    assert rw.write.acquire(timeout=5)
    curator.send("acquire write")
    curator.expect("ACQUIRING")
    _queued(zk_client, path, 2)
    assert rw.read.acquire(timeout=0)
    assert rw.write.release()
    curator.assert_silent(0.5)
    released_at = time.monotonic()
    assert rw.read.release()
    assert curator.expect("ACQUIRED", timeout=10) > released_at
    curator.release("write")


def test_curators_downgrade_lets_our_queued_writer_in_beside_its_read(curator, zk_client, path):
    """Curator's: the downgraded read is a new node, queued behind our writer, which holds as
    soon as Curator's write node goes, beside that read (as a writer of Curator's would)."""
    curator.acquire("write")
    writer = Waiter(ReadWriteLock(zk_client, path).write)
    try:
        _queued(zk_client, path, 2)
        curator.acquire("read")  # the write holder reads at once, on a node of its own
        names = children(zk_client, path)
        assert len(names) == 3 and sum("__READ__" in n for n in names) == 1, names
        curator.release("write")
        writer.wait_held()  # while Curator still reads
        writer.finish()
        curator.release("read")
    finally:
        writer.finish()


def test_curators_locks_do_not_see_each_others_nodes(curator, curators, zk_client, path):
    """Why a path Curator's read/write lock uses carries no mutex nodes (docs/engine.md):
    Curator's read/write lock orders only by the sequence after ``__READ__``/``__WRIT__``
    and takes any other child for a reader, so its writer holds beside a holder of our
    ``FairLock`` (``-lock-``), of kazoo's ``WriteLock`` (``__lock__``) or ``ReadLock``
    (``__rlock__``); and Curator's ``InterProcessMutex`` orders only by the sequence after
    ``-lock-``, so it holds beside our writer and our reader.  Our ReadWriteLock's writer
    waits for each."""
    zk_client.ensure_path(path)  # persistent: kazoo's locks check their parent once per object
    holders = [FairLock(zk_client, path), KazooWriteLock(zk_client, path), KazooReadLock(zk_client, path)]
    for holder in holders:
        assert holder.acquire(timeout=5)
        curator.send("try 5000 write")
        curator.expect("ACQUIRING")
        curator.expect("ACQUIRED", timeout=10)  # at once, beside the holder
        curator.release("write")
        assert ReadWriteLock(zk_client, path).write.acquire(timeout=0.3) is False
        holder.release()

    mutex = curators(path)  # Curator's InterProcessMutex
    for side in ("write", "read"):
        lk = getattr(ReadWriteLock(zk_client, path), side)
        assert lk.acquire(timeout=5)
        mutex.send("try 5000")
        mutex.expect("ACQUIRING")
        mutex.expect("ACQUIRED", timeout=10)  # at once, beside our holder
        mutex.release()
        lk.release()
