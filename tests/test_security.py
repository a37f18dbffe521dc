"""ZooKeeper security against real servers: mutual TLS (a TLS-only ensemble member whose
certificates are made at test time), digest ACLs on every node we create, and the clear
errors for each way a secure setup can be wrong."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionClosedError, NoAuthError, NoNodeError
from kazoo.recipe.lock import Lock
from kazoo.security import Permissions

from celery_zklock import FairLock, LockUnavailable
from celery_zklock.config import SETTINGS, ZkSettings, check_setting, load_settings
from celery_zklock.engine.client import close_clients, connect, disconnect, get_client
from celery_zklock.engine.kazoo_compat import closed_for_good
from celery_zklock.errors import ConfigurationError
from celery_zklock.testing import TlsMaterial, ZooKeeperServer
from support.workers import Worker
from tests.beat.running import Running, make_app
from tests.lockedapp import started_pid
from tests.lockutil import children, locked_app, overlapping, worker_refuses
from tests.polling import holds_for, wait_until
from tests.tcpproxy import TcpProxy
from tests.versions import at_least

OP_SASL = 102  # ZooKeeper's opcode of a SASL handshake's packets

SECRET = "hunter2-not-in-logs"


@pytest.fixture(scope="module")
def tls():
    material = TlsMaterial()
    yield material
    material.close()


@pytest.fixture(scope="module")
def tls_zk(tls):
    server = ZooKeeperServer(tls=tls).start()
    yield server
    server.close()


def _settings(hosts: str, **values) -> ZkSettings:
    return ZkSettings(hosts=hosts, connect_timeout=3.0, session_timeout=4.0,
                      **{k: check_setting(f"zklock_{k}", v, k) for k, v in values.items()})


# ------------------------------------------------------------------ TLS, client side
def test_locks_over_mutual_tls(tls, tls_zk):
    client = connect(_settings(tls_zk.hosts, use_ssl=tls.client_options()))
    try:
        path = client.create("/tls-probe", b"", ephemeral=True)
        assert client.exists(path)
    finally:
        disconnect(client)


def test_encrypted_client_key_with_its_password(tls, tls_zk):
    opts = {**tls.client_options(), "keyfile": tls.client_key_encrypted, "keyfile_password": tls.KEY_PASSWORD}
    disconnect(connect(_settings(tls_zk.hosts, use_ssl=opts)))


@pytest.mark.parametrize(
    "case, expected",
    [
        ("plaintext", r"speaks TLS: set zklock_use_ssl"),
        ("no client certificate", r"requires a client certificate: set zklock_use_ssl\['certfile'\]"),
        ("wrong CA", r"does not verify against zklock_use_ssl\['ca'\]='[^']*rogue-ca.pem'"),
        ("certificate of another CA", r"rejected the client certificate zklock_use_ssl\['certfile'\]='[^']*rogue-client.pem'"),
        ("wrong key password", r"cannot load the client certificate .*wrong keyfile_password"),
    ],
)
def test_each_tls_mistake_gets_its_own_message(tls, tls_zk, case, expected):
    opts = {
        "plaintext": None,
        "no client certificate": {"ca": tls.ca},
        "wrong CA": {**tls.client_options(), "ca": tls.rogue_ca},
        "certificate of another CA": {"ca": tls.ca, "certfile": tls.rogue_cert, "keyfile": tls.rogue_key},
        "wrong key password": {**tls.client_options(), "keyfile": tls.client_key_encrypted, "keyfile_password": "nope"},
    }[case]
    settings = _settings(tls_zk.hosts, use_ssl=opts) if opts else _settings(tls_zk.hosts)
    with pytest.raises(LockUnavailable, match=expected) as info:
        connect(settings)
    assert "nope" not in str(info.value) and tls.KEY_PASSWORD not in str(info.value)


def test_tls_to_a_plaintext_server_says_so(tls, zk_server):
    with pytest.raises(LockUnavailable, match="does not speak TLS"):
        connect(_settings(zk_server.hosts, use_ssl=tls.client_options()))


@pytest.mark.parametrize(
    "value, expected",
    [
        ({"ca": "/nonexistent/ca.pem"}, r"'ca' file '/nonexistent/ca.pem' does not exist"),
        ({"cafile": "/x"}, r"unknown TLS option 'cafile'. Did you mean 'ca'\?"),
        ({"ca_certs": "/x", "cert_reqs": 2}, r"unknown TLS option 'ca_certs'. Did you mean 'ca'\?"),  # broker_use_ssl's names
        ({"verify_certs": "yes"}, r"'verify_certs' must be True or False"),
        ("tls", r"must be True, False, or a dict"),
        ({"keyfile": "/etc/hostname"}, r"'keyfile' needs its 'certfile'"),
    ],
)
def test_bad_use_ssl_values_stop_at_load(value, expected):
    from celery import Celery

    app = Celery(set_as_current=False)
    app.conf.zklock_use_ssl = value
    with pytest.raises(ConfigurationError, match=r"setting zklock_use_ssl: .*" + expected):
        load_settings(app.conf)


def test_secrets_are_never_shown():
    settings = _settings("127.0.0.1:1", auth_secret=[("digest", f"u:{SECRET}")],
                         sasl_options={"mechanism": "DIGEST-MD5", "username": "u", "password": SECRET})
    assert SECRET not in repr(settings)
    for name, bad in (("zklock_sasl_options", {"mechanism": "DIGEST-MD5", "username": "u", "password": SECRET, "pw": 1}),
                      ("zklock_use_ssl", {"keyfile_password": SECRET, "cafile": "x"})):
        with pytest.raises(ConfigurationError) as info:
            check_setting(name, bad, name)
        assert SECRET not in str(info.value)
    # Celery's own censoring (`celery inspect conf`) reaches into these dicts by key name.
    from celery.app.utils import filter_hidden_settings

    shown = filter_hidden_settings({"zklock_sasl_options": {"password": SECRET},
                                    "zklock_use_ssl": {"keyfile_password": SECRET}, "zklock_auth_secret": [SECRET]})
    assert SECRET not in json.dumps(shown)


def test_every_security_setting_is_declared_once():
    assert {"zklock_use_ssl", "zklock_sasl_options", "zklock_acl"} <= set(SETTINGS)


# ------------------------------------------------------------------ real workers
@pytest.fixture(scope="module")
def secure_env(redis_server, tls, tls_zk):
    values = {
        "TEST_REDIS_URL": redis_server.url,
        "TEST_ZK_HOSTS": tls_zk.hosts,
        "TEST_ZK_ROOT": f"/sec-{uuid.uuid4().hex[:8]}",
        "TEST_ZK_SESSION": "4",
        "TEST_ZK_USE_SSL": json.dumps(tls.client_options()),
        "TEST_ZK_AUTH_SECRET": json.dumps([["digest", f"worker:{SECRET}"]]),
    }
    with locked_app(values) as mod:  # later modules reload the app without TLS
        yield values, mod


def _admin(tls, tls_zk, auth: bool) -> KazooClient:
    client = KazooClient(tls_zk.hosts, use_ssl=True, **tls.client_options(),
                         auth_data=[("digest", f"worker:{SECRET}")] if auth else None)
    client.start(timeout=10)
    return client


def test_worker_over_mutual_tls_with_acls_keeps_exclusion_against_an_intruder(secure_env, tls, tls_zk):
    """Locked tasks run through a real worker over TLS with digest credentials.  Another
    client on the ensemble without those credentials can list the queue but can neither
    delete nor overwrite the holder's node; the holder keeps its lock and ends SUCCESS."""
    env, mod = secure_env
    mod._r.delete("history", "arrivals")
    w = Worker(env, "tls1", concurrency=3).start(mod.app)
    intruder = _admin(tls, tls_zk, auth=False)
    try:
        key = f"sec-{uuid.uuid4().hex[:6]}"
        holder = mod.hold.delay(key, 2000, "holder")
        rest = [mod.hold.delay(key, 20, f"w{i}") for i in range(4)]
        path = f"{env['TEST_ZK_ROOT']}/k:{key}"
        wait_until(lambda: children(intruder, path), 10, interval=0.05, what="the holder's node")
        queue = children(intruder, path)
        # READ for everyone: the queue is visible (one node: the worker's agent keeps the
        # other four requests in memory behind it, lock cohorting)
        assert len(queue) == 1
        first = f"{path}/{queue[0]}"
        with pytest.raises(NoAuthError):
            intruder.delete(first)
        with pytest.raises(NoAuthError):
            intruder.set(first, b"mine now")
        with pytest.raises(NoAuthError):
            intruder.delete(path)
        acl, _ = intruder.get_acls(first)
        assert {(a.id.scheme, a.perms) for a in acl} == {("digest", Permissions.ALL), ("world", Permissions.READ)}
        assert holder.get(timeout=30) is not None
        for r in rest:
            r.get(timeout=30)
        rows = [json.loads(x) for x in mod._r.lrange("history", 0, -1)]
        assert overlapping([(r["start"], r["end"]) for r in rows if r["key"] == key]) is None
        assert holder.state == "SUCCESS"
    finally:
        intruder.stop()
        intruder.close()
        w.stop()


