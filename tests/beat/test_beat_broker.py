"""The elected beat against its broker, with real beats, a worker, ZooKeeper and Redis: a
leader whose path to Redis stalls (ZooKeeper still reachable) gives way, and the tick it was
publishing, landing late, does not run after the next leader's (the workers' tick fence).

Each beat reaches Redis through its own byte proxy (tests/brokerproxy.py); the worker does not."""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import uuid
from collections import Counter

import pytest

from support.workers import Proc, Procs, wait_ready
from tests.brokerproxy import BrokerProxy
from tests.polling import wait_until

SESSION = 2.0  # the test ZooKeeper's tickTime is 200 ms


def _beat(procs: Procs, name: str, app: str = "examples.beat_elected.app", **env: str) -> Proc:
    """A ``celery beat`` of ``app`` with ZkScheduler, ``env`` added to the run's, once it has
    joined its group's election."""
    argv = [sys.executable, "-m", "celery", "-A", app, "beat", "-s", os.path.join(procs.logdir, f"{name}-schedule"),
            "-l", "info"]
    b = Proc(name, argv, {**procs.env, **env}, os.path.join(procs.logdir, f"{name}.log")).start()
    procs.items.append(b)
    wait_until(lambda: "joined the election" in b.log_tail(20000), 30, what=f"{name} in the election")
    return b


