"""Three real ``celery beat`` processes with ZkScheduler and a real worker: the active beat is
taken down by SIGKILL, by SIGSTOP past its session, and by a network cut (each beat reaches
ZooKeeper through its own TCP proxy); every tick number is sent and run once, the next beat in
line takes over within session timeout + ZooKeeper's tick + one period, and a beat taken down
sends nothing after (examples/beat_elected/scenario.py does the run and the checks)."""

from __future__ import annotations

import importlib
import sys
import uuid

import pytest

from tests.tcpproxy import TcpProxy

SESSION = 2.0  # the test ZooKeeper's tickTime is 200 ms: sessions of 2 s are honoured


@pytest.fixture
def beat_env(zk_server, redis_server):
    run_id = uuid.uuid4().hex[:8]
    values = {"REDIS_URL": redis_server.url, "ZKLOCK_HOSTS": zk_server.hosts,
              "ZKLOCK_ROOT": f"/celery-zklock-beat-{run_id}", "ZKLOCK_DEMO_PREFIX": f"zklock-beat:{run_id}:"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in values.items():
            mp.setenv(k, v)
        name = "examples.beat_elected.app"
        if name in sys.modules:
            importlib.reload(sys.modules[name])  # its Store and app read the environment at import
        yield values


@pytest.mark.parametrize("faults", [("sigkill", "sigstop"), ("cut",)], ids=["sigkill-then-sigstop", "network-cut"])
def test_three_beats_send_each_tick_once_across_a_lost_leader(beat_env, zk_server, tmp_path, faults):
    from examples.beat_elected import scenario
    from examples.runtime import Report
    from support.workers import Procs

    proxies = [TcpProxy.to(zk_server.hosts) for _ in range(3)]
    report = Report()
    procs = Procs(beat_env, str(tmp_path))
    try:
        scenario.run(report, procs, faults=faults, session=SESSION, granularity=zk_server.tick_ms / 1000,
                     proxies=proxies)
    finally:
        procs.stop_all()
        for p in proxies:
            p.close()
    logs = "\n".join(f"--- {p.name}\n{p.log_tail(3000)}" for p in procs.items)
    assert report.ok, f"{report.render()}\n{logs}"
    values = {row.metric: row.value for row in report.rows}
    assert values["tick numbers sent twice"].startswith("0 of ")
    for fault in faults:
        assert values[f"{fault}: ticks sent by the old leader after the fault"] == "0"
