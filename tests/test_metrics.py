"""Prometheus metrics, scraped over HTTP from a real prefork worker while its tasks wait
for, hold and time out on their locks; the numbers must match what the test ran."""

from __future__ import annotations

import urllib.request
import uuid

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from celery_zklock.testing import free_port  # noqa: E402
from support.workers import Worker  # noqa: E402
from tests.lockutil import locked_app  # noqa: E402
from tests.polling import wait_until  # noqa: E402


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def metrics_worker(redis_server, zk_server):
    port = free_port()
    values = {"TEST_REDIS_URL": redis_server.url, "TEST_ZK_HOSTS": zk_server.hosts,
              "TEST_ZK_ROOT": f"/metrics-{uuid.uuid4().hex[:8]}", "TEST_ZK_SESSION": "4",
              "TEST_ZK_METRICS_PORT": str(port)}
    with locked_app(values) as mod:
        w = Worker(values, "metricsw", concurrency=3).start(mod.app)
        yield mod, w, port
        w.stop()


def test_scrape_matches_what_ran(metrics_worker):
    mod, w, port = metrics_worker
    key = f"m-{uuid.uuid4().hex[:6]}"
    hold = {"task": "tests.apps.locked.hold", "key": "k:{key}"}
    skip = {"task": "tests.apps.locked.hold_skip", "key": "k:{key}"}
    chain = [mod.hold.delay(key, 400, i) for i in range(5)]

    def one_holds_others_wait() -> dict:  # while the chain runs
        during = scrape(port)
        return during if value(during, "zklock_waiting", **hold) >= 2 and value(during, "zklock_holding", **hold) == 1 else {}

    wait_until(one_holds_others_wait, 10, interval=0.1, what="one holding and two or more waiting")
    skipped = [mod.hold_skip.delay(key) for _ in range(2)]  # 0.3 s timeout behind a 2 s chain
    for r in chain:
        r.get(timeout=30)
    assert [r.get(timeout=30) for r in skipped] == [None, None]  # skipped: SUCCESS, None

    def counted() -> dict:  # the pool processes' last counts reach the exporter a moment after the results
        after = scrape(port)
        done = value(after, "zklock_acquired_total", **hold) == 5 and value(after, "zklock_holding", **hold) == 0
        return after if done and value(after, "zklock_timeouts_total", **skip, policy="skip") == 2 else {}

    after = wait_until(counted, 10, interval=0.1, what="the runs counted")
    print("SCRAPE", {name: v for (name, labels), v in after.items() if name.startswith("zklock_") and "bucket" not in name})
    assert value(after, "zklock_acquired_total", **hold) == 5
    assert value(after, "zklock_wait_seconds_count", **hold) == 5
    assert value(after, "zklock_hold_seconds_count", **hold) == 5
    assert value(after, "zklock_hold_seconds_sum", **hold) >= 5 * 0.4
    assert value(after, "zklock_wait_seconds_sum", **hold) >= 0.4 * (1 + 2 + 3 + 4) * 0.9  # FIFO behind 400 ms holds
    assert value(after, "zklock_timeouts_total", **skip, policy="skip") == 2
    assert value(after, "zklock_waiting", **hold) == 0 and value(after, "zklock_holding", **hold) == 0
    assert not any(key in str(labels) for (_, labels) in after)  # key patterns, never raw keys


def test_a_metrics_port_already_taken_stops_the_worker_with_one_line(metrics_worker, redis_server, zk_server):
    """A second worker on the same host with the same ``zklock_metrics_port``: it stops at start
    with one line naming the port and what to do (before: a raw ``OSError: [Errno 98]``
    traceback from the exporter, then "ready", and no metrics served)."""
    mod, w, port = metrics_worker
    values = {"TEST_REDIS_URL": redis_server.url, "TEST_ZK_HOSTS": zk_server.hosts,
              "TEST_ZK_ROOT": f"/metrics-{uuid.uuid4().hex[:8]}", "TEST_ZK_SESSION": "4",
              "TEST_ZK_METRICS_PORT": str(port)}
    second = Worker(values, "metricsw2", concurrency=1).start()
    try:
        assert second.proc.wait(timeout=60) != 0
        log = second.log()
        assert f"zklock_metrics_port {port!r}: cannot serve metrics there (127.0.0.1:{port}: Address already in use)" \
            in log, log[-3000:]
        assert "Traceback" not in log and " ready." not in log, log[-3000:]
    finally:
        second.stop()
    assert scrape(port)  # the first worker's exporter still serves