@pytest.fixture
def beat_env(zk_server, redis_server):
    run_id = uuid.uuid4().hex[:8]
    values = {"REDIS_URL": redis_server.url, "ZKLOCK_HOSTS": zk_server.hosts,
              "ZKLOCK_ROOT": f"/celery-zklock-beat-{run_id}", "ZKLOCK_DEMO_PREFIX": f"zklock-beatb:{run_id}:",
              "BEAT_ELECTED_SESSION_TIMEOUT": str(SESSION), "BEAT_ELECTED_GROUP": f"g{run_id}"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in values.items():
            mp.setenv(k, v)
        name = "examples.beat_elected.app"
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        yield values


def test_a_leader_stalled_in_its_publish_gives_way_and_its_late_tick_does_not_run(beat_env, redis_server, zk_server,
                                                                                    tmp_path):
    """Two beats.  The leader's path to Redis stalls for 12 s (its publish blocks; its
    ZooKeeper session stays alive).  The standby leads within session + tickTime + one period
    + the watchdog's third of a session (before: nobody sent anything for the whole stall);
    when the path heals, the old leader's stuck tick reaches the broker, after the new
    leader's ticks, and the workers do not run it.  No tick number runs twice."""
    from examples.beat_elected import app as m

    m.store.reset()
    r = m.store.r
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    db = redis_server.url.rsplit("/", 1)[1] if redis_server.url.count("/") > 2 else "0"
    proxies = [BrokerProxy(port) for _ in range(2)]
    procs = Procs(beat_env, str(tmp_path))
    try:
        w = procs.worker("examples.beat_elected.app", "beatbw", 2, loglevel="info")
        wait_ready(m.app, [w])
        beats = []
        for i, proxy in enumerate(proxies):
            beats.append(_beat(procs, f"bbeat{i + 1}-{procs.tag}", BROKER_URL=f"redis://127.0.0.1:{proxy.port}/{db}"))

        def sent() -> list[dict]:
            return [json.loads(x) for x in r.lrange(m.store.key("sent"), 0, -1)]

        def runs() -> list[dict]:
            return [json.loads(x) for x in r.lrange(m.store.key("runs"), 0, -1)]

        wait_until(lambda: len(runs()) >= 3, 30, what="three ticks run")
        leader = next(b for b in beats if b.pid == sent()[-1]["pid"])
        other = next(b for b in beats if b is not leader)
        proxies[beats.index(leader)].stall()
        t_stall = time.time()
        bound = SESSION + zk_server.tick_ms / 1000 + m.PERIOD + SESSION / 3
        took = wait_until(lambda: [s for s in sent() if s["pid"] == other.pid and s["at"] > t_stall], bound + 8,
                          what="the standby to send after the leader's broker path stalled")[0]["at"]
        ran_new = wait_until(lambda: [x for x in runs() if x["at"] > took], 10, what="the new leader's tick to run")
        time.sleep(max(0.0, t_stall + 12.0 - time.time()))  # the stall under test lasts 12 s
        proxies[beats.index(leader)].resume()
        wait_until(lambda: ") not run: " in w.log_tail(200000), 10, what="the stuck tick to land, and not run")
        seqs = Counter(x["seq"] for x in runs())
        assert took - t_stall <= bound + 1.0, f"handover took {took - t_stall:.1f}s (bound {bound:.1f}s)"
        twice = sorted(s for s, n in seqs.items() if n > 1)
        assert not twice, f"tick numbers run twice: {twice}"
        first_new = min(x["seq"] for x in ran_new)
        late = [x for x in runs() if x["at"] > took and x["seq"] < first_new]
        assert not late, f"a tick older than the new leader's ran after it: {late}"
        assert "stepping down so that another beat leads" in leader.log_tail(200000)
    finally:
        procs.stop_all()
        for p in proxies:
            p.close()


def test_a_publish_retried_after_its_reply_was_lost_runs_once(beat_env, redis_server, zk_server, tmp_path):
    """One beat, through a proxy to Redis that passes a tick's LPUSH on and loses its reply:
    Redis queued the message, and the beat's publish is retried (Celery's task_publish_retry,
    redis-py's own retries), so the broker holds the tick twice, with one task id.  The tick
    runs once (before: twice, with no error logged anywhere)."""
    from examples.beat_elected import app as m

    m.store.reset()
    r = m.store.r
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    db = redis_server.url.rsplit("/", 1)[1] if redis_server.url.count("/") > 2 else "0"
    procs = Procs(beat_env, str(tmp_path))
    with BrokerProxy(port) as proxy:
        try:
            w = procs.worker("examples.beat_elected.app", "beatrw", 2, loglevel="info")
            wait_ready(m.app, [w])
            _beat(procs, f"rbeat-{procs.tag}", BROKER_URL=f"redis://127.0.0.1:{proxy.port}/{db}")

            def runs() -> list[dict]:
                return [json.loads(x) for x in r.lrange(m.store.key("runs"), 0, -1)]

            wait_until(lambda: len(runs()) >= 2, 30, what="two ticks run")
            proxy.lose_reply(b"LPUSH")
            wait_until(lambda: proxy.replies_lost, 10, what="a tick's LPUSH with its reply lost")
            wait_until(lambda: len(runs()) >= 6, 20, what="ticks after the lost reply")
            wait_until(lambda: "not run: it already ran" in w.log_tail(200000), 10, what="the tick's second copy, not run")
            ids = Counter(x["id"] for x in runs())
            seqs = Counter(x["seq"] for x in runs())
            assert not [s for s, n in seqs.items() if n > 1], f"ticks run twice: {seqs}"
            assert not [i for i, n in ids.items() if n > 1]
            assert "not run: it already ran" in w.log_tail(200000), "the broker never held the tick twice"
        finally:
            procs.stop_all()


def test_a_leader_whose_clock_runs_a_minute_ahead_is_said_and_does_not_stop_its_successor(beat_env, zk_server,
                                                                                           tmp_path):
    """The leader's clock runs 60 s ahead of ZooKeeper's: it warns.  It is SIGKILLed; the next
    beat (a true clock) reads the records on ZooKeeper's clock and sends within session +
    tickTime + one period (before: nothing for about 60 s, and no word of why)."""
    import signal

    from examples.beat_elected import app as m

    m.store.reset()
    r = m.store.r
    procs = Procs(beat_env, str(tmp_path))
    try:
        w = procs.worker("examples.beat_elected.app", "beatkw", 2, loglevel="info")
        wait_ready(m.app, [w])
        beats = []
        for i, skew in enumerate(("60", "0")):
            beats.append(_beat(procs, f"kbeat{i + 1}-{procs.tag}", "tests.apps.beat_host", BEAT_CLOCK_SKEW=skew))

        def sent() -> list[dict]:
            return [json.loads(x) for x in r.lrange(m.store.key("sent"), 0, -1)]

        wait_until(lambda: len([s for s in sent() if s["pid"] == beats[0].pid]) >= 3, 30, what="the skewed leader's ticks")
        assert "clock differs from ZooKeeper's by +60" in beats[0].log_tail(100000)
        os.kill(beats[0].pid, signal.SIGKILL)
        killed = time.time()
        bound = SESSION + zk_server.tick_ms / 1000 + m.PERIOD
        first = wait_until(lambda: [s for s in sent() if s["pid"] == beats[1].pid], bound + 10,
                           what="the next beat's first tick")[0]["at"]
        assert first - killed <= bound + 1.0, f"the next beat sent {first - killed:.1f}s after the kill"
        assert "differed from this beat's by +60" in beats[1].log_tail(100000)
    finally:
        procs.stop_all()


def test_an_entry_only_a_standby_has_is_said_and_status_tells_leading_and_places(beat_env, zk_server, tmp_path):
    """Three beats; the last two have an entry the leader has not (a rolling deploy that added
    it): the leader warns, naming it (before: never sent, silently).  ``celery zklock status``
    says since when the leader leads (not when it joined: before, "active (33.7 s)" for a beat
    that had led for 2.5 s) and each standby's place in line."""
    import subprocess

    from examples.beat_elected import app as m

    m.store.reset()
    procs = Procs(beat_env, str(tmp_path))
    try:
        beats = []
        for i, extra in enumerate(("", "nightly-report", "nightly-report")):
            b = _beat(procs, f"ebeat{i + 1}-{procs.tag}", "tests.apps.beat_host", BEAT_EXTRA_ENTRY=extra)
            beats.append(b)
            if i == 0:
                wait_until(lambda b=b: "is now the active scheduler" in b.log_tail(20000), 30, what="the first to lead")
                time.sleep(3.0)  # it leads for a while: its join and its lead differ
        joined = time.monotonic()
        said = wait_until(lambda: "'nightly-report' is in the schedule of" in beats[0].log_tail(100000), 15,
                          what="the leader's warning of an entry it lacks")
        assert said
        time.sleep(max(0.0, joined + 12.0 - time.monotonic()))  # the standbys joined 12 s ago at least
        os.kill(beats[0].pid, 9)
        wait_until(lambda: "is now the active scheduler" in beats[1].log_tail(100000), 20, what="the next to lead")

        def status() -> str:  # once it tells the new leader and the standby's place (else "")
            out = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.beat_host", "zklock", "status"],
                                 env=procs.env, capture_output=True, text=True, timeout=60).stdout
            return out if "leads since" in out and "#1 in line" in out else ""

        out = wait_until(status, 20, interval=0.5, what="status to tell the new leader and the standby's place")
        active = next(line for line in out.splitlines() if "active" in line and "leads since" in line)
        led_for = float(active.split("(")[1].split("s)")[0])
        assert led_for < 8.0, out  # it joined over 12 s ago, and leads for a few seconds only
        assert "#1 in line" in out, out
    finally:
        procs.stop_all()


