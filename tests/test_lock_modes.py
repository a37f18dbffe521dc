"""lock_mode: tasks that read a key share it, tasks that write it have it alone.  The rules
from tables; the lock of direct calls against a real ZooKeeper (real workers:
tests/worker/test_readers.py)."""

from __future__ import annotations

import time

import pytest
from celery import Celery

from celery_zklock import ConfigurationError, LockUpgradeRefused, ReadWriteLock, ZkLockedTask, current_lock
from celery_zklock.config import check_lock_mode
from celery_zklock.engine.contenders import holding
from celery_zklock.keys import compile_key
from tests.lockutil import in_threads, reads_shared, side_of, write_overlaps


def _spec():
    return compile_key(["sku:{sku_id}", "catalog", "shelf:{shelf}"], lambda sku_id, shelf: None, "t")


@pytest.mark.parametrize(
    "mode, read",
    [
        ("write", set()),
        ("read", {"sku:1", "catalog", "shelf:1"}),
        ({"catalog": "read"}, {"catalog"}),
        ({"catalog": "read", "sku:{sku_id}": "write"}, {"catalog"}),
        # shelf:{shelf} renders "shelf:1"; a key two templates render is read only if both read it
        ({"shelf:{shelf}": "read"}, {"shelf:1"}),
    ],
)
def test_which_keys_a_call_reads(mode, read):
    assert _spec().read_keys((1, 1), {}, mode) == frozenset(read)


def test_a_key_two_templates_render_is_written_if_either_writes():
    spec = compile_key(["k:{a}", "k:{b}"], lambda a, b: None, "t")
    assert spec.keys((1, 1), {}) == ["k:1"]
    assert spec.read_keys((1, 1), {}, {"k:{a}": "read"}) == frozenset()
    assert spec.read_keys((1, 1), {}, {"k:{a}": "read", "k:{b}": "read"}) == {"k:1"}


@pytest.mark.parametrize(
    "value, error",
    [
        ("reader", "must be one of 'write', 'read'"),
        ({}, "empty dict"),
        ({"catalog": "shared"}, "'catalog': must be one of"),
        ({3: "read"}, "keys must be lock_key templates"),
    ],
)
def test_bad_modes_are_refused_with_what_to_write(value, error):
    with pytest.raises(ValueError, match=error):
        check_lock_mode(value)


def test_modes_that_cannot_apply_are_refused_at_registration():
    app = Celery("modes", broker="memory://")
    with pytest.raises(ConfigurationError, match="lock_mode names 'catalogue', which lock_key does not have"):
        @app.task(base=ZkLockedTask, lock_key=["sku:{sku_id}", "catalog"], lock_mode={"catalogue": "read"},
                  shared=False)
        def buy(sku_id):
            pass

        buy.lock_options()
    with pytest.raises(ConfigurationError, match="a semaphore of readers means nothing"):
        @app.task(base=ZkLockedTask, lock_key="k", lock_mode="read", lock_max_holders=3, shared=False)
        def many():
            pass

        many.lock_options()


@pytest.mark.parametrize(
    "nodes, max_holders, holds",
    [
        (["r", "r", "w", "r"], 1, [True, True, False, False]),
        (["w", "r", "r"], 1, [True, False, False]),
        (["kr", "r", "m"], 1, [True, True, False]),
        (["m", "m", "m"], 2, [True, True, False]),
    ],
)
def test_who_holds_as_status_reports_it(nodes, max_holders, holds):
    marker = {"r": "-__READ__", "w": "-__WRIT__", "kr": "__rlock__", "m": "-lock-"}
    names = [f"_c_x{i}{marker[kind]}{i:010d}" for i, kind in enumerate(nodes)]
    assert holding(names, max_holders) == holds


@pytest.fixture
def app(zk_server):
    app = Celery("modes", broker="memory://", backend="cache+memory://")
    app.conf.update(zklock_hosts=zk_server.hosts, zklock_root="/modes", zklock_session_timeout=4.0,
                    zklock_connect_timeout=1.0)
    return app


def _tasks_of(app, hold):
    """A reader and a writer of ``catalog``, each running ``hold(side)`` under its lock."""
    @app.task(base=ZkLockedTask, lock_key="catalog", lock_mode="read", shared=False)
    def read():
        hold("read")

    @app.task(base=ZkLockedTask, lock_key="catalog", shared=False)
    def write():
        hold("write")

    for task in (read, write):  # made now: Celery binds a task lazily, racily across threads
        task.lock_options()
    return {"read": read, "write": write}


