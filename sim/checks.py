"""The invariants, checked after every event and at the end of a run.

What a *belief* is: a pool process (or a foreign contender) that would let its body touch
the protected resource now: granted, told held, not told lost, and (for a pool process)
its agent not silent past the grace it was given.  The server's tree is the truth.

* **Exclusion** (every event): per key, at most one believer whose node is alive on the
  server, and that node is the key's first contender there.
* **Told** (every event): a believer whose node is gone (deleted, expired) stops believing
  within :data:`TOLD_WITHIN` of the loss, counted from when its process and its agent's
  last ran unfrozen.
* **The lease** (every grant): a local handoff (a node's second or later holder) is granted
  only while the node's session is alive on the server: the lease's promise.
* **Tokens** (every grant on a live node): strictly increasing per key in grant order, and
  below 2^53.
* **Streak** (every grant): while a contender of another session has queued behind a
  worker's node for at least :data:`NOTICE` (counted from the node's first grant at the earliest: the cohort looks
  for contenders once its node holds), that node is granted at most
  ``zklock_cohort_handoffs`` + 1 times, all within ``zklock_cohort_hold`` + :data:`NOTICE`
  of the first.
* **Place kept** (every delete a worker sends): a node of a worker whose local queue for
  the key is not empty is deleted only once another node of that worker for the key exists
  or is being created: the streak's end keeps its waiters' place.
* **Readers and writers** (every event; issue 62's read/write actors, sim/actors.RwContender):
  a write hold overlaps no other hold of its path (the *Exclusion* above, with readers
  sharing: a reader believes only while no exclusive node queues ahead of it on the server);
  *readers share*: a reader whose node waits with no exclusive node ahead of it on the
  server takes the lock within :data:`RW_NOTICE`; *writer not starved*: a writer first in
  line holds within :data:`RW_NOTICE`, and one queued behind others within
  :data:`STARVE_BASE` + :data:`STARVE_PER_NODE` per node ahead of it, counted from when no
  fault is active, while readers keep arriving.  Queue order is the server's creation order
  of the children, and a node's kind is read from its name here, not by the package.
* At the end, after faults stop: **liveness** (every request decided and every pool
  process idle), **no leaks** (no request, cohort, subscriber, live timer or node of an
  agent left; no watch of its session left on the server) and **no orphan agent** (an
  agent whose worker and pool processes are gone has stopped).
"""

from __future__ import annotations

import re

from celery_zklock.engine.internals import State
from celery_zklock.engine.znodes import STREAK_BITS, sort_contenders

#: A holder whose node is gone must stop believing within this long (virtual seconds),
#: plus its agent's session timeout (what a partitioned agent needs to call itself cut off).
TOLD_WITHIN = 1.0
#: How long a contender must have queued before a worker is expected to have seen it
#: (a watch's event and one children read, through the agent's event thread).
NOTICE = 0.15
#: Held aside (broker scenarios): a killed worker's message is back in its queue within its
#: lease, a sweep (held_lease.SWEEP_EVERY; the model's other sweeper runs at least as often)
#: and this margin.
SWEPT_WITHIN = 0.5
SWEEP_EVERY = 1.0
#: Read/write locks: a reader with no exclusive node ahead, or a writer with no node ahead,
#: takes the lock within this long of the server's change (a watch's event, a children read
#: and a few gaps), counted from when its process runs and its connection is healthy.
RW_NOTICE = 0.2
#: A queued writer holds within STARVE_BASE + STARVE_PER_NODE per node queued ahead of it
#: (a reader's or writer's hold is at most 0.5 s, a worker's streak about 1 s), counted from
#: when no fault is active.
STARVE_BASE = 0.5
STARVE_PER_NODE = 1.0
#: A node that shares the lock with readers, by its marker (Curator's and ours, kazoo's):
#: read here, not by the package under test (znodes.is_shared is what a mutant breaks).
_SHARED = re.compile(r"(__READ__|__rlock__)-?[0-9]+$")


def _shared(name: str) -> bool:
    return _SHARED.search(name) is not None


