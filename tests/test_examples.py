"""The README's quickstart, run as written against real ZooKeeper, Redis and a real worker;
and a quick flash sale (200 orders, two prefork workers) with its invariants."""

from __future__ import annotations

import importlib
import sys
import uuid

import pytest

from tests.quickstart import run_readme_quickstart


def test_readme_quickstart_runs_as_written(tmp_path, zk_server, redis_server):
    run_readme_quickstart(tmp_path, zk_server, redis_server)


@pytest.fixture(scope="module")
def example_env(zk_server, redis_server):
    """Environment of the example apps (read when a module is imported, and by workers)."""
    run_id = uuid.uuid4().hex[:8]
    values = {
        "REDIS_URL": redis_server.url,
        "ZKLOCK_HOSTS": zk_server.hosts,
        "ZKLOCK_ROOT": f"/celery-zklock-examples-{run_id}",
        "ZKLOCK_DEMO_PREFIX": f"zklock-test:{run_id}:",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in values.items():
            mp.setenv(k, v)
        yield values


@pytest.fixture(scope="module")
def flash_app(example_env):
    """examples.flash_sale.app configured for the test servers."""
    import warnings

    name = "examples.flash_sale.app"
    if name in sys.modules and sys.modules[name].app.conf.broker_url != example_env["REDIS_URL"]:
        with warnings.catch_warnings():  # re-registering the same task names on the new app
            warnings.simplefilter("ignore")
            return importlib.reload(sys.modules[name])
    return importlib.import_module(name)


def test_flash_sale_quick_run_keeps_its_invariants(example_env, flash_app, tmp_path):
    from examples.flash_sale import scenario
    from examples.runtime import Report
    from support.workers import Procs

    report = Report()
    procs = Procs(example_env, str(tmp_path))
    try:
        scenario.run(report, procs, orders=200, workers=2, concurrency=3, timeout=40)
    finally:
        procs.stop_all()
    rendered = report.render()
    logs = "\n".join(f"--- {p.name}\n{p.log_tail(2000)}" for p in procs.items)
    assert report.ok, f"{rendered}\n{logs}"
    values = {row.metric: row.value for row in report.rows}
    stock = sum(scenario.default_stock(200).values())
    assert values["orders accepted == initial stock"] == f"{stock} == {stock}"
    assert values["fenced-write rejections (stale token)"] == "0"
    assert values["final stock (all SKUs)"] == "0"
    assert values["orders processed, each exactly once"] == "200/200"
    assert all(not p.alive() for p in procs.items)


def test_fenced_write_rejects_stale_tokens_and_negative_stock(flash_app):
    """The flash sale's Lua script on its own: what makes a paused former holder harmless."""
    m = flash_app
    m.set_stock({"sku-x": 2})
    assert m.fenced_write("sku-x", 100, 1, "a") == ("ok", 1)
    assert m.fenced_write("sku-x", 100, 1, "a2") == ("ok", 1)  # same holder writing again
    assert m.fenced_write("sku-x", 99, 0, "stale") == ("fenced", 100)  # an older token: rejected
    assert m.fenced_write("sku-x", 101, -1, "oversell") == ("negative", 1)
    assert m.fenced_write("sku-x", 102, 0, "b") == ("ok", 0)
    r = m.store.r
    assert int(r.get(m.stock_key("sku-x"))) == 0
    assert r.hget(m.stats_key("sku-x"), "fenced_rejections") == b"1"
    assert r.hget(m.stats_key("sku-x"), "negative_rejections") == b"1"
    assert [x.decode() for x in r.lrange(m.orders_key("sku-x"), 0, -1)] == ["a@100", "a2@100", "b@102"]