def _kazoo_peer_takes(peer, path: str) -> bool:
    """kazoo's Lock checks its parent once, then creates under it: the emptied key container
    may be reaped in between (NoNodeError, kazoo does not retry it).  A new Lock re-creates it."""
    for _ in range(3):
        lock = Lock(peer, path, identifier="kazoo-peer", extra_lock_patterns=["-lock-"])
        try:
            got = lock.acquire(timeout=10)
        except NoNodeError:
            continue
        lock.release()
        return got
    return False


def test_worker_loss_release_and_a_kazoo_peer_with_the_same_credentials(secure_env, tls, tls_zk):
    """A pool process SIGKILLed while holding: the agent (same credentials) deletes its node
    at once.  A kazoo Lock peer with the same credentials queues on the same path."""
    env, mod = secure_env
    mod._r.delete("history", "arrivals")
    w = Worker(env, "tls2", concurrency=2).start(mod.app)
    peer = _admin(tls, tls_zk, auth=True)
    try:
        key = f"loss-{uuid.uuid4().hex[:6]}"
        mod.report_pid.delay(key, 30000)
        pid = started_pid(mod, key)
        path = f"{env['TEST_ZK_ROOT']}/k:{key}"
        nxt = mod.hold_tracked.delay(key, 10, "next")
        wait_until(lambda: nxt.state == "LOCK_WAITING", 10, interval=0.05, what="the next to wait")
        assert len(children(peer, path)) == 1  # waits behind it, in the agent
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        assert nxt.get(timeout=10) is not None
        took = [json.loads(x) for x in mod._r.lrange("arrivals", 0, -1) if json.loads(x)["tag"] == "next"][0]["start"]
        assert took - killed < 2.0, "the dead process's lock was not freed at once (session timeout is 4 s)"
        assert _kazoo_peer_takes(peer, path)
    finally:
        peer.stop()
        peer.close()
        w.stop()