class Violation(BaseException):  # not swallowed by an "except Exception" in the code under test
    pass


class Checks:
    def __init__(self, run) -> None:
        self.run = run
        self.world = run.world
        self.server = run.server
        self.last_token: dict[str, int] = {}
        self.streaks: dict[str, list] = {}  # path -> [(owner, czxid), count, first counted, first grant]
        self.beliefs: dict = {}  # (process, token) -> when that belief began
        self.stats = {"grants": 0, "handoffs": 0, "leased": 0, "peer_grants": 0, "carried": 0}
        self.last_exclusive: dict[str, int] = {}  # path -> the token of its last exclusive grant
        self.rw: list = []  # the read/write actors (sim/actors.RwContender), set by the run
        self.free_since: dict = {}  # (actor, czxid) -> when its node waited with nothing in its way
        self.writer_waits: dict = {}  # actor name -> (its attempt, counted from, nodes ahead then)

    def fail(self, message: str) -> None:
        raise Violation(message)

    # ------------------------------------------------------------------ who believes
    def believers(self):
        for worker in self.run.workers:
            for pool in worker.pools + worker.dead_pools:
                belief = pool.belief()
                if belief is not None:  # a pool process reads when its node is a read node
                    yield pool.proc, worker.agent_proc, belief, bool(belief[1]) and _shared(belief[1])
        for contender in self.run.contenders:
            belief = contender.belief()
            if belief is not None:
                yield contender.proc, contender.proc, belief, contender.shared

    def observe(self, _who) -> None:
        pass  # every event is checked anyway (step)

    def _alive(self, node_path: str | None, token: int | None):
        node = self.server.nodes.get(node_path) if node_path else None
        if node is None or token is None or node.czxid != token >> STREAK_BITS:
            return None
        return node

    def step(self) -> None:
        by_path: dict[str, list] = {}
        seen = {}
        for proc, agent_proc, (path, node_path, token), shared in self.believers():
            # When this belief began: a grant may be taken on a node already gone (a waiting
            # node deleted by hand, then its turn came), and is told from then on.
            began = seen[(proc.name, token)] = self.beliefs.get((proc.name, token), self.world.now)
            node = self._alive(node_path, token)
            if node is not None:
                by_path.setdefault(path, []).append((proc, node_path, token, shared))
                continue
            gone = self.server.gone.get((node_path, (token or 0) >> STREAK_BITS))
            if gone is None:
                self.fail(f"{proc.name} believes it holds {path} through {node_path} (token {token}), "
                          "a node the server never had")
            # Told within TOLD_WITHIN of the loss while its agent is connected and running;
            # a cut-off agent first has to notice (two thirds of its session timeout).
            since = max(gone[0], began, proc.thaw_time(), agent_proc.thaw_time())
            client = self._client(agent_proc)
            healthy_since = max(since, client.last_trouble if client is not None else since)
            bound = TOLD_WITHIN + self._session_timeout(agent_proc)
            if self.world.now - healthy_since > TOLD_WITHIN or self.world.now - since > bound:
                self.fail(f"{proc.name} still believes it holds {path} through {node_path}, "
                          f"{self.world.now - gone[0]:.2f} s after the node was {gone[1]}")
        self.beliefs = seen
        for path, holders in by_path.items():
            exclusive = [h for h in holders if not h[3]]
            if len(exclusive) < len(holders):  # readers share: judged by what queues ahead of them
                self._readers_hold(path, holders, exclusive)
                continue
            if len(holders) > 1:
                names = ", ".join(f"{p.name} ({n}, token {t})" for p, n, t, _s in holders)
                self.fail(f"two holders of {path}, both on live nodes: {names}")
            _proc, node_path, _token, _shared_hold = holders[0]
            parent = self.server.nodes.get(path)
            first = sort_contenders(parent.children)[0] if parent is not None and parent.children else None
            if first is None or f"{path}/{first}" != node_path:
                self.fail(f"{holders[0][0].name} believes it holds {path} through {node_path}, "
                          f"but the server's first contender is {first}")
        if self.rw:
            self._rw_waits()

    # ------------------------------------------------------------------ read/write locks
    def _ahead(self, path: str, name: str) -> list[str] | None:
        """The children queued ahead of ``name`` on the server (its creation order), or None
        if ``name`` is not there."""
        parent = self.server.nodes.get(path)
        if parent is None or name not in parent.children:
            return None
        ahead = []
        for child in parent.children:
            if child == name:
                return ahead
            ahead.append(child)
        return None

    def _readers_hold(self, path: str, holders: list, exclusive: list) -> None:
        """Readers among the believers of ``path``: no write (or mutex) hold beside them, and
        none of them with an exclusive node queued ahead of it."""
        if exclusive:
            writer = exclusive[0]
            readers = ", ".join(f"{p.name} ({n.rsplit('/', 1)[1]})" for p, n, _t, s in holders if s)
            self.fail(f"a write hold overlaps reads of {path}: {writer[0].name} holds it through "
                      f"{writer[1].rsplit('/', 1)[1]} (token {writer[2]}) while {readers} read it")
        for proc, node_path, _token, _s in holders:
            name = node_path.rsplit("/", 1)[1]
            ahead = self._ahead(path, name) or []
            blocking = [n for n in ahead if not _shared(n)]
            if blocking:
                self.fail(f"{proc.name} reads {path} through {name} while {blocking[-1]} (exclusive) "
                          f"queues ahead of it: a write hold would overlap its read")

    def _healthy_since(self, actor, since: float) -> float:
        return max(since, actor.proc.thaw_time(), actor.client.last_trouble)

    def _rw_waits(self) -> None:
        """Readers share (a reader waits only for an exclusive node ahead), a writer first in
        line takes the lock, and a queued writer is not starved."""
        now = self.world.now
        free, waits = {}, {}
        calm = now >= self.run.fault_until
        for actor in self.rw:
            waiting = actor.waiting()
            if waiting is None:
                kept = self.writer_waits.get(actor.name)
                if kept is not None and kept[0] is actor.attempt and not actor.attempt.finished:
                    waits[actor.name] = kept  # queueing again (its node lost): still the same wait
                continue
            path, name, czxid = waiting
            node = self.server.nodes.get(f"{path}/{name}")
            ahead = self._ahead(path, name) if node is not None and node.czxid == czxid else None
            if ahead is None:
                continue  # its node is gone: the attempt queues again once it hears
            in_way = [n for n in ahead if not _shared(n)] if actor.shared else ahead
            if not in_way:
                since = free[(actor.name, czxid)] = self.free_since.get((actor.name, czxid), now)
                if now - self._healthy_since(actor, since) > RW_NOTICE:
                    if actor.shared:
                        self.fail(f"{actor.name} (a reader) still waits for {path} through {name}, "
                                  f"{now - since:.3f} s after no exclusive node queued ahead of it "
                                  f"(readers never wait for readers; ahead: {ahead[-3:]})")
                    self.fail(f"{actor.name} (a writer) still waits for {path} through {name}, "
                              f"{now - since:.3f} s after it became first in line")
            if actor.shared or not calm:
                continue
            record = self.writer_waits.get(actor.name)
            if record is None or record[0] is not actor.attempt or record[1] < self.run.fault_until:
                record = (actor.attempt, max(node.ctime, self.run.fault_until), len(ahead))
            waits[actor.name] = record
            bound = STARVE_BASE + STARVE_PER_NODE * record[2]
            if now - record[1] > bound:
                self.fail(f"{actor.name} (a writer) starved: waiting for {path} through {name} "
                          f"{now - record[1]:.2f} s since no fault is active, with {record[2]} node(s) "
                          f"ahead of it then (bound {bound:.1f} s); ahead now: {ahead[-3:]}")
        self.free_since = free
        self.writer_waits = waits

    def _client(self, agent_proc):
        for worker in self.run.workers:
            if worker.agent_proc is agent_proc:
                return worker.client
        for contender in self.run.contenders:
            if contender.proc is agent_proc:
                return contender.client
        return None

    def _session_timeout(self, agent_proc) -> float:
        for worker in self.run.workers:
            if worker.agent_proc is agent_proc:
                return worker.client.server.sessions.get(worker.client._session_id, None).timeout \
                    if worker.client._session_id in worker.client.server.sessions else 4.0
        for contender in self.run.contenders:
            if contender.proc is agent_proc:
                session = self.server.sessions.get(contender.client._session_id)
                return session.timeout if session is not None else 4.0
        return 4.0

    def bookkeeping(self, agent) -> None:
        """After each agent event: its per-key books add up (a callback run twice, say by
        kazoo's rawlink, shows here first)."""
        for cohort in agent.requests.cohorts.values():
            for slot in cohort.slots:
                if slot.proving < 0:
                    self.fail(f"{cohort.path}: {slot.node_path} has {slot.proving} proofs in flight "
                              "(a write's reply was handled more often than the write was sent)")
                if slot.holder is not None and slot.holder.done and not slot.handing_on:
                    self.fail(f"{cohort.path}: {slot.node_path} is held by {slot.holder.id}, a request already done")

    # ------------------------------------------------------------------ grants
    def granted(self, worker, wait, cohort, slot, token: int) -> None:
        """The agent grants ``wait`` the node of ``slot`` with ``token``."""
        self.stats["grants"] += 1
        path = cohort.path
        grant_no = token & ((1 << STREAK_BITS) - 1)
        session = self.server.sessions.get(slot.attempt.session)
        if grant_no > 0:
            self.stats["handoffs"] += 1
            if session is None or not session.alive:
                self.fail(f"{worker.name} hands {path} on locally (grant {grant_no} of {slot.node_path}, "
                          f"to {wait.id}) on a session the server has expired")
        self._token(path, slot.node_path, token, f"{worker.name}:{wait.id}")
        self._streak(path, worker.name, slot.node_path, slot.attempt.session, worker.settings, worker.client)

    def carried_start(self, pool, nodes: dict, tokens: dict) -> None:
        """A pool process starts on the grant its task carried, without the claim's answer:
        only on nodes that are still there, or that an operator deleted (that holder is then
        told, as any holder whose node is deleted is): never on a node its session's end, or
        its own agent, has removed since the grant."""
        self.stats["carried"] += 1
        for path, node_path in nodes.items():
            token = tokens.get(path)
            if self._alive(node_path, token) is not None:
                continue
            gone = self.server.gone.get((node_path, (token or 0) >> STREAK_BITS))
            why = gone[1] if gone is not None else "never there"
            if why != "operator":
                self.fail(f"{pool.proc.name} starts {pool.req['id']} on its carried grant of {path} "
                          f"through {node_path}, a node that is gone ({why})")

    def granted_peer(self, name: str, path: str, attempt, client, shared: bool = False) -> None:
        self.stats["peer_grants"] += 1
        self._token(path, f"{path}/{attempt.node}", attempt.token, name, shared)

    def _token(self, path: str, node_path: str, token: int, who: str, shared: bool = False) -> None:
        """Exclusive grants: above every token granted before on the path.  A read's: above
        the last exclusive grant's (readers share, in any order among themselves)."""
        if token >= 2 ** 53:
            self.fail(f"{who}: token {token} of {path} is not below 2^53")
        if self._alive(node_path, token) is None:
            return  # granted on a node already gone: "told" judges that holder
        last = self.last_exclusive.get(path) if shared else self.last_token.get(path)
        if last is not None and token <= last:
            self.fail(f"{who}: token {token} for {path} after token {last}: tokens must increase")
        self.last_token[path] = max(token, self.last_token.get(path, token))
        if not shared:
            self.last_exclusive[path] = token

    def _streak(self, path: str, owner: str, node_path: str, session: int | None, settings, client=None) -> None:
        """Grants through one node of a worker while a contender queued behind that node
        (for at least NOTICE) waits.  A new node of the worker, queued before the contender,
        is ahead of it by FIFO: its grants count afresh.  A grant made while the worker is cut
        off from the server is not counted: it cannot see a contender, and its lease lets it
        hand on locally for up to FRESH_MAX into a silent partition (docs/waiting.md; the
        lease and "told" checks judge those grants).  Grants after the partition heals count
        as before it."""
        if settings is None or (client is not None and client.partitioned):
            return
        parent = self.server.nodes.get(path)
        node = self.server.nodes.get(node_path)
        if parent is None or node is None:
            return
        now = self.world.now
        mine = node_path.rsplit("/", 1)[1]
        ordered = sort_contenders(parent.children)
        behind = ordered[ordered.index(mine) + 1:] if mine in ordered else []
        streak = self.streaks.get(path)
        if streak is None or streak[0] != (owner, node.czxid):
            streak = self.streaks[path] = [(owner, node.czxid), 0, None, now]
        # The cohort looks for contenders once its node holds: it is expected to have seen
        # one NOTICE after the later of the node's first grant and the contender's create.
        waiting = [n for n in behind if self.server.nodes[f"{path}/{n}"].owner != session
                   and max(self.server.nodes[f"{path}/{n}"].ctime, streak[3]) + NOTICE <= now]
        if not waiting:
            streak[1], streak[2] = 0, None
            return
        streak[1] += 1
        if streak[2] is None:
            streak[2] = now
        if streak[1] > settings.cohort_handoffs + 1:
            self.fail(f"{owner} granted {path} {streak[1]} times in a row through {mine} while {waiting[0]} "
                      f"waited behind it (zklock_cohort_handoffs={settings.cohort_handoffs})")
        if now - streak[2] > settings.cohort_hold + NOTICE:
            self.fail(f"{owner} kept {path} for {now - streak[2]:.3f} s through {mine} while {waiting[0]} "
                      f"waited behind it (zklock_cohort_hold={settings.cohort_hold})")

    # ------------------------------------------------------------------ held aside (a broker model)
    def body_started(self, pool, delivery):
        """A pool process starts the body of the task of ``delivery`` (held-aside scenarios).

        Never from a delivery the worker held aside when it learnt that its broker connection
        was lost (the broker has its message back: a copy runs from the next delivery).  Never twice per
        task id, but where the failure semantics say it may:

        * a Redis sweep took the message back between the delivery's hand-over (its lease
          checked) and its acknowledgement, while its worker stalled or was killed there;
        * a copy flagged ``redelivered`` whose earlier run had released its lock but not yet
          stored its result (``redelivery.ran_before``'s window, the task not tracking
          STARTED; with no result kept, only the copy of a delivery whose ack was lost with its
          connection), or whose earlier run's process was killed mid-body;
        * the first delivery, handed to the pool as its connection was lost (its ack lost, or
          never sent), after a copy of it that ran first (acks-early: at least once).

        Returns the run (the pool process notes its release and its stored result)."""
        from .broker import BodyRun

        broker = self.run.broker
        msg = delivery.msg
        now = self.world.now
        if delivery.cut_at is not None and not delivery.handed_when_cut:
            self.fail(f"{pool.proc.name} runs {msg.task_id} from a delivery held aside when its connection was lost "
                      f"(at {delivery.cut_at:.3f}; the broker has its message back): {msg.deliveries}")
        runs = broker.bodies.setdefault(msg.task_id, [])
        run = BodyRun(now, pool.proc.name, delivery)
        earlier, runs[:] = list(runs), runs + [run]
        if not earlier or self._swept_while_handed(msg, delivery):
            return run
        for e in earlier:
            if delivery.redelivered:
                if e.stored_at is not None and e.stored_at <= now:
                    self.fail(f"task {msg.task_id}'s body runs again on {pool.proc.name} from a redelivered copy, "
                              f"after its run on {e.pool} stored its result at {e.stored_at:.3f}: {earlier}; "
                              f"deliveries {msg.deliveries}")
                if self._died(e.pool) or (e.released_at is not None
                                          and (broker.keeps_results or e.delivery.handed_when_cut)):
                    continue  # granted between the release and the store: the stated window (with no
                    # result kept, a copy runs after any release: only one whose ack was lost with its connection)
            elif delivery.handed_when_cut and e.delivery.redelivered:
                continue  # the copy ran first; this one was in the pool as its connection dropped
            self.fail(f"task {msg.task_id}'s body runs twice: {e} and now on {pool.proc.name}; "
                      f"deliveries {msg.deliveries}")
        return run

    def _died(self, pool_name: str) -> bool:
        return any(p.proc.name == pool_name and not p.proc.alive for w in self.run.workers for p in w.dead_pools)

    def _swept_while_handed(self, msg, delivery) -> bool:
        for earlier in msg.deliveries:
            if earlier is delivery or not earlier.restored_while_handed:
                continue
            main = earlier.worker.main
            killed = earlier.worker.killed_at
            stalled = any(a <= earlier.restored_at and b >= earlier.handed_at for a, b in main.stalls)
            if stalled or (killed is not None and killed <= earlier.restored_at):
                return True
        return False

    def held_step(self) -> None:
        """Every 0.25 s: no message of a killed worker, or of a lost connection, stays
        unacknowledged in the broker past its bound: Redis, its lease, a sweep and a margin
        (past the visibility timeout, for one taken in the last turn before, not leased yet);
        RabbitMQ, not at all (requeued as the connection closes)."""
        broker = self.run.broker
        now = self.world.now
        for delivery in broker.unacked_deliveries():
            worker = delivery.worker
            channel = delivery.channel
            if channel.dead:
                since, turns = channel.dead_at, channel.turns_at_cut
            elif worker.killed_at is not None:
                since, turns = worker.killed_at, worker.main.turns_at_death
            else:
                continue
            if broker.kind != "redis":
                self.fail(f"{delivery.msg.task_id} stranded: unacknowledged on a closed connection: {delivery}")
            leased = delivery.leased or delivery.turn < turns
            bound = (worker.settings.session_timeout if leased else broker.visibility_timeout) + SWEEP_EVERY + SWEPT_WITHIN
            if now - since > bound:
                self.fail(f"{delivery.msg.task_id} stranded: its message is still unacknowledged in Redis "
                          f"{now - since:.2f} s after {worker.name} was killed or lost its connection (bound "
                          f"{bound:.2f} s; score {broker.index.get(delivery.tag, 0) - broker.wall():.2f} s from now): "
                          f"{delivery}")

    def held_at_end(self) -> list[str]:
        """Once drained: every task published ran (none lost), nothing is left in the broker
        or held aside.  Lost as in plain Celery: a task acknowledged by a worker killed before
        its body began."""
        broker = self.run.broker
        problems = []
        if not broker.drained():
            problems.append(f"the broker still has {len(broker.queue)} queued and {len(broker.unacked_deliveries())} "
                            f"unacknowledged message(s): {broker.unacked_deliveries()[:2] or [m.task_id for m in broker.queue][:3]}")
        for task_id, msg in broker.messages.items():
            if broker.bodies.get(task_id):
                continue
            excused = [d for d in msg.deliveries if d.acked_at is not None and d.worker.killed_at is not None
                       and d.worker.killed_at >= d.acked_at]
            if not excused:
                problems.append(f"task {task_id} lost: its body never ran; deliveries {msg.deliveries}")
        for worker in self.run.workers:
            if worker.killed_at is None and worker.main.alive and worker.main.step.aside:
                problems.append(f"{worker.name} still holds aside {sorted(worker.main.step.aside)[:5]}")
        return problems

    def stopped(self, worker, said: int | None, took: int) -> None:
        """A warm shutdown's stop: the number of waiting tasks it logs as gone back to the
        broker is the number of rejects the broker took (issue 59 item 5): a reject on a lost
        connection is not a task returned."""
        if (said or 0) != took:
            self.fail(f"{worker.name} stops and logs {said} waiting task(s) as gone back to the broker, which took "
                      f"{took} back (its connection {'is lost' if worker.main.channel.dead else 'is up'})")

    # ------------------------------------------------------------------ place kept
    def deleting(self, worker, path: str) -> None:
        """``worker``'s client sends a delete of its node at ``path``."""
        if worker.client.in_listener:
            return  # a reconnection resumes every attempt in turn: its deletes and creates go together
        key = path.rsplit("/", 1)[0]
        cohort = next((c for c in worker.agent.requests.cohorts.values() if c.path == key), None)
        if cohort is None or not cohort.queue:
            return
        session = worker.client._session_id
        node = self.server.nodes.get(path)
        if node is None or node.owner != session:
            return  # already gone (an operator, an expiry): no place left to keep
        others = [n for n in self.server.nodes.get(key).children if f"{key}/{n}" != path
                  and self.server.nodes[f"{key}/{n}"].owner == session] if key in self.server.nodes else []
        creating = worker.client.sent_creates_under(key) or any(
            s.attempt.state is State.CREATING and not s.attempt.finished for s in cohort.slots)
        if not others and not creating:
            self.fail(f"{worker.name} deletes {path} while {len(cohort.queue)} of its requests wait for the key, "
                      "with no other node of its own there or on its way: they lose their place")

    # ------------------------------------------------------------------ the end
    def at_end(self) -> None:
        problems = []
        for worker in self.run.workers:
            main = worker.main
            for req in main.requests.values() if main.alive else ():  # a killed one's requests died with it
                if not req["done"]:
                    problems.append(f"{req['id']} on {req['path']} never finished (verdict {req.get('verdict')}, "
                                    f"dispatched {req['dispatched']})")
            for pool in worker.pools:
                if pool.proc.alive and pool.phase != "idle":
                    problems.append(f"{pool.proc.name} still {pool.phase} ({pool.req and pool.req['id']})")
            if problems:
                break
            if worker.stopped_at is None and worker.killed_at is None:  # a stopped agent (its main process
                problems += self._agent_leaks(worker)  # was killed) kept nothing: only the server's side is judged
            session = worker.client._session_id
            left = [p for p, n in self.server.nodes.items() if n.owner == session and session is not None]
            if left:
                problems.append(f"{worker.name}: its nodes are left on the server: {left[:3]}")
            watches = [(kind, p) for kind, table in self.server.watches.items()
                       for p, holders in table.items() if session in holders]
            if watches:
                problems.append(f"{worker.name}: watches of its session left on the server: {watches[:3]}")
        if not problems and self.run.broker is not None:
            problems += self.held_at_end()
        for actor in self.rw if not problems else ():
            if actor.attempt is not None and not actor.attempt.result.ready():
                problems.append(f"{actor.name}'s {actor.role} attempt on {actor.path} never decided "
                                f"(state {actor.attempt.state.value}, node {actor.attempt.node})")
            session = actor.client._session_id
            left = [p for p, n in self.server.nodes.items() if n.owner == session and session is not None]
            if left:
                problems.append(f"{actor.name}: its nodes are left on the server: {left[:3]}")
        if problems:
            self.fail("at quiescence: " + "; ".join(problems[:4]))

    @staticmethod
    def _agent_leaks(worker) -> list[str]:
        """What a running agent still keeps in memory once everything has drained."""
        problems = []
        agent = worker.agent
        if agent.requests.waits:
            problems.append(f"{worker.name}: the agent still has requests {sorted(agent.requests.waits)[:5]}")
        if agent.claims.claimed:
            problems.append(f"{worker.name}: the agent still has claimed requests")
        if agent.requests.cohorts:
            problems.append(f"{worker.name}: the agent still has cohorts {list(agent.requests.cohorts)[:5]}")
        monitor = agent.monitor
        if monitor._subscribers:
            problems.append(f"{worker.name}: {len(monitor._subscribers)} attempts still subscribed")
        live = [e for e in monitor.timers._heap if e[2][0]]
        if live:
            problems.append(f"{worker.name}: {len(live)} live timers left ({[getattr(e[3], '__name__', e[3]) for e in live[:3]]})")
        return problems

    def orphans(self) -> None:
        for worker in self.run.workers:
            if worker.stopped_at is None and worker.killed_at is None:
                self.fail(f"{worker.name}: its main and pool processes are gone and the agent still runs")
