"""The ZooKeeper version we claim (README: "a ZooKeeper >= 3.5 ensemble") against the requests
the library actually sends over the wire.

Only ZooKeeper 3.8 is installed to test against, and 3.8 serves every opcode there is up to
its own: a request that needs 3.6 (a persistent watch, ``multiRead``, ``getEphemerals``)
works in every test here and breaks only at a user's 3.5 ensemble.  So the test below records
the type of every request kazoo writes to the socket (its lowest-level send,
``ConnectionHandler._submit``, and the ops inside each ``multi``) while the library exercises
its features against the real server, and checks each one against :data:`OPCODES`: the
release of ZooKeeper that first serves it.  A later change that sends something newer than
:data:`CLAIMED` fails here, naming the opcode and the release it needs.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import NamedTuple

import pytest
from kazoo.protocol import serialization
from kazoo.protocol.connection import ConnectionHandler
from kazoo.protocol.states import KazooState

from celery_zklock import FairLock, MultiLock
from celery_zklock.beat.election import Election, Role
from celery_zklock.beat.ledger import Ledger
from celery_zklock.beat.rules import TickRecord, TickState, Written
from celery_zklock.beat.scheduler import group_path
from celery_zklock.beat.status import beat_report
from celery_zklock.cli import guard_report, lock_report
from celery_zklock.config import from_wire
from celery_zklock.engine import guards, kazoo_compat, znodes
from celery_zklock.engine.contenders import contenders
from celery_zklock.engine.identity import Identity
from celery_zklock.engine.session import guaranteed_proof, monitor_for
from celery_zklock.redelivery import wait_nodes_gone
from celery_zklock.worker.reaper import reap_nodes
from tests.polling import wait_until


class Opcode(NamedTuple):
    name: str  # as in ZooDefs.OpCode
    since: tuple[int, int, int]  # the first release whose ZooDefs.OpCode declares it
    needs: str = ""  # what else the server must be configured with, even at that release


#: ZooKeeper's request opcodes: ``org.apache.zookeeper.ZooDefs.OpCode`` (ZooDefs.java), with
#: the first release tag of apache/zookeeper whose ZooDefs declares each.  release-3.4.0 and
#: release-3.4.14 declare the same set (-11, 1-9, 11-14, 100-102); release-3.5.0 adds 15-18,
#: release-3.5.1 adds 19-20 (ZOOKEEPER-2163, containers), release-3.5.3 adds 21 (ZOOKEEPER-2169,
#: TTL nodes), release-3.6.0 adds 22 and 103-106, release-3.7.0 adds 107; 3.8 and 3.9 add
#: none.  3.5.0-3.5.4 were alpha and beta releases, 3.5.5 the first stable one.  "3.4" below
#: means "every release we checked", not the release that introduced it.
#: (createSession, -10, is the server's own: a client opens a session with a ConnectRequest,
#: which carries no opcode.)
OPCODES: dict[int, Opcode] = {
    -11: Opcode("closeSession", (3, 4, 0)),
    1: Opcode("create", (3, 4, 0)),
    2: Opcode("delete", (3, 4, 0)),
    3: Opcode("exists", (3, 4, 0)),
    4: Opcode("getData", (3, 4, 0)),
    5: Opcode("setData", (3, 4, 0)),
    6: Opcode("getACL", (3, 4, 0)),
    7: Opcode("setACL", (3, 4, 0)),
    8: Opcode("getChildren", (3, 4, 0)),
    9: Opcode("sync", (3, 4, 0)),
    11: Opcode("ping", (3, 4, 0)),
    12: Opcode("getChildren2", (3, 4, 0)),
    13: Opcode("check", (3, 4, 0)),
    14: Opcode("multi", (3, 4, 0)),
    15: Opcode("create2", (3, 5, 0)),
    16: Opcode("reconfig", (3, 5, 0), "reconfigEnabled=true (from 3.5.3) and a superuser"),
    17: Opcode("checkWatches", (3, 5, 0)),
    18: Opcode("removeWatches", (3, 5, 0)),
    19: Opcode("createContainer", (3, 5, 1)),
    20: Opcode("deleteContainer", (3, 5, 1), "nothing a client may send: the server's container reaper"),
    21: Opcode("createTTL", (3, 5, 3), "zookeeper.extendedTypesEnabled=true on every server"),
    22: Opcode("multiRead", (3, 6, 0)),
    100: Opcode("auth", (3, 4, 0)),
    101: Opcode("setWatches", (3, 4, 0)),
    102: Opcode("sasl", (3, 4, 0)),
    103: Opcode("getEphemerals", (3, 6, 0)),
    104: Opcode("getAllChildrenNumber", (3, 6, 0)),
    105: Opcode("setWatches2", (3, 6, 0)),
    106: Opcode("addWatch", (3, 6, 0)),  # persistent (recursive) watches
    107: Opcode("whoAmI", (3, 7, 0)),
}

#: The ops a ``multi`` may carry in 3.5 (ZooKeeper's MultiTransactionRecord): create, delete,
#: setData and check from 3.4; create2 from 3.5.0, createContainer from 3.5.1, createTTL from
#: 3.5.3 (each as in OPCODES).  3.6 renamed it MultiOperationRecord and let it carry getData and
#: getChildren too, for its new multiRead (opcode 22): a 3.5 server cannot read those.
IN_MULTI = {1, 2, 5, 13, 15, 19, 21}

#: The release line the README claims: "It needs ... a ZooKeeper >= 3.5 ensemble".
CLAIMED = (3, 5)


def release(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def beyond(code: int, claimed: tuple[int, ...] = CLAIMED, in_multi: bool = False) -> str | None:
    """Why a request of opcode ``code`` may fail on a server of the ``claimed`` release line
    (configured as shipped), or None when every such server serves it."""
    where = " inside a multi" if in_multi else ""
    op = OPCODES.get(code)
    if op is None:
        return f"opcode {code}{where} is not a ZooKeeper opcode of any release up to 3.9"
    if op.since[: len(claimed)] > claimed:
        return (f"opcode {code} ({op.name}){where} needs ZooKeeper >= {release(op.since)}, "
                f"but the README claims ZooKeeper >= {release(claimed)}")
    if op.needs:
        return f"opcode {code} ({op.name}){where} needs {op.needs}, which the README does not ask for"
    if in_multi and code not in IN_MULTI:
        return f"opcode {code} ({op.name}) inside a multi: ZooKeeper {release(claimed)} cannot read it there"
    return None


# ---------------------------------------------------------------------------------------
# The table itself
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("code, claimed, expected", [
    (15, (3, 5), None),  # create2: our lock's create (its stat is the fencing token)
    (19, (3, 5), None),  # createContainer: the key's parent
    (14, (3, 4), None),
    (15, (3, 4), "opcode 15 (create2) needs ZooKeeper >= 3.5.0, but the README claims ZooKeeper >= 3.4"),
    (19, (3, 5, 0), "opcode 19 (createContainer) needs ZooKeeper >= 3.5.1, but the README claims ZooKeeper >= 3.5.0"),
    (106, (3, 5), "opcode 106 (addWatch) needs ZooKeeper >= 3.6.0, but the README claims ZooKeeper >= 3.5"),
    (22, (3, 5), "opcode 22 (multiRead) needs ZooKeeper >= 3.6.0, but the README claims ZooKeeper >= 3.5"),
    (105, (3, 5), "opcode 105 (setWatches2) needs ZooKeeper >= 3.6.0, but the README claims ZooKeeper >= 3.5"),
    (107, (3, 6), "opcode 107 (whoAmI) needs ZooKeeper >= 3.7.0, but the README claims ZooKeeper >= 3.6"),
    (106, (3, 6), None),
    (21, (3, 5), "opcode 21 (createTTL) needs zookeeper.extendedTypesEnabled=true on every server, "
                 "which the README does not ask for"),
    (999, (3, 5), "opcode 999 is not a ZooKeeper opcode of any release up to 3.9"),
])
def test_what_a_release_serves(code, claimed, expected):
    assert beyond(code, claimed) == expected


def test_the_table_knows_every_request_kazoo_can_build():
    """Every request class kazoo ships has its opcode (with the name ZooDefs gives it) in the
    table: a kazoo upgrade bringing a new one (``AddWatch``) is then judged by its release."""
    kazoo_names = {"Close": "closeSession", "GetACL": "getACL", "SetACL": "setACL", "Auth": "auth", "SASL": "sasl",
                   "CheckVersion": "check", "Transaction": "multi"}
    for name, cls in vars(serialization).items():
        code = getattr(cls, "type", None)
        if isinstance(cls, type) and isinstance(code, int):
            assert code in OPCODES, f"kazoo's {name} sends opcode {code}, not in OPCODES"
            expected = kazoo_names.get(name, name[0].lower() + name[1:])
            assert OPCODES[code].name == expected, (name, code, OPCODES[code])


def test_the_requests_we_build_ourselves_are_within_the_claim():
    """The requests kazoo_compat builds by hand (kazoo has no call for them), whether or not
    the test below gets to send them."""
    built = [cls for cls in vars(kazoo_compat).values()
             if isinstance(cls, type) and cls.__module__ == kazoo_compat.__name__ and isinstance(getattr(cls, "type", None), int)]
    assert {cls.type for cls in built} >= {19, 14}  # CreateContainer, MultiCreate
    for cls in built:
        assert beyond(cls.type) is None, f"{cls.__name__}: {beyond(cls.type)}"


# ---------------------------------------------------------------------------------------
# What goes over the wire
# ---------------------------------------------------------------------------------------
class Wire:
    """The opcodes kazoo sent while installed, and the opcodes of the ops inside each multi."""

    def __init__(self) -> None:
        self.sent: dict[int, str] = {}  # opcode: kazoo's class name (for the messages)
        self.in_multi: dict[int, str] = {}
        self.connects = 0  # ConnectRequests: the session handshake, no opcode

    def saw(self, request) -> None:
        code = request.type
        if code is None:
            self.connects += 1
            return
        self.sent.setdefault(code, type(request).__name__)
        for op in getattr(request, "operations", None) or ():
            self.in_multi.setdefault(op.type, type(op).__name__)

    def problems(self) -> list[str]:
        found = [f"{why} (request {self.sent[c]})" for c in sorted(self.sent) if (why := beyond(c))]
        found += [f"{why} (request {self.in_multi[c]})" for c in sorted(self.in_multi) if (why := beyond(c, in_multi=True))]
        return found


@pytest.fixture
def wire(monkeypatch) -> Wire:
    """Records every request any kazoo client of this process writes to its socket (pings,
    the handshake, authentication and closing included) for the test's duration."""
    seen = Wire()
    real = ConnectionHandler._submit

    def _submit(self, request, timeout, xid=None):
        seen.saw(request)
        return real(self, request, timeout, xid)

    monkeypatch.setattr(ConnectionHandler, "_submit", _submit)
    return seen


