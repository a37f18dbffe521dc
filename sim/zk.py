"""A simulated ZooKeeper and a kazoo client that talks to it, on virtual time.

It keeps what the lock relies on, and no more (docs/simulation.md lists it): the tree with
ephemeral, sequential and container nodes; czxid/mzxid/zxid; one-shot data, exists and
child watches; ``multi`` all or nothing in one zxid (a ``check`` in it fires no watch);
replies and watch events in FIFO order per session; session expiry only after the *negotiated* timeout of silence, on the
server's clock; a lost connection whose in-flight requests may have been applied with
their replies lost (or one that breaks just after the server applies a given request);
leader failover; a server-side delete by an operator.

The client is a :class:`kazoo.client.KazooClient` (the engine checks that) whose requests
go to the simulated server instead of a socket.  Results are kazoo's own ``AsyncResult``,
whose callbacks go through the handler's completion queue as in kazoo (so kazoo's
``rawlink`` quirk is reproduced, not modelled); a lost connection fails pending and queued
requests and clears watchers the way kazoo 2.x does (``_notify_pending``,
``_reset_watchers``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionClosedError, ConnectionLoss, NoNodeError, SessionExpiredError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.handlers.utils import AsyncResult
from kazoo.protocol.serialization import CheckVersion, Create, Create2, Delete, SetData, Transaction
from kazoo.protocol.states import EventType, KazooState, KeeperState, WatchedEvent, ZnodeStat

from celery_zklock.engine import kazoo_compat
from celery_zklock.engine import session as zk_session
from celery_zklock.engine.session import Timers

from .world import Proc, Thread, World
from .zk_server import TICK, Server, ServerSession, parent_of

#: CPython's default switch interval (``sys.getswitchinterval()``): how long a thread may
#: wait for the GIL while another thread of its process runs.
GIL_SWITCH = 0.005


# --------------------------------------------------------------------------- the wire
class Link:
    """One client's connection: requests up, replies and watch events down, FIFO each way.

    A partition holds messages back (TCP would retransmit them); when the client gives up
    on the connection (after two thirds of the session timeout) or the server closes it,
    whatever is still in flight is gone: a request the server applied loses its reply."""

    def __init__(self, client: "SimClient", session: ServerSession) -> None:
        self.client = client
        self.world = client.world
        self.server = client.server
        self.session = session
        self.rng = self.world.rng(f"{client.name}.link")
        self.open = True
        self.closed_by_server = False
        self.closed_at = 0.0
        # kazoo's connection thread wakes on the reset within a few ms of it (or of a thaw),
        # and the process's other threads run meanwhile
        self.notice = self.rng.uniform(0.0, 0.03)
        self._up_last = self._down_last = 0.0
        self.held_up: list = []
        self.held_down: list = []
        self.down: deque = deque()  # [item, delivered] in flight to the client, in order
        self.up: deque = deque()  # [request, arrived] in flight to the server, in order
        # A fault (SimClient.break_on_apply): the connection breaks once the server has
        # applied this request, before its reply leaves: that reply, and whatever else is
        # still on its way to the client, is lost.
        self.breaks_after: Request | None = None
        self.broken = False
        session.link = self

    def _latency(self) -> float:
        r = self.rng.random()
        return 0.0002 + (0.002 if r < 0.9 else 0.02) * self.rng.random()

    def round_trip(self) -> float:
        """A connect's round trip: a request's latency each way."""
        return self._latency() + self._latency()

    def heard_by_server(self) -> bool:
        return self.open and not self.client.partitioned and not self.client.proc.frozen() and self.client.proc.alive

    def to_server(self, item) -> None:
        self._up_last = max(self._up_last, self.world.now + self._latency())
        entry = [item, False]
        self.up.append(entry)
        self.world.at(self._up_last, f"{self.client.name}.up", self._arrive_server, entry)

    @staticmethod
    def _arrived(queue: deque, entry: list) -> bool:
        """Mark ``entry`` arrived and take it off its queue; False if it already arrived
        (taken early by :meth:`early_reply`)."""
        if entry[1]:
            return False
        entry[1] = True
        if queue and queue[0] is entry:
            queue.popleft()
        return True

    def _arrive_server(self, entry) -> None:
        if not self._arrived(self.up, entry):
            return
        item = entry[0]
        if not self.open or self.broken:
            return
        if self.client.partitioned:
            self.held_up.append(item)
            return
        if not self.server.up or not self.session.alive:
            return  # the server closed this connection: the client learns it separately
        self._apply(item)

    def _apply(self, request) -> None:
        try:
            value, error = self.server.apply(self.session.id, request.op), None
        except Exception as exc:  # the request's own error
            value, error = None, exc
        self.session.last_heard = self.world.now
        if request is self.breaks_after:
            self.breaks_after, self.broken = None, True
            self.client.broke(self)
            return
        self.to_client(("reply", request, value, error))

    def to_client(self, item) -> None:
        self._down_last = max(self._down_last, self.world.now + self._latency())
        entry = [item, False]
        self.down.append(entry)
        self.world.at(self._down_last, f"{self.client.name}.down", self._arrive_client, entry,
                      proc=self.client.proc)

    def _arrive_client(self, entry) -> None:
        if not self._arrived(self.down, entry):
            return
        item = entry[0]
        if not self.open or self.broken:
            return
        if self.client.partitioned:
            self.held_down.append(item)
            return
        self.client.conn_thread.put(self.client._receive, self, item)

    def early_reply(self) -> bool:
        """The caller's thread is descheduled for a round trip between two statements (a
        GIL switch is 5 ms; a loopback round trip well under 1): the oldest request in flight
        reaches the server now, and every reply and event before and including its reply
        reaches the client, as kazoo's connection thread would deliver them meanwhile.  The
        race ``kazoo_compat.on_ready`` exists for.  FIFO holds both ways."""
        if (not self.open or self.broken or self.client.partitioned or self.client.conn_thread.items
                or not self.server.up or not self.session.alive):
            return False
        if self.up:
            entry = self.up[0]
            self._arrived(self.up, entry)
            self._apply(entry[0])
        if self.broken or not self.down or self.down[-1][0][0] != "reply":
            return False
        while self.down:
            entry = self.down[0]
            self._arrived(self.down, entry)
            self.client._receive(self, entry[0])
        return True

    def heal(self) -> None:
        up, self.held_up = self.held_up, []
        down, self.held_down = self.held_down, []
        for item in up:
            self.to_server(item)
        for item in down:
            self.to_client(item)

    def server_closed(self) -> None:
        self.closed_by_server = True
        self.closed_at = self.world.now

    def close(self) -> None:
        self.open = False
        self.held_up, self.held_down = [], []


@dataclass(eq=False)
class Request:
    op: tuple
    result: AsyncResult
    watcher: object = None
    watch_kind: str = ""
    post: object = None  # reply value -> what kazoo's call returns


# --------------------------------------------------------------------------- the handler
class SimCondition:
    """What kazoo's AsyncResult waits on.  ``get(timeout=0)`` (a look) is fine; a blocking
    wait is an error: the agent and the engine must never block on ZooKeeper (a blocked
    event or completion thread stalls every lock of the process)."""

    def __init__(self, world: World) -> None:
        self.world = world

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def wait(self, timeout=None) -> None:
        if timeout == 0:
            return
        raise BlockingWait(f"a blocking wait (timeout={timeout}) for a ZooKeeper reply")

    def notify_all(self) -> None:
        return None


class BlockingWait(Exception):
    pass


class SimAsyncResult(AsyncResult):
    """kazoo's AsyncResult, whose ``rawlink`` is a point where a reply may arrive (the
    connection thread runs beside the caller): before a link, the world may deliver the
    client's next reply, so a result can become ready between two links of one caller."""

    def rawlink(self, callback):
        if not self.ready():
            self._handler.preempt()
        return super().rawlink(callback)


