"""The worker's main process for real: ``WaitOutsidePool`` and its ``HeldLeases`` on virtual time.

The held-aside scenarios (``sim/run.py``, shape ``broker``) run the production consumer
step, :class:`celery_zklock.worker.wait_outside_pool.WaitOutsidePool`, unchanged, with its
connection to the real agent the simulator already runs (``agent_connection``: the socket read
in the hub, the ``Outbox``) and its Redis leases (``held_lease``), against a broker model
(:mod:`sim.broker`: Redis or RabbitMQ).  Around it, what Celery gives it, modelled:

* the consumer ``c``: kombu's hub (``call_soon``, ``call_later``, ``call_repeatedly``,
  readers and writers) run as the process's event loop, one turn per simulated event, on
  the main process's clock, so a stalled main process runs nothing; the consumer's QoS
  (its window sent to the channel when ``qos.prev != qos.value``, as asynloop does); the
  prefork pool's books as ``next_in_line`` reads them (the semaphore's ``value`` and
  ``_waiting``, the outbound buffer); the task consumer's channel and the connection's
  default channel; Celery's worker state (``reserved_requests``, ``active_requests``), per
  process;
* a request per delivery (``id``, ``task``, ``message`` with ``delivery_tag``,
  ``channel``, ``ack``/``reject``, ``acknowledged``, ``delivery_info`` with the
  ``redelivered`` flag), reserved as it is delivered, acknowledged when a pool process
  accepts it (Celery's ``on_accepted`` for a task that is not ``acks_late``), read in the
  main process's loop; an ack or reject on a lost connection raises, and Celery logs it;
* Celery's own dispatch (``c.on_task_request``, the step's ``inner``): the semaphore, then
  a free pool process (the simulator's pool process model, as in the other scenarios),
  which checks a delivery flagged ``redelivered`` against the result store with the real
  ``redelivery.earlier_run`` once it holds the lock (``decision.claimed_lock``), and
  stores the final state just after its lock's release;
* a broker connection lost and made again (:meth:`CeleryMain.cut_connection`), in
  ``Consumer.start``'s order: the broker's side (RabbitMQ requeues the unacknowledged
  messages; Redis keeps them in ``unacked``), ``on_connection_error_after_connected`` (the
  step's wrapper: ``no_restore_on_a_dead_channel``), ``c.on_close`` (the step's, around
  Celery's: the semaphore's waiting requests dropped, reserved cut down to active), the
  steps' ``stop`` with the blueprint in RUN, kombu closing the channel (a restore only with
  ``do_restore``), the hub's readers and writers forgotten; the main process blocks for the
  reconnection's gap (its host cannot reach the broker meanwhile: a pool process's publish
  fails), then a new channel and QoS, the step's ``start`` and
  ``register_with_event_loop``;
* a warm shutdown (:meth:`CeleryMain.stop_warm`), with the connection lost as it begins or
  not: ``c.on_close``, the blueprint in CLOSE, the step's ``stop`` (what it logs as gone back
  is checked against what the broker took), no more consuming, the pool finishing its work
  (a request next in line told "shutdown" is published back by its pool process), then
  the main process exits; a worker killed whole (:func:`kill_worker`).

Seams, all in the simulator (nothing in ``celery_zklock`` changes): the modules' ``time``,
``socket`` and ``select`` are replaced by virtual ones; ``agent_supervisor._agent``,
``wait_outside_pool._step`` and Celery's ``reserved_requests`` and ``active_requests`` (one per
process in production) are set to the running worker's at every turn of its loop.  Each
turn runs the hub's ``call_soon`` callbacks first (kombu's ``_ready``), then its due timers,
the agent's socket and the broker's socket in an order the seed draws per turn: after a
stall, any of them may come first.

Not modelled: the agent's death and restart (a kill of the agent fails the run), a Redis
outage seen by renewals alone (a reconnection's dead channel fails them), a broker
unreachable at a warm shutdown (a pool process's publish back works then), heartbeats.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from contextlib import contextmanager
from types import SimpleNamespace

from celery.bootsteps import CLOSE, RUN
from celery.worker import state as worker_state

from celery_zklock import redelivery
from celery_zklock.worker import agent_connection, agent_supervisor, held_lease, wait_outside_pool
from celery_zklock.worker.agent_protocol import BYPASSED, CARRIED, Carry, LineReader, encode, from_wire

from .broker import EPOCH, ConnectionLost, noticed
from .world import Proc

_world = None
_by_path: dict = {}  # agent socket path -> the main process that connects there
_by_fd: dict = {}  # fake descriptor -> its socket


# ---------------------------------------------------------------------- the seams
class _Time:
    """``time`` as wait_outside_pool, agent_connection, agent_supervisor and held_lease read it."""

    @staticmethod
    def monotonic() -> float:
        proc = _world.current
        return proc.monotonic() if proc is not None else _world.now

    @staticmethod
    def time() -> float:
        return EPOCH + _world.now

    @staticmethod
    def sleep(_seconds) -> None:
        raise AssertionError("a blocking sleep in the worker's main process")


class _SocketModule:
    AF_UNIX = 1
    SOCK_STREAM = 1

    @staticmethod
    def socket(_family, _type):
        return SimSocket()


class _SelectModule:
    @staticmethod
    def select(r, w, _x, _timeout=None):
        return [s for s in r if s.readable()], list(w), []


_CELERY_STATE = (worker_state.reserved_requests, worker_state.active_requests)


def uninstall() -> None:
    """Celery's worker state as it was (the simulated workers set theirs at every turn)."""
    worker_state.reserved_requests, worker_state.active_requests = _CELERY_STATE


