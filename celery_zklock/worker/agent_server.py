"""The lock agent's plumbing: its socket, its one event thread, its heartbeat, peers leaving.

Why apart from the lock bookkeeping: this is the part that decides *when* things run, not
what they decide.  Every peer message and ZooKeeper callback is only enqueued (:meth:`post`)
and runs on one event thread, so the bookkeeping (:mod:`celery_zklock.worker.agent_requests`,
:mod:`~celery_zklock.worker.agent_claims`) needs no locks of its own; the heartbeat proves
that thread alive to every peer, and goes silent when it is stuck, so the worker restarts
the agent.  The messages themselves: :mod:`celery_zklock.worker.agent_link`.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from ..engine import clock, guards
from ..engine.client import disconnect
from .agent_link import HEARTBEAT, Cancel, Connection

logger = logging.getLogger("celery_zklock.worker.agent")

#: The agent's event thread is stuck (not merely busy) when work waits and none has been
#: done for this long; its heartbeats then stop, and the worker restarts it.
STUCK_AFTER = 1.0


class AgentServer:
    """The agent's threads and peers (a mixin of :class:`~celery_zklock.worker.agent.Agent`,
    which holds the state)."""

    # ------------------------------------------------------------------ threads
    def post(self, fn, *args) -> None:
        """Run ``fn(*args)`` on the event thread: ZooKeeper callbacks and peer messages only
        enqueue, so no lock orders between the agent and the engine's attempts exist."""
        self.events.put((fn, args))

    def _loop(self) -> None:
        while not self.stopped.is_set():
            fn, args = self.events.get()
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
        server.listen(128)
        for target, name in ((self._loop, "events"), (self._heartbeat, "heartbeat")):
            threading.Thread(target=target, name=f"zklock-agent-{name}", daemon=True).start()
        threading.Thread(target=self._accept, args=(server,), name="zklock-agent-accept", daemon=True).start()
        print("READY", flush=True)  # the worker waits for this line before forking its pool
        self.stopped.wait()
        self.events.put((None, ()))
        server.close()
        disconnect(self.client)

    def _accept(self, server: socket.socket) -> None:
        while not self.stopped.is_set():
            try:
                sock, _ = server.accept()
            except OSError:
                return
            peer = Connection(sock)
            with self.peers_guard:
                self.peers.add(peer)
            threading.Thread(target=self._read, args=(peer,), name="zklock-agent-peer", daemon=True).start()

    def _read(self, peer: Connection) -> None:
        while True:
            messages = peer.receive()
            if messages is None:
                return self.post(self._gone, peer)
            for message in messages:
                self.post(self._handle, peer, message)

    def _heartbeat(self) -> None:
        """Ping everyone while the event thread makes progress (busy is fine, stuck is not),
        and let it push lock states to claimers and retry stalled keys."""
        while not self.stopped.wait(HEARTBEAT):
            if os.getppid() != self.parent and self.main is None and not self._claimed():
                self.stopped.set()  # the worker died, and no process of it holds a lock
                return
            if self.events.qsize() and clock.monotonic() - self.progress > STUCK_AFTER:
                continue  # stuck: silence tells the worker to restart us
            with self.peers_guard:
                peers = list(self.peers)
            for peer in peers:
                peer.send({"op": "ping"})
            self.post(self._tick)

    def _tick(self) -> None:
        for wait in list(self.claimed):
            self._push_state(wait)
        for cohort in list(self.cohorts.values()):
            if cohort.queue and not any(s.holder is not None for s in cohort.slots):
                cohort.pump()  # a node suspended while free: granted once verified again
            self._tidy(cohort)

    # ------------------------------------------------------------------ requests
    def _handle(self, peer: Connection, msg: dict) -> None:
        op = msg.get("op")
        if op == "hello":
            if msg.get("role") == "main":
                self.main, self.main_seen = peer, True
        elif op == "wait":
            self._wait(peer, msg)
        elif op == "cancel":
            self._cancel(msg["id"], Cancel(msg["why"]), bool(msg.get("in_pool")))
        elif op == "finished":
            for request_id in msg.get("ids") or ():
                self._cancel(request_id, Cancel.FINISHED)
        elif op == "claim":
            self._claim(peer, msg["id"])
        elif op == "unclaim":
            self._unclaim(peer, msg["id"])
        elif op == "release":
            self._release(peer, msg["id"])
        elif op == "unguard":
            self._guard_op(guards.release, msg["paths"], msg["id"], int(msg.get("retries") or 0))

    # ------------------------------------------------------------------ peers leaving
    def _claimed(self) -> bool:
        return bool(self.claimed)

    def _gone(self, peer: Connection) -> None:
        """A process closed its end (exited, or was killed): free what it held at once."""
        with self.peers_guard:
            self.peers.discard(peer)
        if peer is self.main:
            self.main = None
        for wait in [w for w in self.waits.values() if not w.done]:
            if wait.claimer is peer:
                self._guard_finished(wait)
                self._drop(wait)
                logger.warning("zklock agent: released the lock of request %s: its pool process is gone", wait.id)
            elif wait.owner is peer and wait.claimer is None:
                self._drop(wait)
        if self.main_seen and self.main is None and not self._claimed():
            self.stopped.set()