class _Queue:
    def __init__(self, thread: Thread) -> None:
        self.thread = thread

    def put(self, fn) -> None:
        self.thread.put(fn)


class SimHandler:
    """kazoo's handler interface on simulated threads of one process."""

    name = "sim"
    timeout_exception = KazooTimeoutError
    running = True

    def __init__(self, world: World, proc: Proc) -> None:
        self.world = world
        self.proc = proc
        self.completion_queue = _Queue(Thread(proc, "completion"))
        self._spawned = 0
        self.client = None  # set by the client it serves
        self.rng = world.rng(f"{proc.name}.preempt")

    def async_result(self) -> AsyncResult:
        return SimAsyncResult(self, lambda: SimCondition(self.world), KazooTimeoutError)

    def preempt(self) -> None:
        """The caller is descheduled between two statements: replies arrive (kazoo's
        connection thread) and the completion thread runs what it can meanwhile."""
        client = self.client
        if client is None or client.link is None or self.rng.random() >= 0.3:
            return
        if not client.link.early_reply():
            return
        ran = 0
        queue = self.completion_queue.thread.items
        while queue and not _takes_engine_lock(queue[0][0]):
            fn, args = queue.popleft()
            fn(*args)
            ran += 1
        if self.world.full_trace is not None:
            self.world.log(f"{client.name}: replies arrived between two links ({ran} callbacks ran meanwhile)")

    def event_object(self):
        return threading.Event()

    def lock_object(self):
        return threading.Lock()

    def rlock_object(self):
        return threading.RLock()

    def spawn(self, fn, *args) -> None:
        self._spawned += 1
        Thread(self.proc, f"spawn{self._spawned}").put(fn, *args)

    def dispatch_callback(self, callback) -> None:
        self.completion_queue.put(lambda: callback.func(*callback.args))


