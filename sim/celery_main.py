"""The worker's main process for real: ``WaitOutsidePool`` and its ``HeldLeases`` on virtual time.

The held-aside scenarios (``sim/run.py``, shape ``broker``) run the production consumer
step, :class:`celery_zklock.worker.worker_queue.WaitOutsidePool`, unchanged, with its link
to the real agent the simulator already runs (``agent_supervisor``'s ``_connect``,
``_readable``, ``Outbox``) and its Redis leases (``held_lease``), against a Redis broker
model (:mod:`sim.broker`).  Around it, what Celery gives it, modelled:

* the consumer ``c``: kombu's hub (``call_soon``, ``call_later``, ``call_repeatedly``,
  readers and writers) run as the process's event loop, one turn per simulated event, on
  the main process's clock, so a stalled main process runs nothing; the consumer's QoS
  (its window sent to the channel when ``qos.prev != qos.value``, as asynloop does); the
  prefork pool's books as ``pool_handoff`` reads them (the semaphore's ``value`` and
  ``_waiting``, the outbound buffer); the task consumer's Redis channel;
* a request per delivery (``id``, ``task``, ``message`` with ``delivery_tag``,
  ``channel``, ``ack``/``reject``, ``acknowledged``, ``delivery_info`` with the
  ``redelivered`` flag), acknowledged when a pool process accepts it (Celery's
  ``on_accepted`` for a task that is not ``acks_late``), read in the main process's loop;
* Celery's own dispatch (``c.on_task_request``, the step's ``inner``): the semaphore, then
  a free pool process (the simulator's pool process model, as in the other scenarios).

Seams, all in the simulator (nothing in ``celery_zklock`` changes): the modules' ``time``,
``socket`` and ``select`` are replaced by virtual ones; ``agent_supervisor._agent`` and
``worker_queue._step`` (one per process in production) are set to the running worker's at
every turn of its loop.  Each turn runs the hub's ``call_soon`` callbacks first (kombu's
``_ready``), then its due timers, the agent's socket and the broker's socket (BRPOP) in an
order the seed draws per turn: after a stall, any of them may come first.

Not modelled: the agent's death and restart (a kill of the agent fails the run), a Redis
outage (renewals that fail), broker reconnections (``on_close``, ``stop``), RabbitMQ.
"""

from __future__ import annotations

import heapq
from collections import deque
from types import SimpleNamespace

from celery_zklock.worker import agent_supervisor, held_lease, worker_queue
from celery_zklock.worker.agent_link import BYPASSED, CARRIED, LineReader, encode

from .broker import EPOCH, Channel
from .world import Proc

_world = None
_by_path: dict = {}  # agent socket path -> the main process that connects there
_by_fd: dict = {}  # fake descriptor -> its socket


# ---------------------------------------------------------------------- the seams
class _Time:
    """``time`` as worker_queue, agent_supervisor and held_lease read it."""

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


def install(world) -> None:
    """Point the seams at ``world`` (a new one per seed)."""
    global _world
    _world = world
    _by_path.clear()
    _by_fd.clear()
    for module in (worker_queue, agent_supervisor, held_lease):
        module.time = _Time
    agent_supervisor.socket = _SocketModule
    agent_supervisor.select = _SelectModule
    agent_supervisor._agent = None
    worker_queue._step = None


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

    def kill(self) -> None:
        self.worker.run.checks.fail(f"{self.worker.name}: its main process kills its lock agent (silent for "
                                    f"{_Time.monotonic() - self.worker.main.step.last_ping:.2f} s)")

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
        self.turns += 1
        main.enter()
        todo, self.ready = self.ready, deque()
        for fn, args in todo:
            fn(*args)
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
            cb(*args)


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

    def lock_keys(self, args, kwargs):
        return (args[0],)


TASK = SimTask()


class SimMessage:
    """kombu's ``Message`` on the Redis channel."""

    def __init__(self, delivery, channel: Channel) -> None:
        self.delivery = delivery
        self.delivery_tag = delivery.msg.tag
        self.channel = channel
        self._state = "RECEIVED"

    @property
    def acknowledged(self) -> bool:
        return self._state in ("ACK", "REJECTED", "REQUEUED")

    def ack(self) -> None:
        if self.acknowledged:
            raise RuntimeError(f"Message already acknowledged with state: {self._state}")
        self.channel.delivered.pop(self.delivery_tag, None)
        self.channel.broker.ack(self.delivery_tag, self.delivery)
        self._state = "ACK"

    def reject(self, requeue: bool = False) -> None:
        if self.acknowledged:
            raise RuntimeError(f"Message already acknowledged with state: {self._state}")
        self.channel.delivered.pop(self.delivery_tag, None)
        if requeue:
            self.channel.broker.requeue(self.delivery_tag, self.delivery)
        else:
            self.channel.broker.ack(self.delivery_tag, self.delivery)
        self._state = "REQUEUED" if requeue else "REJECTED"


class SimRequest:
    """Celery's ``Request`` for one delivery, with what the step and held_lease read."""

    def __init__(self, main: "CeleryMain", delivery) -> None:
        self.delivery = delivery
        self.id = delivery.msg.task_id
        self.task = TASK
        self.path = delivery.msg.path
        self.message = SimMessage(delivery, main.channel)
        self.args = (delivery.msg.path,)
        self.kwargs: dict = {}
        self.request_dict = {"retries": 0}
        self.hostname = main.worker.name
        self.expires = None
        self.eventer = None
        self.delivery_info = {"redelivered": delivery.msg.redelivered}
        self.acknowledged = False

    def acknowledge(self) -> None:  # Celery: a failed ack is logged, not raised
        if not self.acknowledged:
            try:
                self.message.ack()
            except RuntimeError:
                pass
            self.acknowledged = True

    def reject(self, requeue: bool = False) -> None:
        if not self.acknowledged:
            try:
                self.message.reject(requeue)
            except RuntimeError:
                pass
            self.acknowledged = True

    def revoked(self) -> bool:
        self.acknowledge()
        return True

    def maybe_expire(self) -> bool:
        return False

    def send_event(self, *args, **kwargs) -> None:
        pass