def test_the_recorder_judges_requests_and_the_ops_inside_multis():
    """What the wire test reports, on requests made up here (a server would refuse them)."""

    class Request(NamedTuple):
        type: int | None
        operations: tuple = ()

    seen = Wire()
    for request in (Request(None), Request(15), Request(106), Request(14, (Request(19), Request(22), Request(4)))):
        seen.saw(request)
    assert seen.connects == 1 and sorted(seen.sent) == [14, 15, 106] and sorted(seen.in_multi) == [4, 19, 22]
    assert seen.problems() == [
        "opcode 106 (addWatch) needs ZooKeeper >= 3.6.0, but the README claims ZooKeeper >= 3.5 (request Request)",
        "opcode 4 (getData) inside a multi: ZooKeeper 3.5 cannot read it there (request Request)",
        "opcode 22 (multiRead) inside a multi needs ZooKeeper >= 3.6.0, but the README claims ZooKeeper >= 3.5 "
        "(request Request)",
    ]


def _waiting(client, path: str, n: int) -> None:
    wait_until(lambda: len(contenders(client, path, max_holders=None)) >= n, timeout=10, what=f"{n} contenders on {path}")


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _exercise(zk_server, clients, root: str) -> None:
    """Each of the library's ways of talking to ZooKeeper, once."""
    a, b, c = clients(), clients(), clients()

    # A FairLock on a new key, with contention: b queues behind a and watches a's node.
    # (containers not yet proven on this server: createContainer pipelined beside create2.)
    k1 = f"{root}/k1"
    la, lb = FairLock(a, k1), FairLock(b, k1)
    assert la.acquire(timeout=10)
    got = []
    waiter = threading.Thread(target=lambda: got.append(lb.acquire(timeout=10)))
    waiter.start()
    _waiting(a, k1, 2)
    assert la.release()
    waiter.join(15)
    assert got == [True] and lb.is_held()

    # A lost connection while held: kazoo reconnects on the same session, the lock checks its node.
    states = []
    b.add_listener(states.append)
    kazoo_compat.drop_connection(b)
    wait_until(lambda: KazooState.SUSPENDED in states and b.state == KazooState.CONNECTED and lb.is_held(),
               timeout=10, what="b suspended, then back and still holding")
    b.remove_listener(states.append)
    # The agent's proofs of a held node (lock cohorting): a check, and a write renaming its owner.
    session = kazoo_compat.session_id(b)
    assert guaranteed_proof(monitor_for(b), lb.node, session).get(timeout=10) is not None
    assert guaranteed_proof(monitor_for(b), lb.node, session, rename=b"renamed").get(timeout=10) is not None
    gone = lb.node
    assert lb.release()
    wait_nodes_gone(a, [gone])

    # New keys now that containers are proven: the container and our node in one multi,
    # several keys at once (a MultiLock), each queue read by another client.
    multi = MultiLock(a, [f"{root}/m{i}" for i in range(4)])
    assert multi.acquire(timeout=10)
    assert lock_report(c, root)
    assert multi.release()

    # A semaphore of two: a third contender waits for a slot.
    sem = [FairLock(cl, f"{root}/sem", max_holders=2) for cl in (a, b, c)]
    assert sem[0].acquire(timeout=10) and sem[1].acquire(timeout=10)
    third = []
    waiter = threading.Thread(target=lambda: third.append(sem[2].acquire(timeout=10)))
    waiter.start()
    _waiting(a, f"{root}/sem", 3)
    assert sem[0].release()
    waiter.join(15)
    assert third == [True]
    for s in sem[1:]:
        s.release()

    # Enqueue guards: taken, confirmed, deduped into, moved to the run, ended with it.
    gpath = guards.guard_path(root, "tasks.t", "user:1")
    g1 = guards.Guard("T1", "tasks.t", "finish", time.time() + 60, 0, time.time())
    taken = guards.take(a, [gpath], g1)
    assert taken.outcome is guards.TakeOutcome.TAKEN
    guards.confirm(a, taken, g1)
    g2 = guards.Guard("T2", "tasks.t", "finish", time.time() + 60, 0, time.time())
    assert guards.take(b, [gpath], g2).outcome is guards.TakeOutcome.HELD
    wait_until(lambda: guards.dedupes(c, gpath) == 1, timeout=10, what="the dedupe counted")
    assert guard_report(c, root)
    guards.start(a, [gpath], "T1", 0, "finish")
    assert [g.id for g in guards.release(a, [gpath], "T1", 0, running=True)] == ["T1"]

    # The elected beat: an election won, its ledger loaded, a tick recorded and updated, its
    # status read; then it leaves (its own client, which the election closes).
    gp = group_path(root, "beat-group")
    roles = []
    election = Election(lambda: clients(), f"{gp}/leader", Identity.of_this_process().to_bytes(),
                        lambda role, why: roles.append(role), lambda n: 0.1)
    election.start()
    try:
        assert election.wait(10)
        ledger = Ledger(election.client, gp, timeout=10)
        ledger.load()
        now = datetime.now(timezone.utc)
        tick = TickRecord(now, now, 1, 1, TickState.SENDING, "host:1", election.token, uuid.uuid4().hex)
        assert ledger.write("entry", tick, election.node_if_held()) is Written.RECORDED
        assert ledger.write("entry", tick.sent(), election.node_if_held()) is Written.RECORDED
        assert beat_report(c, root)
    finally:
        election.close()
    assert roles == [Role.LEADER, Role.LEFT]

    # The worker side: the start-up permission probe, and the reaper of a dead pool child's
    # nodes, which connects as a worker does (with credentials: an auth request).
    znodes.probe_permissions(c, root)
    dead = _dead_pid()
    orphan = FairLock(c, f"{root}/k1", identifier=Identity(socket.gethostname(), dead, task_id="T9").to_bytes())
    assert orphan.acquire(timeout=10)
    settings = {"hosts": zk_server.hosts, "auth_secret": [["digest", "someone:secret"]], "root": root}
    assert from_wire(settings).auth_secret  # the field names are right: credentials are sent
    assert reap_nodes(settings, [f"{root}/k1"], "T9", dead, socket.gethostname()) == 1
    orphan.release()

    for cl in (a, b, c):
        cl.stop()