def test_a_deposed_leader_whose_publish_is_retried_after_the_next_leaders_tick_does_not_run_it(beat_env, redis_server,
                                                                                                 zk_server, tmp_path):
    """Two beats, each through its own proxies to Redis and ZooKeeper.  The leader's tick N
    reaches Redis and runs, but its reply is held; the leader is cut from ZooKeeper too, and
    steps down; the standby leads and sends tick N+1.  Then the held broker connection resets,
    and the old leader's publish retry sends tick N again, after N+1: it does not run (before:
    it ran a second time)."""
    from examples.beat_elected import app as m
    from tests.tcpproxy import TcpProxy

    m.store.reset()
    r = m.store.r
    port = int(redis_server.url.rsplit(":", 1)[1].split("/")[0])
    db = redis_server.url.rsplit("/", 1)[1] if redis_server.url.count("/") > 2 else "0"
    brokers = [BrokerProxy(port) for _ in range(2)]
    zks = [TcpProxy.to(zk_server.hosts) for _ in range(2)]
    procs = Procs(beat_env, str(tmp_path))
    try:
        w = procs.worker("examples.beat_elected.app", "beatdw", 2, loglevel="info")
        wait_ready(m.app, [w])
        beats = [_beat(procs, f"dbeat{i + 1}-{procs.tag}", BROKER_URL=f"redis://127.0.0.1:{brokers[i].port}/{db}",
                       ZKLOCK_HOSTS=zks[i].hosts) for i in range(2)]

        def sent() -> list[dict]:
            return [json.loads(x) for x in r.lrange(m.store.key("sent"), 0, -1)]

        def runs() -> list[dict]:
            return [json.loads(x) for x in r.lrange(m.store.key("runs"), 0, -1)]

        wait_until(lambda: len(runs()) >= 3, 30, what="three ticks run")
        leader = next(i for i, b in enumerate(beats) if b.pid == sent()[-1]["pid"])
        brokers[leader].hold_reply(b"LPUSH")
        wait_until(lambda: brokers[leader].replies_held, 10, what="the leader's tick with its reply held")
        held_seq = sent()[-1]["seq"]
        zks[leader].hold()  # and cut off from ZooKeeper: it loses the election
        other = beats[1 - leader]
        wait_until(lambda: [s for s in sent() if s["pid"] == other.pid], 20, what="the next leader's tick")
        wait_until(lambda: [x for x in runs() if x["seq"] > held_seq], 10, what="a later tick to run")
        brokers[leader].cut()  # the held connection resets: the old leader's publish is retried
        wait_until(lambda: f"beat tick {held_seq} of refresh-exchange-rates" in w.log_tail(200000), 10,
                   what="the retried tick at the worker, not run")
        zks[leader].release_held()
        seqs = Counter(x["seq"] for x in runs())
        assert not [s for s, n in seqs.items() if n > 1], f"ticks run twice: {seqs}"
        assert seqs[held_seq] == 1
        assert f"beat tick {held_seq} of refresh-exchange-rates" in w.log_tail(200000), "the retry never came"
    finally:
        procs.stop_all()
        for p in (*brokers, *zks):
            p.close()
