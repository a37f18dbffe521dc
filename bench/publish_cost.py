"""What one guarded publish costs, as a whole process: ``python -m bench.publish_cost N``.

Publishes ``N`` tasks on distinct keys (each queues: a guard is created and, since issue 40,
confirmed) and ``N`` on one key (the first queues, the rest are deduped and counted), with
``lock_enqueue="dedupe"``, to a queue no worker reads; prints the median ms of each.
Meant for ``farm-bench --vs`` between two checkouts, against the same ZooKeeper and Redis
(``BENCH_ZK_HOSTS``, ``BENCH_REDIS_URL``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import uuid

from celery import Celery

from celery_zklock import ZkLockedTask

app = Celery("publish-cost", set_as_current=False)
app.conf.update(broker_url=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
                zklock_hosts=os.environ.get("BENCH_ZK_HOSTS", "127.0.0.1:2181"), zklock_root="/bench-publish-cost")


@app.task(base=ZkLockedTask, lock_key="k:{k}", lock_enqueue="dedupe")
def job(k):
    return k


def main(n: int) -> None:
    tag = uuid.uuid4().hex[:8]
    queue = f"bench-publish-cost-{tag}"
    with app.connection() as conn:
        conn.default_channel.client.delete(queue)
        for shape in ("distinct", "same"):
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                job.apply_async((f"{tag}-{i}" if shape == "distinct" else f"{tag}-one",), queue=queue)
                times.append((time.perf_counter() - t0) * 1000)
            print(f"{shape}: p50 {statistics.median(times):.3f} ms over {n}")
        conn.default_channel.client.delete(queue)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 300)