def install(world) -> None:
    """Point the seams at ``world`` (a new one per seed)."""
    global _world
    _world = world
    _by_path.clear()
    _by_fd.clear()
    for module in (wait_outside_pool, agent_connection, agent_supervisor, held_lease):
        module.time = _Time
    for module in (agent_connection, agent_supervisor):
        module.socket = _SocketModule
        module.select = _SelectModule
    agent_supervisor._agent = None
    wait_outside_pool._step = None


class SimSocket:
    """The main process's end of the agent's Unix socket: what it sends goes to the agent as
    messages (over the simulator's wire), what the agent sends waits here until read."""

    _fds = 1000

    def __init__(self) -> None:
        SimSocket._fds += 1
        self.fd = SimSocket._fds
        _by_fd[self.fd] = self
        self.main = None
        self.inbound = bytearray()
        self.eof = False
        self.closed = False
        self.out = LineReader()

    def settimeout(self, _t) -> None:
        pass

    def setblocking(self, _b) -> None:
        pass

    def connect(self, path: str) -> None:
        main = _by_path.get(path)
        if main is None or not main.worker.agent_proc.alive:
            raise ConnectionRefusedError(path)
        self.main = main
        main.attach(self)

    def fileno(self) -> int:
        return self.fd

    def send(self, data) -> int:
        if self.closed or self.eof:
            raise BrokenPipeError()
        for msg in self.out.feed(bytes(data)):
            self.main.to_agent.send(msg)
        return len(data)

    def recv(self, _n: int) -> bytes:
        if self.inbound:
            data = bytes(self.inbound)
            self.inbound.clear()
            return data
        if self.eof:
            return b""
        raise BlockingIOError()

    def readable(self) -> bool:
        return bool(self.inbound) or self.eof

    def close(self) -> None:
        self.closed = True
        _by_fd.pop(self.fd, None)


