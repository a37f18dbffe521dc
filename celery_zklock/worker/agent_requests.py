"""The lock agent's requests: each one's locks taken path by path, then one verdict.

Why apart from the pool's claims (:mod:`celery_zklock.worker.agent_claims`): the main
process's side of a request — queue for its locks, be told ``queued``/``next``, get a
verdict, cancel — is one life that ends in :meth:`RequestBook._decide`; what a pool process
is told once it claims that verdict is another.  A request's paths are taken in canonical
order through the key's :class:`~celery_zklock.worker.cohort.Cohort` (one node per key, a
local queue behind it), all or nothing, so two multi-key requests never deadlock.
All of it runs on the agent's event thread (:mod:`celery_zklock.worker.agent_server`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine import clock, guards
from ..engine.contenders import holders_async
from .agent_link import HANDOFF_MAX_WAIT, Cancel, Connection, Verdict
from .cohort import Cohort

#: How long a timeout's verdict waits for the report of who holds the key (s).
HOLDERS_WITHIN = 0.5


@dataclass(eq=False)
class Wait:
    """One request's locks: taken in canonical order, all or nothing."""

    id: str
    task: str
    paths: list[str]
    max_holders: int
    deadline: float | None
    identity: bytes
    owner: Connection
    early: bool = False  # the main process may hand it to the pool once it is next in line
    guard: dict | None = None  # its enqueue guard (lock_enqueue): ended or moved when decided
    guard_moved: bool = False  # the guard's start is done (or under way) for its grant
    claimer: Connection | None = None
    holds: dict = field(default_factory=dict)  # path -> (cohort, slot, token), in order taken
    current: Cohort | None = None  # the cohort whose local queue it waits in
    expired: bool = False  # its deadline passed; a fresh node's first answer decides
    verdict: dict | None = None  # what a claim is told once decided
    shown_held: bool | None = None  # the last state pushed to the claimer
    next_sent: bool = False  # told the main process it is next in line (claimable undecided)
    queued: bool = False  # had to wait behind another holder (its key is contended)
    watched: bool = True  # the main process reads "queued" (events, LOCK_WAITING, metrics)
    timer: list | None = None
    granted_at: float | None = None
    started: float = field(default_factory=clock.monotonic)
    done: bool = False  # released or cancelled