def test_worker_without_a_client_certificate_refuses_to_start(secure_env, tls):
    env, mod = secure_env
    bad = {**env, "TEST_ZK_USE_SSL": json.dumps({"ca": tls.ca})}
    assert "requires a client certificate: set zklock_use_ssl['certfile']" in worker_refuses(bad, "tls3")


# ------------------------------------------------------------------ SASL DIGEST-MD5
@pytest.fixture(scope="module")
def sasl_zk():
    server = ZooKeeperServer(sasl_users={"worker": SECRET, "monitor": "read-only-pw"}).start()
    yield server
    server.close()


def _sasl(user: str, password: str) -> dict:
    return {"mechanism": "DIGEST-MD5", "username": user, "password": password}


# kazoo >= 2.11 names the server's "SASL required" reply (SessionClosedRequireSaslError);
# before, the reply is one of several that close the session at once, and the message can
# only suggest SASL (celery_zklock/security.py).
@pytest.mark.parametrize(
    "options, expected",
    [
        (None, r"the server requires SASL authentication: set zklock_sasl_options" if at_least(kazoo=(2, 11)) else
               r"closed our session at once; if the server requires SASL authentication, set zklock_sasl_options "
               r"\(kazoo [\d.]+ cannot tell that reply from others: kazoo >= 2.11 names it\)"),
        (_sasl("worker", "wrong"), r"SASL DIGEST-MD5 authentication as 'worker': check zklock_sasl_options' username and password"),
        (_sasl("nobody", "x"), r"as 'nobody': check zklock_sasl_options"),
    ],
)
def test_sasl_mistakes_get_clear_messages(sasl_zk, options, expected):
    settings = _settings(sasl_zk.hosts, sasl_options=options) if options else _settings(sasl_zk.hosts)
    with pytest.raises(LockUnavailable, match=expected) as info:
        connect(settings)
    assert SECRET not in str(info.value) and "wrong" not in str(info.value).split("check")[0]


