"""ReadWriteLock sharing one path with kazoo's ``ReadLock`` and ``WriteLock`` (issue 62).

kazoo's read/write locks see our nodes when told their markers: its ``ReadLock`` waits for
the ``extra_lock_patterns`` it is given (and its own writers' ``__lock__``), so it needs our
writers' ``"__WRIT__"``; its ``WriteLock`` waits for everyone it knows of, so it needs our
readers' ``"__READ__"`` too (``kazoo.recipe.lock.Lock._get_predecessor`` and
``_EXCLUDE_NAMES``).  Ours orders kazoo's ``__lock__`` and ``__rlock__`` always.  All of them
then queue in one FIFO line, readers sharing with readers of either library.
"""

from __future__ import annotations

import threading

import pytest
from kazoo.recipe.lock import ReadLock, WriteLock

from celery_zklock.engine import ReadWriteLock
from tests.lockutil import children, hold_for, in_threads, reads_shared, side_of, write_overlaps
from tests.polling import holds_for, wait_until

#: What a kazoo user gives its read/write locks to share a path with ours (docs/engine.md).
KAZOO_READER_SEES = ["__WRIT__"]
KAZOO_WRITER_SEES = ["__WRIT__", "__READ__"]


@pytest.fixture
def path(request, zk_client):
    path = f"/t/rwkazoo/{request.node.name.replace('[', '_').replace(']', '')}"
    zk_client.ensure_path(path)  # persistent: a kazoo lock checks its path once per object (docs/engine.md)
    return path


def kazoo_reader(client, path, name="kazoo reader"):
    return ReadLock(client, path, name, extra_lock_patterns=KAZOO_READER_SEES)


def kazoo_writer(client, path, name="kazoo writer"):
    return WriteLock(client, path, name, extra_lock_patterns=KAZOO_WRITER_SEES)


def test_control_kazoo_locks_without_the_patterns_do_not_see_ours(zk_client, path):
    """Control: proves the checks below can fail.  Untold, kazoo's writer takes the path
    beside our reader, and kazoo's reader beside our writer."""
    ours = ReadWriteLock(zk_client, path)
    assert ours.read.acquire(timeout=5)
    blind = WriteLock(zk_client, path, "blind writer")
    assert blind.acquire(blocking=False) is True  # the hazard: a write beside a read
    blind.release()
    ours.read.release()
    assert ours.write.acquire(timeout=5)
    blind_reader = ReadLock(zk_client, path, "blind reader")
    assert blind_reader.acquire(blocking=False) is True  # a read beside a write
    blind_reader.release()
    ours.write.release()


def test_readers_of_both_share_and_writers_of_both_exclude(zk_client, path):
    ours, theirs, third = ReadWriteLock(zk_client, path), kazoo_reader(zk_client, path), ReadWriteLock(zk_client, path)
    assert ours.read.acquire(timeout=5)
    assert theirs.acquire(blocking=False) is True  # kazoo's reader shares with ours
    assert third.read.acquire(timeout=0)  # and ours with both
    assert kazoo_writer(zk_client, path).acquire(blocking=False) is False
    assert ReadWriteLock(zk_client, path).write.acquire(timeout=0.2) is False
    assert theirs.release() and ours.read.release() and third.read.release()
    assert children(zk_client, path) == []  # nobody left a node behind

    writer = kazoo_writer(zk_client, path)
    assert writer.acquire(blocking=False)
    assert ReadWriteLock(zk_client, path).read.acquire(timeout=0.2) is False  # ours waits for kazoo's writer
    assert ReadWriteLock(zk_client, path).write.acquire(timeout=0) is False
    writer.release()
    assert ours.write.acquire(timeout=5)
    assert kazoo_reader(zk_client, path).acquire(blocking=False) is False  # kazoo's waits for ours
    assert kazoo_writer(zk_client, path).acquire(blocking=False) is False
    ours.write.release()


def test_a_kazoo_writer_queued_ahead_of_our_reader_is_waited_for(zk_client, path):
    """FIFO across the libraries: a reader holds, kazoo's writer queues, our reader comes
    after it and must not share with the holder past the writer (nor starve it)."""
    first = kazoo_reader(zk_client, path, "first")
    assert first.acquire(blocking=False)
    writer = kazoo_writer(zk_client, path)
    events: list[str] = []
    t = threading.Thread(target=lambda: writer.acquire(timeout=10) and events.append("kazoo writer holds"))
    t.start()
    wait_until(lambda: len(children(zk_client, path)) == 2, 5, what="kazoo's writer to queue")
    late = ReadWriteLock(zk_client, path)
    assert late.read.acquire(timeout=0.3) is False  # behind the writer
    reader = threading.Thread(target=lambda: late.read.acquire(timeout=10) and events.append("our reader holds"))
    reader.start()
    wait_until(lambda: len(children(zk_client, path)) == 3, 5, what="our reader to queue")
    first.release()
    t.join(10)
    holds_for(lambda: events == ["kazoo writer holds"], 0.3, what="our reader waiting for kazoo's writer")
    writer.release()
    reader.join(10)
    assert events == ["kazoo writer holds", "our reader holds"]
    late.read.release()


def test_our_writer_queued_ahead_of_a_kazoo_reader_is_waited_for(zk_client, path):
    first = ReadWriteLock(zk_client, path)
    assert first.read.acquire(timeout=5)
    ours = ReadWriteLock(zk_client, path)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(ours.write.acquire(timeout=10)))
    t.start()
    wait_until(lambda: len(children(zk_client, path)) == 2, 5, what="our writer to queue")
    late = kazoo_reader(zk_client, path, "late")
    assert late.acquire(blocking=False) is False  # behind our writer
    first.read.release()
    t.join(10)
    assert got == [True] and late.acquire(blocking=False) is False  # our writer holds
    ours.write.release()
    assert late.acquire(blocking=False) is True
    late.release()


def test_mixed_threads_no_write_overlaps_any_hold_and_readers_share(clients, path):
    """Eight threads on one path, half kazoo's locks, half ours, a third of the holds writes,
    each held 20 ms: no write overlaps another hold; reads overlap, ours with kazoo's too."""
    ours_client, kazoo_client = clients(), clients()
    spans: list[tuple[str, float, float, str]] = []

    def run(i: int) -> None:
        if i % 2:
            library = "kazoo"
            sides = {"read": kazoo_reader(kazoo_client, path, f"r{i}"), "write": kazoo_writer(kazoo_client, path, f"w{i}")}
        else:
            library, rw = "ours", ReadWriteLock(ours_client, path)
            sides = {"read": rw.read, "write": rw.write}
        for j in range(8):
            side = side_of(i, j)
            spans.append((side, *hold_for(sides[side], 0.02), library))

    in_threads(run, 8)
    assert len(spans) == 64
    broken = write_overlaps(spans)
    assert not broken, f"a write overlapped another hold: {broken[:3]}"
    assert {(s[0], s[3]) for s in spans} == {("read", "ours"), ("read", "kazoo"), ("write", "ours"),
                                             ("write", "kazoo")}
    assert reads_shared(spans, "ours", "kazoo"), "our readers never shared with kazoo's"
