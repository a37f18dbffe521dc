"""Scenario: one process waits on 1,000 keys at once, with a bounded number of threads.

Why: the worker-side lock agent (waiting outside the pool) must queue for thousands of
keys from one process.  The event-driven engine (:class:`celery_zklock.engine.internals.LockInternals`)
advances on ZooKeeper callbacks only, so the number of threads must not grow with the
number of waiters.  This scenario proves it on a real ZooKeeper:

1. a *holder* process (a separate interpreter, its own session) takes ``keys`` locks;
2. this process queues two waiters per key, W1 then W2 (2 x ``keys`` attempts), and
   counts its threads;
3. the holder releases everything; each W1 lets go as soon as it is granted, so W2 follows.

It checks that no waiter was granted while the holder held, that on every key W1 was
granted before W2 (FIFO) with a lower fencing token, and reports the thread count, the
time from the release command to the last grant, and grant latencies.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import uuid

from kazoo.client import KazooClient

from celery_zklock.engine.internals import LockInternals, State

from .stats import summary


def _paths(root: str, keys: int) -> list[str]:
    return [f"{root}/k{i}" for i in range(keys)]


def _take_all(client: KazooClient, paths: list[str]) -> list:
    attempts = [LockInternals(client, p, 1, b"holder").attempt(None) for p in paths]
    for a in attempts:
        if a.result.get(timeout=60) is not True:
            raise RuntimeError(f"holder could not take {a.lk.path}")
    return attempts


def hold(hosts: str, root: str, keys: int) -> None:
    """The holder process: take every key, say so, release on command."""
    client = KazooClient(hosts=hosts, timeout=10)
    client.start(timeout=15)
    attempts = _take_all(client, _paths(root, keys))
    print("HELD", flush=True)
    sys.stdin.readline()
    released = [a.release()[1] for a in attempts]
    for r in released:
        r.get(timeout=30)
    print("RELEASED", flush=True)
    client.stop()
    client.close()


def run(hosts: str, keys: int = 1000) -> dict:
    """Run the scenario against the ZooKeeper at ``hosts``; returns the figures."""
    root = f"/bench-many-keys-{uuid.uuid4().hex[:8]}"
    holder = subprocess.Popen(
        [sys.executable, "-m", "bench.many_keys", "--hold", hosts, root, str(keys)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    client = KazooClient(hosts=hosts, timeout=10)
    try:
        if holder.stdout.readline().strip() != "HELD":
            raise RuntimeError("holder process failed")
        client.start(timeout=15)
        threads_idle = threading.active_count()
        paths = _paths(root, keys)
        queued = threading.Semaphore(0)
        grants: dict[tuple[int, int], tuple[float, int]] = {}
        all_granted = threading.Event()
        lock = threading.Lock()
        first, second = [], []

        def granted(i: int, rank: int, attempt, result) -> None:
            now = time.time()
            if result.get() is not True:
                return
            with lock:
                grants[(i, rank)] = (now, attempt.token)
                if len(grants) == 2 * keys:
                    all_granted.set()
            if rank == 1:
                attempt.release()  # async: W2 on this key is next

        def start(i: int, rank: int):
            internals = LockInternals(client, paths[i], 1, f"W{rank}".encode())
            a = internals.attempt(None, on_wait=lambda _pos: queued.release())
            a.result.rawlink(lambda r, i=i, rank=rank, a=a: granted(i, rank, a, r))
            return a

        t0 = time.monotonic()
        first.append(start(0, 1))
        queued.acquire(timeout=60)
        # The baseline: one waiter.  A client's timer thread starts with its first lock (the
        # session monitor's reply watch runs while locks are subscribed): one per client.
        threads_one = threading.active_count()
        for i in range(1, keys):
            first.append(start(i, 1))
        for _ in range(keys - 1):
            queued.acquire(timeout=60)  # every W1 queued before any W2 is
        for i in range(keys):
            second.append(start(i, 2))
        for _ in range(keys):
            queued.acquire(timeout=60)
        queue_all_s = time.monotonic() - t0
        threads_waiting = threading.active_count()
        early = [a.lk.path for a in first + second if a.state is not State.WAITING]

        release_at = time.time()
        holder.stdin.write("go\n")
        holder.stdin.flush()
        if not all_granted.wait(120):
            raise RuntimeError(f"only {len(grants)} of {2 * keys} waiters were granted")
        threads_granted = threading.active_count()
        last_grant = max(t for t, _ in grants.values())
        fifo_violations = sum(
            1 for i in range(keys) if not (grants[(i, 1)][0] <= grants[(i, 2)][0] and grants[(i, 1)][1] < grants[(i, 2)][1])
        )
        granted_while_held = sum(1 for t, _ in grants.values() if t < release_at)
        holder.stdout.readline()
        for a in second:
            a.release()
        w1 = [grants[(i, 1)][0] - release_at for i in range(keys)]
        return {
            "keys": keys,
            "waiters": 2 * keys,
            "threads_idle_client": threads_idle,
            "threads_one_waiting": threads_one,
            "threads_with_all_waiting": threads_waiting,
            "threads_after_all_granted": threads_granted,
            "queue_all_waiters_s": round(queue_all_s, 3),
            "not_waiting_before_release": len(early),
            "granted_while_holder_held": granted_while_held,
            "fifo_violations": fifo_violations,
            "release_to_last_grant_s": round(last_grant - release_at, 3),
            **summary(w1, "w1_grant_after_release_"),
        }
    finally:
        client.stop()
        client.close()
        if holder.poll() is None:
            holder.kill()
        holder.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hold", nargs=3, metavar=("HOSTS", "ROOT", "KEYS"), help=argparse.SUPPRESS)
    parser.add_argument("--hosts", default="127.0.0.1:2181")
    parser.add_argument("--keys", type=int, default=1000)
    args = parser.parse_args(argv)
    if args.hold:
        hold(args.hold[0], args.hold[1], int(args.hold[2]))
        return 0
    print(json.dumps(run(args.hosts, args.keys), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