def test_sasl_worker_acl_keeps_other_sasl_users_read_only(redis_server, sasl_zk):
    """A real worker authenticated with SASL DIGEST-MD5: its nodes carry sasl:worker (all
    rights) + world READ, so another authenticated user can watch the queue but cannot
    delete the holder's node; the holder ends SUCCESS."""
    values = {
        "TEST_REDIS_URL": redis_server.url, "TEST_ZK_HOSTS": sasl_zk.hosts,
        "TEST_ZK_ROOT": f"/sasl-{uuid.uuid4().hex[:8]}", "TEST_ZK_SESSION": "4",
        "TEST_ZK_SASL_OPTIONS": json.dumps(_sasl("worker", SECRET)),
        "TEST_ZK_USE_SSL": "", "TEST_ZK_AUTH_SECRET": "",  # not the TLS tests' settings
    }
    with locked_app(values) as mod:
        _sasl_worker_run(values, mod, sasl_zk)


def _sasl_worker_run(values, mod, sasl_zk):
    w = Worker(values, "sasl1", concurrency=2).start(mod.app)
    monitor = KazooClient(sasl_zk.hosts, sasl_options=_sasl("monitor", "read-only-pw"))
    monitor.start(timeout=10)
    try:
        key = f"s-{uuid.uuid4().hex[:6]}"
        holder = mod.hold.delay(key, 1500, "holder")
        waiter = mod.hold.delay(key, 10, "waiter")
        path = f"{values['TEST_ZK_ROOT']}/k:{key}"
        wait_until(lambda: children(monitor, path), 10, interval=0.05, what="the holder's node")
        queue = children(monitor, path)
        assert len(queue) == 1  # the holder's; the waiter waits in the worker's agent
        with pytest.raises(NoAuthError):
            monitor.delete(f"{path}/{queue[0]}")
        acl, _ = monitor.get_acls(f"{path}/{queue[0]}")
        assert {(a.id.scheme, a.id.id, a.perms) for a in acl} == {("sasl", "worker", Permissions.ALL),
                                                                  ("world", "anyone", Permissions.READ)}
        assert holder.get(timeout=30) is not None and waiter.get(timeout=30) is not None
        assert SECRET not in w.log()
    finally:
        monitor.stop()
        monitor.close()
        w.stop()


# ------------------------------------------------------------------ a client closed for good
def _dead(proxy: TcpProxy, client: KazooClient, replaced=lambda: False) -> None:
    """Drop the client's connection and its reconnection's SASL handshake: kazoo reads that as
    an authentication failure (AUTH_FAILED) and stops connecting for good (or ``replaced()``
    says its owner has already put a new client in its place)."""
    for _ in range(20):  # another client of the process's may reconnect first and take the cut
        proxy.arm_cut(opcodes={OP_SASL}, forward=False)
        proxy.drop_all()
        try:
            wait_until(lambda: closed_for_good(client) or replaced(), timeout=1.0)
            return
        except AssertionError:
            continue
    raise AssertionError("the client did not close for good")


def test_a_client_closed_for_good_is_replaced_and_no_lock_waits_on_it(sasl_zk):
    """A connection dropped during a SASL handshake (a rolling restart of ZooKeeper) leaves
    kazoo's client closed for good.  Before, the process's cached client was handed out dead
    and every lock on it waited for a connection that never came (False at its timeout, or
    never with none); now the lock says so at once and the process connects a new client."""
    with TcpProxy.to(sasl_zk.hosts) as proxy:
        settings = _settings(proxy.hosts, sasl_options=_sasl("worker", SECRET))
        client = get_client(settings)
        try:
            _dead(proxy, client)
            started = time.monotonic()
            with pytest.raises(ConnectionClosedError, match="new client"):
                FairLock(client, f"/dead-{uuid.uuid4().hex[:6]}").acquire(timeout=5)
            assert time.monotonic() - started < 1.0
            fresh = get_client(settings)
            assert fresh is not client and fresh.connected
            lock = FairLock(fresh, f"/dead-{uuid.uuid4().hex[:6]}")
            assert lock.acquire(timeout=5)
            lock.release()
        finally:
            close_clients()


