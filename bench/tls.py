"""Scenario: what TLS to ZooKeeper costs, side by side with plaintext, in one run.

Why: issue 14 asks for the engine and the Celery overhead benches over TLS.  A TLS-only
ZooKeeper (``secureClientPort``, Netty, client certificates required; certificates made
now) and a plaintext one run side by side; the same two measurements go to each:

* engine: uncontended ``FairLock`` acquire + release, one after another (p50 / p99 ms);
* Celery: bursts of trivial locked tasks on distinct keys through 2 workers x
  ``prefork -c 2`` (waiting in the worker), tasks/s, and the worker CPU per task.
"""

from __future__ import annotations

import json
import time

from celery_zklock.config import ZkSettings, check_setting
from celery_zklock.engine.client import connect, disconnect
from celery_zklock.engine.lock import FairLock
from celery_zklock.testing import TlsMaterial, ZooKeeperServer

from .infra import CostMeter, Services, Workers, log
from .lock_bench import percentile


def _engine(settings: ZkSettings, rounds: int) -> dict:
    client = connect(settings)
    try:
        samples = []
        for i in range(rounds):
            lock = FairLock(client, f"/bench-tls/k{i}", identifier="bench")
            t0 = time.perf_counter()
            lock.acquire()
            lock.release()
            samples.append((time.perf_counter() - t0) * 1000)
        samples = samples[rounds // 10:]  # warm-up
        return {"acquire_release_p50_ms": round(percentile(samples, 50), 3),
                "acquire_release_p99_ms": round(percentile(samples, 99), 3)}
    finally:
        disconnect(client)


def _celery(services: Services, driver, zk_hosts: str, use_ssl: dict | None, tasks: int) -> dict:
    env = {**services.env(), "BENCH_ZK_HOSTS": zk_hosts, "BENCH_ZK_USE_SSL": json.dumps(use_ssl) if use_ssl else ""}
    workers = Workers(env, count=2, concurrency=2)
    try:
        workers.start(driver.app)
        warm = driver.new_tag("tls-warm")
        driver.records(warm, sum(driver.publish("zklock", f"w-{warm}-{i}", warm) is not None for i in range(40)), 60)
        meter = CostMeter(services, workers)
        before = meter.snapshot()
        tag = driver.new_tag("tls")
        t0 = time.time()
        sent = sum(driver.publish("zklock", f"t-{tag}-{i}", tag) is not None for i in range(tasks))
        rows = driver.records(tag, sent, timeout=300)
        busy = max(r["done"] for r in rows) - t0
        cost = CostMeter.per_task(before, meter.snapshot(), len(rows))
    finally:
        workers.stop()
    return {"throughput_per_s": round(len(rows) / busy, 1), "cpu_workers_ms_per_task": cost["cpu_workers_ms_per_task"]}


def run(services: Services, driver, quick: bool) -> dict:
    rounds, tasks = (100, 150) if quick else (600, 600)
    material = TlsMaterial()
    tls_zk = ZooKeeperServer(tls=material).start()
    try:
        opts = material.client_options()
        plain_settings = ZkSettings(hosts=services.zk_hosts)
        tls_settings = ZkSettings(hosts=tls_zk.hosts, use_ssl=check_setting("zklock_use_ssl", opts, "bench"))
        out = {}
        for label, settings, use_ssl in (("plaintext", plain_settings, None), ("TLS (mutual)", tls_settings, opts)):
            log(f"  {label}: engine {rounds} acquire+release, Celery {tasks} tasks")
            out[label] = {"label": label, **_engine(settings, rounds),
                          **_celery(services, driver, settings.hosts, use_ssl, tasks)}
        p, t = out["plaintext"], out["TLS (mutual)"]
        return {
            "contenders": out,
            "engine_tls_vs_plain": round(t["acquire_release_p50_ms"] / p["acquire_release_p50_ms"], 2),
            "celery_tls_vs_plain": round(t["throughput_per_s"] / p["throughput_per_s"], 2),
        }
    finally:
        tls_zk.close()
        material.close()
