"""ZkScheduler in this process against a real ZooKeeper (Celery's in-memory broker): who sends,
the conditional tick write, a graceful handover, and ZooKeeper unreachable at start."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid

import pytest

from celery_zklock.beat import ZkScheduler, group_path
from celery_zklock.beat.ledger import Ledger
from celery_zklock.beat.rules import TickRecord, TickState, Written
from celery_zklock.beat.status import beat_report
from celery_zklock.errors import LockUnavailable
from tests.beat.running import TASK, Running, make_app
from tests.polling import holds_for, wait_until


@pytest.fixture
def root():
    return f"/beat-{uuid.uuid4().hex[:8]}"


def leader_and_standby(hosts: str, root: str) -> tuple[Running, Running]:
    """Two schedulers of one group: the first leads (it joined first), the second stands by."""
    a = Running(make_app(hosts, root))
    wait_until(lambda: a.scheduler.election.term() is not None, what="the first to lead")
    return a, Running(make_app(hosts, root))


def test_one_leader_sends_and_the_next_continues_its_ticks(zk_server, zk_client, root, sends):
    a, b = leader_and_standby(zk_server.hosts, root)
    try:
        wait_until(lambda: len(sends) >= 4, what="4 ticks sent")
        assert {who for who, _, _ in sends} == {a.ident}, "the standby sent"
        assert b.scheduler.election.term() is None
        report = beat_report(zk_client, root)["default"]  # what `celery zklock status` shows
        assert [(x["role"], x["pid"]) for x in report["beats"]] == [("active", os.getpid()), ("standby", os.getpid())]
        assert report["ticks"]["job"]["seq"] >= 4 and report["ticks"]["job"]["state"] == "sent"
        closed_at = time.monotonic()
        a.close()  # graceful: its election node goes at once
        wait_until(lambda: any(who == b.ident for who, _, _ in sends), 5.0, what="the standby to send")
        wait_until(lambda: sum(who == b.ident for who, _, _ in sends) >= 3, what="3 ticks sent by the standby")
    finally:
        a.close()
        b.close()
    seqs = [seq for _, seq, _ in sends]
    assert seqs == list(range(1, len(seqs) + 1)), seqs  # each tick once, none lost, across the handover
    first_b = min(t for who, _, t in sends if who == b.ident)
    assert first_b - closed_at < 2.0  # a graceful handover does not wait for the session to expire


def test_a_leader_whose_election_node_is_deleted_stops_sending(zk_server, zk_client, root, sends):
    a, b = leader_and_standby(zk_server.hosts, root)
    try:
        wait_until(lambda: len(sends) >= 2, what="2 ticks sent")
        zk_client.delete(a.scheduler.election.node)  # an operator, or a session ZooKeeper ended
        deleted_at = time.monotonic()
        wait_until(lambda: sum(who == b.ident for who, _, _ in sends) >= 3, what="3 ticks sent by the standby")
    finally:
        a.close()
        b.close()
    late = [(seq, round(t - deleted_at, 3)) for who, seq, t in sends if who == a.ident and t > deleted_at]
    assert late == []
    seqs = [seq for _, seq, _ in sends]
    assert len(seqs) == len(set(seqs)), seqs


def test_the_tick_write_proves_leadership_and_detects_a_second_writer(zk_server, zk_client, root):
    """The ledger's multi: applied only while the writer's election node exists and only at the
    version it read, so a deposed leader's write and a racing one both fail."""
    from celery_zklock.config import load_settings
    from celery_zklock.engine.client import connect

    settings = load_settings(make_app(zk_server.hosts, root).conf)
    c1, c2 = connect(settings), connect(settings)
    try:
        path = group_path(root, "g")
        zk_client.ensure_path(f"{path}/leader")
        node = zk_client.create(f"{path}/leader/n-", b"", ephemeral=True, sequence=True)
        l1, l2 = Ledger(c1, path, 2.0), Ledger(c2, path, 2.0)
        l1.load()
        l2.load()
        tick = TickRecord(last_run_at=_now(), due=_now(), seq=1, runs=1, state=TickState.SENDING, by="t", token=1,
                          nonce="a")
        assert l1.write("job", tick, node) is Written.RECORDED
        assert l2.write("job", tick, node) is Written.CONFLICT  # created since its read
        assert l2.refresh("job") == tick
        assert l1.write("job", tick.sent(), node) is Written.RECORDED
        assert l2.write("job", tick, node) is Written.CONFLICT  # a version behind
        zk_client.delete(node)
        l2.refresh("job")
        assert l2.write("job", tick, node) is Written.DEPOSED
        assert l2.refresh("job").state is TickState.SENT  # untouched by the deposed write
    finally:
        c1.stop(), c2.stop()


