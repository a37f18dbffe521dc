"""The lock agent: one process per worker that waits for locks so that pool processes do not.

It holds the worker's only ZooKeeper session, queues for every locked request the main
process receives (the event-driven engine: no thread per waiter), and hands each lock to
the pool process that claims it.  It is exec'd, not forked (a kazoo client's threads must
not be copied by a fork), and exits once the worker's main process and every pool process
holding a lock through it have gone.  Why a process of its own: docs/waiting.md.

Run by the worker (:mod:`celery_zklock.worker.agent_supervisor`) as ``python -m celery_zklock.worker.agent
SOCKET`` with the settings as JSON on stdin (they may carry credentials: never argv).

:class:`Agent` is the plumbing (socket, one event thread, heartbeat, peers leaving) and the
dispatch of each message to its parts (:mod:`celery_zklock.worker.agent_requests`, read top
to bottom), each an object with its own state:
:class:`~celery_zklock.worker.agent_requests.Requests` (a request's life up to its verdict,
and the key's :class:`~celery_zklock.worker.cohort.Cohort`),
:class:`~celery_zklock.worker.agent_requests.Claims` (pool processes claiming, lock states,
releases) and :class:`~celery_zklock.worker.agent_requests.GuardJobs` (enqueue guards).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import selectors
import socket
import sys
import threading

from kazoo.protocol.states import KazooState

from ..config import ZkSettings, from_wire
from ..engine import clock, guards, kazoo_compat, tick_fence
from ..engine.client import EventLoopHandler, connect, disconnect
from ..engine.session import monitor_for
from .agent_protocol import (
    AGENT_DIR_PREFIX,
    HEARTBEAT,
    OWNER,
    Cancel,
    Claim,
    Connection,
    Dropped,
    Fence,
    FenceAnswer,
    Finished,
    Hello,
    PeerRole,
    Ping,
    Release,
    StopWaiting,
    Unclaim,
    Unguard,
    Wait,
)
from .agent_requests import Claims, GuardJobs, Requests

logger = logging.getLogger("celery_zklock.worker.agent")


#: The agent's event thread is stuck (not merely busy) when work waits and none has been
#: done for this long; its heartbeats then stop, and the worker restarts it.
STUCK_AFTER = 1.0


class EventQueue:
    """Events posted to the event thread, which also waits on the peers' sockets.

    Why not a ``queue.Queue`` and a reader thread per peer: each hop between threads costs
    a wake-up (a futex, a GIL hand-over), and a locked task made about 25 of them here
    (docs/design.md, "The agent's one thread").  A post from another thread writes one
    byte to a pipe, and only while the event thread sleeps in ``select``."""

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.wake_r = self.wake_w = -1  # the pipe is made by the loop (the simulator runs none)
        self.sleeping = False

    def open(self) -> int:
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        return self.wake_r

    def put(self, item) -> None:
        self.items.append(item)
        if self.sleeping:
            self.sleeping = False
            try:
                os.write(self.wake_w, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def qsize(self) -> int:
        return len(self.items)

    def drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass


class Agent:
    """Serves the worker's processes; every decision runs on one event thread (:meth:`post`),
    so its parts need no locks of their own."""

    selector: selectors.BaseSelector  # made by serve() (the simulator runs events without one)

    def __init__(self, settings: ZkSettings, path: str, client=None) -> None:
        self.settings = settings
        self.path = path
        self.events = EventQueue()  # the simulator puts its own in place
        # ZooKeeper's replies and watches run on the event thread too (EventLoopHandler):
        # one hop from kazoo's connection thread, not two through its completion thread.
        self.client = connect(settings, handler=EventLoopHandler(self.post)) if client is None else client
        self.monitor = monitor_for(self.client)
        self.progress = clock.monotonic()  # when the event thread last finished an event
        self.peers_lock = threading.Lock()
        self.peers: set[Connection] = set()
        self.main: Connection | None = None
        self.main_seen = False
        self.kept: set = set()  # carried grants the main process left behind, kept for their claims
        self.stopped = threading.Event()
        self.parent = os.getppid()
        self.guards = GuardJobs(self)
        self.claims = Claims(self.post, self.client, self.guards)
        self.requests = Requests(self, self.claims, self.guards)
        self.claims.attach(self.requests)

    # ------------------------------------------------------------------ threads
    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event thread, from any thread: ZooKeeper's callbacks and
        the heartbeat only enqueue, so no lock orders between the agent and the engine's
        attempts exist."""
        self.events.put((fn, args))

    def _loop(self) -> None:
        """Wait for a peer's bytes, a new peer or a posted event; run what came, posted
        events in the order posted (those posted meanwhile wait for the next turn, so peers
        are read between them)."""
        events = self.events
        self.selector.register(events.open(), selectors.EVENT_READ, None)
        handler = self.client.handler
        if isinstance(handler, EventLoopHandler):
            handler.loop_thread = threading.get_ident()
        while True:
            events.sleeping = True
            ready = self.selector.select(0 if events.items else None)
            events.sleeping = False
            for key, mask in ready:
                if key.data is None:
                    events.drain_wake()
                else:
                    key.data(mask)
            for _ in range(len(events.items)):
                fn, args = events.items.popleft()
                if fn is None:
                    return
                self.run_event(fn, args)

    def run_event(self, fn, args) -> None:
        """One event of the event thread (the simulator calls this in its own order)."""
        try:
            fn(*args)
        except Exception:  # one bad event must not take the agent down
            logger.exception("zklock agent: %s failed", getattr(fn, "__name__", fn))
        self.progress = clock.monotonic()

    def serve(self) -> None:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.path)
        os.chmod(self.path, 0o600)
        bound = os.lstat(self.path)  # our socket: removed at exit only if still this one
        server.listen(128)
        self.selector = selectors.DefaultSelector()
        self.selector.register(server, selectors.EVENT_READ, lambda _mask: self._accept(server))
        loop = threading.Thread(target=self._loop, name="zklock-agent-events", daemon=True)
        loop.start()
        threading.Thread(target=self._heartbeat, name="zklock-agent-heartbeat", daemon=True).start()
        print("READY", flush=True)  # the worker waits for this line before forking its pool
        self.stopped.wait()
        self.events.put((None, ()))
        loop.join(timeout=5.0)
        server.close()
        if self._worker_gone():
            leave_nothing_behind(self.path, bound)  # before the disconnect, which may take long
        disconnect(self.client)

    def _worker_gone(self) -> bool:
        """Does the agent stop because its worker's main process is gone (not to be restarted
        by it: then the main process keeps the socket's path and directory for the next one)?"""
        return (self.main_seen and self.main is None) or os.getppid() != self.parent

    def _accept(self, server: socket.socket) -> None:
        try:
            sock, _ = server.accept()
        except OSError:
            return
        peer: Connection  # named by its own backlog callback
        peer = Connection(sock, on_backlog=lambda: self.post(self._backlog, peer))
        with self.peers_lock:
            self.peers.add(peer)
        self.selector.register(sock, selectors.EVENT_READ, lambda mask: self._ready(peer, mask))

    def _ready(self, peer: Connection, mask: int) -> None:
        if mask & selectors.EVENT_WRITE and peer.flush() and not peer.closed:
            self.selector.modify(peer.sock, selectors.EVENT_READ, lambda m: self._ready(peer, m))
        if mask & selectors.EVENT_READ:
            self._read(peer)

    def _backlog(self, peer: Connection) -> None:
        """A peer's socket took only part of what we sent: write the rest when it can take it
        (the event thread never blocks on a peer: :class:`~.agent_protocol.Connection`)."""
        if peer.pending and not peer.closed:
            self.selector.modify(peer.sock, selectors.EVENT_READ | selectors.EVENT_WRITE,
                                 lambda m: self._ready(peer, m))

    def _read(self, peer: Connection) -> None:
        """A peer's socket is readable: its messages, or its end (the socket then leaves
        the selector: it is closed with the peer)."""
        messages = peer.receive()
        if messages is None:
            self.selector.unregister(peer.sock)
            peer.close()
            return self.run_event(self.gone, (peer,))
        for message in messages:
            self.run_event(self.handle, (peer, message))

    def _heartbeat(self) -> None:
        """Ping everyone while the event thread makes progress (busy is fine, stuck is not),
        and let it push lock states to claimers and retry stalled keys."""
        while not self.stopped.wait(HEARTBEAT):
            if os.getppid() != self.parent and self.main is None and not self.claims.any_claimed() and not self.kept:
                self.stopped.set()  # the worker died, and no process of it holds a lock
                return
            if self.events.qsize() and clock.monotonic() - self.progress > STUCK_AFTER:
                continue  # stuck: silence tells the worker to restart us
            with self.peers_lock:
                peers = list(self.peers)
            for peer in peers:
                peer.send(Ping())
            self.post(self.tick)

    def tick(self) -> None:
        self.claims.push_states()
        self.requests.tidy_all()

    # ------------------------------------------------------------------ messages
    def handle(self, peer: Connection, msg) -> None:
        """One message from a peer (protocol: :mod:`celery_zklock.worker.agent_protocol`)."""
        match msg:
            case Hello(role=PeerRole.MAIN):
                self.main, self.main_seen = peer, True
            case Wait():
                self.requests.wait(peer, msg)
            case StopWaiting():
                self.requests.cancel(msg.id, msg.why, msg.in_pool)
            case Finished():
                for request_id, seq in msg.deliveries():
                    self.requests.cancel(request_id, Cancel.FINISHED, seq=seq)
            case Dropped():
                for request_id, seq in msg.deliveries():
                    wait = self.requests.delivery(request_id, seq)
                    if wait is not None and wait.claimer is None:
                        self._unless_claimed(wait)
            case Claim():
                self.claims.claim(peer, msg.id, msg.carried)
            case Unclaim():
                self.claims.unclaim(peer, msg.id)
            case Release():
                self.claims.release(peer, msg.id)
            case Unguard():
                self.guards.op(guards.release, list(msg.paths), msg.id, msg.retries)
            case Fence():
                self._fence(peer, msg)
            case Hello():
                pass  # a pool process: known by its connection alone
            case _:
                logger.error("zklock agent: %s is not a message for the agent; ignored", type(msg).__name__)

    def _fence(self, peer: Connection, msg: Fence) -> None:
        """A beat tick's message reached the worker: may its body run (:mod:`~..engine.tick_fence`)?
        Blocking ZooKeeper calls, so on the guards' thread, in order with their updates."""
        tick = tick_fence.Tick(msg.path, msg.seq, msg.token)
        outcome: list = []

        def run(client, tick) -> None:
            try:
                outcome.append(tick_fence.consume(client, tick))
            except Exception as exc:  # ZooKeeper unreachable, or refused: the main process decides
                outcome.append(None)
                outcome.append(repr(exc))

        def answer(_error) -> None:
            peer.send(FenceAnswer(msg.id, outcome[0] if outcome else None, outcome[1] if len(outcome) > 1 else None))

        self.guards.op(run, tick, after=answer)

    # ------------------------------------------------------------------ peers leaving
    def gone(self, peer: Connection) -> None:
        """A process closed its end (exited, or was killed): free what it held at once."""
        with self.peers_lock:
            self.peers.discard(peer)
        if peer is self.main:
            self.main = None
        for wait in self.requests.undone():
            if wait.claimer is peer:
                self.guards.finished(wait)
                self.requests.abandon(wait)
                logger.warning("zklock agent: released the lock of request %s: its pool process is gone", wait.id)
            elif wait.owner is peer and wait.claimer is None:
                self._unless_claimed(wait)
        self._stop_if_orphaned()

    def _unless_claimed(self, wait) -> None:
        """Let go of a request the main process no longer holds and no pool process has
        claimed (the main process is gone, or Celery dropped the request unrun): at once,
        or, if its grant went to the pool with the task, once that grant can no longer be
        started on (a pool process may have started on it, its claim still on its way
        here).  A claim that comes after is answered "unknown": it locks in-process."""
        left = self.requests.carry_left(wait)
        if left > 0:
            self.kept.add(wait)
            self.monitor.timers.call_at(clock.monotonic() + left, self.post, self._carry_ended, wait)
        else:
            self.requests.abandon(wait)

    def _carry_ended(self, wait) -> None:
        """A carried grant the main process left behind: claimed by now, or let go."""
        self.kept.discard(wait)
        if not wait.done and wait.claimer is None:
            self.requests.abandon(wait)
        self._stop_if_orphaned()

    def _stop_if_orphaned(self) -> None:
        if self.main_seen and self.main is None and not self.claims.any_claimed() and not self.kept:
            self.stopped.set()


