"""Mutual exclusion, FIFO order, N holders and cleanup — many contenders, real ZooKeeper."""

from __future__ import annotations

import multiprocessing as mp
import random
import subprocess
import sys
import threading
import time

import pytest
from kazoo.client import KazooClient

from celery_zklock import FairLock, MultiLock
from celery_zklock.testing import four_letter_word
from tests.lockutil import overlapping
from tests.polling import wait_until


def test_overlap_checker_itself():
    assert overlapping([(0, 2), (1, 3)]) == 1
    assert overlapping([(0, 1), (1, 2)]) is None
    assert overlapping([(0, 3), (1, 2), (1.5, 4)], max_holders=2) == 1.5


def _hold_loop(hosts, path, rounds, hold, queue):
    """Child process: its own client; records (start, end) of every hold."""
    client = KazooClient(hosts=hosts)
    client.start()
    out = []
    for _ in range(rounds):
        lock = FairLock(client, path)
        lock.acquire()
        start = time.monotonic()
        time.sleep(hold)  # the hold
        end = time.monotonic()
        lock.release()
        out.append((start, end))
    client.stop()
    queue.put(out)


def test_mutual_exclusion_across_processes(zk_server):
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_hold_loop, args=(zk_server.hosts, "/t/mx-proc", 15, 0.003, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    intervals = [iv for _ in procs for iv in queue.get(timeout=60)]
    for p in procs:
        p.join(10)
    assert len(intervals) == 60
    assert overlapping(intervals) is None


def test_mutual_exclusion_across_threads_sharing_one_client(zk_client):
    intervals, lock_ = [], threading.Lock()

    def worker():
        for _ in range(15):
            with FairLock(zk_client, "/t/mx-thread"):
                start = time.monotonic()
                time.sleep(0.002)  # the hold
                end = time.monotonic()
            with lock_:
                intervals.append((start, end))

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(intervals) == 90
    assert overlapping(intervals) is None


def _wait_children(client, path, n, timeout=5.0):
    wait_until(lambda: len(client.get_children(path)) >= n, timeout, interval=0.005,
               what=lambda: f"{n} children of {path}: {client.get_children(path)}")


def test_fifo_order_of_arrival(zk_client, zk_server):
    path = "/t/fifo"
    holder = FairLock(zk_client, path)
    holder.acquire()
    order, threads, clients = [], [], []
    for i in range(8):
        c = KazooClient(hosts=zk_server.hosts)
        c.start()
        clients.append(c)

        def run(i=i, c=c):
            lk = FairLock(c, path)
            lk.acquire()
            order.append(i)
            time.sleep(0.002)  # the hold
            lk.release()

        t = threading.Thread(target=run)
        t.start()
        threads.append(t)
        _wait_children(zk_client, path, i + 2)  # i-th waiter queued before the next starts
    holder.release()
    for t in threads:
        t.join(10)
    for c in clients:
        c.stop()
    assert order == list(range(8))


@pytest.mark.parametrize("max_holders", [2, 3])
def test_max_holders_never_exceeded_with_out_of_order_releases(zk_server, max_holders):
    """Random hold times make holders release out of queue order and waiters time out:
    the case where watching only the node N places ahead would strand a waiter."""
    path = f"/t/sem{max_holders}"
    intervals, guard, stuck = [], threading.Lock(), []
    clients = [KazooClient(hosts=zk_server.hosts) for _ in range(3)]
    for c in clients:
        c.start()
    rnd = random.Random(max_holders)

    def worker(idx):
        c = clients[idx % len(clients)]
        for j in range(12):
            lk = FairLock(c, path, max_holders=max_holders)
            if not lk.acquire(timeout=0.05 if (idx + j) % 5 == 0 else 10):
                if (idx + j) % 5 != 0:
                    stuck.append(idx)
                continue
            start = time.monotonic()
            time.sleep(rnd.uniform(0.0, 0.012))  # the hold
            end = time.monotonic()
            lk.release()
            with guard:
                intervals.append((start, end))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in clients:
        c.stop()
    assert not stuck, "a waiter with a free slot ahead was never woken"
    assert overlapping(intervals, max_holders) is None
    # and the slots were really shared: at some moment max_holders ran together
    assert overlapping(intervals, max_holders - 1) is not None


def test_fencing_tokens_strictly_increase(zk_client):
    tokens = []
    for _ in range(10):
        with FairLock(zk_client, "/t/fence") as lk:
            tokens.append(lk.token)
    zk_client.delete("/t/fence", recursive=True)  # parent recreated below: tokens still grow
    for _ in range(5):
        with FairLock(zk_client, "/t/fence") as lk:
            tokens.append(lk.token)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)