def _now():
    from datetime import datetime, timezone

    return datetime.now(timezone.utc)


def _dead_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"127.0.0.1:{port}"


def test_zookeeper_unreachable_at_start_fails_loudly_with_policy_fail(root):
    app = make_app(_dead_port(), root, zklock_on_unavailable="fail", zklock_connect_timeout=0.5)
    with pytest.raises(LockUnavailable, match="zklock_hosts=.*zklock_on_unavailable='fail'"):
        ZkScheduler(app=app)


def test_zookeeper_unreachable_at_start_stands_by_with_policy_retry(root, sends, caplog):
    app = make_app(_dead_port(), root, zklock_on_unavailable="retry", zklock_connect_timeout=0.5,
                   zklock_retry_countdown=0.2)
    with caplog.at_level(logging.ERROR, logger="celery.beat.zklock"):
        s = ZkScheduler(app=app)
        try:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                s.tick()
        finally:
            s.close()
    assert sends == []
    assert "standing by" in caplog.text or "stands by" in caplog.text
    assert "zklock_hosts" in caplog.text


def test_the_wrapped_scheduler_is_named_by_a_setting_and_checked(zk_server, root):
    from celery_zklock.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="zklock_beat_scheduler.*cannot be imported"):
        ZkScheduler(app=make_app(zk_server.hosts, root, zklock_beat_scheduler="nowhere:Nothing"), lazy=True)
    with pytest.raises(ConfigurationError, match="ZkScheduler itself"):
        ZkScheduler(app=make_app(zk_server.hosts, root, zklock_beat_scheduler="celery_zklock.beat:ZkScheduler"), lazy=True)
    with pytest.raises(ConfigurationError, match="zklock_beat_grop.*zklock_beat_group"):  # a typo is not a default
        ZkScheduler(app=make_app(zk_server.hosts, root, zklock_beat_grop="sales"), lazy=True)
    lazy = ZkScheduler(app=make_app(zk_server.hosts, root), lazy=True)  # beat's banner: no connection
    assert lazy.election is None and "one active beat of group 'default'" in lazy.info


def test_the_beat_metrics_say_leader_and_count_ticks(zk_server, root, sends):
    import urllib.request

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    a = Running(make_app(zk_server.hosts, root, zklock_beat_metrics_port=port))
    try:
        wait_until(lambda: len(sends) >= 2, what="2 ticks sent")
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        a.close()
    assert 'zklock_beat_leader{group="default"} 1.0' in text
    sent = [line for line in text.splitlines() if line.startswith('zklock_beat_ticks_total{group="default",outcome="sent"}')]
    assert sent and float(sent[0].split()[-1]) >= 2


def test_a_failed_publish_is_said_and_never_sent_twice(zk_server, root, sends, caplog):
    """At most once: a publish that raised is logged with its tick number and not retried (the
    broker may have taken it); the next due time is the next tick."""
    app = make_app(zk_server.hosts, root)
    task = app.tasks[TASK]
    publish = task.apply_async

    def failing_once(*args, **options):  # the broker refuses tick 2's message (after the signal saw it)
        result = publish(*args, **options) if options["headers"]["zklock_beat"]["seq"] != 2 else None
        if result is None:
            raise ConnectionError("broker gone for this one publish")
        return result

    task.apply_async = failing_once
    with caplog.at_level(logging.ERROR, logger="celery.beat.zklock"):
        a = Running(app)
        try:
            wait_until(lambda: len(sends) >= 3, what="3 ticks sent")
        finally:
            a.close()
    seqs = [seq for _, seq, _ in sends]
    assert 2 not in seqs and seqs[:2] == [1, 3], seqs  # tick 2 lost and said, never sent late
    assert len(seqs) == len(set(seqs))
    assert "tick 2 of job not sent" in caplog.text