def test_readers_share_a_key_writers_have_it_alone(app):
    """Direct calls in eight threads: readers of the key run together, a writer alone."""
    spans: list[tuple] = []

    def hold(side: str) -> None:
        lk = current_lock()
        assert lk.mode == side and lk.modes == {"catalog": side}
        start = time.monotonic()
        time.sleep(0.1)  # the hold
        spans.append((side, start, time.monotonic()))

    tasks = _tasks_of(app, hold)
    in_threads(lambda i: tasks["write" if i % 4 == 0 else "read"](), 8)
    assert len(spans) == 8
    assert not write_overlaps(spans)
    assert reads_shared(spans), "no two readers ran together"


def test_a_task_writes_one_key_and_reads_another(app, zk_client):
    """lock_mode per key: the sku written, the catalog read, beside an engine reader of the
    catalog; a writer of the catalog waits."""
    @app.task(base=ZkLockedTask, lock_key=["sku:{sku_id}", "catalog"], lock_mode={"catalog": "read"},
              lock_timeout=0.3, on_lock_timeout="skip", shared=False)
    def buy(sku_id):
        lk = current_lock()
        return lk.modes, lk.mode

    reader = ReadWriteLock(zk_client, "/modes/catalog")
    assert reader.read.acquire(timeout=5)
    try:
        assert buy(1) == ({"catalog": "read", "sku:1": "write"}, "write")
    finally:
        reader.read.release()
    writer = ReadWriteLock(zk_client, "/modes/catalog")
    assert writer.write.acquire(timeout=5)
    try:
        assert buy(1) is None  # skipped: a writer holds the catalog
    finally:
        writer.write.release()


def test_a_locked_call_inside_a_reader_may_read_but_not_write(app):
    @app.task(base=ZkLockedTask, lock_key="catalog", lock_mode="read", shared=False)
    def peek():
        return current_lock().mode

    @app.task(base=ZkLockedTask, lock_key="catalog", shared=False)
    def rebuild():
        return "rebuilt"

    @app.task(base=ZkLockedTask, lock_key="catalog", lock_mode="read", shared=False)
    def outer(inner: str):
        return {"peek": peek, "rebuild": rebuild}[inner]()

    assert outer("peek") == "read"
    with pytest.raises(LockUpgradeRefused, match="release the read lock first"):
        outer("rebuild")


@pytest.mark.parametrize("interop, marker", [("mutex", "-lock-"), ("read-write", "-__WRIT__")])
def test_a_writers_node_carries_the_names_of_the_curator_recipe_that_shares_the_key(app, zk_client, interop, marker):
    app.conf.zklock_curator_interop = interop

    @app.task(base=ZkLockedTask, lock_key="catalog", shared=False)
    def write():
        return zk_client.get_children(current_lock().path)

    @app.task(base=ZkLockedTask, lock_key="catalog", lock_mode="read", shared=False)
    def read():
        return zk_client.get_children(current_lock().path)

    (mine,), (theirs,) = write(), read()
    assert marker in mine and "-__READ__" in theirs


def test_a_delivery_that_may_be_a_copy_writes_the_keys_it_would_read(app):
    """Beside its original, still reading, a copy would run again; as a writer it waits for it."""
    from types import SimpleNamespace

    from celery_zklock.redelivery import COPY_HEADER

    @app.task(base=ZkLockedTask, lock_key=["sku:{sku_id}", "catalog"], lock_mode={"catalog": "read"}, shared=False)
    def buy(sku_id):
        pass

    assert buy.lock_read_paths((1,), {}) == {"/modes/catalog"}
    for copy in (SimpleNamespace(delivery_info={"redelivered": True}),
                 SimpleNamespace(delivery_info={}, request_dict={COPY_HEADER: True})):
        assert buy.lock_read_paths((1,), {}, request=copy) == frozenset()
    assert buy.lock_read_paths((1,), {}, request=SimpleNamespace(delivery_info={})) == {"/modes/catalog"}


def test_tasks_share_a_key_with_curators_read_write_lock(app, curators):
    """zklock_curator_interop = "read-write": a Java service's InterProcessReadWriteLock and
    our tasks (readers and writers, direct calls in three threads) on one key: no write
    overlaps any hold, and a task's read shares with Curator's."""
    app.conf.zklock_curator_interop = "read-write"
    curator = curators("/modes/catalog", lock="rw")
    spans: list[tuple] = []

    def hold(side: str) -> None:
        start = time.monotonic()
        time.sleep(0.01)  # the hold
        spans.append((side, start, time.monotonic(), "task"))

    tasks = _tasks_of(app, hold)
    plan = ["read", "read", "write"] * 6
    curator.hold_each(plan, 10)
    in_threads(lambda i: [tasks[side_of(i, j)]() for j in range(8)], 3)
    spans += curator.holds(plan)
    assert not write_overlaps(spans), write_overlaps(spans)[:3]
    assert len(spans) == 18 + 24
    assert reads_shared(spans, "task", "curator"), "no task read shared the key with a Curator read"
