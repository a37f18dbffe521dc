"""The README's quickstart, run as written against real ZooKeeper, Redis and a real worker;
and a quick flash sale (200 orders, two prefork workers) with its invariants."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def readme_section(title: str) -> str:
    with open(README) as f:
        text = f.read()
    m = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def code_blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\s*\n(.*?)^```", section, re.M | re.S)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_readme_quickstart_runs_as_written(tmp_path, zk_server, redis_server):
    run_readme_quickstart(tmp_path, zk_server, redis_server)


def run_readme_quickstart(tmp_path, zk_server, redis_server, python: str = sys.executable, path: str = ROOT) -> None:
    """The quickstart's files written as the README shows them, its worker and ``celery zklock``
    commands run with ``python`` (this checkout's on ``path``, or an installed wheel's with
    ``path=""``), its tasks called from here."""
    section = readme_section("Quickstart")
    blocks = code_blocks(section, "python")
    assert blocks, "no python code block under '## Quickstart'"
    files = {}
    for block in blocks:
        first = block.splitlines()[0].strip()
        rel = first[1:].strip() if first.startswith("#") and first.endswith(".py") else "proj/tasks.py"
        files[rel] = files.get(rel, "") + block
    assert "proj/tasks.py" in files
    for rel, source in files.items():
        # Only the addresses change: the README's Redis and ZooKeeper become the test servers.
        for old, new in (("127.0.0.1:6379", f"127.0.0.1:{redis_server.port}"), ("127.0.0.1:2181", zk_server.hosts)):
            if rel == "proj/tasks.py":
                assert old in source, f"quickstart no longer mentions {old}"
            source = source.replace(old, new)
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)

    commands = [shlex.split(line.split("#", 1)[0]) for block in code_blocks(section, "bash")
                for line in block.splitlines() if line.strip().startswith("celery ")]
    worker_cmd = next(c for c in commands if "worker" in c)
    node = f"quickstart-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(p) for p in (tmp_path, path) if p])}
    argv = [python, "-m", *worker_cmd, "-n", f"{node}@%h", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "-l", "info"]
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    sys.path.insert(0, str(tmp_path))
    try:
        tasks = importlib.import_module("proj.tasks")
        deadline = time.monotonic() + 30
        while not tasks.app.control.ping(destination=[f"{node}@{os.uname().nodename}"], timeout=0.5):
            assert worker.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "worker not ready:\n" + log.read_text()[-4000:]

        result = tasks.settle.delay(42).get(timeout=30)
        assert re.fullmatch(r"settled 42 with token \d+", result), result
        assert int(result.rsplit(" ", 1)[1]) > 0
        report = tasks.nightly_report.delay()
        assert report.get(timeout=30) is None and report.state == "SUCCESS"

        # the README's other commands: `celery -A proj.tasks zklock path order:42` and `... status`
        for cmd in (c for c in commands if "zklock" in c):
            out = subprocess.run([python, "-m", *cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
            if "path" in cmd:
                assert out.stdout.strip() == "/celery-zklock/order:42"
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m == "proj" or m.startswith("proj.")]:
            del sys.modules[name]
        _stop(worker)


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