def test_a_tick_whose_reply_was_lost_is_published_when_the_same_beat_leads_again(zk_server, root, sends,
                                                                                   monkeypatch):
    """Tick 3's write reaches ZooKeeper but its reply is lost, and the connection stays down
    past a third of the session: the election node is given up and this beat, alone in its
    group, leads again in a new term.  Its own record of tick 3 is still the last: the tick is
    written again and published, neither lost nor sent twice."""
    from tests.tcpproxy import OP_MULTI, TcpProxy

    with TcpProxy.to(zk_server.hosts) as proxy:
        cuts = []
        write = Ledger.write

        def cut_at_tick_3(self, name, record, leader_node, **kw):  # the real write, on a real connection cut
            if record.seq == 3 and record.state is TickState.SENDING and not cuts:
                cuts.append(proxy.arm_cut(opcodes=(OP_MULTI,), forward=True, then_hold=True))
            return write(self, name, record, leader_node, **kw)

        monkeypatch.setattr(Ledger, "write", cut_at_tick_3)
        a = Running(make_app(proxy.hosts, root))
        try:
            wait_until(lambda: cuts and cuts[0].fired.is_set(), what="tick 3's write cut")
            assert cuts[0].reply_err == 0  # applied: the record of tick 3 is there, its reply is not
            term = a.scheduler.election.term()
            time.sleep(1.0)  # 2 s session: past its third (the lock lets go), short of its end
            proxy.release_held()
            wait_until(lambda: len(sends) >= 5, 15.0, what=lambda: f"5 ticks sent: {sends}")
            assert a.scheduler.election.term() != term
        finally:
            a.close()
    seqs = [seq for _, seq, _ in sends]
    assert seqs == list(range(1, len(seqs) + 1)), seqs


def test_the_publish_window_follows_the_session_timeout_the_server_granted(short_session_server, root, sends,
                                                                            caplog, monkeypatch):
    """Asked for 2 s, granted 0.4 s (the server's maxSessionTimeout): a write's proof is good
    for a third of 0.4 s, and each ledger request is bounded by that too.  A reply that comes
    0.3 s after its request (a slow network) withholds the tick: a third of the request
    (0.67 s) would publish it after the session may have expired."""
    write = Ledger.write

    def slow_reply(self, *args, **kw):
        written = write(self, *args, **kw)
        time.sleep(0.3)  # the slow network under test: the reply comes 0.3 s after its request
        return written

    monkeypatch.setattr(Ledger, "write", slow_reply)
    with caplog.at_level(logging.WARNING, logger="celery.beat.zklock"):
        a = Running(make_app(short_session_server.hosts, root))
        try:
            wait_until(lambda: sends or "not sent (stale)" in caplog.text, what="a tick sent or withheld")
            timeout = a.scheduler.ledger.timeout
        finally:
            a.close()
    assert sends == []
    assert timeout == pytest.approx(0.4 / 3)


def test_loading_the_ledger_while_zookeeper_is_unreachable_is_bounded(zk_server, root):
    """A new leader's first step reads every record; its ``ensure_path`` of the records' parent
    had no bound, so a connection lost just then held beat's whole loop (no inner tick, no
    metrics) until ZooKeeper came back.  Every request of the ledger is bounded by its timeout."""
    from kazoo.client import KazooClient

    from tests.tcpproxy import TcpProxy

    with TcpProxy.to(zk_server.hosts) as proxy:
        client = KazooClient(hosts=proxy.hosts, timeout=10.0)
        client.start(timeout=10)
        outcome: list = []
        try:
            ledger = Ledger(client, group_path(root, "g"), 0.5)
            proxy.hold()  # the connection drops; reconnections are parked
            started = time.monotonic()

            def load() -> None:
                try:
                    ledger.load()
                    outcome.append("loaded")
                except Exception as exc:
                    outcome.append(exc)
                outcome.append(time.monotonic() - started)

            loader = threading.Thread(target=load, daemon=True)
            loader.start()
            loader.join(3.0)
            assert outcome and isinstance(outcome[0], Exception), f"load() still blocked after 3 s: {outcome}"
            assert outcome[1] < 2.0
        finally:
            proxy.release_held()
            client.stop()
            client.close()


def test_a_late_word_of_an_ended_term_does_not_end_the_next(zk_server, root, sends):
    """A term's end is often told twice (the election node's watch, then a tick write that
    found the node gone); the second word may come after the beat has queued again and leads a
    new term.  It ended that new term at once: a needless handover, a gap with no leader."""
    beat = Running(make_app(zk_server.hosts, root))
    try:
        election = beat.scheduler.election
        wait_until(lambda: election.term() == 1, what="term 1")
        first = election._lock
        election.step_down("the first word of the end")
        wait_until(lambda: election.term() == 2, what="term 2")
        first.on_lost(first)  # the late word, from the first term's lock
        holds_for(lambda: election.term() == 2, 2.0, what="term 2 (a late word ended it)")
    finally:
        beat.close()
