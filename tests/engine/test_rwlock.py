"""ReadWriteLock against a real ZooKeeper: readers share, a writer is alone, in one fair queue,
with Curator's re-entry (a downgrade, no upgrade) and fencing tokens."""

from __future__ import annotations

import threading

import pytest

from celery_zklock import LockUpgradeRefused
from celery_zklock.engine.rwlock import ReadWriteLock
from tests.lockutil import children, hold_for, in_threads, reads_shared, side_of, write_overlaps
from tests.polling import holds_for, wait_until


@pytest.fixture
def path(request):
    return f"/t/{request.node.name.replace('[', '_').replace(']', '')}"


def test_readers_share_and_a_writer_waits_for_them(zk_client, path):
    a, b, w = (ReadWriteLock(zk_client, path) for _ in range(3))
    assert a.read.acquire(timeout=5) and b.read.acquire(timeout=5)
    assert a.read.is_held() and b.read.is_held() and a.read.token != b.read.token
    read_tokens = (a.read.token, b.read.token)
    assert "__READ__" in a.read.node
    assert w.write.acquire(timeout=0.3) is False  # two readers ahead
    assert len(children(zk_client, path)) == 2  # the writer left nothing behind
    a.read.release()
    assert w.write.acquire(timeout=0.3) is False  # one reader is still ahead
    b.read.release()
    assert w.write.acquire(timeout=5) and "__WRIT__" in w.write.node
    assert w.write.token > max(read_tokens)
    w.write.release()


def test_a_writer_is_not_starved_by_a_stream_of_readers(zk_client, path):
    """Readers that come after a queued writer wait behind it, even while readers hold."""
    first = ReadWriteLock(zk_client, path)
    assert first.read.acquire(timeout=5)
    writer = ReadWriteLock(zk_client, path)
    got: list[str] = []
    t = threading.Thread(target=lambda: writer.write.acquire(timeout=10) and got.append("writer"))
    t.start()
    wait_until(lambda: len(children(zk_client, path)) == 2, 5, what="the writer to queue")
    late = ReadWriteLock(zk_client, path)
    assert late.read.acquire(timeout=0.3) is False  # queued behind the writer: no sharing past it
    first.read.release()
    t.join(10)
    assert got == ["writer"]
    assert late.read.acquire(timeout=0.3) is False  # the writer holds
    writer.write.release()
    assert late.read.acquire(timeout=5)
    late.read.release()


def test_tokens_fence_a_writer_after_every_earlier_hold(zk_client, path):
    tokens = []
    for side in ("read", "read", "write", "read", "write"):
        lk = getattr(ReadWriteLock(zk_client, path), side)
        assert lk.acquire(timeout=5)
        tokens.append(lk.token)
        lk.release()
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_no_write_overlaps_any_hold_and_readers_overlap(zk_client, path):
    """Eight threads, each its own lock, a third of them writers, 60 holds in all."""
    spans: list[tuple[str, float, float]] = []

    def run(i: int) -> None:
        rw = ReadWriteLock(zk_client, path)
        for j in range(8):
            side = side_of(i, j)
            spans.append((side, *hold_for(getattr(rw, side), 0.02)))

    in_threads(run, 8)
    assert len(spans) == 64
    broken = write_overlaps(spans)
    assert not broken, f"a write overlapped another hold: {broken[:3]}"
    assert reads_shared(spans), "no two reads ever shared the lock"


def test_the_write_holder_downgrades_and_no_writer_slips_in(zk_client, path):
    """Curator's downgrade (write, then read, then release the write), without its gap: a
    writer queued during the write does not hold beside the downgraded read."""
    rw = ReadWriteLock(zk_client, path)
    assert rw.write.acquire(timeout=5)
    written = rw.write.token
    other = ReadWriteLock(zk_client, path)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(other.write.acquire(timeout=10)))
    t.start()
    wait_until(lambda: len(children(zk_client, path)) == 2, 5, what="the other writer to queue")
    assert rw.read.acquire(timeout=0)  # at once, under the write node
    assert rw.read.token == written and len(children(zk_client, path)) == 2  # no node of its own
    assert rw.write.release() is True
    assert not rw.write.is_held() and rw.write.token is None and rw.read.is_held()
    holds_for(lambda: got == [], 0.3, what="the queued writer waiting: the read holds the node")
    assert rw.read.release() is True
    t.join(10)
    assert got == [True] and other.write.token > written
    other.write.release()


def test_the_write_holder_may_write_again_while_downgraded(zk_client, path):
    rw = ReadWriteLock(zk_client, path)
    assert rw.write.acquire(timeout=5) and rw.read.acquire(timeout=0)
    node = rw.write.node
    rw.write.release()
    assert rw.write.acquire(timeout=0) and rw.write.node == node and rw.write.is_held()
    rw.read.release()
    assert rw.write.is_held()  # the write goes on
    assert rw.write.release() and children(zk_client, path) == []