class SimAgentProcess:
    """``agent_supervisor.AgentProcess`` for one simulated worker (its agent is already up)."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.settings = worker.settings
        self.path = f"/sim/{worker.name}.sock"  # the path actors.Worker gives its agent

    def start(self) -> None:
        self.worker.run.checks.fail(f"{self.worker.name}: its lock agent is started again (not modelled)")

    def start_again(self) -> None:
        self.start()

    def kill(self) -> None:
        self.worker.run.checks.fail(f"{self.worker.name}: its main process kills its lock agent (silent for "
                                    f"{self.worker.main.step.agent.silence():.2f} s)")

    @property
    def alive(self) -> bool:
        return self.worker.agent_proc.alive


# ---------------------------------------------------------------------- the hub
class _Timer:
    def __init__(self, hub, interval: float | None, fn, args) -> None:
        self.hub = hub
        self.interval = interval
        self.fn = fn
        self.args = args
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class SimHub:
    """kombu's ``Hub`` as the step uses it, turned by simulated events on the main process."""

    def __init__(self, main: "CeleryMain") -> None:
        self.main = main
        self.world = main.world
        self.rng = self.world.rng(f"{main.proc.name}.hub")
        self.ready: deque = deque()
        self.timers: list = []  # (due, n, timer)
        self.readers: dict = {}
        self.writers: dict = {}
        self.n = 0
        self.turns = 0
        self.next_turn = float("inf")

    # kombu's API
    def call_soon(self, fn, *args):
        self.ready.append((fn, args))
        self.wake()
        return fn

    def call_later(self, delay: float, fn, *args):
        return self._enter(delay, _Timer(self, None, fn, args))

    def call_repeatedly(self, interval: float, fn, *args):
        return self._enter(interval, _Timer(self, interval, fn, args))

    def _enter(self, delay: float, timer: _Timer) -> _Timer:
        self.n += 1
        heapq.heappush(self.timers, (self.world.now + delay, self.n, timer))
        self.wake(self.world.now + delay)
        return timer

    def add_reader(self, fd, cb, *args) -> None:
        self.readers[fd] = (cb, args)
        self.wake()

    def add_writer(self, fd, cb, *args) -> None:
        self.writers[fd] = (cb, args)
        self.wake()

    def remove_writer(self, fd) -> None:
        self.writers.pop(fd, None)

    def remove_reader(self, fd) -> None:
        self.readers.pop(fd, None)

    def remove(self, fd) -> None:
        self.readers.pop(fd, None)
        self.writers.pop(fd, None)

    # the loop
    def wake(self, at: float | None = None, latency: float = 0.0) -> None:
        at = (self.world.now if at is None else at) + latency
        if at < self.next_turn - 1e-9:
            self.next_turn = at
            self.world.at(at, f"{self.main.proc.name}.hub", self._turn, proc=self.main.proc)

    def _turn(self) -> None:
        main = self.main
        if not main.alive or self.world.now < self.next_turn - 1e-9:
            return  # a later turn was asked for after an earlier one was scheduled: that one runs
        self.next_turn = float("inf")
        if main.reconnecting:
            return  # Consumer.start: the steps start again (the step's start first) before the loop turns
        self.turns += 1
        main.enter()
        self.run_ready()
        parts = [self._fire_timers, self._poll, main.consume]
        self.rng.shuffle(parts)
        for part in parts:
            if main.alive:
                part()
        if not main.alive:
            return
        qos = main.c.qos
        if qos.prev != qos.value:  # asynloop: the window is sent once per turn
            qos.update()
        if self.ready or any(s.readable() for s in self._sockets()) or main.can_consume():
            self.wake(latency=0.0002)
        elif self.timers:
            self.wake(self.timers[0][0])

    def run_ready(self) -> None:
        """The callbacks that were ready run now: at each turn, and at a loss (kombu's
        ``Hub.reset``, ``_close``)."""
        todo, self.ready = self.ready, deque()
        for fn, args in todo:
            fn(*args)

    def _sockets(self):
        return [_by_fd[fd] for fd in self.readers if fd in _by_fd]

    def _fire_timers(self) -> None:
        now = self.world.now
        due = []
        while self.timers and self.timers[0][0] <= now + 1e-12:
            due.append(heapq.heappop(self.timers)[2])
        for timer in due:
            if timer.cancelled:
                continue
            if timer.interval is not None:
                self._enter(timer.interval, timer)
            timer.fn(*timer.args)

    def _poll(self) -> None:
        for fd, (cb, args) in list(self.readers.items()):
            sock = _by_fd.get(fd)
            if sock is not None and sock.readable() and self.readers.get(fd) == (cb, args):
                cb(*args)
        for fd, (cb, args) in list(self.writers.items()):
            if self.writers.get(fd) == (cb, args):  # kombu looks each up as it comes: one removed
                cb(*args)                            # earlier in the same turn does not fire


