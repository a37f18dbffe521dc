"""Leave nothing behind (issue 61, item 7): a worker's stop -- warm, cold, or a SIGKILL of its
main process -- removes what its start made on disk: its lock agent's socket and private
directory (``/tmp/zklock-agent-*``) and its metrics directory (``/tmp/zklock-metrics-*``);
and a later start removes what a worker killed outright (main process and agent) left, and
never a live worker's.

The real-worker tests identify a worker's directories from the command lines of its agent
(``python -m celery_zklock.worker.agent SOCKET LEVEL``) and its metrics exporter (``python -m
celery_zklock.metrics DIR PORT PID``).  The others check the rules of the sweep at start
on directories made here, without workers."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid

import pytest

from celery_zklock import metrics
from celery_zklock.testing import free_port
from celery_zklock.worker import agent as agent_module
from celery_zklock.worker import agent_supervisor
from support.workers import Worker
from tests.lockedapp import in_pool
from tests.polling import wait_until
from tests.worker.local_agent import accepts


# ---------------------------------------------------------------------- helpers
def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode() for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _child_running(w: Worker, module: str) -> tuple[int, list[str]]:
    """The pid and argv of the worker's child running ``python -m module``."""
    for pid in w.child_pids():
        argv = _argv(pid)
        if argv[1:3] == ["-m", module]:
            return pid, argv
    raise AssertionError(f"{w.name} runs no {module}:\n{w.log_tail()}")