class RequestBook:
    """Requests from queueing to verdict, and the cohorts they wait in (a mixin of
    :class:`~celery_zklock.worker.agent.Agent`, which holds the state; the cohorts call
    back its ``on_*`` methods)."""

    def _wait(self, peer: Connection, msg: dict) -> None:
        timeout = msg.get("timeout")
        wait = Wait(
            id=msg["id"],
            task=str(msg.get("task") or ""),
            paths=sorted(set(msg["paths"])),
            max_holders=int(msg.get("max_holders") or 1),
            deadline=None if timeout is None else clock.monotonic() + float(timeout),
            identity=str(msg.get("identity") or "").encode(),
            owner=peer,
            early=bool(msg.get("early")),
            watched=bool(msg.get("watched", True)),
            guard=guards.guarded(msg.get("guard") and {guards.HEADER: msg.get("guard")}),
        )
        old = self.waits.get(wait.id)
        if old is not None and not old.done:
            # The same task id while we still wait for, or hold, its lock: a retry the body
            # published while holding it, or a redelivery.  The running one keeps its lock;
            # this one runs in-process (its claim will say "unknown"), still protected.
            peer.send({"op": "bypass", "id": wait.id})
            return
        self.waits[wait.id] = wait
        if wait.deadline is not None:
            wait.timer = self.monitor.timers.call_at(wait.deadline, self.post, self._deadline, wait)
        self._take_next(wait)

    def _take_next(self, wait: Wait) -> None:
        """Join the next path's local queue (canonical order) or, with all taken, grant."""
        if wait.done:
            return
        if len(wait.holds) == len(wait.paths):
            self.monitor.timers.cancel(wait.timer)
            return self._decide(wait, {"verdict": Verdict.GRANTED, "tokens": self._tokens(wait), "nodes": self._nodes(wait)})
        path = wait.paths[len(wait.holds)]
        cohort = self.cohorts.get((path, wait.max_holders))
        if cohort is None:
            cohort = self.cohorts[(path, wait.max_holders)] = Cohort(self, path, wait.max_holders)
        wait.current = cohort
        cohort.join(wait)

    # The cohort's callbacks (on the event thread).
    def on_granted(self, wait: Wait, cohort: Cohort, slot, token: int) -> None:
        wait.holds[cohort.path] = (cohort, slot, token)
        wait.current = None
        self._take_next(wait)

    def on_failed(self, wait: Wait, exc: BaseException) -> None:
        wait.current = None
        self._let_go(wait)
        self._decide(wait, {"verdict": Verdict.UNAVAILABLE, "error": str(exc)})

    def on_timed_out(self, wait: Wait, path: str) -> None:
        """Free what it took, then say who holds the key: read asynchronously, and waited
        for at most :data:`HOLDERS_WITHIN` (a timeout is told on time, ZooKeeper or not)."""
        wait.current = None
        self._let_go(wait)

        def told(holders) -> None:
            self.monitor.timers.cancel(bound)
            self._decide(wait, {"verdict": Verdict.TIMEOUT, "holders": holders})

        bound = self.monitor.timers.call_at(clock.monotonic() + HOLDERS_WITHIN, self.post, told, [])
        holders_async(self.client, path, wait.max_holders, lambda holders: self.post(told, holders))

    def on_queued(self, wait: Wait, position: int) -> None:
        if not wait.queued:
            wait.queued = True
            if wait.watched:
                wait.owner.send({"op": "queued", "id": wait.id, "position": position})

    def on_next(self, wait: Wait) -> None:
        """Every path but the last is held and only a holder is ahead of it on the last: the
        main process may hand it to the pool now, so the release that grants it reaches a
        pool process already claiming (no dispatch, no wait for a free slot)."""
        if (not wait.early or wait.done or wait.verdict is not None or wait.next_sent
                or len(wait.holds) != len(wait.paths) - 1):
            return
        expected = self._expected_hold(wait)
        if expected is not None and expected > HANDOFF_MAX_WAIT:
            return
        wait.next_sent = True
        wait.owner.send({"op": "next", "id": wait.id, "hold": expected})

    def on_slot_lost(self, wait: Wait) -> None:
        self._push_state(wait)

    def _deadline(self, wait: Wait) -> None:
        if wait.done or wait.verdict is not None or wait.current is None:
            return
        if wait.current.expire(wait):
            self.on_timed_out(wait, wait.current.path)

    # Mean time a lock was held (grant to release), per lock path and per task name: how
    # long a request next in line would idle in a pool process if handed over.
    def _expected_hold(self, wait: Wait) -> float | None:
        held = self.hold_by_path.get(wait.paths[-1])
        return held if held is not None else self.hold_by_task.get(wait.task)

    def _learn_hold(self, wait: Wait) -> None:
        if wait.granted_at is None:
            return
        held = clock.monotonic() - wait.granted_at
        for table, key in ((self.hold_by_path, wait.paths[-1]), (self.hold_by_task, wait.task)):
            if len(table) > 10_000:
                table.clear()  # bounded: many one-off keys must not grow the agent
            mean = table.get(key)
            table[key] = held if mean is None else mean + 0.3 * (held - mean)

    def _decide(self, wait: Wait, verdict: dict) -> None:
        """The request's one verdict, told to the main process (and to its claimer, if any).
        Its enqueue guard's moves stay in this transition, not in :mod:`agent_guards
        <celery_zklock.worker.agent_guards>`: a grant is told only once its guard's start is done."""
        if wait.done or wait.verdict is not None:
            return
        self.monitor.timers.cancel(wait.timer)
        if verdict["verdict"] is Verdict.GRANTED and wait.guard is not None and not wait.guard_moved:
            # Its enqueue guard ends (or becomes ours) before its body can start: a publish
            # after the start is then never deduped into a run that began without it.
            wait.guard_moved = True
            guard = wait.guard
            self._guard_op(guards.start, guard["paths"], wait.id, int(guard.get("retries") or 0), guard["until"],
                           after=lambda error: self._guard_started(wait, verdict, error))
            return
        wait.verdict = {"op": "claimed", "id": wait.id, "waited": round(clock.monotonic() - wait.started, 6), **verdict}
        if verdict["verdict"] is Verdict.GRANTED:
            wait.granted_at = clock.monotonic()
        self._guard_decided(wait, verdict["verdict"])
        answer = {"op": verdict["verdict"], "id": wait.id}
        if wait.queued:
            answer["queued"] = True
        if verdict["verdict"] is Verdict.UNAVAILABLE:
            answer["error"] = verdict["error"]
        wait.owner.send(answer)
        if wait.claimer is not None:
            self._send_verdict(wait)
            if verdict["verdict"] is not Verdict.GRANTED:
                self._forget(wait)

    def _guard_started(self, wait: Wait, verdict: dict, error: BaseException | None) -> None:
        """A grant whose guard could not be ended (or moved) is not told as granted: the body
        would run past a guard that swallows the work published meanwhile.  Its locks go and
        the pool process follows ``on_lock_unavailable`` (its retry takes the guard over)."""
        if error is None:
            return self._decide(wait, verdict)
        self._let_go(wait)
        self._decide(wait, {"verdict": Verdict.UNAVAILABLE, "error": f"could not end the enqueue guard at the start: {error!r}"})

    def _cancel(self, request_id: str, why: Cancel = Cancel.FINISHED, in_pool: bool = False) -> None:
        """Stop waiting for a request: ``revoked`` or ``shutdown`` by the main process, or
        ``finished`` by the pool without claiming (a grant nobody claimed is let go).

        A request the main process handed to the pool while next in line (``in_pool``) and
        still undecided is given the verdict ``why`` instead: its pool process, claiming or
        about to, must not run it.  Decided, it runs (or ran) as granted: its own release
        lets go."""
        wait = self.waits.get(request_id)
        if wait is None or wait.done or (wait.claimer is not None and wait.verdict is not None):
            return
        if in_pool and wait.verdict is not None:
            return
        if why is Cancel.REVOKED:
            self._guard_decided(wait, Verdict.REVOKED)
        elif why is Cancel.FINISHED:
            # Done in the pool without claiming (its process died before it could, or it ran
            # in process): a guard moved at the grant, or never moved, must not outlive it.
            self._guard_finished(wait)
        if not in_pool:
            if wait.claimer is None:
                self._drop(wait)
            return
        self._let_go(wait)
        self._decide(wait, {"verdict": Verdict(why.value)})

    # ------------------------------------------------------------------ letting go
    def _let_go(self, wait: Wait) -> list:
        """Leave the local queue and let go of every path taken (the next of ours may get
        it at once); the release proof per path, newest first."""
        if wait.current is not None:
            cohort, wait.current = wait.current, None
            cohort.leave(wait)
            self._tidy(cohort)
        outcomes = []
        for cohort, _slot, _token in reversed(list(wait.holds.values())):
            outcomes.append(cohort.release(wait))
            self._tidy(cohort)
        wait.holds.clear()
        return outcomes

    def _tidy(self, cohort: Cohort) -> None:
        if cohort.idle and self.cohorts.get((cohort.path, cohort.max_holders)) is cohort:
            del self.cohorts[(cohort.path, cohort.max_holders)]

    def _drop(self, wait: Wait) -> None:
        """Stop waiting for, or let go of, a request nobody runs."""
        self._forget(wait)
        self._let_go(wait)

    def _forget(self, wait: Wait) -> None:
        wait.done = True
        self.claimed.discard(wait)
        self.monitor.timers.cancel(wait.timer)
        if self.waits.get(wait.id) is wait:
            del self.waits[wait.id]

    @staticmethod
    def _tokens(wait: Wait) -> dict[str, int]:
        return {path: token for path, (_c, _s, token) in wait.holds.items()}

    @staticmethod
    def _nodes(wait: Wait) -> dict[str, str]:
        return {path: slot.node_path for path, (_c, slot, _t) in wait.holds.items()}
