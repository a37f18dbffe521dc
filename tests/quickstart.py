"""The README's quickstart run as written: its files written from the README's code blocks,
its worker started and its ``celery zklock`` commands run, against the test servers.  Run from
this checkout (tests/test_examples.py) and from an installed wheel (tests/test_packaging.py)."""

from __future__ import annotations

import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import uuid

from tests.polling import wait_until

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


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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

        def ready():
            assert worker.poll() is None, log.read_text()[-4000:]
            return tasks.app.control.ping(destination=[f"{node}@{os.uname().nodename}"], timeout=0.5)

        wait_until(ready, 30, what=lambda: "the worker to be ready:\n" + log.read_text()[-4000:])

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
        stop(worker)