class _PostToLoop:
    """What a pool process tells the main process (its result pipe): read in its loop."""

    def __init__(self, main: "CeleryMain") -> None:
        self.main = main

    def put(self, fn, *args) -> None:
        if self.main.alive:
            self.main.hub.call_soon(fn, *args)


# ---------------------------------------------------------------------- Celery's side
class _Opts:
    timeout = None


class SimTask:
    """A locked task as the step sees it (``task.LockedTask``'s surface)."""

    name = "sim.locked"
    acks_late = False
    lock_max_holders = 1
    send_events = False
    track_started = False
    ignore_result = True
    backend = None

    def lock_options(self):
        return _Opts

    def lock_paths(self, args, kwargs, opts):
        return [args[0]]

    def lock_read_paths(self, args, kwargs, opts=None, request=None):
        return frozenset()  # the modelled task writes its key (lock_mode "write")

    def lock_keys(self, args, kwargs):
        return (args[0],)


TASK = SimTask()


class SimMessage:
    """kombu's ``Message`` on the channel it was delivered on (Redis or AMQP): an ack or
    reject on a channel whose connection is gone raises (kombu's connection error)."""

    def __init__(self, delivery) -> None:
        self.delivery = delivery
        self.delivery_tag = delivery.tag
        self.channel = delivery.channel
        self._state = "RECEIVED"

    @property
    def acknowledged(self) -> bool:
        return self._state in ("ACK", "REJECTED", "REQUEUED")

    def ack(self) -> None:
        if self.acknowledged:
            raise RuntimeError(f"Message already acknowledged with state: {self._state}")
        self.channel.ack(self.delivery)
        self._state = "ACK"

    def reject(self, requeue: bool = False) -> None:
        if self.acknowledged:
            raise RuntimeError(f"Message already acknowledged with state: {self._state}")
        self.channel.reject(self.delivery, requeue)
        self._state = "REQUEUED" if requeue else "REJECTED"


class SimRequest:
    """Celery's ``Request`` for one delivery, with what the step and held_lease read."""

    def __init__(self, main: "CeleryMain", delivery) -> None:
        self.delivery = delivery
        self.id = delivery.msg.task_id
        self.task = TASK
        self.path = delivery.msg.path
        self.message = SimMessage(delivery)
        self.args = (delivery.msg.path,)
        self.kwargs: dict = {}
        self.request_dict = {"retries": 0}
        self.hostname = main.worker.name
        self.expires = None
        self.eventer = None
        self.delivery_info = {"redelivered": delivery.redelivered}
        self.acknowledged = False
        self.main = main

    def acknowledge(self) -> None:  # Celery: a failed ack is logged, not raised (ack_log_error)
        if not self.acknowledged:
            with self._lost_at_shutdown():
                self.message.ack()
            self.acknowledged = True

    def reject(self, requeue: bool = False) -> None:
        if not self.acknowledged:
            with self._lost_at_shutdown():
                self.message.reject(requeue)
            self.acknowledged = True

    @contextmanager
    def _lost_at_shutdown(self):
        """A connection error is logged (``ack_log_error``).  kombu's AttributeError on a
        closed Redis channel is not: it ends the worker ("Unrecoverable error", the run
        crashes), except in a warm shutdown, whose hub close logs it ("Error on stopping Hub")."""
        try:
            yield
        except (RuntimeError, ConnectionError):
            pass
        except AttributeError:
            if not self.main.stopping:
                raise

    def revoked(self) -> bool:
        self.acknowledge()
        return True

    def maybe_expire(self) -> bool:
        return False

    def send_event(self, *args, **kwargs) -> None:
        pass


class _QoS:
    """Celery's consumer QoS: ``value`` is Celery's window; ``update`` sends it (``callback``)."""

    def __init__(self, channel, value: int) -> None:
        self.value = value
        self.prev = None
        self.max_prefetch = None

        def callback(prefetch_count):
            channel.prefetch = prefetch_count
            channel.wake()

        self.callback = callback

    def update(self) -> None:
        self.prev = self.value
        self.callback(prefetch_count=self.value)