def test_multilock_opposite_orders_do_not_deadlock(zk_server):
    clients = [KazooClient(hosts=zk_server.hosts) for _ in range(4)]
    for c in clients:
        c.start()
    done, intervals, guard = [], {"/t/ml/a": [], "/t/ml/b": []}, threading.Lock()

    def worker(i):
        paths = ["/t/ml/a", "/t/ml/b"] if i % 2 else ["/t/ml/b", "/t/ml/a"]
        for _ in range(10):
            m = MultiLock(clients[i], paths)
            assert m.acquire(timeout=20)
            start = time.monotonic()
            time.sleep(0.002)  # the hold
            end = time.monotonic()
            m.release()
            with guard:
                for p in paths:
                    intervals[p].append((start, end))
        done.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in clients:
        c.stop()
    assert sorted(done) == [0, 1, 2, 3]
    for iv in intervals.values():
        assert overlapping(iv) is None


def test_gevent_handler_exclusion(zk_server, tmp_path):
    """Run under gevent in a subprocess (monkey-patching must not leak into this process)."""
    script = tmp_path / "g.py"
    script.write_text(
        f"""
from gevent import monkey; monkey.patch_all()
import gevent, time
from kazoo.client import KazooClient
from kazoo.handlers.gevent import SequentialGeventHandler
from celery_zklock import FairLock
c = KazooClient(hosts={zk_server.hosts!r}, handler=SequentialGeventHandler())
c.start()
intervals = []
def w():
    for _ in range(10):
        with FairLock(c, '/t/gevent'):
            s = time.monotonic(); gevent.sleep(0.002); intervals.append((s, time.monotonic()))
gevent.joinall([gevent.spawn(w) for _ in range(5)], timeout=60)
c.stop()
intervals.sort()
ok = len(intervals) == 50 and all(a[1] <= b[0] for a, b in zip(intervals, intervals[1:]))
print('OK' if ok else f'BAD {{len(intervals)}}')
"""
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "OK", out.stdout + out.stderr


def _znode_count(server):
    for line in four_letter_word("127.0.0.1", server.client_port, "mntr").splitlines():
        if line.startswith("zk_znode_count"):
            return int(line.split()[1])
    raise AssertionError("no zk_znode_count in mntr")


def test_parents_of_finished_keys_do_not_accumulate(zk_server):
    """10,000 distinct keys: parent znodes are containers the server removes when empty."""
    client = KazooClient(hosts=zk_server.hosts)
    client.start()
    client.ensure_path("/t/many")
    baseline = _znode_count(zk_server)

    def run(start):
        for i in range(start, 10_000, 4):
            lk = FairLock(client, f"/t/many/key-{i}")
            lk.acquire()
            lk.release(wait=False)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    try:  # the server reaps empty containers on its own schedule
        wait_until(lambda: _znode_count(zk_server) <= baseline + 50, 30, interval=0.2,
                   what=lambda: f"the finished keys' parents reaped: {baseline} znodes before, {_znode_count(zk_server)} now")
    finally:
        client.stop()


def test_semaphore_waiter_woken_when_a_node_between_it_and_its_watch_leaves(zk_client):
    """Queue A B C D E with max_holders=2: D gives up, then B releases.  C must now hold.
    A waiter that watched only the node N places ahead (C watches A) would sleep on."""
    path = "/t/sem-window"
    a, b = FairLock(zk_client, path, max_holders=2), FairLock(zk_client, path, max_holders=2)
    assert a.acquire() and b.acquire()
    waiters = {name: FairLock(zk_client, path, max_holders=2) for name in "CDE"}
    threads = {}
    for i, (name, lk) in enumerate(waiters.items()):
        threads[name] = threading.Thread(target=lk.acquire, daemon=True)
        threads[name].start()
        _wait_children(zk_client, path, 3 + i)
    waiters["D"].cancel()
    threads["D"].join(5)
    b.release()
    threads["C"].join(3)
    assert waiters["C"].is_held(), "C was not woken although a slot was free"
    assert not waiters["E"].is_held()
    a.release()
    threads["E"].join(3)
    assert waiters["E"].is_held()
    waiters["C"].release(), waiters["E"].release()