class Made:
    """What a worker's start made on disk, and the processes that use it."""

    def __init__(self, w: Worker) -> None:
        self.agent_pid, argv = _child_running(w, "celery_zklock.worker.agent")
        self.socket = argv[3]
        self.agent_dir = os.path.dirname(self.socket)
        self.exporter_pid, argv = _child_running(w, "celery_zklock.metrics")
        self.metrics_dir = argv[3]
        assert os.path.basename(self.agent_dir).startswith("zklock-agent-"), self.agent_dir
        assert os.path.basename(self.metrics_dir).startswith("zklock-metrics-"), self.metrics_dir
        assert os.path.exists(self.socket) and os.path.isdir(self.metrics_dir)

    def left(self) -> list[str]:
        return [p for p in (self.agent_dir, self.metrics_dir) if os.path.lexists(p)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _start(env, mod, name: str) -> Worker:
    w = Worker({**env, "TEST_ZK_METRICS_PORT": str(free_port())}, f"{name}-{uuid.uuid4().hex[:4]}", concurrency=1)
    return w.start(mod.app)


def _one_task(mod) -> None:
    """A locked task through the worker's agent (the agent and the metrics are used)."""
    mod.hold.delay(f"lnb-{uuid.uuid4().hex[:6]}", 10, "lnb").get(timeout=30)


def _kill_group(w: Worker) -> None:
    """SIGKILL whatever is left of the worker's process group (main, agent, pool, exporter)."""
    try:
        os.killpg(w.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    w.proc.wait(10)


# ---------------------------------------------------------------------- real workers
@pytest.mark.parametrize("how", ["warm", "cold"])
def test_a_stop_leaves_nothing_behind(mod, env, how):
    w = _start(env, mod, f"lnb-{how}")
    try:
        made = Made(w)
        _one_task(mod)
        if how == "warm":
            w.stop(signal.SIGTERM)
            assert w.proc.returncode == 0, w.log_tail()
        else:
            # Idle first: a SIGQUIT that lands while the main process reads a pool process's
            # result can hang Celery's cold shutdown for good (its handler stops the pool from
            # inside that read: _flush_outqueue waits for the rest of the message); then only
            # the SIGKILL after Proc.stop's grace ends it, and nothing of the worker's can
            # remove anything.
            wait_until(lambda: in_pool(mod.app, w.name) == set(), 10, "the worker idle: its pool's result read")
            w.stop(signal.SIGQUIT)
        assert made.left() == [], f"left behind after a {how} stop: {made.left()}\n{w.log_tail()}"
        wait_until(lambda: not _alive(made.agent_pid), 10, "the agent to exit")
    finally:
        w.kill()
        _kill_group(w)


def test_a_sigkill_of_the_main_process_leaves_nothing_behind(mod, env):
    """Its agent and metrics exporter notice that the worker is gone and remove its directories."""
    w = _start(env, mod, "lnb-kill")
    try:
        made = Made(w)
        _one_task(mod)
        os.kill(w.pid, signal.SIGKILL)
        w.proc.wait(10)
        wait_until(lambda: not made.left(), 15, f"the killed worker's directories to go ({made.left()})")
        wait_until(lambda: not _alive(made.agent_pid) and not _alive(made.exporter_pid), 10,
                   "the agent and the exporter to exit")
    finally:
        _kill_group(w)


def test_a_start_removes_what_a_killed_worker_left_and_spares_live_ones(mod, env):
    """Main process, agent and exporter SIGKILLed at once: nothing of them can clean up.  The next
    worker's start removes their directories, and leaves a live worker's alone."""
    live = _start(env, mod, "lnb-live")
    dead = _start(env, mod, "lnb-dead")
    later = None
    try:
        kept, gone = Made(live), Made(dead)
        _kill_group(dead)
        wait_until(lambda: not _alive(gone.agent_pid) and not _alive(gone.exporter_pid), 10,
                   "the killed worker's agent and exporter to exit")
        assert gone.left() == [gone.agent_dir, gone.metrics_dir]  # nothing of it could remove them
        later = _start(env, mod, "lnb-later")
        made = Made(later)
        assert gone.left() == [], f"a later start left the killed worker's {gone.left()}\n{later.log_tail()}"
        assert kept.left() == [kept.agent_dir, kept.metrics_dir] and accepts(kept.socket), "a live worker's went"
        _one_task(mod)
        for w in (live, later):
            w.stop(signal.SIGTERM)
        assert kept.left() == [] and made.left() == []
    finally:
        for w in (live, dead, later):
            if w is not None:
                w.kill()
                _kill_group(w)


# ---------------------------------------------------------------------- the sweep's rules, no workers
@pytest.fixture
def tmp_root(monkeypatch):
    """A temporary directory of our own as tempfile's (short: AF_UNIX paths are limited)."""
    root = tempfile.mkdtemp(prefix="lnb-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", root)
    monkeypatch.setattr(agent_supervisor, "RECHECK", 0.05)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _agent_dir(root: str, name: str, owner: str | None = None, sock: str | None = None) -> str:
    """A directory as a worker's start makes it: ``sock`` "refused" (bound, nobody listens) or
    "listening" (returned socket kept open by the caller through _listeners)."""
    d = os.path.join(root, name)
    os.mkdir(d, 0o700)
    if owner is not None:
        with open(os.path.join(d, agent_supervisor.OWNER), "w") as f:
            f.write(owner)
    if sock is not None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(os.path.join(d, "agent.sock"))
        if sock == "listening":
            s.listen(1)
            _listeners.append(s)
        else:
            s.close()
    return d


_listeners: list[socket.socket] = []


@pytest.fixture
def listeners():
    yield _listeners
    for s in _listeners:
        s.close()
    _listeners.clear()


def test_the_sweep_removes_only_dead_workers_agent_directories(tmp_root, listeners):
    me = agent_supervisor.process_record()
    dead = f"{_dead_pid()} -"
    reused = f"{os.getpid()} 1"  # our pid, another start time: the pid was reused
    gone = [
        _agent_dir(tmp_root, "zklock-agent-dead1", dead, "refused"),
        _agent_dir(tmp_root, "zklock-agent-dead2", dead),  # killed before its agent bound
        _agent_dir(tmp_root, "zklock-agent-reused", reused, "refused"),
        _agent_dir(tmp_root, "zklock-agent-legacy", None, "refused"),  # from before owner records
    ]
    kept = [
        _agent_dir(tmp_root, "zklock-agent-alive", me, "refused"),  # its agent restarts
        _agent_dir(tmp_root, "zklock-agent-serving", dead, "listening"),  # the agent serves pool processes still
        _agent_dir(tmp_root, "zklock-agent-legacylive", None, "listening"),
        _agent_dir(tmp_root, "zklock-agent-new"),  # just made: its owner is written next
        _agent_dir(tmp_root, "zklock-agent-unknown", "garbage", "refused"),
        _agent_dir(tmp_root, "zklock-agents-x", dead, "refused"),  # not ours
        _agent_dir(tmp_root, "other", dead, "refused"),
    ]
    odd = _agent_dir(tmp_root, "zklock-agent-odd", dead, "refused")
    open(os.path.join(odd, "something-else"), "w").close()  # not what a worker makes: left alone
    kept.append(odd)
    target = _agent_dir(tmp_root, "target", dead, "refused")
    os.symlink(target, os.path.join(tmp_root, "zklock-agent-link"))
    kept += [target, os.path.join(tmp_root, "zklock-agent-link")]

    agent_supervisor.sweep()

    assert [d for d in gone if os.path.lexists(d)] == []
    assert [d for d in kept if not os.path.lexists(d)] == []
    assert sorted(os.listdir(target)) == ["agent.sock", agent_supervisor.OWNER]


def test_the_sweep_spares_a_legacy_directory_whose_agent_restarts_meanwhile(tmp_root, monkeypatch):
    """A directory without owner record whose socket refuses is removed only if it still
    refuses, the same socket, a moment later: its worker may be restarting its agent."""
    d = _agent_dir(tmp_root, "zklock-agent-restarting", None, "refused")
    path = os.path.join(d, "agent.sock")
    real_sleep = agent_supervisor.time.sleep

    def restart(seconds):
        os.unlink(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)
        s.close()  # another socket (inode) than the one that refused
        real_sleep(seconds)

    monkeypatch.setattr(agent_supervisor.time, "sleep", restart)
    agent_supervisor.sweep()
    assert os.path.exists(path)


def test_an_agent_removes_its_directory_only_as_its_worker_is_gone(tmp_root):
    d = tempfile.mkdtemp(prefix="zklock-agent-")
    path = os.path.join(d, "agent.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    bound = os.lstat(path)
    with open(os.path.join(d, agent_supervisor.OWNER), "w") as f:
        f.write(agent_supervisor.process_record())
    s.close()
    # Another socket on the path (not the one this agent bound): not this agent's to remove.
    os.unlink(path)
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(path)
    agent_module.leave_nothing_behind(path, bound)
    assert os.path.exists(path)
    other.close()
    agent_module.leave_nothing_behind(path, os.lstat(path))
    assert not os.path.lexists(d)
    # A path outside a directory of ours (the tests' agents): only the socket goes.
    path = os.path.join(tmp_root, "agent.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    s.close()
    agent_module.leave_nothing_behind(path, os.lstat(path))
    assert not os.path.lexists(path) and os.path.isdir(tmp_root)


def test_the_agent_and_its_supervisor_name_the_owner_record_alike():
    assert agent_module.OWNER == agent_supervisor.OWNER


def test_the_sweep_removes_only_dead_workers_metrics_directories(tmp_root):
    def make(name: str, owner: str | None) -> str:
        d = os.path.join(tmp_root, name)
        os.mkdir(d, 0o700)
        open(os.path.join(d, "counter_123.db"), "w").close()
        if owner is not None:
            with open(os.path.join(d, metrics.OWNER), "w") as f:
                f.write(owner)
        return d

    gone = make("zklock-metrics-dead", f"{_dead_pid()} -")
    kept = [make("zklock-metrics-alive", metrics.process_record()),
            make("zklock-metrics-legacy", None),  # no owner record: not ours to judge
            make("zklock-metricsx", f"{_dead_pid()} -")]
    metrics.sweep()
    assert not os.path.lexists(gone)
    assert all(os.path.isdir(d) for d in kept)


def test_the_worker_keeps_its_agent_directory_for_a_restart_and_removes_it_at_its_stop(tmp_root, monkeypatch):
    from celery_zklock.config import ZkSettings

    proc = agent_supervisor.AgentProcess(ZkSettings(hosts="127.0.0.1:1"))
    folder = os.path.dirname(proc.path)
    assert folder.startswith(tmp_root + os.sep)
    proc._own_directory()  # at each (re)start: the directory, private, with our owner record
    assert sorted(os.listdir(folder)) == [agent_supervisor.OWNER]
    shutil.rmtree(folder)  # removed meanwhile (by anything): made again on the same path
    proc._own_directory()
    assert os.stat(folder).st_mode & 0o777 == 0o700
    with open(os.path.join(folder, agent_supervisor.OWNER)) as f:
        assert f.read() == agent_supervisor.process_record()
    os.chmod(folder, 0o755)  # not private any more: the agent does not listen there
    with pytest.raises(SystemExit):
        proc._own_directory()
    os.chmod(folder, 0o700)
    monkeypatch.setattr(agent_supervisor, "_agent", proc)
    monkeypatch.setattr(proc, "maker", os.getpid() + 1)  # a pool process (forked): never
    agent_supervisor.leave_nothing_behind()
    assert os.path.isdir(folder)
    monkeypatch.setattr(proc, "maker", os.getpid())
    agent_supervisor.leave_nothing_behind()
    assert not os.path.lexists(folder)
    agent_supervisor.leave_nothing_behind()  # twice (worker_shutdown, then at exit): no error


def test_the_worker_removes_the_metrics_directory_it_made_and_no_other(tmp_root, monkeypatch):
    monkeypatch.setattr(metrics, "_made", None)
    monkeypatch.setattr("atexit.register", lambda fn: fn)
    given = tempfile.mkdtemp(prefix="zklock-metrics-")  # as if PROMETHEUS_MULTIPROC_DIR named it
    metrics.leave_nothing_behind()
    assert os.path.isdir(given)
    made = metrics._make_dir()
    assert made.startswith(tmp_root + os.sep) and os.listdir(made) == [metrics.OWNER]
    monkeypatch.setattr(metrics, "_made", (made, os.getpid() + 1))  # a pool process (forked): never
    metrics.leave_nothing_behind()
    assert os.path.isdir(made)
    monkeypatch.setattr(metrics, "_made", (made, os.getpid()))
    metrics.leave_nothing_behind()
    assert not os.path.lexists(made) and os.path.isdir(given)