def test_a_reader_may_not_upgrade(zk_client, path):
    rw = ReadWriteLock(zk_client, path)
    assert rw.read.acquire(timeout=5)
    with pytest.raises(LockUpgradeRefused, match="release the read lock first"):
        rw.write.acquire(timeout=5)
    assert len(children(zk_client, path)) == 1  # no writer's node was left queued behind it
    rw.read.release()
    assert rw.write.acquire(timeout=5)
    rw.write.release()


def test_both_sides_reenter(zk_client, path):
    rw = ReadWriteLock(zk_client, path)
    assert rw.read.acquire(timeout=5) and rw.read.acquire(timeout=0)
    assert rw.read.release() and rw.read.is_held()
    rw.read.release()
    assert rw.write.acquire(timeout=5) and rw.write.acquire(timeout=0)
    rw.write.release()
    assert rw.write.is_held()
    rw.write.release()
    assert children(zk_client, path) == []


def test_readers_queued_behind_a_writer_all_hold_at_its_release(zk_client, path):
    """Ten readers behind one writer: its release grants all ten (each watched its node)."""
    w = ReadWriteLock(zk_client, path)
    assert w.write.acquire(timeout=5)
    readers = [ReadWriteLock(zk_client, path) for _ in range(10)]
    results: list[bool] = []
    threads = [threading.Thread(target=lambda r=r: results.append(r.read.acquire(timeout=10))) for r in readers]
    for t in threads:
        t.start()
    wait_until(lambda: len(children(zk_client, path)) == 11, 5, what="ten readers to queue")
    w.write.release()
    for t in threads:
        t.join(10)
    assert results == [True] * 10 and all(r.read.is_held() for r in readers)
    for r in readers:
        r.read.release()


def test_a_downgraded_hold_lost_is_lost_for_its_reads_and_a_new_write_is_whole(zk_client, path):
    """The write node carrying a downgraded read is deleted (an operator, an expired session):
    the read's release says it was lost, and the next write is a hold of its own that no
    leftover read release can delete (found by review: the new write's node went with it)."""
    rw = ReadWriteLock(zk_client, path)
    assert rw.write.acquire(timeout=5) and rw.read.acquire(timeout=0)
    rw.write.release()  # downgraded: the read rides on the write node
    zk_client.delete(rw.read.node)
    wait_until(lambda: not rw.read.is_held(), 5, what="the loss to be seen")
    assert rw.write.acquire(timeout=5) and rw.write.is_held() and rw.write.token is not None
    node = rw.write.node
    assert rw.read.release() is False  # lost with the node
    assert zk_client.exists(node) is not None and rw.write.is_held()
    assert rw.write.release() is True and children(zk_client, path) == []


def test_another_threads_write_waits_out_a_downgrade_and_leaves_its_reads_alone(zk_client, path):
    """Found by review: another thread's write acquire during the owner's downgrade wiped the
    owner's carried reads, and the write node stayed in the queue for good."""
    rw = ReadWriteLock(zk_client, path)
    assert rw.write.acquire(timeout=5) and rw.read.acquire(timeout=0)
    rw.write.release()  # downgraded
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(rw.write.acquire(timeout=0.5)))
    t.start()
    t.join(5)
    assert got == [False] and rw.read.is_held()
    assert rw.read.release() is True and children(zk_client, path) == []


def test_a_write_retaken_after_its_node_was_lost_does_not_carry_the_lost_reads(zk_client, path):
    """Found by review: reads carried on a lost write node were counted against the next one,
    and their release deleted it with a false proof."""
    rw = ReadWriteLock(zk_client, path)
    assert rw.write.acquire(timeout=5) and rw.read.acquire(timeout=0)
    zk_client.delete(rw.write.node)
    wait_until(lambda: not rw.write.is_held(), 5, what="the loss to be seen")
    assert rw.write.acquire(timeout=5)
    assert not rw.read.is_held() and rw.read.release() is False
    assert rw.write.is_held() and rw.write.release() is True
    assert children(zk_client, path) == []


def test_a_read_lost_but_not_released_still_refuses_the_upgrade(zk_client, path):
    """Its node may still queue ahead of the write it would queue: the write would wait for itself."""
    rw = ReadWriteLock(zk_client, path)
    assert rw.read.acquire(timeout=5)
    zk_client.delete(rw.read.node)
    wait_until(lambda: not rw.read.is_held(), 5, what="the loss to be seen")
    with pytest.raises(LockUpgradeRefused):
        rw.write.acquire(timeout=1)
    assert rw.read.release() is False
    assert rw.write.acquire(timeout=5) and rw.write.release()
