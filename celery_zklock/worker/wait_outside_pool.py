"""Waiting outside the pool: the worker's main process holds locked requests aside while its
lock agent queues for them.

A locked request is kept aside (unacknowledged, outside the prefetch window) while the
worker's lock agent queues for its lock, and handed to the pool once decided — or, next in
line on a briefly held key, just before (:mod:`celery_zklock.worker.next_in_line`).  A consumer
bootstep wraps ``c.on_task_request``; it owns its connection to the agent
(:mod:`celery_zklock.worker.agent_connection`), which runs in the hub, with no thread in the
forking parent.  Prefork and solo pools only.  Why: docs/design.md, "Waiting outside the pool".
Its collaborators: the prefetch window (:mod:`celery_zklock.worker.prefetch_window`), the Redis
leases (:mod:`celery_zklock.worker.held_lease`), a handoff to the pool, its rules and books
(:mod:`celery_zklock.worker.next_in_line`).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from celery import bootsteps
from celery.bootsteps import RUN
from celery.utils.log import get_logger
from celery.worker import state as worker_state
from celery.worker.control import inspect_command

from .. import lock_waiting, metrics
from ..engine import guards
from ..engine.identity import Identity
from ..engine.tick_fence import Fenced, Tick
from ..options import is_locked_task
from ..states import stores_waiting
from . import agent_supervisor
from .agent_connection import AgentConnection
from .agent_protocol import (
    BYPASSED,
    CARRIED,
    HEARTBEAT,
    Bypass,
    Cancel,
    Carry,
    Decided,
    Dropped,
    Fence,
    FenceAnswer,
    Finished,
    Next,
    Queued,
    StopWaiting,
    Unguard,
    Verdict,
    Wait,
    as_wire,
)
from .agent_supervisor import NotStarted
from .dead_channel import LostChannels
from .held_lease import SWEEP_EVERY, HeldLeases, delivery_tag, forget_delivery, redis_channel
from .next_in_line import NextInLine, handoff_slots, pool_size, run_next
from .prefetch_window import PrefetchWindow

if TYPE_CHECKING:
    from celery.worker.request import Request

logger = get_logger("celery_zklock.worker")

_step: "WaitOutsidePool | None" = None


def this_step() -> "WaitOutsidePool | None":
    """The consumer step of this process's worker, once it waits outside the pool (a pool
    process forked later inherits it: :meth:`WaitOutsidePool.ours` tells)."""
    return _step


class WaitOutsidePool(bootsteps.StartStopStep):
    """Consumer step: hold locked requests in the main process until the agent decides.

    A request's path, top to bottom: :meth:`on_request` (a beat tick first asks the tick
    fence: :class:`BeatTicks`) → :meth:`_lock_or_run` holds it aside (leased on Redis) →
    :meth:`_submit` sends the agent :class:`~.agent_protocol.Wait` → the agent answers
    (:class:`~.agent_connection.AgentAnswers`): :meth:`queued` (it waits: out of the prefetch
    window), :meth:`next_in_line`, then :meth:`decided` → :meth:`hand_over` to the pool."""

    label = "zklock wait outside the pool"
    requires = ("celery.worker.consumer.tasks:Tasks",)  # its start reads the new connection and QoS

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        global _step
        self.c = c
        self.inner = c.on_task_request
        self.pid = os.getpid()  # a pool process forked later inherits this step: it must not send
        process = agent_supervisor.running()
        self.active = process is not None and getattr(c, "hub", None) is not None
        self.agent = AgentConnection(process, self)
        self.aside: dict[str, Request] = {}  # requests held aside, waiting for a verdict here
        self.expiring: set[str] = set()  # held ids with an ``expires`` (checked every 0.1 s)
        self.counted_waiting: set[str] = set()  # held ids in the zklock_waiting gauge
        self.parked = NextInLine(c, handoff_slots(c, process.settings) if process is not None and self.active else 0,
                                 self)
        self.window = PrefetchWindow(c)
        self.listing = WaitingPaths()
        self.ticks = BeatTicks(c, self.agent, self._lock_or_run, process.settings.beat_fence if process else True)
        # Redis messages held aside: leased, not left to the visibility timeout (held_lease).
        self.leases = HeldLeases(process.settings.session_timeout if process is not None else 10.0)
        self.seq = 0  # numbers the deliveries sent to the agent (a task id can come again)
        self.lost_channels = LostChannels()  # Redis channels lost with the connection, until the reconnection
        self.timers: list = []
        if self.active:
            c.on_task_request = self.on_request
            # Celery's close drops requests no pool process took yet: at a broker reconnection
            # (Consumer.start calls c.on_close) and at shutdown (the blueprint's own reference).
            self.celery_close = c.on_close
            c.on_close = c.blueprint.on_close = self.on_close
            lost = getattr(c, "on_connection_error_after_connected", None)
            if lost is not None:

                def connection_lost(exc: BaseException) -> Any:
                    self.lost_channels.lost(getattr(c, "connection", None),
                                            {*worker_state.reserved_requests, *worker_state.active_requests})
                    return lost(exc)

                c.on_connection_error_after_connected = connection_lost
            _step = self

    def ours(self) -> bool:
        """Does this process own the step (the worker's main process, not a pool process that
        inherited it by fork)?"""
        return self.pid == os.getpid()

    # ------------------------------------------------------------------ Celery hooks
    def start(self, c):
        """Connect to the agent once; (re)arm the checks at every consumer start (a broker
        reconnection stops and starts the consumer's steps, the agent link stays)."""
        if not self.active:
            return
        self._move_deliveries(c)
        self.agent.open(c.hub)
        if not self.timers:
            self.timers = [c.hub.call_repeatedly(0.1, self._check_revoked),
                           c.hub.call_repeatedly(0.1, self.parked.park),  # also after tasks not ours
                           c.hub.call_repeatedly(HEARTBEAT * 2, self.agent.check),
                           c.hub.call_repeatedly(self.leases.lease / 4, self._renew_leases),
                           c.hub.call_repeatedly(SWEEP_EVERY, self._sweep)]

    def _move_deliveries(self, c) -> None:
        """Reconnected: what the lost Redis channel delivered is acknowledged through the live
        one (:mod:`.dead_channel`).  Runs after Celery's Tasks step (``requires``), so the
        connection is the new one, and before the event loop reads a pool process's news."""
        moved = self.lost_channels.reconnected(c.connection)
        if moved:
            logger.debug("celery-zklock: %d delivery(ies) of the lost Redis channel acknowledge on the new one", moved)

    def register_with_event_loop(self, c, hub) -> None:
        """The event loop (re)starts, with a hub reset at a broker reconnection: the agent's
        socket is read through it again."""
        if self.active:
            self.agent.register(hub)

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
                self.agent.send(Dropped(tuple(r.id for r in dropped), tuple(_seq(r) for r in dropped)))
            for req in dropped:
                if self.parked.get(req.id) is req:
                    self._forget_early(req.id)

    # ------------------------------------------------------------------ requests
    def on_request(self, req) -> None:
        tick = Tick.of((req.request_dict or {}).get("zklock_beat")) if self.agent.connected else None
        if tick is not None and self.ticks.fenced(req.task):
            self.seq += 1
            return self.ticks.hold(f"{req.id}#{self.seq}", req, tick)  # two copies of one tick have one task id
        self._lock_or_run(req)

    def _lock_or_run(self, req) -> None:
        task = req.task
        if not self.agent.connected or task.acks_late or not req.id or not is_locked_task(task):
            return self.inner(req)
        held = self.aside.get(req.id)
        if held is not None and delivery_tag(held) == delivery_tag(req):
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
            self.hand_over(req.id)  # bad key values and the like: the pool reports them

    def _submit(self, req) -> bool:
        task = req.task
        try:
            opts = task.lock_options()
            paths = task.lock_paths(tuple(req.args or ()), dict(req.kwargs or {}), opts)
            reads = task.lock_read_paths(tuple(req.args or ()), dict(req.kwargs or {}), opts, req)
        except Exception:
            return False
        retries = (req.request_dict or {}).get("retries") or 0
        # Another request of ours waits for one of its keys: this one will wait behind it.
        behind = self.listing.track(req.id, paths)
        if behind:
            self.window.outside(req.id)
        identity = Identity.of_this_process(task_id=req.id, retries=retries, task=task.name, worker=req.hostname,
                                            holders=task.lock_max_holders if task.lock_max_holders > 1 else None)
        # Told Queued if it waits (queued()): whatever reads it, and the window for one
        # not known to wait here.
        self.seq += 1
        req.zklock_seq = self.seq  # this delivery, as the agent knows it (finished, dropped)
        wait = Wait(req.id, tuple(paths), self.seq, task.name, task.lock_max_holders, opts.timeout, str(identity),
                    early=self.parked.slots() > 0, guard=guards.guarded(req), watched=not behind or watched(req))
        if reads:  # at most one read node of ours per pool process
            wait = replace(wait, read=tuple(sorted(reads)), readers=pool_size(self.c))
        self.agent.send(wait)
        return True

    # ------------------------------------------------------------------ what the agent says
    def _current(self, request_id, seq) -> bool:
        """Is an answer of the agent's about the delivery of ``request_id`` we hold now?  Its
        ``seq`` names the delivery it was asked for: a task id can come again (the same
        message, swept back by Redis and delivered here again), and an answer about the old
        delivery, read late, must not decide the new one."""
        if seq is None:
            return True
        req = self.aside.get(request_id) or self.parked.get(request_id)
        return req is None or _seq(req) in (None, seq)

    def decided(self, answer: Decided) -> None:
        if not self._current(answer.id, answer.seq):
            return  # about a delivery that is gone (swept back to the broker and delivered again)
        if answer.verdict is Verdict.REVOKED:
            return self._revoked_in_pool(answer.id)
        if answer.verdict is Verdict.SHUTDOWN:
            return  # next in line at a shutdown: its pool process publishes it back
        # Only a grant that had to queue jumps the pool's queue: its key is contended, and
        # tasks behind it wait for its release.
        self.hand_over(answer.id, first=answer.verdict is Verdict.GRANTED and answer.queued, carry=answer.carry)
        if answer.id in self.parked:
            self._early_done(answer.id)  # decided: it no longer waits in its slot

    def bypassed(self, answer: Bypass) -> None:
        if not self._current(answer.id, answer.seq):
            return
        self.hand_over(answer.id, bypassed=True)
        if answer.id in self.parked:
            self._early_done(answer.id)

    def next_in_line(self, answer: Next) -> None:
        if self._current(answer.id, answer.seq):
            self.parked.told(answer.id, answer.hold, answer.ours)

    def queued(self, answer: Queued) -> None:
        if not self._current(answer.id, answer.seq):
            return
        self._queued(answer.id, answer.position)

    def fenced(self, answer: FenceAnswer) -> None:
        self.ticks.answered(answer)

    def _queued(self, request_id: str, position) -> None:
        req = self.aside.get(request_id)
        if req is None:
            return
        self.window.outside(request_id)
        if not watched(req):
            return  # asked for the window only
        waiter = lock_waiting.Waiter.held_aside(req)
        first = request_id not in self.counted_waiting
        self.counted_waiting.add(request_id)
        lock_waiting.record(waiter, position, first)

    def _revoked_in_pool(self, request_id: str) -> None:
        """The agent gave up the node of a request revoked while next in line in the pool:
        record it as Celery records a revoked request (state, event, signal); the pool
        process, told ``revoked``, does not run it."""
        req = self.parked.get(request_id)
        if req is not None:
            req.revoked()
        self._early_done(request_id)

    # ------------------------------------------------------------------ the agent's restarts
    def agent_lost(self) -> None:
        logger.error("celery-zklock: the lock agent is gone; restarting it (%d request(s) waiting)", len(self.aside))
        # Requests in the pool next in line lost their nodes with the agent: their claims
        # now find no verdict, and they lock in-process.
        for request_id in self.parked.agent_lost():
            self.listing.untrack(request_id)

    def agent_unavailable(self, why: NotStarted) -> None:
        """Without an agent, requests go to the pool as they are, where each locks in-process
        and, ZooKeeper being unreachable, follows ``on_lock_unavailable``."""
        logger.error("%s; %d waiting request(s) follow on_lock_unavailable in the pool; trying again in %.0fs",
                     why.why, len(self.aside), why.retry_in)
        for request_id in list(self.aside):
            self.hand_over(request_id)

    def agent_started(self) -> None:
        """Its session ended with the old agent, so its nodes are gone: requests we held queue
        again, at the back."""
        for req in list(self.aside.values()):
            self._submit(req)

    # ------------------------------------------------------------------ handing over
    def held(self, request_id: str):
        """The request held aside under ``request_id``, or None."""
        return self.aside.get(request_id)

    def hand_over(self, request_id: str, first: bool = False, carry: Carry | None = None,
                  bypassed: bool = False) -> None:
        """Give a request held aside to the pool (``first``: at the head of its queue)."""
        self.parked.not_waiting(request_id)
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
            _mark(req, CARRIED, as_wire(carry))
        if bypassed:
            _mark(req, BYPASSED, True)
        self.inner(req)
        if first:
            run_next(self.c, req)

    def _early_done(self, request_id: str) -> None:
        self._forget_early(request_id)
        self.parked.park()

    def _forget_early(self, request_id: str) -> None:
        self.parked.forget(request_id)
        self.listing.untrack(request_id)

    def _not_waiting(self, request_id: str, req) -> None:
        """It no longer waits here: out of the prefetch accounting, the listing (unless it
        waits on, next in line, in a pool process), the gauge."""
        if request_id not in self.parked:
            self.listing.untrack(request_id)
        self.window.inside(request_id)
        if request_id in self.counted_waiting:
            self.counted_waiting.discard(request_id)
            lock_waiting.ended(req.task)

    def _taken_back(self, request_id: str, req, redelivered_here: bool = False) -> None:
        """The broker took back the message of ``req``, held aside (its lease lapsed): it
        runs from its next delivery, never from this one.  The agent lets go of its wait or
        grant; the delivery is forgotten here, unacknowledged."""
        self._not_waiting(request_id, req)
        self.leases.let_go(req)
        seq = _seq(req)
        self.agent.send(Finished((request_id,), (seq,)))
        forget_delivery(req, redelivered_here)
        logger.warning("celery-zklock: task %s, held aside for its lock, went back to the broker's queue (this worker "
                       "could not renew its lease for %.0fs); it runs from its next delivery", request_id,
                       self.leases.lease)

    # ------------------------------------------------------------------ timers
    def _renew_leases(self, new_only: bool = False) -> None:
        lost = self.leases.renew_new() if new_only else self.leases.renew()
        if lost:
            for request_id, req in [(i, r) for i, r in self.aside.items() if delivery_tag(r) in lost]:
                self.aside.pop(request_id)
                self.parked.not_waiting(request_id)
                self._taken_back(request_id, req)

    def _sweep(self) -> None:
        channel = redis_channel(getattr(getattr(self.c, "task_consumer", None), "channel", None))
        if channel is not None:
            self.leases.sweep(channel)

    def _check_revoked(self) -> None:
        """A revoked waiting request, or one whose ``expires`` passed while it waited: its node
        goes at once and it never reaches the pool."""
        for request_id in list(self.expiring):
            req = self.aside.get(request_id) or self.parked.get(request_id)
            if req is None:
                self.expiring.discard(request_id)  # handed over, or gone: Celery checks it there
            elif req.maybe_expire():  # past it: revoked, as Celery marks an expired request
                self.expiring.discard(request_id)
        for request_id in among(self.aside, worker_state.revoked):
            req = self.aside.pop(request_id)
            self.parked.not_waiting(request_id)
            self._not_waiting(request_id, req)
            self.agent.send(StopWaiting(request_id, Cancel.REVOKED))
            req.revoked()  # acknowledges, stores REVOKED, sends the event and signal
        for request_id in self.parked.to_revoke(among(self.parked, worker_state.revoked)):
            # the agent answers "revoked" unless already granted
            self.agent.send(StopWaiting(request_id, Cancel.REVOKED, in_pool=True))

    # ------------------------------------------------------------------ the pool is done
    def request_finished(self, req) -> None:
        """The pool is done with a request, or Celery dropped it before it ran: free a grant
        it never claimed (no-op otherwise).  Only for a delivery the agent was told of, and
        named as that delivery: the same task id may wait there again already.

        Told in one message per turn of the event loop, not one per request.  A task that
        succeeded does not come here (Celery's dispatch overrides ``on_success``): it
        claimed and released its lock itself."""
        seq = _seq(req)
        self.leases.let_go(req)
        if seq is not None:
            self.agent.finish(req.id, seq)
        if self.parked.get(req.id) is req:
            self._early_done(req.id)  # finished undecided: it never claimed (or was bypassed)
        else:
            self.parked.park()  # a process is free: the pool may be idle now

    def waiting(self) -> dict[str, list[dict]]:
        """{lock path: requests this worker holds aside for it, in arrival order}: with lock
        cohorting they wait in memory, not in ZooKeeper (``celery zklock status`` asks)."""
        return self.listing.listing([*self.aside.items(), *self.parked.items()])

    def holding(self) -> bool:
        """Does it hold a request aside, or one next in line in the pool?"""
        return bool(self.aside) or bool(len(self.parked))

    def unguard(self, job: dict) -> bool:
        """End the enqueue guard of a request this worker discarded unrun, through the agent."""
        if not self.agent.connected:
            return False
        self.agent.send(Unguard(job["id"], tuple(job["paths"]), job["retries"]))
        return True

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
        self.agent.send_finished()
        for tref in self.timers:
            tref.cancel()
        self.timers = []
        held = [*self.ticks.take_all(), *self.aside.values()]
        for request_id, req in list(self.aside.items()):
            self.agent.send(StopWaiting(request_id, Cancel.SHUTDOWN))
            self._not_waiting(request_id, req)
        early = len(self.parked)
        if restarting:
            for req in held:
                worker_state.reserved_requests.discard(req)
            logger.info("celery-zklock: the broker connection restarts: %d waiting task(s) left to the broker, which "
                        "delivers them again (RabbitMQ at once, Redis within %.0fs, as their leases lapse)%s",
                        len(held), self.leases.lease,
                        f"; {early} next in line in the pool wait there for their locks" if early else "")
        else:
            returned = sum(returned_to_broker(req) for req in held)
            failed = len(held) - returned
            if held or early or not getattr(self, "_stop_logged", False):
                self._stop_logged = True  # Celery calls stop, then shutdown: one line, not two
                logger.info("celery-zklock: stopping: %d waiting task(s) went back to the broker%s%s", returned,
                            f", {failed} could not (the broker gives them back itself: RabbitMQ at once, Redis "
                            f"within {self.leases.lease:.0f}s)" if failed else "",
                            f"; {early} next in line in the pool go back from there" if early else "")
        self.aside.clear()
        self.leases.clear()  # a new connection's deliveries are leased anew
        self.window.clear()  # the consumer's next start makes a new window (and QoS)
        self.parked.stop_waiting()
        if restarting:
            return  # next in line in the pool: still listed (paths), still waiting for grants
        self.listing.clear()
        for request_id in self.parked:
            # In the pool, next in line: unless granted meanwhile, its process is told
            # "shutdown" and publishes it back to the broker instead of running it.
            self.agent.send(StopWaiting(request_id, Cancel.SHUTDOWN, in_pool=True))
        if not self.agent.drain(2.0):
            logger.warning("celery-zklock: the lock agent did not read our last messages; it lets go of what "
                           "we held once this process has gone")

    shutdown = stop


class WaitingPaths:
    """The lock paths of the requests held aside or next in line in the pool, since when:
    whether another of ours waits for a key, and the listing ``celery zklock status`` reads."""

    def __init__(self) -> None:
        self.paths: dict[str, tuple[list[str], float]] = {}  # id -> its lock paths, since
        self.on_path: Counter = Counter()  # lock path -> ids waiting for it

    def track(self, request_id: str, paths: list[str]) -> bool:
        """List a request (once); True if another request of ours waits for one of its paths."""
        if request_id not in self.paths:
            self.paths[request_id] = (paths, time.time())
            self.on_path.update(set(paths))
        return any(self.on_path[path] > 1 for path in paths)

    def untrack(self, request_id: str) -> None:
        """It no longer waits here, nor next in line in the pool: out of the listing."""
        entry = self.paths.pop(request_id, None)
        if entry is not None:
            for path in set(entry[0]):
                self.on_path[path] -= 1
                if self.on_path[path] <= 0:
                    del self.on_path[path]

    def listing(self, requests) -> dict[str, list[dict]]:
        """{lock path: those of ``requests`` ((id, request) pairs) waiting for it, in order}."""
        out: dict[str, list[dict]] = {}
        now = time.time()
        for request_id, req in requests:
            paths, since = self.paths.get(request_id, ([], now))
            for path in paths:
                out.setdefault(path, []).append({"task_id": request_id, "task": req.task.name, "worker": req.hostname,
                                                 "pid": os.getpid(), "for_s": round(now - since, 3)})
        return out

    def clear(self) -> None:
        self.paths.clear()
        self.on_path.clear()


class BeatTicks:
    """Beat ticks held while the agent asks the tick fence whether they may run
    (:mod:`~celery_zklock.engine.tick_fence`): run (locked, if their task is), or dropped."""

    def __init__(self, c, agent: AgentConnection, run, fence: bool) -> None:
        self.c = c  # Celery's consumer: its hub
        self.agent = agent
        self.run = run  # what a tick that may run goes on to (the step's _lock_or_run)
        self.fence = fence  # zklock_beat_fence: a task's own zklock_beat_fence overrides it
        self.held: dict[str, Request] = {}  # key (id#seq: two copies of a tick share an id) -> request

    def fenced(self, task) -> bool:
        """Do ``task``'s ticks ask the fence?"""
        return getattr(task, "zklock_beat_fence", self.fence)

    def hold(self, key: str, req, tick: Tick) -> None:
        self.held[key] = req
        self._ask(key, tick)

    def _ask(self, key: str, tick: Tick) -> None:
        if key in self.held:
            self.agent.send(Fence(key, tick.path, tick.seq, tick.token))

    def answered(self, answer: FenceAnswer) -> None:
        """The tick fence's answer for a beat tick held here."""
        key, verdict = answer.id, answer.verdict
        req = self.held.pop(key, None)
        if req is None:
            return
        if verdict is Fenced.RUN:
            return self.run(req)
        if verdict is None:  # ZooKeeper did not answer: the tick waits, it neither runs nor goes
            logger.warning("celery-zklock: beat tick %s: the tick fence cannot reach ZooKeeper (%s); asking again in 1s",
                           req.id, answer.error)
            self.held[key] = req
            tick = Tick.of((req.request_dict or {}).get("zklock_beat"))
            self.c.hub.call_later(1.0, self._ask, key, tick)
            return
        header = (req.request_dict or {}).get("zklock_beat") or {}
        why = "it already ran (a publish sent twice)" if verdict is Fenced.DUPLICATE else \
            "a later tick of its entry ran first (sent late by a stalled or deposed beat)"
        logger.warning("celery-zklock: beat tick %d of %s (task %s) not run: %s", int(header.get("seq") or 0),
                       header.get("entry"), req.id, why)
        metrics.tick_dropped(req.task.name, verdict.value)
        req.acknowledge()
        worker_state.reserved_requests.discard(req)

    def take_all(self) -> list:
        """The consumer stops: the ticks held here, no longer waited for."""
        held = list(self.held.values())
        self.held.clear()
        return held


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
    runs every 0.1 s, and a hot key's backlog keeps up to ``MAX_HELD`` requests aside, while
    Celery's revoked set holds the few revoked lately (up to 50,000 after a storm)."""
    if len(revoked) < len(held):
        return [i for i in revoked if i in held]
    return [i for i in held if i in revoked]


def watched(req) -> bool:
    """Does anything here read that ``req`` waits (the agent's Queued)?  Its event, the
    LOCK_WAITING state and the waiting gauge; with none of them on, the agent does not
    send it: on a hot key every task waits, and each message costs both processes."""
    eventer = req.eventer  # Celery's own test in Request.send_event
    events = bool(eventer and eventer.enabled and req.task.send_events)
    return events or stores_waiting(req.task) or metrics.enabled()


def unguard(job: dict) -> bool:
    """Ask the lock agent to end the enqueue guard of a request this worker discarded unrun
    (revoked, expired); False when no agent can (then a helper process does)."""
    step = this_step()
    return step is not None and step.unguard(job)


@inspect_command()
def zklock_waiting(state, **kwargs) -> dict:
    """Remote control: the requests this worker holds aside for their locks, per lock path."""
    step = this_step()
    return step.waiting() if step is not None and step.active else {}


def request_finished(req) -> None:
    """A request of a locked task ended in this worker's main process (failed, or dropped
    unrun: see :class:`~celery_zklock.worker.worker_hooks.LockAwareRequest`)."""
    step = this_step()
    if step is not None and step.ours():
        step.request_finished(req)


def waits_in_agent(task) -> bool:
    """Does this worker queue ``task``'s requests in the agent (so the agent frees its lock
    when a pool process dies)?"""
    step = this_step()
    return step is not None and step.agent.connected and not task.acks_late


def _mark(req, field: str, value) -> None:
    """Set a field of the request's ``delivery_info``, which its pool process reads."""
    if isinstance(req.delivery_info, dict):
        req.delivery_info[field] = value


def _seq(req) -> int | None:
    """The delivery number the agent knows ``req`` by; None if it was never sent there."""
    return getattr(req, "zklock_seq", None)
