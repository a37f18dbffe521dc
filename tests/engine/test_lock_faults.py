"""FairLock under real faults: session expiry, SUSPENDED connections, leader failover in a
3-node ensemble, lost create replies (ghost nodes) and fencing across parent re-creation.

Nothing is mocked: faults are produced on real ZooKeeper servers (a dedicated server when
the fault is destructive, the shared ``zk_server`` otherwise) and on the wire by
``tests/tcpproxy.py``.
"""

from __future__ import annotations

import threading
import time
from itertools import pairwise

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from celery_zklock import FairLock, LockLost
from celery_zklock.engine.znodes import fencing_token
from celery_zklock.testing import ZooKeeperServer
from tests.lockutil import children, watching
from tests.polling import holds_for, wait_until
from tests.tcpproxy import (
    OP_CREATE,
    OP_CREATE2,
    OP_DELETE,
    OP_EXISTS,
    OP_GET_CHILDREN,
    OP_GET_CHILDREN2,
    OP_MULTI,
    TcpProxy,
)

SESSION = 4.0  # seconds; the servers' tickTime of 200 ms allows 0.4 .. 4 s

# Reconnect promptly.  kazoo's default connection retry backs off to 0.1, 0.2, 0.4, 0.8 s...
# while a held FairLock declares itself lost after SESSION/3 of SUSPENDED (its
# simulated expiration), so with the default a failover can outlast the grace by backoff
# alone.  A short, flat retry keeps reconnection times a property of the server.
FAST_RETRY = {"max_tries": -1, "delay": 0.05, "backoff": 1.5, "max_delay": 0.2, "max_jitter": 0.2}


def _client(hosts, **kw):
    kw.setdefault("timeout", SESSION)
    kw.setdefault("connection_retry", dict(FAST_RETRY))
    c = KazooClient(hosts=hosts, **kw)
    c.start(timeout=30)
    return c


def _stop(*clients):
    for c in clients:
        try:
            c.stop()
            c.close()
        except Exception:
            pass


@pytest.fixture
def path(request):
    name = request.node.name.replace("[", "_").replace("]", "")
    return f"/t/faults/{name}"


@pytest.fixture
def private_zk():
    """A standalone server of our own, for faults that would disturb the shared one."""
    server = ZooKeeperServer().start()
    yield server
    server.close()