class _Semaphore:
    """The worker's pool semaphore (one permit per free process) as next_in_line reads it."""

    def __init__(self, main: "CeleryMain") -> None:
        self.main = main
        self._waiting: deque = deque()

    @property
    def value(self) -> int:
        return sum(1 for pool in getattr(self.main.worker, "pools", ()) if pool.free())


class _Requests:
    """Celery's ``reserved_requests`` or ``active_requests`` for one process.  Celery's is a
    ``WeakSet``: it iterates in the order of its requests' addresses, which follow when the
    garbage collector last freed memory (a plain set here did the same, so the step's
    ``dropped`` list came out in a heap-dependent order).  The seed draws that order here,
    from the order the requests came in: a replay does not depend on the heap, and the
    step meets every order."""

    def __init__(self, rng) -> None:
        self.rng = rng
        self._in: dict = {}  # request -> None, in the order added

    def add(self, req) -> None:
        self._in[req] = None

    def discard(self, req) -> None:
        self._in.pop(req, None)

    def clear(self) -> None:
        self._in.clear()

    def update(self, reqs) -> None:
        for req in reqs:
            self._in[req] = None

    def __contains__(self, req) -> bool:
        return req in self._in

    def __len__(self) -> int:
        return len(self._in)

    def __iter__(self):
        order = list(self._in)
        self.rng.shuffle(order)
        return iter(order)


PreforkPool = type("TaskPool", (), {"__module__": "celery.concurrency.prefork"})