def test_a_beat_whose_client_closed_for_good_leads_again(sasl_zk, sends):
    """The elected beat's client closed for good: it loses its term (the node's session ends
    with the client) and, before, stood by for good with nothing said, its new election lock
    waiting on the dead client.  It connects a new client and leads again."""
    root = f"/beat-{uuid.uuid4().hex[:8]}"
    with TcpProxy.to(sasl_zk.hosts) as proxy:
        beat = Running(make_app(proxy.hosts, root, zklock_sasl_options=_sasl("worker", SECRET)))
        try:
            assert wait_until(lambda: beat.scheduler.election.term() == 1, timeout=15)
            assert wait_until(lambda: len(sends) >= 1, timeout=10)
            dead = beat.scheduler.election.client
            _dead(proxy, dead, replaced=lambda: beat.scheduler.election.client is not dead)
            assert wait_until(lambda: beat.scheduler.election.term() != 1, timeout=10)
            before = len(sends)
            assert wait_until(lambda: beat.scheduler.election.term() == 2 and len(sends) > before, timeout=20)
        finally:
            beat.close()


def test_a_standby_beat_whose_client_closed_for_good_leads_when_the_leader_goes(sasl_zk, sends):
    """The same for a standby: its election lock waits, and a wait for a connection that never
    comes was for good, so it never took over from a leader that then went."""
    root = f"/beat-{uuid.uuid4().hex[:8]}"
    sasl = {"zklock_sasl_options": _sasl("worker", SECRET)}
    leader = Running(make_app(sasl_zk.hosts, root, **sasl))
    try:
        assert wait_until(lambda: leader.scheduler.election.term() == 1, timeout=15)
        with TcpProxy.to(sasl_zk.hosts) as proxy:
            standby = Running(make_app(proxy.hosts, root, **sasl))
            try:
                election = standby.scheduler.election
                assert wait_until(lambda: election.client is not None and election._lock is not None, timeout=15)
                dead = election.client
                _dead(proxy, dead, replaced=lambda: election.client is not dead)
                leader.close()
                assert wait_until(lambda: election.term() is not None, timeout=20)
            finally:
                standby.close()
    finally:
        leader.close()


def test_a_client_still_starting_is_not_closed_for_good():
    """kazoo's client is CLOSED until its first connection attempt, and stays so while its
    hosts do not resolve: that is no client closed for good."""
    client = KazooClient(hosts="zklock-test-host-that-does-not-resolve.invalid:2181")
    client.start_async()
    try:
        holds_for(lambda: not closed_for_good(client), 0.5, what="not closed for good while it starts")
    finally:
        client.stop()
        client.close()


def test_a_worker_whose_agent_client_closed_for_good_gets_a_new_agent(redis_server, sasl_zk):
    """The worker's lock agent holds the worker's one ZooKeeper session: its client closed for
    good (a connection dropped mid-SASL-handshake) and, alive and answering heartbeats, the
    agent kept it, so every locked task waited to its lock_timeout from then on.  The agent
    ends instead, and the worker starts a new one with a new client."""
    with TcpProxy.to(sasl_zk.hosts) as proxy:
        values = {
            "TEST_REDIS_URL": redis_server.url, "TEST_ZK_HOSTS": proxy.hosts,
            "TEST_ZK_ROOT": f"/sasl-{uuid.uuid4().hex[:8]}", "TEST_ZK_SESSION": "4",
            "TEST_ZK_SASL_OPTIONS": json.dumps(_sasl("worker", SECRET)),
            "TEST_ZK_USE_SSL": "", "TEST_ZK_AUTH_SECRET": "",
        }
        with locked_app(values) as mod:
            w = Worker(values, "sasl2", concurrency=2).start(mod.app)
            try:
                key = f"s-{uuid.uuid4().hex[:6]}"
                assert mod.hold.delay(key, 10, "before").get(timeout=20) is not None
                first = w.agent_pid()
                for _ in range(20):
                    proxy.arm_cut(opcodes={OP_SASL}, forward=False)
                    proxy.drop_all()
                    try:
                        wait_until(lambda: w.agent_pid() not in (None, first), timeout=1.5)
                        break
                    except AssertionError:
                        continue
                assert w.agent_pid() not in (None, first), "the agent kept its dead client"
                assert mod.hold.delay(key, 10, "after").get(timeout=30) is not None
            finally:
                w.stop()
