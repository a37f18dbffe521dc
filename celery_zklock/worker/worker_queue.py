"""Waiting outside the pool: the worker's main process queues locked requests in the agent.

A locked request is kept aside (unacknowledged, outside the prefetch window) while the
worker's lock agent queues for its lock, and handed to the pool once decided — or, next in
line on a briefly held key, just before (:func:`hand_over_early`).  A consumer bootstep
wraps ``c.on_task_request``; it talks to the agent through the hub, with no thread in the
forking parent.  Prefork and solo pools only.  Why: docs/design.md, "Waiting outside the
pool".  Keeping the agent alive: :mod:`celery_zklock.worker.agent_supervisor`; a handoff's
rules: :mod:`celery_zklock.worker.pool_handoff`.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter

from celery import bootsteps
from celery.bootsteps import RUN
from celery.utils.log import get_logger
from celery.worker import state as worker_state
from celery.worker.control import inspect_command
from kombu.common import PREFETCH_COUNT_MAX

from .. import metrics
from ..engine import guards
from ..engine.identity import Identity
from ..engine.tick_fence import Fenced, Tick
from ..options import is_locked_task
from ..states import LOCK_WAITING, stores_waiting
from . import agent_supervisor
from .agent_protocol import BYPASSED, CARRIED, HEARTBEAT, Cancel, LineReader
from .agent_supervisor import AgentSupervisor, start_agent  # noqa: F401  (start_agent: worker_hooks calls it here)
from .agent_supervisor import running as running_agent  # noqa: F401  (worker_hooks logs its pid)
from .held_lease import SWEEP_EVERY, HeldLeases, forget_delivery, redis_channel
from .pool_handoff import Early, hand_over_early, handoff_slots, may_park, pool_size, run_next

logger = get_logger("celery_zklock.worker")

#: Requests one worker holds aside for their locks beyond its prefetch window (unacknowledged;
#: a few KB of memory each).  Why a bound: a burst of 100,000 on one key must stay in the
#: broker, not in one worker, where a crash would leave it to the broker's visibility timeout
#: (Redis: 1 hour).  Beyond it, held requests count against the prefetch window, and the
#: worker takes new messages only as grants free the window.
MAX_HELD = 5000

_step: "WaitOutsidePool | None" = None


class WaitOutsidePool(AgentSupervisor, bootsteps.StartStopStep):
    """Consumer step: hold locked requests in the main process until the agent decides."""

    label = "zklock wait outside the pool"

    def __init__(self, c, **kwargs):
        super().__init__(c, **kwargs)
        global _step
        self.c = c
        self.inner = c.on_task_request
        self.aside: dict[str, object] = {}  # requests held aside, waiting for a verdict here
        self.early: dict[str, object] = {}  # handed to the pool while next in line
        self.next_up: dict[str, tuple] = {}  # held ids next in line awaiting a slot -> (expected wait, ours)
        self.revoking: set[str] = set()  # early ids whose revocation was sent to the agent
        self.expiring: set[str] = set()  # held ids with an ``expires`` (checked every 0.1 s)
        self.counted_waiting: set[str] = set()  # held ids in the zklock_waiting gauge
        self.sock: socket.socket | None = None
        self.outbox = None  # what waits to be written to the agent (agent_supervisor.Outbox)
        self.reader = LineReader()
        self.last_check = self.last_ping = time.monotonic()  # the agent's liveness (agent_supervisor._check_agent)
        self.timers: list = []
        self.restart_delay = 0.0  # backoff of the agent's restart while ZooKeeper is unreachable
        self.counted: set[str] = set()  # held ids kept out of the prefetch window (it was raised for them)
        self.band = WindowBand()  # what the prefetch window is raised by for them
        self.paths: dict[str, tuple[list[str], float]] = {}  # held id -> its lock paths, since
        self.on_path: Counter = Counter()  # lock path -> held ids waiting for it (aside or early)
        self.finished: list[tuple[str, int]] = []  # (id, seq) done in the pool, told at the next loop turn
        self.seq = 0  # numbers the deliveries sent to the agent (a task id can come again)
        self.fencing: dict[str, object] = {}  # beat ticks held while the agent asks the tick fence
        self.pid = os.getpid()  # a pool process forked later inherits this step: it must not send
        agent = agent_supervisor.running()
        self.active = agent is not None and getattr(c, "hub", None) is not None
        self.handoff_slots = handoff_slots(c, agent.settings) if self.active else 0
        # Redis messages held aside: leased, not left to the visibility timeout (held_lease).
        self.leases = HeldLeases(agent.settings.session_timeout if agent is not None else 10.0)
        if self.active:
            c.on_task_request = self.on_request
            # Celery's close drops requests no pool process took yet: at a broker reconnection
            # (Consumer.start calls c.on_close) and at shutdown (the blueprint's own reference).
            self.celery_close = c.on_close
            c.on_close = c.blueprint.on_close = self.on_close
            lost = getattr(c, "on_connection_error_after_connected", None)
            if lost is not None:
                c.on_connection_error_after_connected = lambda exc: (no_restore_on_a_dead_channel(c), lost(exc))[1]
            _step = self

    # ------------------------------------------------------------------ Celery hooks
    def start(self, c):
        """Connect to the agent once; (re)arm the checks at every consumer start (a broker
        reconnection stops and starts the consumer's steps, the agent link stays)."""
        if not self.active:
            return
        if self.sock is None:
            try:
                self._connect()
            except OSError as exc:
                # No agent to connect to: it died and its restart waits for ZooKeeper.  Raising
                # here would restart the consumer over and over, and the hub that retries the
                # agent would never run: start it from here instead (or schedule the retry).
                logger.error("celery-zklock: no lock agent to connect to (%r); starting it again", exc)
                agent_supervisor.running().kill()
                self._restart_agent()
        if not self.timers:
            self.timers = [c.hub.call_repeatedly(0.1, self._check_revoked),
                           c.hub.call_repeatedly(0.1, self._park_next_up),  # also after tasks not ours
                           c.hub.call_repeatedly(HEARTBEAT * 2, self._check_agent),
                           c.hub.call_repeatedly(self.leases.lease / 4, self._renew_leases),
                           c.hub.call_repeatedly(SWEEP_EVERY, self._sweep)]

    def register_with_event_loop(self, c, hub) -> None:
        """Read the agent through the hub again: a broker reconnection resets the hub, which
        forgets every reader, and the event loop calls this each time it (re)starts.
        Without it the agent's grants were read only by the 0.4 s liveness check."""
        if self.active and self.sock is not None:
            hub.add_reader(self.sock.fileno(), self._readable)
            self.outbox.register(hub)

    def on_close(self) -> None:
        """Celery drops the requests no pool process has taken yet (its semaphore, the
        pool's unsent jobs): their messages come back from the broker.  Those we handed
        over, granted or next in line, no process may ever claim, and their grants would
        hold their keys for nobody: the agent lets go of each one no pool process claims
        (a job already written to a process runs there, and claims; a grant that travelled
        with the task is kept for that claim while it could be started on)."""
        active = worker_state.active_requests
        dropped = [req for req in tuple(worker_state.reserved_requests)
                   if req not in active and self.aside.get(req.id) is not req and _seq(req) is not None]
        try:
            self.celery_close()
        finally:
            if dropped:
                self._send({"op": "dropped", "ids": [r.id for r in dropped], "seqs": [_seq(r) for r in dropped]})
            for req in dropped:
                if self.early.get(req.id) is req:
                    self._forget_early(req.id)

    # ------------------------------------------------------------------ requests
    def on_request(self, req) -> None:
        tick = Tick.of((req.request_dict or {}).get("zklock_beat")) if self.sock is not None else None
        if tick is not None and getattr(req.task, "zklock_beat_fence", running_agent().settings.beat_fence):
            self.seq += 1
            key = f"{req.id}#{self.seq}"  # two copies of one tick have one task id
            self.fencing[key] = req
            return self._ask_fence(key, tick)
        self._lock_or_run(req)

    def _ask_fence(self, key: str, tick: Tick) -> None:
        if key in self.fencing:
            self._send({"op": "fence", "id": key, "path": tick.path, "seq": tick.seq, "token": tick.token})

    def _fenced(self, key: str, verdict: str | None, error: str | None) -> None:
        """The tick fence's answer for a beat tick held here (:mod:`~..engine.tick_fence`)."""
        req = self.fencing.pop(key, None)
        if req is None:
            return
        if verdict == Fenced.RUN:
            return self._lock_or_run(req)
        if verdict is None:  # ZooKeeper did not answer: the tick waits, it neither runs nor goes
            logger.warning("celery-zklock: beat tick %s: the tick fence cannot reach ZooKeeper (%s); asking again in 1s",
                           req.id, error)
            self.fencing[key] = req
            tick = Tick.of((req.request_dict or {}).get("zklock_beat"))
            self.c.hub.call_later(1.0, self._ask_fence, key, tick)
            return
        header = (req.request_dict or {}).get("zklock_beat") or {}
        why = "it already ran (a publish sent twice)" if verdict == Fenced.DUPLICATE else \
            "a later tick of its entry ran first (sent late by a stalled or deposed beat)"
        logger.warning("celery-zklock: beat tick %d of %s (task %s) not run: %s", int(header.get("seq") or 0),
                       header.get("entry"), req.id, why)
        metrics.tick_dropped(req.task.name, str(verdict))
        req.acknowledge()
        worker_state.reserved_requests.discard(req)

    def _current(self, request_id, seq) -> bool:
        """Is an answer of the agent's about the delivery of ``request_id`` we hold now?  Its
        ``seq`` names the delivery it was asked for: a task id can come again (the same
        message, swept back by Redis and delivered here again), and an answer about the old
        delivery, read late, must not decide the new one."""
        if seq is None:
            return True
        req = self.aside.get(request_id) or self.early.get(request_id)
        return req is None or _seq(req) in (None, seq)

    def _lock_or_run(self, req) -> None:
        task = req.task
        if self.sock is None or task.acks_late or not req.id or not is_locked_task(task):
            return self.inner(req)
        held = self.aside.get(req.id)
        if held is not None and _tag(held) == _tag(req):
            # The same message again: Redis swept the held one back (its lease lapsed while
            # this worker stalled): that delivery is void, this one waits in its place.
            self.aside.pop(req.id)
            self._taken_back(req.id, held, redelivered_here=True)
        elif held is not None:  # another message with this task id waits here: it locks in process
            _mark(req, BYPASSED, True)
            return self.inner(req)
        self.aside[req.id] = req
        if not self.leases.new and self.leases.hold(req):
            self.c.hub.call_soon(self._renew_leases, True)
        else:
            self.leases.hold(req)
        if req.expires:
            self.expiring.add(req.id)
        if not self._submit(req):
            self._hand_over(req.id)  # bad key values and the like: the pool reports them

    def _submit(self, req) -> bool:
        task = req.task
        try:
            opts = task.lock_options()
            paths = task.lock_paths(tuple(req.args or ()), dict(req.kwargs or {}), opts)
            reads = task.lock_read_paths(tuple(req.args or ()), dict(req.kwargs or {}), opts, req)
        except Exception:
            return False
        retries = (req.request_dict or {}).get("retries") or 0
        if req.id not in self.paths:
            self.paths[req.id] = (paths, time.time())
            self.on_path.update(set(paths))
        # Another request of ours waits for one of its keys: this one will wait behind it.
        behind = any(self.on_path[path] > 1 for path in paths)
        if behind:
            self._outside_window(req.id)
        identity = Identity.of_this_process(task_id=req.id, retries=retries, task=task.name, worker=req.hostname,
                                            holders=task.lock_max_holders if task.lock_max_holders > 1 else None)
        # Told "queued" if it waits (_queued): whatever reads it, and the window for one
        # not known to wait here.
        self.seq += 1
        req.zklock_seq = self.seq  # this delivery, as the agent knows it (finished, dropped)
        self._send({"op": "wait", "id": req.id, "seq": self.seq, "paths": paths, "max_holders": task.lock_max_holders,
                    "timeout": opts.timeout, "identity": str(identity), "task": task.name,
                    "early": self._slots() > 0, "guard": guards.guarded(req), "watched": not behind or watched(req),
                    **({"read": sorted(reads), "readers": pool_size(self.c)} if reads else {})})
        return True

    def _outside_window(self, request_id: str) -> None:
        """A request that waits for its lock must not use up the prefetch window (as Celery
        does for ETA tasks) -- up to MAX_HELD of them; beyond, each held request takes a
        place in the window, so the worker stops taking messages until grants free some.

        Only one that waits: known when another of ours waits for its key, or when the agent
        says ``queued``.  Until then it counts against the window, as any message does until
        a pool process takes it: a burst's requests granted at once (keys nobody holds) are
        not taken past the window by whichever worker reads first, then to queue for a
        process there behind a hot key's streak (issue 39).  The band of
        :func:`window_change` still lets a worker holding requests aside take up to twice
        its step more: the price of not moving the window once per task."""
        if request_id not in self.counted and len(self.counted) < MAX_HELD:
            self.counted.add(request_id)  # taken back in _not_waiting
            self._fit_window()

    def _fit_window(self) -> None:
        self.band.fit(self.c.qos, len(self.counted), pool_size(self.c))

    def _untrack(self, request_id: str) -> None:
        """It no longer waits here, nor next in line in the pool: out of the listing."""
        entry = self.paths.pop(request_id, None)
        if entry is not None:
            for path in set(entry[0]):
                self.on_path[path] -= 1
                if self.on_path[path] <= 0:
                    del self.on_path[path]

    def _hand_over(self, request_id: str, first: bool = False, carry: dict | None = None,
                   bypassed: bool = False) -> None:
        self.next_up.pop(request_id, None)
        req = self.aside.pop(request_id, None)
        if req is None:
            return
        ours = self.leases.ours(req)
        self._not_waiting(request_id, req)
        if not ours:
            return self._taken_back(request_id, req)
        # The grant travels with the task (agent_client.claim), in the delivery's own fields:
        # the worker builds them anew for every delivery, and they are not headers, which a
        # retry publishes again.  So does the mark of a delivery the agent bypassed.
        if carry is not None:
            _mark(req, CARRIED, carry)
        if bypassed:
            _mark(req, BYPASSED, True)
        self.inner(req)
        if first:
            run_next(self.c, req)

    def _next_in_line(self, request_id: str, hold: float | None, ours: bool = True) -> None:
        """The agent says only holders are ahead of this request: if its wait is expected
        to be short, a handoff slot is free and no other request waits for a process, hand
        it to the pool now (at the head of its queue), where it claims and waits for the
        release; the grant then reaches a process already running it.  Behind another
        contender's holders (not ``ours``), a process must also stay free besides."""
        req = self.aside.get(request_id)
        if req is None:
            return
        when = hand_over_early(hold, len(self.early), self._slots(), may_park(self.c, ours))
        if when is Early.LATER:
            self.next_up[request_id] = (hold, ours)  # a slot (or a process) may free up before its grant
        elif when is Early.NOW:
            self.early[request_id] = req
            self._hand_over(request_id, first=True)

    def _slots(self) -> int:
        """Handoff slots, never all of the pool: a process must stay for the holders
        themselves, or next-in-line requests parked in every process would wait for
        grants that no free process can run (a deadlock until their lock timeouts)."""
        processes = pool_size(self.c)
        return max(0, min(self.handoff_slots, processes - 1))

    def _early_done(self, request_id: str) -> None:
        self._forget_early(request_id)
        self._park_next_up()

    def _forget_early(self, request_id: str) -> None:
        self.early.pop(request_id, None)
        self._untrack(request_id)
        self.revoking.discard(request_id)

    def _park_next_up(self) -> None:
        """A handoff slot or a pool process freed: next-in-line requests that waited for one
        go to the pool now, in the order they were told, while the pool is idle for them
        (:func:`may_park`).  Called as a locked request ends, and every 0.1 s (the
        pool also frees when other tasks end)."""
        for request_id, (hold, ours) in list(self.next_up.items()):
            if len(self.early) >= self._slots():
                return
            if not may_park(self.c, ours):
                continue
            del self.next_up[request_id]
            self._next_in_line(request_id, hold, ours)

    def waiting(self) -> dict[str, list[dict]]:
        """{lock path: requests this worker holds aside for it, in arrival order}: with lock
        cohorting they wait in memory, not in ZooKeeper (``celery zklock status`` asks)."""
        out: dict[str, list[dict]] = {}
        now = time.time()
        for request_id, req in [*self.aside.items(), *self.early.items()]:
            paths, since = self.paths.get(request_id, ([], now))
            for path in paths:
                out.setdefault(path, []).append({"task_id": request_id, "task": req.task.name, "worker": req.hostname,
                                                 "pid": os.getpid(), "for_s": round(now - since, 3)})
        return out

    def _not_waiting(self, request_id: str, req) -> None:
        """It no longer waits here: out of the prefetch accounting, the listing (unless it
        waits on, next in line, in a pool process), the gauge."""
        if request_id not in self.early:
            self._untrack(request_id)
        if request_id in self.counted:
            self.counted.discard(request_id)
            self._fit_window()
        if request_id in self.counted_waiting:
            self.counted_waiting.discard(request_id)
            metrics.record("waited", req.task)

    def _taken_back(self, request_id: str, req, redelivered_here: bool = False) -> None:
        """The broker took back the message of ``req``, held aside (its lease lapsed): it
        runs from its next delivery, never from this one.  The agent lets go of its wait or
        grant; the delivery is forgotten here, unacknowledged."""
        self._not_waiting(request_id, req)
        self.leases.let_go(req)
        seq = _seq(req)
        self._send({"op": "finished", "ids": [request_id], "seqs": [seq]})
        forget_delivery(req, redelivered_here)
        logger.warning("celery-zklock: task %s, held aside for its lock, went back to the broker's queue (this worker "
                       "could not renew its lease for %.0fs); it runs from its next delivery", request_id,
                       self.leases.lease)

    def _renew_leases(self, new_only: bool = False) -> None:
        lost = self.leases.renew_new() if new_only else self.leases.renew()
        if lost:
            for request_id, req in [(i, r) for i, r in self.aside.items() if _tag(r) in lost]:
                self.aside.pop(request_id)
                self.next_up.pop(request_id, None)
                self._taken_back(request_id, req)

    def _sweep(self) -> None:
        channel = redis_channel(getattr(getattr(self.c, "task_consumer", None), "channel", None))
        if channel is not None:
            self.leases.sweep(channel)

    def _revoked_in_pool(self, request_id: str) -> None:
        """The agent gave up the node of a request revoked while next in line in the pool:
        record it as Celery records a revoked request (state, event, signal); the pool
        process, told ``revoked``, does not run it."""
        req = self.early.get(request_id)
        if req is not None:
            req.revoked()

    def _queued(self, request_id: str, position) -> None:
        req = self.aside.get(request_id)
        if req is None:
            return
        self._outside_window(request_id)
        if not watched(req):
            return  # asked for the window only
        key = req.task.lock_keys(tuple(req.args or ()), dict(req.kwargs or {}))
        label = key[0] if len(key) == 1 else key
        if request_id not in self.counted_waiting:
            self.counted_waiting.add(request_id)
            metrics.record("waiting", req.task)
        try:
            req.send_event("task-lock-waiting", key=label, position=position)
            if stores_waiting(req.task):
                req.task.backend.store_result(req.id, {"key": label, "position": position}, LOCK_WAITING)
        except Exception as exc:  # monitoring only
            logger.warning("could not record that task %s waits for lock %s: %r", req.id, label, exc)

    def _check_revoked(self) -> None:
        """A revoked waiting request, or one whose ``expires`` passed while it waited: its node
        goes at once and it never reaches the pool."""
        for request_id in list(self.expiring):
            req = self.aside.get(request_id) or self.early.get(request_id)
            if req is None:
                self.expiring.discard(request_id)  # handed over, or gone: Celery checks it there
            elif req.maybe_expire():  # past it: revoked, as Celery marks an expired request
                self.expiring.discard(request_id)
        for request_id in among(self.aside, worker_state.revoked):
            req = self.aside.pop(request_id)
            self.next_up.pop(request_id, None)
            self._not_waiting(request_id, req)
            self._send({"op": "cancel", "id": request_id, "why": Cancel.REVOKED})
            req.revoked()  # acknowledges, stores REVOKED, sends the event and signal
        for request_id in [i for i in among(self.early, worker_state.revoked) if i not in self.revoking]:
            self.revoking.add(request_id)  # the agent answers "revoked" unless already granted
            self._send({"op": "cancel", "id": request_id, "why": Cancel.REVOKED, "in_pool": True})

    def request_finished(self, req) -> None:
        """The pool is done with a request, or Celery dropped it before it ran: free a grant
        it never claimed (no-op otherwise).  Only for a delivery the agent was told of, and
        named as that delivery: the same task id may wait there again already.

        Told in one message per turn of the event loop, not one per request.  A task that
        succeeded does not come here (Celery's dispatch overrides ``on_success``): it
        claimed and released its lock itself."""
        seq = _seq(req)
        self.leases.let_go(req)
        if self.sock is not None and seq is not None:
            if not self.finished:
                self.c.hub.call_soon(self._send_finished)
            self.finished.append((req.id, seq))
        if self.early.get(req.id) is req:
            self._early_done(req.id)  # finished undecided: it never claimed (or was bypassed)
        elif self.next_up:
            self._park_next_up()  # a process is free: the pool may be idle now

    def _send_finished(self) -> None:
        done, self.finished = self.finished, []
        if done:
            self._send({"op": "finished", "ids": [i for i, _ in done], "seqs": [n for _, n in done]})

    def stop(self, c):
        """Warm shutdown, or a broker reconnection.  At a shutdown, waiting requests go back to
        the broker (rejected with requeue, on the live connection; counted only if the broker
        took them); requests next in line in a pool process go back from there.  At a
        reconnection the connection is already gone: a reject cannot reach the broker (Celery's
        reject is deferred to the event loop, where it met a closed Redis channel and the worker
        exited), so waiting requests are left to it: RabbitMQ requeues them at once, Redis
        returns them as their leases lapse.  Next in line in the pool, they wait on for their
        grants (published again, they would run twice)."""
        restarting = getattr(getattr(c, "blueprint", None), "state", None) == RUN
        self._send_finished()
        for tref in self.timers:
            tref.cancel()
        self.timers = []
        held = [*self.fencing.values(), *self.aside.values()]
        self.fencing.clear()
        for request_id, req in list(self.aside.items()):
            self._send({"op": "cancel", "id": request_id, "why": Cancel.SHUTDOWN})
            self._not_waiting(request_id, req)
        if restarting:
            for req in held:
                worker_state.reserved_requests.discard(req)
            logger.info("celery-zklock: the broker connection restarts: %d waiting task(s) left to the broker, which "
                        "delivers them again (RabbitMQ at once, Redis within %.0fs, as their leases lapse)%s",
                        len(held), self.leases.lease,
                        f"; {len(self.early)} next in line in the pool wait there for their locks" if self.early else "")
        else:
            returned = sum(returned_to_broker(req) for req in held)
            failed = len(held) - returned
            if held or self.early or not getattr(self, "_stop_logged", False):
                self._stop_logged = True  # Celery calls stop, then shutdown: one line, not two
                logger.info("celery-zklock: stopping: %d waiting task(s) went back to the broker%s%s", returned,
                            f", {failed} could not (the broker gives them back itself: RabbitMQ at once, Redis "
                            f"within {self.leases.lease:.0f}s)" if failed else "",
                            f"; {len(self.early)} next in line in the pool go back from there" if self.early else "")
        self.aside.clear()
        self.leases.clear()  # a new connection's deliveries are leased anew
        self.counted.clear()
        self.band.clear()  # the consumer's next start makes a new window (and QoS)
        self.next_up.clear()
        if restarting:
            return  # next in line in the pool: still listed (paths), still waiting for grants
        self.paths.clear()
        self.on_path.clear()
        for request_id in self.early:
            # In the pool, next in line: unless granted meanwhile, its process is told
            # "shutdown" and publishes it back to the broker instead of running it.
            self._send({"op": "cancel", "id": request_id, "why": Cancel.SHUTDOWN, "in_pool": True})
        if self.sock is not None and not self.outbox.drain(2.0):
            logger.warning("celery-zklock: the lock agent did not read our last messages; it lets go of what "
                           "we held once this process has gone")

    shutdown = stop


def no_restore_on_a_dead_channel(c) -> None:
    """The broker connection is lost: kombu must not try to give the unacknowledged messages
    of its Redis channel back on it as the connection is closed.  Why: Celery 5.7 closes the
    lost connection after ``collect()`` has already let go of its transport, and kombu's
    restore then fails on that closed transport with an AttributeError, which Celery does not
    ignore: the worker exited ("Unrecoverable error") at every Redis outage with messages held
    aside (372 of 430 never ran).  Nothing is lost by it: the restore could not reach Redis
    anyway (before Celery 5.7 it failed quietly), held messages come back when their leases
    lapse (:mod:`.held_lease`), and the others at Redis's visibility timeout, as before.
    Reads the Celery consumer's ``connection`` and kombu's ``do_restore`` flag."""
    channel = redis_channel(getattr(getattr(c, "connection", None), "_default_channel", None))
    if channel is not None:
        channel.do_restore = False


def _tag(req):
    """The delivery tag of ``req``'s message (Redis keeps it across a sweep back to the queue)."""
    return getattr(getattr(req, "message", None), "delivery_tag", None)


def returned_to_broker(req) -> bool:
    """Reject ``req``'s message with requeue, now; True only if the broker took it back.  Why
    not Celery's ``Request.reject``: it defers the reject to the event loop and logs a
    connection error ("Couldn't reject") instead of raising, so a count of attempts said tasks
    went back that had not."""
    req.acknowledged = True  # Celery's flag: nothing acknowledges or rejects it after this
    try:
        req.message.reject(requeue=True)
    except Exception as exc:
        logger.warning("could not return waiting task %s to the broker: %r", req.id, exc)
        return False
    return True


def among(held, revoked) -> list:
    """The ids of ``held`` that are in ``revoked``, looked up from the smaller side.  Why: this
    runs every 0.1 s, and a hot key's backlog keeps up to :data:`MAX_HELD` requests aside,
    while Celery's revoked set holds the few revoked lately (up to 50,000 after a storm)."""
    if len(revoked) < len(held):
        return [i for i in revoked if i in held]
    return [i for i in held if i in revoked]


#: The most messages the band of :func:`window_change` adds to the prefetch window beyond the
#: requests held aside (twice this, before it is lowered).
WINDOW_BAND_MAX = 64


def window_change(counted: int, raised: int, pool: int) -> int:
    """How much to raise (> 0) or lower (< 0) the prefetch window that ``raised`` messages were
    added to, for ``counted`` requests held aside outside it: raised to ``counted + step`` when
    short, lowered back to that once more than ``2 * step`` over, all of it once none is held;
    ``step`` is an eighth of ``counted``, at most :data:`WINDOW_BAND_MAX`, but at least the
    ``pool``'s size (so a pool of more than 64 processes has a wider band).

    Why a band and not one message per request: kombu sends each change of the window to the
    broker, and on RabbitMQ that is a ``basic.qos`` round trip in the worker's main process;
    on a hot key every request is held and handed over in turn, so the window went up and
    down about once per task (one RPC per order on the flash sale, 0.2 ms of the main
    process's time each).  The price: while requests wait aside, the worker may take up to
    ``2 * step`` more messages than its window.  Raising exactly to ``counted`` would not lower
    that bound (the lowering's band is what allows it), only cost a round trip per request
    while a backlog grows."""
    if counted <= 0:
        return -raised
    step = max(pool, min(counted // 8, WINDOW_BAND_MAX))
    if counted > raised:
        return counted + step - raised
    if raised - counted > 2 * step:
        return counted + step - raised
    return 0


class WindowBand:
    """The messages the prefetch window is raised by for requests held aside, kept apart from
    Celery's own window (``qos.value``): they are added only as the window is sent to the
    broker.  Why apart: Celery writes its value outright (its restore after a broker
    reconnection) and moves it for ETA tasks up to ``worker_eta_task_limit``; a raise folded
    into it was overwritten or took Celery's room, and taking it back then shrank the window
    for good (a review found a window of 16 ending at 2)."""

    def __init__(self) -> None:
        self.raised = 0
        self.qos = None  # the consumer's QoS whose sends add ``raised`` (a new one per consumer start)

    def fit(self, qos, counted: int, pool: int) -> None:
        """Move the band for ``counted`` requests held aside (:func:`window_change`); the event
        loop's next turn sends the window, as it does for Celery's own changes."""
        if qos is None:
            return  # no consumer (stopped): the next start makes a new window
        if qos is not self.qos:
            self._wrap(qos)
        change = window_change(counted, self.raised, pool)
        if change:
            self.raised += change
            qos.prev = None  # asynloop sends the window when qos.prev != qos.value

    def clear(self) -> None:
        self.raised = 0
        if self.qos is not None:
            self.qos.prev = None

    def _wrap(self, qos) -> None:
        send = qos.callback

        def callback(prefetch_count):
            # ``max_prefetch`` (``worker_eta_task_limit``): kombu >= 5.6; before, no limit.
            return send(prefetch_count=window_sent(prefetch_count, self.raised, getattr(qos, "max_prefetch", None)))

        qos.callback = callback
        self.qos, self.raised = qos, 0  # a new consumer start's window holds none of ours


def window_sent(value: int, raised: int, limit: int | None) -> int:
    """The window the broker is told: Celery's ``value`` and the band's ``raised`` messages,
    the band capped by ``worker_eta_task_limit`` (``limit``: a bound on what one worker holds
    in memory) and by the most AMQP can say; a window of 0 (no limit) stays 0, and the band
    never lowers Celery's own value."""
    if not value or raised <= 0:
        return value
    top = min(limit, PREFETCH_COUNT_MAX) if limit else PREFETCH_COUNT_MAX
    return value + max(0, min(raised, top - value))


def watched(req) -> bool:
    """Does anything here read that ``req`` waits (the ``queued`` message)?  Its event, the
    LOCK_WAITING state and the waiting gauge; with none of them on, the agent does not
    send it: on a hot key every task waits, and each message costs both processes."""
    eventer = req.eventer  # Celery's own test in Request.send_event
    events = bool(eventer and eventer.enabled and req.task.send_events)
    return events or stores_waiting(req.task) or metrics.enabled()


def unguard(job: dict) -> bool:
    """Ask the lock agent to end the enqueue guard of a request this worker discarded unrun
    (revoked, expired); False when no agent can (then a helper process does)."""
    step = _step
    if step is None or step.sock is None:
        return False
    step._send({"op": "unguard", **job})
    return True


@inspect_command()
def zklock_waiting(state, **kwargs) -> dict:
    """Remote control: the requests this worker holds aside for their locks, per lock path."""
    return _step.waiting() if _step is not None and _step.active else {}


def request_finished(req) -> None:
    """A request of a locked task ended in this worker's main process (failed, or dropped
    unrun: see :class:`~celery_zklock.worker.worker_hooks.LockAwareRequest`)."""
    if _step is not None and _step.pid == os.getpid():
        _step.request_finished(req)


def _mark(req, field: str, value) -> None:
    """Set a field of the request's ``delivery_info``, which its pool process reads."""
    if isinstance(req.delivery_info, dict):
        req.delivery_info[field] = value


def _seq(req) -> int | None:
    """The delivery number the agent knows ``req`` by; None if it was never sent there."""
    return getattr(req, "zklock_seq", None)


def waits_in_agent(task) -> bool:
    """Does this worker queue ``task``'s requests in the agent (so the agent frees its lock
    when a pool process dies)?"""
    return _step is not None and _step.sock is not None and not task.acks_late