class _QoS:
    """Celery's consumer QoS: ``value`` is Celery's window; ``update`` sends it (``callback``)."""

    def __init__(self, channel: Channel, value: int) -> None:
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
    """The worker's pool semaphore (one permit per free process) as pool_handoff reads it."""

    def __init__(self, main: "CeleryMain") -> None:
        self.main = main
        self._waiting: deque = deque()

    @property
    def value(self) -> int:
        return sum(1 for pool in getattr(self.main.worker, "pools", ()) if pool.free())


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
        self.channel = Channel(self.broker, worker)
        # BRPOP: Redis answers the blocked clients in turn; who reads first is a draw
        rng = self.world.rng(f"{self.proc.name}.brpop")
        self.channel.on_wake = lambda: self.alive and self.hub.wake(latency=rng.uniform(0.0001, 0.002))
        pools = worker.pool_count
        c = self.c = SimpleNamespace()
        c.hub = self.hub
        c.qos = _QoS(self.channel, 4 * pools)  # worker_prefetch_multiplier 4
        c.pool = PreforkPool()
        c.pool.limit = pools
        c.pool._pool = SimpleNamespace(_processes=pools, outbound_buffer=deque())
        c.controller = SimpleNamespace(semaphore=_Semaphore(self))
        c.blueprint = SimpleNamespace(state=None, on_close=None)
        c.on_close = lambda: None
        c.task_consumer = SimpleNamespace(channel=self.channel)
        c.on_task_request = self.to_pool
        self.peer = None
        self.to_agent = None
        self.sock = None
        self.agent_process = SimAgentProcess(worker)
        _by_path[self.agent_process.path] = self
        self.enter()
        self.step = worker_queue.WaitOutsidePool(c)
        if not self.step.active:
            raise AssertionError("the consumer step is not active")
        self.enter()
        self.step.start(c)
        self.step.register_with_event_loop(c, self.hub)
        self.hub.wake()

    def enter(self) -> None:
        """This process's module state (one worker per process in production)."""
        agent_supervisor._agent = self.agent_process
        worker_queue._step = getattr(self, "step", None)

    # the agent's socket
    def attach(self, sock: SimSocket) -> None:
        self.sock = sock
        self.peer = self.worker.connect(self, "main")
        self.worker.agent.peers.add(self.peer)

    def receive(self, msg: dict) -> None:
        """A message from the agent reaches the socket (the wire runs on this process)."""
        if self.sock is not None and not self.sock.closed:
            self.sock.inbound += encode(msg)
            self.hub.wake()

    # the broker's socket
    def can_consume(self) -> bool:
        return bool(self.broker.queue) and self.channel.room() > 0

    def consume(self) -> None:
        """BRPOP's reply read: each message becomes a request, given to ``c.on_task_request``
        (the step's hook) as Celery's task strategy does."""
        for delivery in self.channel.fetch(self.hub.turns):
            req = SimRequest(self, delivery)
            delivery.req = req
            if self.world.full_trace is not None:
                self.world.log(f"{self.proc.name}: delivered {req.id} ({req.message.delivery_tag}"
                               f"{', redelivered' if delivery.msg.redelivered else ''})")
            self.c.on_task_request(req)
            if not self.alive:
                return

    # Celery's dispatch (the step's ``inner``)
    def to_pool(self, req: SimRequest) -> None:
        req.delivery.handed_at = self.world.now
        info = req.delivery_info
        nodes = {}
        if info.get(CARRIED) is not None:
            wait = self.worker.agent.requests.waits.get(req.id)
            nodes = dict((wait.verdict or {}).get("nodes") or {}) if wait is not None else {}
        job = {"id": req.id, "seq": getattr(req, "zklock_seq", None), "path": req.path, "verdict": "handed",
               "dispatched": True, "done": False, "carry": info.get(CARRIED), "nodes": nodes,
               "bypassed": bool(info.get(BYPASSED)), "creq": req,
               "on_start": self._accepting, "on_body": self._body}
        req.job = job
        self.requests[f"{req.id}#{len(self.requests)}"] = job
        if self.world.full_trace is not None:
            self.world.log(f"{self.proc.name}: hands {req.id} to the pool"
                           f"{' (bypassed)' if job['bypassed'] else ''}{' with its grant' if job['carry'] else ''}")
        self.c.controller.semaphore._waiting.append((self._dispatch, (req,), {}))
        self.feed()

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
        job["creq"].acknowledge()

    def _body(self, pool) -> None:
        job = pool.req
        job["ran"] = True
        self.run.checks.body_started(pool, job["creq"].delivery)

    def finished(self, job: dict) -> None:
        """The pool is done with it: a task that did not succeed tells the step (Celery's
        failure path, worker_loss.LockAwareRequest); a free process takes the next job."""
        job["done"] = True
        if not job.get("ran"):
            self.enter()
            self.step.request_finished(job["creq"])
        self.feed()

    def die(self) -> None:
        if self.alive:
            self.alive = False
            self.proc.alive = False
            if self.peer is not None:
                self.worker.gone(self)


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