class HolderMonitor:
    """Samples ``is_held()`` of several locks every millisecond; records any moment at which
    more than one claims to hold, and whether each was ever seen not holding."""

    def __init__(self, locks):
        self.locks = locks
        self.duplicates: list[tuple[float, list[int]]] = []
        self.seen_not_held = [False] * len(locks)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            held = [lk.is_held() for lk in self.locks]
            for i, h in enumerate(held):
                if not h:
                    self.seen_not_held[i] = True
            if sum(held) > 1:
                self.duplicates.append((time.monotonic(), [i for i, h in enumerate(held) if h]))
            time.sleep(0.001)  # the sampling period

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def _acquire_in_thread(lock, result, timeout=30):
    def run():
        try:
            result["ok"] = lock.acquire(timeout=timeout)
        except BaseException as exc:
            result["error"] = exc
        result["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _children_with(client, path, prefix):
    return [c for c in client.get_children(path) if c.startswith(prefix)]


# --------------------------------------------------------------------------------------
# a. session expiry while holding
# --------------------------------------------------------------------------------------
def test_session_expiry_while_holding(zk_server, zk_client, path):
    a = _client(zk_server.hosts)
    try:
        lost, lost_event = [], threading.Event()

        def on_lost(lk):
            lost.append(lk)
            lost_event.set()

        # A long grace keeps the SUSPENDED safety timer out of the picture: the loss must be
        # learnt from the expiry itself.
        lock = FairLock(a, path, on_lost=on_lost, suspended_grace=60.0)
        assert lock.acquire(timeout=5)
        node, token = lock.node, lock.token
        session_id, password = a.client_id  # only available while connected
        states = []
        a.add_listener(lambda s: states.append(s))

        # The standard trick: attach a second client to A's session and close it; the
        # server ends the session (deleting its ephemeral nodes) and A then sees LOST.
        zombie = KazooClient(hosts=zk_server.hosts, client_id=(session_id, password), timeout=SESSION)
        zombie.start(timeout=15)
        assert zombie.client_id[0] == session_id
        zombie.stop()
        zombie.close()

        assert lost_event.wait(10), "on_lost was not called after the session expired"
        assert lost == [lock]
        assert not lock.is_held()
        assert lock.token is None
        with pytest.raises(LockLost):
            lock.ensure()
        wait_until(lambda: KazooState.LOST in states, 10, what=lambda: f"LOST among {states}")
        assert zk_client.exists(node) is None

        # Someone else gets the lock, with a larger fencing token.
        other = FairLock(zk_client, path)
        assert other.acquire(timeout=5)
        assert other.token > token

        # A's client carries on with a new session; the lost lock stays lost.
        wait_until(lambda: a.connected, 10, what="the client to reconnect on a new session")
        assert a.client_id[0] != session_id
        holds_for(lambda: not lock.is_held(), 0.3, what="the lost lock not held on the new session")
        with pytest.raises(LockLost):
            lock.ensure()
        assert lost == [lock], "on_lost fired more than once"
        assert lock.release() is False
        assert other.is_held()
        other.release()
    finally:
        _stop(a)


def test_session_expiry_while_waiting_requeues_and_acquires(zk_server, zk_client, path):
    """A *waiter* whose session expires loses its queue node with the session.  acquire()
    must not fail with kazoo's SessionExpiredError: it queues again on the client's new
    session (the engine's "queue again at the back" branch) and gets the lock once the
    holder releases."""
    holder = FairLock(zk_client, path)
    assert holder.acquire(timeout=5)
    w = _client(zk_server.hosts)
    try:
        waiter = FairLock(w, path)
        result = {}
        t = _acquire_in_thread(waiter, result, timeout=20)
        wait_until(lambda: len(zk_client.get_children(path)) == 2 and waiter.node is not None, 5, what="the waiter queued")
        old_node = waiter.node
        session_id, password = w.client_id

        zombie = KazooClient(hosts=zk_server.hosts, client_id=(session_id, password), timeout=SESSION)
        zombie.start(timeout=15)
        zombie.stop()
        zombie.close()

        wait_until(lambda: w.connected and w.client_id and w.client_id[0] != session_id, 10, what="a new session")
        wait_until(lambda: zk_client.exists(old_node) is None, 5, what="the old queue node gone with its session")
        # Re-queued behind the holder, on the new session (or acquire() raised: said below).
        wait_until(lambda: len(zk_client.get_children(path)) == 2 or result, 5,
                   what=lambda: f"the waiter to queue again: {zk_client.get_children(path)}")
        assert "error" not in result, f"acquire() raised {result.get('error')!r} after the waiter's session expired"
        assert "ok" not in result and not waiter.is_held()
        holder.release()
        t.join(10)
        assert result.get("ok") is True, result
        stat = zk_client.exists(waiter.node)
        assert stat is not None and stat.ephemeralOwner == w.client_id[0]
        waiter.release()
    finally:
        holder.release()
        _stop(w)


# --------------------------------------------------------------------------------------
# b. SUSPENDED: not held while cut off, held again once re-verified on the same session
# --------------------------------------------------------------------------------------
def test_suspended_server_paused_then_same_session_reverified(private_zk, path):
    """SIGSTOP our own server: kazoo notices after its ping times out (2/3 of the session
    timeout), reports SUSPENDED; the lock must not claim to be held.  The server resumes
    before the session could expire: same session, node re-verified, held again."""
    c = _client(private_zk.hosts)
    try:
        lost = []
        lock = FairLock(c, path, on_lost=lost.append)
        assert lock.acquire(timeout=5)
        node, token, session = lock.node, lock.token, c.client_id[0]
        suspended = threading.Event()
        c.add_listener(lambda s: suspended.set() if s == KazooState.SUSPENDED else None)

        private_zk.pause()
        try:
            assert suspended.wait(SESSION), "kazoo never noticed the paused server"
            wait_until(lambda: not lock.is_held(), 0.5, what="is_held() to turn False while SUSPENDED")
            with pytest.raises(LockLost):
                lock.ensure()
        finally:
            private_zk.resume()

        wait_until(lock.is_held, SESSION / 3, what="the lock re-verified after reconnecting")
        assert c.client_id[0] == session
        assert lock.node == node and lock.token == token
        assert lost == []
        check = _client(private_zk.hosts)
        try:
            stat = check.exists(node)
            assert stat is not None and stat.ephemeralOwner == session
        finally:
            _stop(check)
        assert lock.release() is True
    finally:
        _stop(c)


def test_suspended_connection_cut_then_same_session_reverified(zk_server, zk_client, path):
    """Cut the connection at the proxy and keep the client from reconnecting for 0.6 s
    (well inside the SESSION/3 grace): not held meanwhile, held again afterwards."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            lost = []
            lock = FairLock(c, path, on_lost=lost.append)
            assert lock.acquire(timeout=5)
            node, token, session = lock.node, lock.token, c.client_id[0]

            proxy.hold()
            wait_until(lambda: not lock.is_held(), 1.0, what="is_held() to turn False while SUSPENDED")
            holds_for(lambda: not lock.is_held() and not c.connected, 0.6, what="not held while cut off")
            # Nobody else can take it meanwhile: our node is still there on the server.
            assert zk_client.exists(node).ephemeralOwner == session
            proxy.release_held()

            wait_until(lock.is_held, 2.0, what="the lock re-verified after reconnecting")
            assert c.client_id[0] == session
            assert lock.node == node and lock.token == token
            assert lost == []
            lock.ensure()
            assert lock.release() is True
            assert zk_client.exists(node) is None
        finally:
            _stop(c)


def _lost_by_grace(proxy, c, path):
    """Hold a lock through ``proxy``, cut off past the grace, reconnect on the same session:
    the lock, declared lost, and its node (still there: the session survived)."""
    lost = threading.Event()
    lock = FairLock(c, path, on_lost=lambda lk: lost.set())
    assert lock.acquire(timeout=5)
    node, session = lock.node, c.client_id[0]
    proxy.hold()
    t0 = time.monotonic()
    assert lost.wait(SESSION), "on_lost not called while cut off past the grace"
    took = time.monotonic() - t0
    assert SESSION / 3 - 0.2 <= took <= SESSION / 3 + 1.0, took
    proxy.release_held()
    wait_until(lambda: c.connected, 3, what="the client to reconnect")
    assert c.client_id[0] == session  # the session itself survived
    return lock, node


def test_suspended_past_grace_is_lost_for_good(zk_server, zk_client, path):
    """Cut off longer than the grace (SESSION/3): the lock is declared lost even though the
    session survives and reconnects; release() then still removes the node."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            lock, node = _lost_by_grace(proxy, c, path)
            holds_for(lambda: not lock.is_held(), 0.3, what="the lost lock not held again once reconnected")
            with pytest.raises(LockLost):
                lock.ensure()
            assert lock.release() is False
            wait_until(lambda: zk_client.exists(node) is None, 3, what="release() to delete the node")
            other = FairLock(zk_client, path)
            assert other.acquire(timeout=5)
            other.release()
        finally:
            _stop(c)


def test_acquiring_again_after_a_lost_hold_removes_its_node_first(zk_server, zk_client, path):
    """A hold declared lost by its grace keeps its node if the session survives; the owner
    acquiring again without a release (a kazoo user does, once is_acquired turns False) used
    to queue behind that node for good, and everyone else with it."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            lock, old = _lost_by_grace(proxy, c, path)
            assert lock.acquire(timeout=3), "queued behind its own lost node"
            assert lock.node != old and zk_client.exists(old) is None
            assert lock.release() is True
            other = FairLock(zk_client, path)
            assert other.acquire(timeout=3)
            other.release()
        finally:
            proxy.release_held()
            _stop(c)


def test_a_silent_partition_of_a_busy_client_is_reported(zk_server, zk_client, path):
    """A silent partition (nothing passes, no socket error) while the client keeps sending
    requests, as a lock agent renewing leases does.  kazoo pings only after a quiet spell
    with nothing to send, and drops the connection only for a ping unanswered: a busy client
    never pings, so it never saw the cut, and the holder was never told while the server
    expired its session and gave the lock to someone else.  The session monitor now drops
    a connection whose oldest request has gone unanswered too long, and the lock follows its
    SUSPENDED rules: told within the session timeout."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        busy = threading.Event()
        try:
            lost = threading.Event()
            lock = FairLock(c, path, on_lost=lambda lk: lost.set())
            assert lock.acquire(timeout=5)

            sent = []

            def keep_sending():
                while not busy.is_set():
                    try:
                        c.exists_async("/")
                        sent.append(time.monotonic())
                    except Exception:
                        pass
                    time.sleep(0.2)  # the busy client's cadence: never quiet long enough to ping

            threading.Thread(target=keep_sending, daemon=True).start()
            wait_until(lambda: len(sent) >= 3, 5, what="the client to be busy sending")
            proxy.blackhole()
            assert lost.wait(SESSION), "a busy client cut off silently never learnt its lock was lost"
            assert not lock.is_held()
        finally:
            busy.set()
            proxy.blackhole(False)
            _stop(c)


RACE_ROUNDS = 12  # the races below show in roughly half of the rounds when present


def _not_held_while_cut_off(lock, round_: int, result: dict | None = None) -> None:
    """The lock stays not held for 0.15 s while its client is cut off.  A failure names the
    round and the lock's state at that moment (and, given a racing acquire's result, what it
    had returned): the message is built then, not when the check starts."""

    def what() -> str:
        returned = "" if result is None else f"acquire returned {result.get('ok')!r}, "
        return f"round {round_}: not held while the client is disconnected ({returned}_suspended={lock._suspended})"

    holds_for(lambda: not lock.is_held(), 0.15, what=what)


@pytest.mark.parametrize("key", ["known", "new"])
def test_acquire_completing_as_connection_drops_is_not_held_while_suspended(zk_server, zk_client, path, key):
    """The reply that makes us the holder is the last thing through before the connection
    drops, so SUSPENDED arrives while acquire() is still finishing.  Whatever acquire()
    then does, the lock must not claim to be held while disconnected (if it does, the
    SUSPENDED safety timer is not armed either, and a partition longer than the session
    timeout gives the lock to someone else while we still say is_held()).  Once
    reconnected on the same session it must hold.

    That reply is the children listing on a key this process locked lately ("known"), and
    the reply of the multi that made the key's container and our node on a key it has not
    ("new"; until the client knows the server has containers, the create goes beside the
    container's and the queue is read after it, the "known" case again)."""
    zk_client.ensure_path(path)
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            session = c.client_id[0]
            if key == "known":
                with FairLock(c, path):  # from now on this process knows the key
                    pass
            for round_ in range(RACE_ROUNDS):
                lost = []
                lock_path = path if key == "known" else f"{path}/new{round_}"
                lock = FairLock(c, lock_path, on_lost=lost.append)
                # Pass the reply that makes us the holder, then cut and keep the client out.
                last = (OP_GET_CHILDREN,) if key == "known" else (OP_CREATE, OP_CREATE2, OP_MULTI)
                cut = proxy.arm_cut(last, forward=True, deliver_reply=True, then_hold=True)
                result = {}
                t = _acquire_in_thread(lock, result, timeout=10)
                assert cut.fired.wait(5), "the proxy never saw the acquire's holding reply"
                wait_until(lambda: not c.connected, 2, what="the client cut off")
                _not_held_while_cut_off(lock, round_, result)
                with pytest.raises(LockLost):
                    lock.ensure()
                proxy.release_held()
                t.join(10)
                assert result.get("ok") is True, result
                wait_until(lock.is_held, 2, what=f"round {round_}: held after reconnecting")
                assert c.client_id[0] == session and lost == []
                lock.release()
        finally:
            proxy.release_held()
            _stop(c)


def test_reverification_racing_a_new_suspension_is_not_held(zk_server, zk_client, path):
    """After a reconnection the lock re-verifies its node; the reply arrives and the
    connection drops again right after it.  The newer SUSPENDED must win: not held while
    disconnected, held again after the next reconnection."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            session = c.client_id[0]
            for round_ in range(RACE_ROUNDS):
                lost = []
                lock = FairLock(c, path, on_lost=lost.append)
                assert lock.acquire(timeout=5)
                wait_until(lambda lock=lock: watching(c, lock.node), 5, what="the holder's watch on its node")
                proxy.hold()
                wait_until(lambda lock=lock: not lock.is_held(), 1, what="not held once cut off")
                # The first exists() after reconnecting is the re-verification: let its
                # reply through, then cut again.
                cut = proxy.arm_cut((OP_EXISTS,), forward=True, deliver_reply=True, then_hold=True)
                proxy.release_held()
                assert cut.fired.wait(5), "the lock never re-verified its node"
                wait_until(lambda: not c.connected, 2, what="the client cut off")
                _not_held_while_cut_off(lock, round_)
                proxy.release_held()
                wait_until(lock.is_held, 2, what=f"round {round_}: held after reconnecting")
                assert c.client_id[0] == session and lost == []
                lock.release()
        finally:
            proxy.release_held()
            _stop(c)


def test_a_suspension_that_resumes_during_reverification_keeps_its_grace(zk_server, zk_client, path):
    """Cut off, reconnected for a moment (the re-verification's exists() goes out, its reply
    never comes back), then cut off again for good.  The suspension never ended, so its grace
    still runs from the first cut: the holder is told its lock is lost within SESSION/3 of
    it.  Until 2026-11-28 the second SUSPENDED armed no grace and the first one's timer,
    of an older epoch, did nothing: a partition then went unreported for as long as it lasted."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            lost = threading.Event()
            lock = FairLock(c, path, on_lost=lambda lk: lost.set())
            assert lock.acquire(timeout=5)
            wait_until(lambda: watching(c, lock.node), 5, what="the holder's watch on its node")
            proxy.hold()
            t0 = time.monotonic()
            wait_until(lambda: not lock.is_held(), 1, what="not held once cut off")
            cut = proxy.arm_cut((OP_EXISTS,), forward=True, then_hold=True)  # no reply: cut again
            proxy.release_held()
            assert cut.fired.wait(5), "the lock never re-verified its node"
            assert lost.wait(SESSION / 3 + 1.5 - (time.monotonic() - t0)), (
                "a partition that resumed during the re-verification was never reported as a lost lock")
            assert not lock.is_held()
            with pytest.raises(LockLost):
                lock.ensure()
        finally:
            proxy.release_held()
            _stop(c)


def test_a_cancel_while_a_ghost_is_looked_for_still_deletes_the_ghost(zk_server, zk_client, path):
    """A create whose reply was lost (a ghost), the reconnection's look for it cut off too, and
    the acquire cancelled while that look is in flight: the ghost must still go once
    reconnected.  Until 2026-11-28 the look cleared the attempt's pending work before its
    answer came, so the cancel sealed the cleanup with nothing to delete and stopped
    listening to the session: the ghost stayed at the head of the queue for the session's life."""
    holder = FairLock(zk_client, path)
    assert holder.acquire(timeout=5)
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            lock = FairLock(c, path)
            cut = proxy.arm_cut((OP_CREATE, OP_CREATE2), forward=True, then_hold=True)
            result = {}
            t = _acquire_in_thread(lock, result, timeout=None)
            assert cut.fired.wait(5) and cut.reply_err == 0
            assert len(_children_with(zk_client, path, lock._internals.prefix)) == 1  # the ghost
            look = proxy.arm_cut((OP_GET_CHILDREN, OP_GET_CHILDREN2), forward=True, then_hold=True)
            proxy.release_held()
            assert look.request_seen.wait(5), "the reconnection never looked for the ghost"
            lock.cancel()
            assert look.fired.wait(5)
            proxy.release_held()
            t.join(10)
            assert result.get("ok") is False, result
            wait_until(lambda: _children_with(zk_client, path, lock._internals.prefix) == [], 5,
                       what="the ghost deleted after the cancel")
        finally:
            proxy.release_held()
            holder.release()
            _stop(c)


def test_timeout_after_lost_create_reply_leaves_no_ghost(zk_server, zk_client, path):
    """acquire(timeout) whose create executed but whose reply was lost, and the deadline
    passes while cut off: once reconnected our ghost node must be gone, not left at the
    head of the queue blocking everybody for the rest of our session."""
    zk_client.ensure_path(path)
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            lock = FairLock(c, path)
            cut = proxy.arm_cut((OP_CREATE, OP_CREATE2), forward=True, then_hold=True)
            result = {}
            t = _acquire_in_thread(lock, result, timeout=0.3)
            assert cut.fired.wait(5) and cut.reply_err == 0
            time.sleep(0.6)  # past the deadline, still cut off
            assert len(_children_with(zk_client, path, lock._internals.prefix)) == 1  # the ghost
            proxy.release_held()
            t.join(5)
            assert result.get("ok") is False, result
            wait_until(lambda: _children_with(zk_client, path, lock._internals.prefix) == [], 3, what="the ghost node deleted")
            assert lock.node is None and not lock.is_held()
            other = FairLock(zk_client, path)
            assert other.acquire(timeout=2)
            other.release()
        finally:
            proxy.release_held()
            _stop(c)


# --------------------------------------------------------------------------------------
# c. 3-node ensemble: leader failover
# --------------------------------------------------------------------------------------
def test_leader_killed_while_holding(zk_ensemble, path):
    a = _client(zk_ensemble.hosts)
    b = _client(zk_ensemble.hosts)
    try:
        lost = []
        holder = FairLock(a, path, on_lost=lost.append)
        assert holder.acquire(timeout=10)
        node, token, session = holder.node, holder.token, a.client_id[0]
        waiter = FairLock(b, path)
        result = {}
        t = _acquire_in_thread(waiter, result)
        wait_until(lambda: len(b.get_children(path)) == 2, 5, what="the waiter queued")

        with HolderMonitor([holder, waiter]) as mon:
            leader = zk_ensemble.leader()
            leader.kill()
            # Every member drops its clients (the followers lose their leader): suspended.
            wait_until(lambda: not holder.is_held(), 3, what="the holder not to claim the lock while SUSPENDED")
            zk_ensemble.wait_quorum(15)
            wait_until(holder.is_held, 10, what=lambda: f"the lock re-verified after failover (lost: {holder.lost_reason})")
            assert a.client_id[0] == session and holder.node == node and holder.token == token
            assert lost == []
            # The waiter is still queued behind us, on the same session.
            wait_until(lambda: b.connected, 10, what="the waiter's client to reconnect")
            holds_for(lambda: "ok" not in result and not waiter.is_held(), 0.3, what="the waiter still waiting")
            names = sorted(b.get_children(path), key=lambda n: n[-10:])
            assert len(names) == 2 and node.endswith(names[0]), names
            released_at = time.monotonic()
            assert holder.release() is True
            t.join(15)
        assert result.get("ok") is True, result
        assert result["at"] >= released_at
        assert waiter.token > token
        assert not mon.duplicates, mon.duplicates
        assert mon.seen_not_held[0]
        waiter.release()
    finally:
        _stop(a, b)


def test_leader_killed_while_waiting(zk_ensemble, path):
    """The waiter's own server is the leader and dies; the holder releases in the middle
    of the failover (its delete is retried until reconnected).  The waiter still gets the
    lock, after the release, and never alongside the holder."""
    leader = zk_ensemble.leader()
    others = [m for m in zk_ensemble.members if m is not leader]
    a = _client(zk_ensemble.hosts)
    # Connect the waiter to the leader first so that it is the waiter's server that dies.
    b = _client(",".join([leader.hosts] + [m.hosts for m in others]), randomize_hosts=False)
    try:
        holder = FairLock(a, path)
        assert holder.acquire(timeout=10)
        holder_node, token = holder.node, holder.token
        waiter = FairLock(b, path)
        result = {}
        t = _acquire_in_thread(waiter, result)
        wait_until(lambda: len(a.get_children(path)) == 2, 5, what="the waiter queued")
        waiter_session = b.client_id[0]

        with HolderMonitor([holder, waiter]) as mon:
            leader.kill()
            # Both clients are cut off (the followers drop their clients when they lose the
            # leader): the release below must be carried through the failover.
            wait_until(lambda: not b.connected and not a.connected, 3, what="both clients cut off")
            release_started = time.monotonic()
            released = {}
            r = threading.Thread(target=lambda: released.setdefault("ok", holder.release()), daemon=True)
            r.start()
            r.join(15)
            t.join(20)
        assert released.get("ok") is True
        assert result.get("ok") is True, result
        assert result["at"] >= release_started
        assert b.client_id[0] == waiter_session  # queued on the same session throughout
        assert waiter.is_held() and waiter.token > token
        assert not mon.duplicates, mon.duplicates
        assert a.exists(holder_node) is None
        assert a.get_children(path) == [waiter.node.rsplit("/", 1)[1]]
        waiter.release()
    finally:
        _stop(a, b)


# --------------------------------------------------------------------------------------
# d. ghost nodes: a create that succeeded but whose reply was lost
# --------------------------------------------------------------------------------------
def test_lost_create_reply_adopts_own_node(zk_server, zk_client, path):
    zk_client.ensure_path(path)  # so the cut hits the create of the lock node itself
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            session = c.client_id[0]
            lock = FairLock(c, path)
            cut = proxy.arm_cut((OP_CREATE, OP_CREATE2), forward=True)
            assert lock.acquire(timeout=10) is True
            assert cut.fired.is_set(), "the proxy never cut a create"
            assert cut.reply_err == 0, "the server did not execute the create whose reply we swallowed"
            assert proxy.accepted >= 2  # kazoo reconnected through the proxy
            assert c.client_id[0] == session  # ... on the same session

            mine = _children_with(zk_client, path, lock._internals.prefix)
            assert len(mine) == 1, mine
            assert lock.node == f"{path}/{mine[0]}"
            stat = zk_client.exists(lock.node)
            assert stat.ephemeralOwner == session
            assert lock.token == fencing_token(stat.czxid)
            assert lock.is_held()
            lock.release()
            assert children(zk_client, path) == []  # the empty container may be reaped already
        finally:
            _stop(c)


def test_lost_multi_reply_on_a_new_key_adopts_own_node(zk_server, zk_client, path):
    """A new key's container and our node go in one multi; its reply lost, the ghost
    search finds our node under the new container and adopts it (no second node)."""
    from celery_zklock.engine import znodes

    zk_client.ensure_path(path)
    key = f"{path}/new"
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            znodes.mark_containers_work(c)
            session = c.client_id[0]
            lock = FairLock(c, key)
            cut = proxy.arm_cut((OP_MULTI,), forward=True)
            assert lock.acquire(timeout=10) is True
            assert cut.fired.is_set() and cut.reply_err == 0, "the multi was not executed and cut"
            assert c.client_id[0] == session
            mine = _children_with(zk_client, key, lock._internals.prefix)
            assert len(mine) == 1 and lock.node == f"{key}/{mine[0]}"
            assert lock.token == fencing_token(zk_client.exists(lock.node).czxid)
            assert lock.is_held()
            lock.release()
            assert children(zk_client, key) == []  # [] too once the new key's container is swept
        finally:
            _stop(c)


def test_lost_create_reply_while_queued_leaves_no_ghost(zk_server, zk_client, path):
    """The ghost case that hurts: queued behind a holder, our create's reply is lost.  We
    must adopt our node (not add a second one), get the lock when the holder leaves, and
    after our release the next waiter must not be blocked by a leftover node of ours."""
    zk_client.ensure_path(path)
    holder = FairLock(zk_client, path)
    assert holder.acquire(timeout=5)
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        third_client = _client(zk_server.hosts)
        try:
            session = c.client_id[0]
            lock = FairLock(c, path)
            cut = proxy.arm_cut((OP_CREATE, OP_CREATE2), forward=True)
            result = {}
            t = _acquire_in_thread(lock, result)
            assert cut.fired.wait(5) and cut.reply_err == 0
            wait_until(lambda: lock.node is not None, 5, what="our node adopted")
            holds_for(lambda: len(_children_with(zk_client, path, lock._internals.prefix)) == 1, 0.3,
                      what=lambda: f"one node of ours: {_children_with(zk_client, path, lock._internals.prefix)}")
            mine = _children_with(zk_client, path, lock._internals.prefix)
            assert zk_client.exists(f"{path}/{mine[0]}").ephemeralOwner == session
            assert "ok" not in result

            third = FairLock(third_client, path)
            third_result = {}
            t3 = _acquire_in_thread(third, third_result)
            wait_until(lambda: len(zk_client.get_children(path)) == 3, 5, what="the third queued")

            holder.release()
            t.join(10)
            assert result.get("ok") is True, result
            assert "ok" not in third_result
            lock.release()
            t3.join(10)
            assert third_result.get("ok") is True, "a node of ours outlived our release"
            assert _children_with(zk_client, path, lock._internals.prefix) == []
            third.release()
        finally:
            _stop(c, third_client)


def test_stale_node_with_our_prefix_from_another_session_is_replaced(zk_server, zk_client, path):
    """A node named with our prefix but owned by another session is not ours: after a lost
    create (dropped before reaching the server) it must be deleted, not adopted, and a
    fresh node created."""
    zk_client.ensure_path(path)
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            session = c.client_id[0]
            lock = FairLock(c, path)
            stale = zk_client.create(f"{path}/{lock._internals.prefix}", b"stale", ephemeral=True, sequence=True)
            stale_owner = zk_client.exists(stale).ephemeralOwner
            assert stale_owner != session
            cut = proxy.arm_cut((OP_CREATE, OP_CREATE2), forward=False)
            assert lock.acquire(timeout=5) is True, "blocked behind a stale node with our prefix"
            assert cut.fired.is_set()
            assert zk_client.exists(stale) is None, "the stale node was not deleted"
            mine = _children_with(zk_client, path, lock._internals.prefix)
            assert len(mine) == 1 and f"{path}/{mine[0]}" == lock.node != stale, (mine, stale)
            stat = zk_client.exists(lock.node)
            assert stat.ephemeralOwner == session and lock.token == fencing_token(stat.czxid)
            lock.release()
        finally:
            _stop(c)


def test_lost_create_reply_with_stale_twin_keeps_ours_deletes_stale(zk_server, zk_client, path):
    """Both a stale node (other session) and our real ghost carry our prefix: ours is
    adopted, the stale one deleted."""
    zk_client.ensure_path(path)
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            session = c.client_id[0]
            lock = FairLock(c, path)
            stale = zk_client.create(f"{path}/{lock._internals.prefix}", b"stale", ephemeral=True, sequence=True)
            cut = proxy.arm_cut((OP_CREATE, OP_CREATE2), forward=True)
            assert lock.acquire(timeout=5) is True
            assert cut.fired.is_set() and cut.reply_err == 0
            assert zk_client.exists(stale) is None
            mine = _children_with(zk_client, path, lock._internals.prefix)
            assert len(mine) == 1 and lock.node == f"{path}/{mine[0]}"
            stat = zk_client.exists(lock.node)
            assert stat.ephemeralOwner == session
            assert stat.czxid == cut.reply_zxid  # the node the lost reply was about, adopted
            assert lock.token == fencing_token(stat.czxid)
            lock.release()
        finally:
            _stop(c)


@pytest.mark.parametrize("forward", [False, True], ids=["delete-dropped", "delete-reply-lost"])
def test_release_whose_delete_is_lost_is_retried(zk_server, zk_client, path, forward):
    """The release's delete meets a connection loss (dropped before the server, or executed
    with the reply lost).  release() must still leave no node behind, so the next waiter
    gets the lock while our session lives on."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            session = c.client_id[0]
            lock = FairLock(c, path)
            assert lock.acquire(timeout=5)
            node = lock.node
            waiter = FairLock(zk_client, path)
            result = {}
            t = _acquire_in_thread(waiter, result)
            wait_until(lambda: len(zk_client.get_children(path)) == 2, 5, what="the waiter queued")
            cut = proxy.arm_cut((OP_DELETE,), forward=forward)
            assert lock.release() is True
            assert cut.fired.is_set(), "the proxy never saw the release's delete"
            if forward:
                assert cut.reply_err == 0
            assert zk_client.exists(node) is None, "release() returned with our node still there"
            t.join(5)
            assert result.get("ok") is True, result
            wait_until(lambda: c.connected, 5, what="the client to reconnect")
            assert c.client_id[0] == session
            waiter.release()
        finally:
            _stop(c)


# --------------------------------------------------------------------------------------
# e. fencing tokens
# --------------------------------------------------------------------------------------
def test_fencing_tokens_increase_across_holders_clients_and_parent_recreation(zk_server, zk_client, path):
    """20 successive holders from 4 clients contending; between the two halves the parent
    znode is deleted (and it is a container, so the server may reap it in any idle gap
    too).  Every holder's token is its node's czxid and strictly larger than the previous
    holder's."""
    clients = [_client(zk_server.hosts) for _ in range(4)]
    holds, guard, errors = [], threading.Lock(), []

    def worker(c, rounds):
        try:
            for _ in range(rounds):
                lk = FairLock(c, path)
                assert lk.acquire(timeout=30)
                start = time.monotonic()
                token = lk.token
                stat, parent = c.exists(lk.node), c.exists(path)
                time.sleep(0.002)  # the hold
                lk.release()
                with guard:
                    holds.append((start, token, stat.czxid if stat else None, parent.czxid if parent else None))
        except BaseException as exc:
            errors.append(exc)

    def phase(rounds_per_client):
        threads = [threading.Thread(target=worker, args=(c, n))
                   for c, n in zip(clients, rounds_per_client, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    try:
        phase([3, 3, 2, 2])  # 10 holders
        first_parents = {p for *_, p in holds}
        if zk_client.exists(path) is not None:
            zk_client.delete(path, recursive=True)
        assert zk_client.exists(path) is None
        phase([2, 2, 3, 3])  # 10 more, on a re-created parent
        assert not errors, errors
        assert len(holds) == 20
        holds.sort()  # exclusive holds: start order is holder order
        second_parents = {p for *_, p in holds[10:]}
        assert None not in first_parents | second_parents
        assert max(first_parents) < min(second_parents), "the parent was not re-created"
        tokens = [tok for _, tok, _, _ in holds]
        assert all(tok == fencing_token(czxid) for _, tok, czxid, _ in holds), holds  # token from the node's czxid
        assert all(a < b for a, b in pairwise(tokens)), tokens
    finally:
        _stop(*clients)


# --------------------------------------------------------------------------------------
# e. release is the last proof of exclusion
# --------------------------------------------------------------------------------------
def test_release_after_the_session_expired_unnoticed_reports_the_loss(zk_server, zk_client, path):
    """A holder cut off (or frozen) past its session timeout, whose safety timer has not
    fired yet, must not be told at release that it held the lock to the end: the server
    expired its session and another contender held the lock meanwhile."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            lock = FairLock(c, path, suspended_grace=60.0)  # keep the SUSPENDED timer out of it
            assert lock.acquire(timeout=5)
            proxy.hold()
            other = FairLock(zk_client, path)
            assert other.acquire(timeout=SESSION * 3), "the server never expired the cut-off session"
            releasing = threading.Thread(target=lambda: result.append(lock.release()))
            result: list[bool] = []
            releasing.start()
            # The release begins while still cut off: our node let go of here, its delete waits.
            wait_until(lambda: lock.node is None, 5, what="the release to begin")
            proxy.release_held()
            releasing.join(SESSION * 3)
            assert result == [False]
            assert "expired" in lock.lost_reason
            assert other.is_held()
            other.release()
        finally:
            _stop(c)


def test_release_of_a_lock_still_ours_reports_success_even_after_a_blip(zk_server, zk_client, path):
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            lock = FairLock(c, path, suspended_grace=60.0)
            assert lock.acquire(timeout=5)
            proxy.hold()
            result: list[bool] = []
            releasing = threading.Thread(target=lambda: result.append(lock.release()))
            releasing.start()
            # The blip: the release begins while cut off: our node let go of here, its delete waits.
            wait_until(lambda: not c.connected and lock.node is None, 5, what="the release to begin, cut off")
            proxy.release_held()
            releasing.join(SESSION * 3)
            assert result == [True] and lock.lost_reason is None
            assert children(zk_client, path) == []  # the empty container may be reaped already
        finally:
            _stop(c)


def test_lost_create_while_the_key_container_is_reaped(zk_server, zk_client, path):
    """The create's reply is lost *and* the create failed; meanwhile the empty key
    container is reaped by the server.  Looking for a ghost must find "no node", not
    escape acquire with NoNodeError."""
    with TcpProxy.to(zk_server.hosts) as proxy:
        c = _client(proxy.hosts)
        try:
            zk_client.ensure_path(path)
            lock = FairLock(c, path)
            cut = proxy.arm_cut((OP_CREATE, OP_CREATE2), forward=False)
            zk_client.delete(path)  # what the container reaper does to an empty key
            assert lock.acquire(timeout=10) is True
            assert cut.fired.is_set()
            assert lock.is_held() and zk_client.exists(lock.node) is not None
            lock.release()
        finally:
            _stop(c)


def test_unauthorised_client_gets_a_clear_error_and_leaves_nothing(zk_server, zk_client, path):
    from kazoo.security import make_digest_acl

    from celery_zklock import ConfigurationError
    from celery_zklock.engine.znodes import probe_permissions

    owner = _client(zk_server.hosts, auth_data=[("digest", "owner:secret")])
    stranger = _client(zk_server.hosts)
    try:
        owner.create(path, b"", acl=[make_digest_acl("owner", "secret", all=True)], makepath=True)
        with pytest.raises(ConfigurationError, match=r"NoAuth.*zklock_auth_secret"):
            FairLock(stranger, f"{path}/key").acquire(timeout=2)
        with pytest.raises(ConfigurationError, match="zklock_auth_secret"):
            probe_permissions(stranger, path)
        assert owner.get_children(path) == []
        probe_permissions(owner, path)  # the owner may lock there, and the probe leaves nothing
        assert owner.get_children(path) == []
    finally:
        owner.delete(path, recursive=True)
        _stop(owner, stranger)


def test_a_node_ahead_we_may_not_read_is_still_waited_for_to_its_end(zk_server, zk_client, path):
    """A contender ahead whose node we may not read (a Curator or kazoo peer creating with
    CREATOR_ALL_ACL, or our own nodes under a ``zklock_acl`` without world READ for another
    identity): the data watch is refused with NoAuth and no watch is set (nor does ZooKeeper
    send an ``exists`` watch's event on a node the client may not read).  Before, the waiter
    then waited with no watch at all, until its deadline (False while the lock was free) or
    for good with none; it watches the queue instead now.  ``celery zklock status`` read the
    node's data and failed with NoAuth: it lists the node, unreadable."""
    from kazoo.security import make_digest_acl

    from celery_zklock.engine.contenders import contenders

    owner = _client(zk_server.hosts, auth_data=[("digest", "owner:secret")])
    try:
        zk_client.ensure_path(path)
        ahead = owner.create(f"{path}/_c_{'0' * 32}-lock-", b"peer", ephemeral=True, sequence=True,
                             acl=[make_digest_acl("owner", "secret", all=True)])
        lock = FairLock(zk_client, path)
        outcome: list = []
        waiter = threading.Thread(target=lambda: outcome.append(lock.acquire(timeout=8)), daemon=True)
        waiter.start()
        # Queued behind the unreadable node, its data watch refused: the queue watched instead.
        wait_until(lambda: zk_client._child_watchers.get(path), 5, what="the waiter to watch the queue")
        assert [c.node for c in contenders(zk_client, path)] == [ahead.rsplit("/", 1)[1], lock.node.rsplit("/", 1)[1]]
        owner.delete(ahead)
        waiter.join(timeout=3)
        assert outcome == [True], "the waiter did not see the unreadable node ahead of it go"
        lock.release()
    finally:
        _stop(owner)