def _takes_engine_lock(fn, seen: set | None = None) -> bool:
    """Would this completion callback take an attempt's lock?  Then it must wait for the
    caller (which may hold it); others may run while the caller is descheduled.  It does if
    an Attempt or one of its collaborators (which take its lock, or hand their replies to
    the attempt) is reachable through its partials, bound self or closures (wrappers such
    as ``on_ready``'s ``once`` included)."""
    from functools import partial

    from celery_zklock.engine.attempt import Attempt, Ghosts, HoldWatch, KeyParent

    def engine(value) -> bool:
        return isinstance(value, (Attempt, KeyParent, Ghosts, HoldWatch))

    seen = set() if seen is None else seen
    if id(fn) in seen:
        return False
    seen.add(id(fn))
    if isinstance(fn, partial):
        return any(engine(a) for a in fn.args) or _takes_engine_lock(fn.func, seen)
    if engine(getattr(fn, "__self__", None)):
        return True
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # not filled yet
            continue
        if engine(value) or (callable(value) and _takes_engine_lock(value, seen)):
            return True
    return False


class SimTimers(Timers):
    """The engine's :class:`~celery_zklock.engine.session.Timers`, woken by the world instead
    of a thread: due callbacks run on the process's timers thread."""

    def __init__(self, world: World, proc: Proc, handler: SimHandler) -> None:
        super().__init__(handler)
        self._started = True  # no loop thread: the world wakes run_due
        self.world = world
        self.proc = proc
        self.thread = Thread(proc, "timers")
        self._armed: float | None = None

    def call_at(self, when, fn, *args):
        handle = super().call_at(when, fn, *args)
        self._arm(when)
        return handle

    def _arm(self, when: float) -> None:
        at = self.world.now + max(0.0, when - self.proc.monotonic())
        if self._armed is not None and self._armed <= at:
            return
        self._armed = at
        self.world.at(at, f"{self.proc.name}.timer-wake", self.thread.put, self._fire, proc=self.proc)

    def _fire(self) -> None:
        self._armed = None
        nxt = self.run_due()
        if nxt is not None:
            self._arm(nxt)


class SimClocks:
    """The package's clocks (:mod:`celery_zklock.engine.clock`) read the running process's."""

    def __init__(self, world: World) -> None:
        self.world = world

    def monotonic(self) -> float:
        proc = self.world.current
        return proc.monotonic() if proc is not None else self.world.now

    def boottime(self) -> float:
        return self.world.now