def test_every_request_the_library_sends_is_served_by_zookeeper_3_5(zk_server, clients, wire, monkeypatch):
    # As for a process that has not yet seen this server answer a createContainer: the first
    # new key's container is made beside its create, later ones in one multi with it.
    monkeypatch.setattr(znodes, "_CONTAINERS_WORK", set())
    _exercise(zk_server, clients, f"/zk-version-{uuid.uuid4().hex[:8]}")

    assert not wire.problems(), "\n".join(wire.problems())
    # Not vacuous: what the features above must have sent (pings depend on idle time: not required).
    sent = {OPCODES[c].name for c in wire.sent}
    in_multi = {OPCODES[c].name for c in wire.in_multi}
    assert sent >= {"create", "create2", "createContainer", "delete", "exists", "getData", "setData", "getChildren",
                    "sync", "multi", "auth", "closeSession"}, sorted(sent)
    assert in_multi >= {"create", "create2", "createContainer", "delete", "setData", "check"}, sorted(in_multi)
    assert wire.connects >= 6  # a, b (twice: the reconnection), c, the election's, the reaper's
    # The container create is in use (alone and inside a multi): the README's claim about
    # containers is a claim about this library's requests, not a footnote.
    assert OPCODES[19].name in sent and OPCODES[19].name in in_multi
    print(f"\nconnects: {wire.connects}\nopcodes sent: {sorted(wire.sent)} {sorted(sent)}\ninside multis: {sorted(wire.in_multi)} {sorted(in_multi)}")