def leave_nothing_behind(path: str, bound: os.stat_result) -> None:
    """The worker is gone and its agent exits: remove the socket it bound at ``path`` (not
    another one there) and the private directory the worker made for it (the worker's stop
    removes them too; after a SIGKILL of its main process only the agent can).  Only a
    directory named as the worker names it (``zklock-agent-*``): never a test's."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        now = None
    except OSError:
        return
    if now is not None:
        if _identity(now) != _identity(bound):
            return  # another agent's socket
        try:
            os.unlink(path)
        except OSError:
            return
    folder = os.path.dirname(path)
    if not os.path.basename(folder).startswith(AGENT_DIR_PREFIX):
        return
    try:
        os.unlink(os.path.join(folder, OWNER))
    except OSError:
        pass
    try:
        os.rmdir(folder)  # not if anything else is in it
    except OSError:
        pass


def _identity(st: os.stat_result) -> tuple:
    """A file's identity: its inode number alone is reused at once by the next file made."""
    return st.st_dev, st.st_ino, st.st_ctime_ns


def main() -> int:
    level = int(sys.argv[2]) if len(sys.argv) > 2 else logging.WARNING  # the worker's (agent_supervisor)
    logging.basicConfig(level=level, format="[%(asctime)s: %(levelname)s/zklock-agent] %(message)s")
    path = sys.argv[1]
    settings = from_wire(json.loads(sys.stdin.readline()))
    agent = Agent(settings, path)

    def on_state(state: str) -> None:
        if state == KazooState.LOST and not agent.stopped.is_set():
            logger.warning("zklock agent: ZooKeeper session lost; locks held through it are lost")
            if kazoo_compat.closed_for_good(agent.client):
                # kazoo never connects this client again (its authentication failed, also when
                # a connection merely dropped mid-SASL-handshake): end, and the worker starts
                # a new agent with a new client (its restart backs off while ZooKeeper refuses).
                logger.error("zklock agent: the ZooKeeper client stopped connecting for good (authentication "
                             "failed); stopping so that the worker starts a new agent")
                agent.stopped.set()

    agent.client.add_listener(on_state)
    agent.serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