# --------------------------------------------------------------------------- the client
class _SimSocket:
    """The connection's socket as :func:`celery_zklock.engine.kazoo_compat.drop_connection`
    reaches it: shutting it down drops the connection, on the client's connection thread."""

    def __init__(self, client: "SimClient") -> None:
        self.client = client

    def shutdown(self, _how) -> None:
        c = self.client
        c.world.log(f"{c.name}: connection dropped by the client (a request unanswered too long)")
        c.world.at(c.world.now, f"{c.name}.drop", c.conn_thread.put, c._dropped, proc=c.proc)


class _SimConnection:
    def __init__(self, client: "SimClient") -> None:
        self._socket = _SimSocket(client)
        self.connection_stopped = threading.Event()  # kazoo's: its connection loop ended (never, here)


class SimClient(KazooClient):
    """A kazoo client whose connection is a :class:`Link` to the simulated :class:`Server`."""

    def __init__(self, world: World, server: Server, proc: Proc, name: str, session_timeout: float = 10.0) -> None:
        # Not KazooClient.__init__: no socket, no threads.  Only what the engine reads.
        self.world = world
        self.server = server
        self.proc = proc
        self.name = name
        self.logger = logging.getLogger("sim.zk")
        self.hosts = "sim:2181"
        self.chroot = ""
        self.default_acl = None
        self.handler = SimHandler(world, proc)
        self.handler.client = self
        self.conn_thread = Thread(proc, "zk-conn")
        self._live = threading.Event()
        self._stopped = threading.Event()
        self._session_timeout = int(session_timeout * 1000)
        self._session_id = None
        self.state = KazooState.LOST
        self._listeners: list = []
        self._data_watchers: dict[str, dict] = {}
        self._child_watchers: dict[str, dict] = {}
        self.partitioned = False
        self.link: Link | None = None
        self._pending: list[Request] = []  # sent, not answered
        self._queued: list[Request] = []  # asked while reconnecting: sent once connected
        self._last_recv = world.now
        self._last_send = world.now  # kazoo's ping deadline counts from the last request sent
        self._connection = _SimConnection(self)  # what kazoo_compat.drop_connection reaches
        self.closed = False
        self.on_send = None  # an observer of every request sent (the checks' "place kept")
        self.in_listener = False  # requests sent now are the resumption of a reconnection
        self.last_trouble = -1.0  # when the connection last was not healthy (cut, down, reconnecting)
        # A fault: SIGSTOP right after the next reply a decision rests on (a write's or a
        # delete's proof, a queue read): the instant between a proof's arrival and its use.
        self.pause_on_reply: tuple | None = None  # (seconds, the ops whose reply triggers it)
        # A fault: the connection drops right after the next request of these (op, watch) is
        # sent (its reply never comes: ConnectionLoss), then comes back within the session.
        self.drop_on_send: tuple = ()
        # A fault: the connection breaks just after the server applies the next request of
        # these (op, last field), before its reply is on its way (Link.breaks_after), and is
        # made again at once (_back_at_once).
        self.break_on_apply: tuple = ()
        zk_session.monitor_for(self, timers=SimTimers(world, proc, self.handler))
        self._connect()
        world.at(world.now + TICK, f"{name}.zk-tick", self.conn_thread.put, self._tick, proc=proc)

    # -------------------------------------------------------------- connection state
    @property
    def connected(self) -> bool:
        return self._live.is_set()

    @property
    def _state(self):
        """kazoo's KeeperState (``client_state``), as far as the engine reads it: there is no
        authentication here, so never AUTH_FAILED, and the client never stops connecting on
        its own."""
        if self._stopped.is_set():
            return KeeperState.CLOSED
        return KeeperState.CONNECTED if self.connected else KeeperState.CONNECTING

    def add_listener(self, listener) -> None:
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def _state_change(self, state) -> None:
        self.state = state
        self.world.log(f"{self.name}: {state}")
        self.in_listener = True
        try:
            self._tell_listeners(state)
        finally:
            self.in_listener = False

    def _tell_listeners(self, state) -> None:
        for listener in list(self._listeners):
            try:
                if listener(state) is True:
                    self._listeners.remove(listener)
            except Exception:  # kazoo logs a listener's error and goes on
                logging.getLogger("sim.zk").exception("listener failed")

    def _connect(self) -> None:
        if self._session_id is None or self.server.sessions.get(self._session_id) is None:
            session = self.server.open_session(self._session_timeout / 1000.0)
            self._session_id = session.id
        session = self.server.sessions[self._session_id]
        setattr(self, kazoo_compat._NEGOTIATED, int(session.timeout * 1000))
        self.link = Link(self, session)
        self._last_recv = self.world.now
        session.last_heard = self.world.now
        self._live.set()
        self._state_change(KazooState.CONNECTED)
        queued, self._queued = self._queued, []
        for request in queued:
            self._send(request)

    def _tick(self) -> None:
        if self.closed:
            return
        now = self.world.now
        link = self.link
        if not self.healthy():
            self.last_trouble = now
        if self.connected and link is not None:
            if link.closed_by_server:
                if now - max(link.closed_at, self.proc.thaw_time()) >= link.notice:
                    self._teardown()
            elif self.partitioned or not self.server.up:
                # kazoo 2.11 drops a connection only for a ping left unanswered, and pings only
                # once nothing was sent for half its read timeout (2/3 of the session): each
                # request sent puts that off, so a client that keeps sending never notices.
                if now - max(self._last_recv, self._last_send) >= kazoo_compat.session_timeout(self) * 2 / 3:
                    self._teardown()
            else:
                self._last_recv = now
        elif not self.connected and not self.partitioned and self.server.up:
            self._reconnect()
        self.world.at(now + TICK, f"{self.name}.zk-tick", self.conn_thread.put, self._tick, proc=self.proc)

    def _dropped(self) -> None:
        if self.connected and not self.closed:
            self.last_trouble = self.world.now
            self._teardown()

    def broke(self, link: Link) -> None:
        """Our connection broke just after the server applied a request (Link.breaks_after).
        kazoo's connection thread sees it, fails what is pending, and goes straight on to the
        ensemble's next server (its ``_connect_loop`` tries each host before any retry's
        sleep): connected again within the session a connect's round trip later, while the
        completion thread waits a GIL switch interval.  The CONNECTED listeners then run
        before any failed request's callback has."""
        self.world.log(f"{self.name}: connection broken after the server applied a request, its reply lost")
        self.handler.completion_queue.thread.late(GIL_SWITCH)
        self.world.at(self.world.now, f"{self.name}.drop", self.conn_thread.put, self._dropped, proc=self.proc)
        self.world.at(self.world.now + link.round_trip(), f"{self.name}.drop", self.conn_thread.put,
                      self._back_at_once, proc=self.proc)

    def _back_at_once(self) -> None:
        if not self.connected and not self.closed and not self.partitioned and self.server.up:
            self.world.log(f"{self.name}: connected again at once, to another server")
            self._reconnect()

    def _teardown(self) -> None:
        """The connection is gone (kazoo: CONNECTING): in-flight requests fail with
        ConnectionLoss, whatever the server did with them; watchers get a NONE event."""
        if self.link is not None:
            self.link.close()
        self._live.clear()
        self._fail_pending(ConnectionLoss())
        self._state_change(KazooState.SUSPENDED)
        self._reset_watchers()

    def _reconnect(self) -> None:
        session = self.server.sessions.get(self._session_id)
        if session is None or not session.alive:
            # kazoo: EXPIRED_SESSION -> LOST, pending and queued fail, a new session.
            self._state_change(KazooState.LOST)
            self._fail_pending(SessionExpiredError(), queued=True)
            self._reset_watchers()
            self._session_id = None
            self.world.log(f"{self.name}: session expired, reconnecting with a new one")
        self._connect()

    def _fail_pending(self, exc, queued: bool = False) -> None:
        pending, self._pending = self._pending, []
        if queued:
            pending += self._queued
            self._queued = []
        for request in pending:
            request.result.set_exception(type(exc)())

    def _reset_watchers(self) -> None:
        watchers = [w for table in (self._child_watchers, self._data_watchers) for ws in table.values() for w in ws]
        self._child_watchers, self._data_watchers = {}, {}
        event = WatchedEvent(EventType.NONE, self.state, None)
        for watcher in watchers:
            self.handler.completion_queue.put(lambda w=watcher: w(event))

    def healthy(self) -> bool:
        link = self.link
        return (self.connected and link is not None and link.open and not link.closed_by_server
                and not self.partitioned and self.server.up)

    # -------------------------------------------------------------- faults
    def partition(self) -> None:
        self.partitioned = True
        self.last_trouble = self.world.now
        self.world.log(f"{self.name}: partitioned")

    def heal(self) -> None:
        self.partitioned = False
        self.last_trouble = self.world.now
        self.world.log(f"{self.name}: partition healed")
        if self.link is not None and self.link.open:
            self.link.heal()

    def stop(self) -> None:
        """The process exits: its session ends with its connection (a clean close)."""
        self.closed = True
        self._live.clear()
        self._stopped.set()
        session = self.server.sessions.get(self._session_id)
        if session is not None and session.alive and not self.partitioned and self.server.up:
            self.server.expire(session)  # a clean close; cut off, the server expires it on silence
        if self.link is not None:
            self.link.close()

    # -------------------------------------------------------------- requests
    def _submit(self, op: tuple, watcher=None, watch_kind: str = "", post=None) -> AsyncResult:
        result = self.handler.async_result()
        request = Request(op, result, watcher, watch_kind, post)
        if self.closed:
            result.set_exception(ConnectionClosedError("Connection has been closed"))
        elif self.connected:
            self._send(request)
        else:
            self._queued.append(request)  # kazoo queues while CONNECTING
        return result

    def _send(self, request: Request) -> None:
        if self.on_send is not None:
            self.on_send(request.op)
        if self.world.full_trace is not None:
            self.world.log(f"{self.name} -> {_show(request.op)}")
        self._pending.append(request)
        self._last_send = self.world.now
        self.link.to_server(request)
        if (request.op[0], request.op[-1]) in self.drop_on_send:
            self.drop_on_send = ()
            self.world.log(f"{self.name}: connection drops, a {request.op[0]} request just sent")
            self.world.at(self.world.now, f"{self.name}.drop", self.conn_thread.put, self._dropped, proc=self.proc)
        if (request.op[0], request.op[-1]) in self.break_on_apply:
            self.break_on_apply = ()
            self.link.breaks_after = request

    def _receive(self, link: Link, item) -> None:
        if link is not self.link or not link.open:
            return
        self._last_recv = self.world.now
        if item[0] == "watch":
            _, event_type, path = item
            if event_type in (EventType.CREATED, EventType.CHANGED):
                watchers = list(self._data_watchers.pop(path, {}))
            elif event_type == EventType.CHILD:
                watchers = list(self._child_watchers.pop(path, {}))
            else:
                watchers = list(self._data_watchers.pop(path, {})) + list(self._child_watchers.pop(path, {}))
            event = WatchedEvent(event_type, "CONNECTED", path)
            if self.world.full_trace is not None:
                self.world.log(f"{self.name} <- watch {event_type} {path} ({len(watchers)} watchers)")
            for watcher in watchers:
                self.handler.completion_queue.put(lambda w=watcher: w(event))
            return
        _, request, value, error = item
        if self.pause_on_reply is not None and request.op[0] in self.pause_on_reply[1]:
            length, self.pause_on_reply = self.pause_on_reply[0], None
            self.world.log(f"{self.proc.name}: stopped (SIGSTOP) for {length:.2f} s, a {request.op[0]} reply just read")
            self.proc.pause(length)
        if self.world.full_trace is not None:
            self.world.log(f"{self.name} <- {_show(request.op)}: {error!r}" if error is not None else
                           f"{self.name} <- {_show(request.op)}: {_show_value(value)}")
        if request in self._pending:
            self._pending.remove(request)
        if request.watcher is not None and (error is None):
            table = self._child_watchers if request.watch_kind == "child" else self._data_watchers
            table.setdefault(request.op[1], {})[request.watcher] = None
        if error is not None:
            request.result.set_exception(error)
        else:
            try:
                out = request.post(value) if request.post is not None else value
            except Exception as exc:
                request.result.set_exception(exc)
            else:
                request.result.set(out)

    def sent_creates_under(self, parent: str) -> bool:
        """A create under ``parent`` is on its way (sent or queued, not yet answered)."""
        prefix = parent + "/"
        for request in self._pending + self._queued:
            ops = request.op[1] if request.op[0] == "multi" else [request.op]
            if any(o[0] == "create" and o[1].startswith(prefix) for o in ops):
                return True
        return False

    # kazoo's public calls the lock uses
    def create_async(self, path, value=b"", acl=None, ephemeral=False, sequence=False, makepath=False,
                     include_data=False):
        outer = self.handler.async_result()

        def sent():
            inner = self._submit(("create", path, value, ephemeral, sequence, False),
                                 post=lambda v: (v[0], v[1]) if include_data else v[0])
            inner.rawlink(done)

        def done(inner):
            try:
                outer.set(inner.get())
            except NoNodeError:
                if not makepath:
                    return outer.set_exception(NoNodeError())
                again = self._submit(("ensure", parent_of(path)))
                again.rawlink(lambda r: sent_after_ensure(r))
            except Exception as exc:
                outer.set_exception(exc)

        def sent_after_ensure(r):
            try:
                r.get()
            except Exception as exc:
                return outer.set_exception(exc)
            inner = self._submit(("create", path, value, ephemeral, sequence, False),
                                 post=lambda v: (v[0], v[1]) if include_data else v[0])
            inner.rawlink(lambda i: _copy(i, outer))

        sent()
        return outer

    def get_async(self, path, watch=None):
        return self._submit(("get", path, watch is not None), watch, "data")

    def get_children_async(self, path, watch=None, include_data=False):
        return self._submit(("children", path, watch is not None), watch, "child")

    def exists_async(self, path, watch=None):
        return self._submit(("exists", path, watch is not None), watch, "data")

    def set_async(self, path, value, version=-1):
        return self._submit(("set", path, value, version))

    def delete_async(self, path, version=-1):
        return self._submit(("delete", path, version))

    def ensure_path_async(self, path, acl=None):
        return self._submit(("ensure", path))

    def sync_async(self, path):
        return self._submit(("sync", path))

    def _call(self, request, async_object):
        """kazoo's request objects the engine sends itself: ``createContainer``, the
        multi-create and kazoo's own ``Transaction`` (replies as kazoo reads them)."""
        ops = _ops_of(request)
        inner = self._submit(("multi", ops) if ops is not None else _op_of(request))
        inner.rawlink(lambda r: _copy(r, async_object))
        return True

    def unchroot(self, path):
        return path