class CeleryMain:
    """A worker's main process: the real consumer step on a modelled Celery consumer."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.world = worker.world
        self.run = worker.run
        self.broker = worker.run.broker
        self.proc = Proc(self.world, worker.host, f"{worker.name}.main")
        self.alive = True
        self.stalls: list[tuple[float, float]] = []  # (from, to): when this process did not run (a fault)
        self.turns_at_death: int | None = None
        self.requests: dict[str, dict] = {}  # every request handed to the pool (the end checks read it)
        self.hub = SimHub(self)
        self.thread = _PostToLoop(self)
        # Celery's worker state (celery.worker.state), per process: set at every turn (enter)
        self.reserved = _Requests(self.world.rng(f"{self.proc.name}.reserved"))  # task_reserved: delivered, not done
        self.active = _Requests(self.world.rng(f"{self.proc.name}.active"))  # task_accepted: a pool process took it
        # BRPOP: Redis answers the blocked clients in turn; who reads first is a draw
        self.brpop = self.world.rng(f"{self.proc.name}.brpop")
        self.cuts = 0
        self.stopping = False  # a warm shutdown began: no more consuming
        self.cut_when_waiting: float | None = None  # a fault: cut the connection (for this long) when a
        # granted request next waits for a pool process
        self.unreachable_until = -1.0  # the broker cannot be reached from this host (a reconnection's gap)
        self.reconnecting = False  # between a loss and its reconnection: the event loop does not turn
        pools = worker.pool_count
        c = self.c = SimpleNamespace()
        c.hub = self.hub
        self._new_channel()
        c.pool = PreforkPool()
        c.pool.limit = pools
        c.pool._pool = SimpleNamespace(_processes=pools, outbound_buffer=deque())
        c.controller = SimpleNamespace(semaphore=_Semaphore(self))
        c.blueprint = SimpleNamespace(state=None, on_close=None)
        c.on_close = self._celery_close
        c.on_connection_error_after_connected = lambda exc: None  # Celery's: a warning
        c.on_task_request = self.to_pool
        self.peer = None
        self.to_agent = None
        self.sock = None
        self.agent_process = SimAgentProcess(worker)
        _by_path[self.agent_process.path] = self
        self.enter()
        self.step = wait_outside_pool.WaitOutsidePool(c)
        if not self.step.active:
            raise AssertionError("the consumer step is not active")
        self.enter()
        self.step.start(c)
        self.step.register_with_event_loop(c, self.hub)
        self.hub.wake()

    def enter(self) -> None:
        """This process's module state (one worker per process in production)."""
        agent_supervisor._agent = self.agent_process
        wait_outside_pool._step = getattr(self, "step", None)
        worker_state.reserved_requests = self.reserved
        worker_state.active_requests = self.active

    def _new_channel(self) -> None:
        """The consumer's connection, channel and QoS (Celery makes a new QoS at each start
        of its Tasks step: the window is sent on the new channel)."""
        c = self.c
        self.channel = self.broker.channel(self.worker)
        self.channel.on_wake = lambda: self.alive and self.hub.wake(latency=self.brpop.uniform(0.0001, 0.002))
        c.qos = _QoS(self.channel, 4 * self.worker.pool_count)  # worker_prefetch_multiplier 4
        c.task_consumer = SimpleNamespace(channel=self.channel)
        c.connection = SimpleNamespace(_default_channel=self.channel, default_channel=self.channel)

    # a broker connection lost, and made again (celery/worker/consumer/consumer.py, Consumer.start)
    def cut_connection(self, gap: float) -> None:
        """The broker connection drops: the broker's side first (RabbitMQ requeues the
        channel's unacknowledged messages; Redis keeps them in ``unacked``), then Celery's:
        ``on_connection_error_after_connected`` (the step's wrapper: no restore on the dead
        channel), ``c.on_close`` (the step's, around Celery's), the blueprint's restart (the
        steps' ``stop`` with the blueprint still in RUN), kombu closing the channel, the hub
        reset (its readers and writers forgotten); the main process then blocks in the
        reconnection for ``gap`` and starts the steps again (``start``,
        ``register_with_event_loop``)."""
        if not self.alive or self.stopping or self.channel.dead:
            return  # gone, stopping, or between a loss and its reconnection already
        world = self.world
        self.cuts += 1
        world.log(f"fault: {self.worker.name}'s broker connection lost ({self.broker.kind}); back in {gap:.2f} s")
        channel = self.channel
        channel.turns_at_cut = self.hub.turns
        self.broker.cut(channel)  # at once; Celery hears of it when its loop next runs
        world.at(world.now, f"{self.proc.name}.lost", self._lost, channel, gap, proc=self.proc)

    def _lost(self, channel, gap: float) -> None:
        if not self.alive or self.stopping:
            return
        world = self.world
        self.enter()
        noticed(channel)
        self.hub.run_ready()  # asynloop's error: kombu's Hub.reset runs what was ready (an ack meets the lost connection)
        self.c.on_connection_error_after_connected(ConnectionLost("connection lost"))
        self.c.on_close()
        self.c.blueprint.state = RUN
        self.step.stop(self.c)
        self.broker.closed(channel)
        self.hub.readers.clear()
        self.hub.writers.clear()
        self.reconnecting = True
        self.proc.pause(gap)  # Connection step: ensure_connection blocks the main process
        self.unreachable_until = world.now + gap  # for this host's pool processes too
        world.at(world.now + gap, f"{self.proc.name}.reconnect", self._reconnected, proc=self.proc)

    def _reconnected(self) -> None:
        self.reconnecting = False
        if not self.alive or self.stopping:
            self.hub.wake()
            return
        self.world.log(f"{self.proc.name}: broker connection made again")
        self.enter()
        self._new_channel()
        self.step.start(self.c)
        self.step.register_with_event_loop(self.c, self.hub)
        self.hub.wake()

    def _celery_close(self) -> None:
        """Celery's ``Consumer.on_close``: the semaphore's waiting requests dropped, reserved
        requests cut down to the active ones, the pool's unsent jobs flushed (the model
        writes a job to a free process at once: none)."""
        waiting = self.c.controller.semaphore._waiting
        for _fn, args, _kw in list(waiting):
            job = args[0].job
            job["done"] = job["dropped"] = True
            self.world.log(f"{self.proc.name}: drops {job['id']} (it waited for a pool process)")
        waiting.clear()
        self.reserved.clear()
        self.reserved.update(self.active)

    # the agent's socket
    def attach(self, sock: SimSocket) -> None:
        self.sock = sock
        self.peer = self.worker.connect(self, "main")
        self.worker.agent.peers.add(self.peer)

    def receive(self, msg) -> None:
        """A message from the agent reaches the socket (the wire runs on this process)."""
        if self.sock is not None and not self.sock.closed:
            self.sock.inbound += encode(msg)
            self.hub.wake()

    # the broker's socket
    def can_consume(self) -> bool:
        return not self.stopping and bool(self.broker.queue) and self.channel.room() > 0

    def consume(self) -> None:
        """BRPOP's reply read: each message becomes a request, given to ``c.on_task_request``
        (the step's hook) as Celery's task strategy does."""
        if self.stopping:
            return
        for delivery in self.channel.fetch(self.hub.turns):
            req = SimRequest(self, delivery)
            delivery.req = req
            self.reserved.add(req)  # Celery's task_reserved, before the strategy's handler
            if self.world.full_trace is not None:
                self.world.log(f"{self.proc.name}: delivered {req.id} ({req.message.delivery_tag}"
                               f"{', redelivered' if delivery.redelivered else ''})")
            self.c.on_task_request(req)
            if not self.alive:
                return

    # Celery's dispatch (the step's ``inner``)
    def to_pool(self, req: SimRequest) -> None:
        req.delivery.handed_at = self.world.now
        info = req.delivery_info
        nodes, carry = {}, None
        if info.get(CARRIED) is not None:
            carry = from_wire(Carry, info[CARRIED])  # as agent_client.carried_grant reads it
            wait = self.worker.agent.requests.waits.get(req.id)
            nodes = dict(wait.verdict.nodes or {}) if wait is not None and wait.verdict is not None else {}
        job = {"id": req.id, "seq": getattr(req, "zklock_seq", None), "path": req.path, "verdict": "handed",
               "dispatched": True, "done": False, "carry": carry, "nodes": nodes,
               "bypassed": bool(info.get(BYPASSED)), "creq": req,
               "on_start": self._accepting, "on_body": self._body, "on_end": self._stored,
               "on_shutdown": self._published_back}
        req.job = job
        self.requests[f"{req.id}#{len(self.requests)}"] = job
        if self.world.full_trace is not None:
            self.world.log(f"{self.proc.name}: hands {req.id} to the pool"
                           f"{' (bypassed)' if job['bypassed'] else ''}{' with its grant' if job['carry'] else ''}")
        self.c.controller.semaphore._waiting.append((self._dispatch, (req,), {}))
        self.feed()
        if self.cut_when_waiting is not None and self.c.controller.semaphore._waiting:
            gap, self.cut_when_waiting = self.cut_when_waiting, None
            self.world.at(self.world.now, f"{self.proc.name}.cut", self.cut_connection, gap, proc=self.proc)

    def feed(self) -> None:
        waiting = self.c.controller.semaphore._waiting
        for pool in self.worker.pools:
            if not waiting:
                return
            if pool.free():
                fn, args, _kw = waiting.popleft()
                fn(pool, *args)

    def _dispatch(self, pool, req: SimRequest) -> None:
        pool.dispatch(req.job)

    def _accepting(self, pool) -> None:
        """A pool process took the job: Celery's on_accepted, read in this loop, acks it."""
        job = pool.req
        self.thread.put(self._accepted, job)

    def _accepted(self, job: dict) -> None:
        if not job["done"]:
            self.active.add(job["creq"])  # task_accepted
        job["creq"].acknowledge()

    def _body(self, pool):
        """The pool process holds the lock: its body begins, unless the delivery is flagged
        redelivered and the result store says an earlier run finished (decision's
        claimed_lock: ``ran_before``, whose reading is ``redelivery.earlier_run``)."""
        job = pool.req
        job["ran"] = True
        delivery = job["creq"].delivery
        if delivery.redelivered:
            earlier = redelivery.earlier_run(self.broker.state_of(job["id"]))
            if earlier is redelivery.Earlier.FINISHED:
                self.world.log(f"{pool.proc.name}: {job['id']} is a redelivered copy of a finished run: not run")
                job["skipped"] = True
                return False
        job["body"] = self.run.checks.body_started(pool, delivery)
        return True

    def _stored(self, pool, job: dict) -> None:
        """The pool process stores the body's final state, just after its lock's release (none
        when the task keeps no result: a copy flagged ``redelivered`` then finds nothing and
        runs, as ``redelivery.ran_before`` lets it with ``ignore_result``)."""
        body = job.get("body")
        if body is not None and body.stored_at is None and self.broker.keeps_results:
            body.stored_at = self.world.now
            self.broker.store(job["id"], "SUCCESS")

    def finished(self, job: dict) -> None:
        """The pool is done with it: a task that did not succeed tells the step (Celery's
        failure path, worker_hooks.LockAwareRequest); a free process takes the next job."""
        job["done"] = True
        self.reserved.discard(job["creq"])  # task_ready
        self.active.discard(job["creq"])
        if not job.get("ran"):
            self.enter()
            self.step.request_finished(job["creq"])
        self.feed()

    def _published_back(self, pool, job: dict) -> None:
        """Told "shutdown" next in line (the worker stops warm): the pool process publishes the
        task back to the broker, a new message with the same id (decision: Verdict.SHUTDOWN, shut_down)."""
        if self.world.now < self.unreachable_until:  # apply_async raises: the task is lost
            self.world.log(f"{pool.proc.name}: {job['id']} cannot be published back: the broker is out of reach")
            return
        self.world.log(f"{pool.proc.name}: {job['id']} goes back to the broker (the worker stops)")
        self.broker.publish(job["id"], job["path"], copy=job["creq"].delivery.redelivered)  # redelivery.publish_again

    # a warm shutdown (celery/bootsteps.py, Blueprint.stop)
    def stop_warm(self, cut: bool) -> None:
        """The worker stops warm (SIGTERM): the consumer's blueprint closes (``c.on_close``),
        goes to CLOSE and stops its steps (the step's ``stop``: held requests rejected with
        requeue, counted only if the broker took them), the pool finishes what it runs, then
        the main process exits.  With ``cut``, the broker connection is lost just as the
        shutdown begins: every reject fails, and what the step logs as gone back must say so
        (issue 59 item 5)."""
        if not self.alive or self.stopping:
            return
        world = self.world
        world.log(f"fault: {self.worker.name} stops warm{' as its broker connection is lost' if cut else ''}")
        self.enter()
        if cut and not self.channel.dead:
            self.channel.turns_at_cut = self.hub.turns
            self.broker.cut(self.channel)  # the restore at the channel's close cannot reach the broker
        self.stopping = True
        self.worker.stopping_at = world.now
        self.c.on_close()
        self.c.blueprint.state = CLOSE
        said = _Said()
        logger = logging.getLogger("celery_zklock.worker")
        level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(said)
        requeued = self.broker.requeued
        try:
            self.step.stop(self.c)
        finally:
            logger.removeHandler(said)
            logger.setLevel(level)
        self.run.checks.stopped(self.worker, said.returned, self.broker.requeued - requeued)
        self.worker.exiting_pools = True
        for pool in self.worker.pools:
            pool.exit()
        self._exit_when_idle()

    def _exit_when_idle(self) -> None:
        if not self.alive:
            return
        if any(p.proc.alive and p.phase != "idle" for p in self.worker.pools):
            self.world.at(self.world.now + 0.1, f"{self.proc.name}.stopping", self._exit_when_idle, proc=self.proc)
            return
        self.world.log(f"{self.proc.name}: the pool is done: exits")
        self.die()

    def die(self) -> None:
        if self.alive:
            self.alive = False
            self.proc.alive = False
            if not self.channel.dead:  # the connection closes with the process
                self.channel.turns_at_cut = self.hub.turns
                self.broker.cut(self.channel)
            if self.peer is not None:
                self.worker.gone(self)


class _Said(logging.Handler):
    """What the step's stop logs as gone back to the broker ("stopping: %d waiting task(s)
    went back to the broker")."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.returned: int | None = None

    def emit(self, record) -> None:
        if "went back to the broker" in str(record.msg) and record.args:
            self.returned = int(record.args[0])


def kill_worker(worker) -> None:
    """SIGKILL to the whole worker: main process, pool processes and lock agent at once."""
    world = worker.world
    world.log(f"fault: worker {worker.name} killed whole (main, pool processes, agent)")
    worker.killed_at = world.now
    worker.exiting_pools = True
    worker.main.turns_at_death = worker.main.hub.turns
    worker.agent_proc.alive = False
    for pool in list(worker.pools):
        pool.die()
    worker.main.die()