def _copy(src: AsyncResult, dst: AsyncResult) -> None:
    try:
        dst.set(src.get())
    except Exception as exc:
        dst.set_exception(exc)


def _is_create(op: tuple) -> bool:
    return op[0] == "create"


def _op_of(request) -> tuple:
    flags = getattr(request, "flags", 0)
    if isinstance(request, (Create, Create2)) or type(request).__name__ == "CreateContainer":
        container = type(request).__name__ == "CreateContainer"
        return ("create", request.path, request.data, bool(flags & 1), bool(flags & 2), container)
    if isinstance(request, Delete):
        return ("delete", request.path, request.version)
    if isinstance(request, SetData):
        return ("set", request.path, request.data, request.version)
    if isinstance(request, CheckVersion):
        return ("check", request.path, request.version)
    raise NotImplementedError(f"the simulated server does not know {type(request).__name__}")


def _ops_of(request):
    if isinstance(request, Transaction):
        return [_op_of(op) for op in request.operations]
    return None


def _show(op: tuple) -> str:
    if op[0] == "multi":
        return "multi[" + ", ".join(_show(o) for o in op[1]) + "]"
    return f"{op[0]} {op[1]}" + (" +watch" if op[0] in ("get", "exists", "children") and op[2] else "")


def _show_value(value) -> str:
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], ZnodeStat):
        return f"{value[0]} (czxid {value[1].czxid:#x})" if isinstance(value[0], str) else f"stat czxid {value[1].czxid:#x}"
    if isinstance(value, ZnodeStat):
        return f"stat czxid {value.czxid:#x}"
    if isinstance(value, list):
        return "[" + ", ".join(_show_value(v) if not isinstance(v, str) else v[-16:] for v in value) + "]"
    return repr(value)[:60]
