"""Run the simulator: ``python -m sim.run`` (``make sim``).

    python -m sim.run                      # the CI budget: seeds 1..CI_SEEDS
    python -m sim.run --seeds 100000       # the long run
    python -m sim.run --seed 4711          # replay one seed, with its trace
    python -m sim.run --first 500 --seeds 200
    python -m sim.run --scenario held-aside-reconnect --seeds 50   # one directed scenario

Each seed draws a scenario (workers, pool processes, keys, foreign contenders, settings,
load and faults) and runs it on virtual time against the production code.  A violated
invariant stops the seed: its seed, the invariant and the last events are printed, and
the exit status is 1.  See docs/simulation.md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import time
import uuid

from .world import World
from .zk import SimClocks
from .zk_server import Server

#: The seeds ``make sim`` runs in CI (1..CI_SEEDS, about 90 s on one core): every mutant
#: of sim/mutants.py must be found among them.
CI_SEEDS = 400
#: Seeds per directed scenario in the CI run (unless its shape says "seeds").
SCENARIO_SEEDS = 15

#: Directed scenarios: a fixed shape and fault plan, where chance alone reaches a window
#: too rarely (FoundationDB's "specific workloads").  Each runs SCENARIO_SEEDS seeds in CI
#: (or its "seeds"); the seed still draws the load's timing, the settings and every gap.  A
#: plan entry is (fault, at seconds, length in session timeouts).
SCENARIOS = {
    # The agent stopped right after reading a write's reply (the proof a handoff waits for),
    # past its session: the proof must not be used when it thaws.
    "stopped-after-a-write": {"workers": 1, "pools": 3, "keys": 1, "rate": 60.0, "long": 0.5, "session": 1.0,
                              "peers": 1, "plan": [("pause-after-write", 1.0, 1.5), ("pause-after-write", 3.0, 1.5)]},
    # Operators deleting nodes by hand, eight times a run, while two workers and two peers
    # contend for four keys, with holds of up to 2.5 s: every path of a node lost under its
    # holder (told by its watch alone, mid-hold) or its waiter.
    "deleted-by-hand": {"workers": 2, "pools": 3, "keys": 4, "rate": 20.0, "peers": 2, "long": 0.3,
                        "long_holds": (0.3, 1.0, 2.5),
                           "plan": [("delete", t, 0.0) for t in (0.6, 1.2, 1.8, 2.4, 3.0, 3.6, 4.2, 4.8)]},
    # Many keys, each idle long enough for its container to be swept, started again by
    # three workers at once: one agent's group commit of new keys meets a container another
    # worker has just made, and the whole batch rolls back (its creates must be sent again).
    "new-keys-at-once": {"workers": 3, "pools": 3, "keys": 30, "rate": 60.0, "peers": 0, "faults": 0},
    # Two workers and a peer on one hot key; twelve times a run, one worker's connection
    # drops right after it sends a read of the key's queue (the read that tells a streak
    # whether anyone else waits), and comes back within the session: a streak must count a
    # read that failed as contended, or it runs unbounded.
    "read-dropped": {"workers": 2, "pools": 3, "keys": 1, "rate": 60.0, "peers": 1, "session": 3.0,
                     "plan": [("drop-read", 0.4 + 0.45 * i, 0.0) for i in range(12)]},
    # Two workers on one hot key; one worker's main process is killed mid-load: a grant it
    # handed to a pool process with the task just before may still be started on there, so
    # its agent must keep it for that process's claim (then stop once nothing is held).
    "main-killed": {"workers": 2, "pools": 2, "keys": 1, "rate": 60.0, "peers": 0, "session": 3.0,
                    "plan": [("main-killed", 2.0, 0.0)]},
    # Two workers on one hot key; twice a run, one worker's main process stops while its
    # agent is cut off past the session: the grants its agent made on the lease meanwhile
    # carry a proof that has aged by the time they reach a pool process, whose node the
    # session's end has taken (a pool process must wait for its claim's answer then).
    # Two workers on three keys whose containers count their children from just short of a
    # wrap of ZooKeeper's sequence (2**31 - 1 to -2**31, or -1 to 0; the seed picks one):
    # queue order and the first child's shortcut must hold across it.  No peers: kazoo's and
    # Curator's own recipes order by the digits and break there.
    "sequence-wraps": {"workers": 2, "pools": 2, "keys": 3, "rate": 60.0, "peers": 0,
                       "cversion_start": (2**31 - 40, -40)},
    "main-paused-cut-off": {"workers": 2, "pools": 2, "keys": 1, "rate": 60.0, "peers": 0, "session": 1.0,
                            "plan": [("main-paused-cut-off", 1.0, 1.5), ("main-paused-cut-off", 3.5, 1.5)]},
    # The worker's main process for real (wait_outside_pool.WaitOutsidePool, held_lease) against a
    # Redis broker model (sim/broker.py, sim/celery_main.py): three workers on one hot key,
    # the tasks published to one queue, another worker's sweeps at random moments.  w2, then
    # w3, is killed whole with requests held aside: their leases lapse, a sweep puts them
    # back, the others run them.  A plan entry's fourth field names the worker (an index).
    "held-aside-killed": {"workers": 3, "pools": 3, "keys": 1, "rate": 40.0, "peers": 0, "session": 2.0,
                          "long": 0.05, "long_holds": (0.06, 0.1, 0.3), "broker": "redis",
                          "plan": [("worker-killed", 1.5, 0.0, 1), ("worker-killed", 3.5, 0.0, 2)]},

    # w1, the queue's only consumer after w2 is killed, stalls twice for one and a half and
    # two sessions: its leases lapse, the sweeper puts its held messages back, and w1 meets
    # them again when it thaws (a renewal, a verdict read first, or the same message
    # redelivered to it: the order the seed draws).
    "held-aside-stalled": {"workers": 2, "pools": 3, "keys": 1, "rate": 40.0, "peers": 0, "session": 2.0,
                           "long": 0.05, "long_holds": (0.06, 0.1, 0.3), "broker": "redis",
                           "plan": [("worker-killed", 1.5, 0.0, 1), ("main-stalled", 2.0, 1.5, 0),
                                    ("main-stalled", 5.0, 2.0, 0)]},
    # The same stalls with another live consumer (w2), which fetches w1's swept-back messages
    # before w1 thaws.
    "held-aside-stalled-elsewhere": {"workers": 2, "pools": 3, "keys": 1, "rate": 40.0, "peers": 0, "session": 2.0,
                                     "long": 0.05, "long_holds": (0.06, 0.1, 0.3), "broker": "redis",
                                     "plan": [("main-stalled", 2.0, 1.5, 0), ("main-stalled", 5.0, 2.0, 0)]},
    # Broker connections lost and made again (issue 59 item 6): three workers on one hot key,
    # four times a run one worker's connection drops while it holds requests aside, has
    # granted ones waiting for a pool process, next in line in the pool and running, and comes
    # back 0.1 to 1 s later (Celery's on_close, the steps' stop and start, for real).  Redis
    # keeps the lost connection's unacknowledged messages until their leases lapse: a sweep
    # gives them back, flagged redelivered; one whose ack was lost with the connection comes
    # back too, and its copy must not run if its first run finished (redelivery.earlier_run).
    "held-aside-reconnect": {"workers": 3, "pools": 2, "keys": 2, "rate": 40.0, "peers": 0, "session": 2.0,
                             "long": 0.05, "long_holds": (0.06, 0.1, 0.3), "broker": "redis",
                             "plan": [("broker-cut", 1.0, 0.05, 0), ("broker-cut", 2.2, 0.5, 1),
                                      ("broker-cut", 3.4, 0.2, 0), ("broker-cut", 4.6, 0.1, 2),
                                      ("broker-cut-waiting", 1.5, 0.1, 1), ("broker-cut-waiting", 3.0, 0.3, 2),
                                      ("worker-stopped", 5.3, 1.0, 1)]},
    # The same cuts against RabbitMQ: the lost connection's unacknowledged messages are
    # requeued at once, flagged redelivered, to be delivered on new channels with new tags
    # (often to another worker while the first delivery still runs in a pool process).
    "held-aside-rabbitmq-cut": {"workers": 3, "pools": 2, "keys": 2, "rate": 40.0, "peers": 0, "session": 2.0,
                                "long": 0.05, "long_holds": (0.06, 0.1, 0.3), "broker": "rabbitmq",
                                "plan": [("broker-cut", 1.0, 0.05, 0), ("broker-cut", 2.2, 0.5, 1),
                                         ("broker-cut", 3.4, 0.2, 0), ("broker-cut", 4.6, 0.1, 2),
                                         ("broker-cut-waiting", 1.5, 0.1, 1), ("broker-cut-waiting", 3.0, 0.3, 2),
                                         ("worker-stopped", 5.3, 1.0, 1), ("worker-killed", 5.6, 0.0, 2)]},
    # Every pool process of a worker busy for 2.5 sessions (5 s; w1 at 1 s, w2 at 3.5 s), while
    # its agent grants requests on the key they do not hold (three keys, two processes each):
    # a granted request waits in the pool's queue (Celery's semaphore) past its lease, which
    # must last until a pool process takes it (its ack), or a sweep gives its message back and
    # it runs twice.  The tasks keep no result (ignore_result): nothing but the lease stops a
    # second delivery from running (redelivery.ran_before says no at once).
    "held-aside-busy-pool": {"workers": 2, "pools": 2, "keys": 3, "rate": 40.0, "peers": 0, "session": 2.0,
                             "long": 0.05, "long_holds": (0.06, 0.1, 0.3), "broker": "redis", "results": False,
                             "plan": [("pool-busy", 1.0, 2.5, 0), ("pool-busy", 3.5, 2.5, 1)]},
    # Read/write locks (issue 62), at the engine's level (sim/actors.RwContender), with no
    # worker: four readers (ours, kazoo's, either, either) back every few ms and three writers
    # (ours, either, either) on two keys, sessions of 1 to 4 s.  A plan entry "rw-*" picks its
    # reader or writer by its fourth field (readers first), else draws one; its length counts
    # in that one's session: cut off (past its session too: it expires), stopped (SIGSTOP),
    # its connection dropped just after a create, a watch or a delete is sent (the reply
    # lost); an operator's deletes and a failover besides.  A schedule of the readers-*
    # scenarios costs a tenth of a worker's: they run 40 seeds each ("seeds").
    "readers-writers": {"workers": 0, "peers": 0, "keys": 1, "seeds": 40,
                        "rw": {"keys": 2, "readers": ("ours", "kazoo", None, None), "writers": ("ours", None, None)},
                        "plan": [("rw-partition", 0.8, 0.5), ("rw-drop", 1.2, 0.0, 3), ("rw-pause", 1.8, 0.3),
                                 ("rw-partition", 2.4, 1.5), ("delete", 3.0, 0.0), ("rw-drop", 3.4, 0.0),
                                 ("failover", 4.0, 0.2), ("rw-pause", 4.6, 1.5), ("rw-drop", 5.2, 0.0, 4)]},
    # The same across the sequence's wraps (2**31 - 1 to -2**31, or -1 to 0: the seed picks),
    # fewer faults: queue order, a reader's shared neighbours and the first child's shortcut
    # past the wrap.
    "readers-writers-wrap": {"workers": 0, "peers": 0, "keys": 1, "cversion_start": (2**31 - 40, -40), "seeds": 40,
                             "rw": {"keys": 1, "readers": ("ours", "kazoo", None), "writers": ("ours", None)},
                             "plan": [("rw-partition", 1.5, 1.5), ("rw-drop", 3.0, 0.0), ("delete", 4.5, 0.0)]},
    # Readers and a writer on a worker's hot key: the worker's nodes (and its cohort's local
    # handoffs) exclude readers as a writer does, and readers behind them are contenders its
    # streak must yield to.
    "readers-beside-a-worker": {"workers": 1, "pools": 2, "keys": 1, "rate": 30.0, "peers": 0, "session": 2.0, "seeds": 40,
                                "long": 0.05, "long_holds": (0.06, 0.1, 0.3),
                                "rw": {"beside_workers": True, "readers": ("ours", "kazoo"), "writers": ("ours",)},
                                "plan": [("partition", 1.0, 0.5, 0), ("rw-partition", 2.0, 1.5), ("delete", 3.0, 0.0),
                                         ("rw-drop", 3.5, 0.0), ("pause", 4.0, 0.5, 0)]},
    # Two workers and a peer on one hot key; eight times a run, the server applies one
    # worker's create of a node and the connection breaks before the reply leaves (a ghost);
    # kazoo goes straight on to the ensemble's next server, connected again within the
    # session a round trip later, while the completion thread waits a GIL switch interval:
    # the attempt hears CONNECTED with its create still in flight, its ConnectionLoss not yet
    # read.  That failure, not the reconnection, must decide what comes next (a look for the
    # ghost), or the create is sent twice and both nodes are taken.
    "create-reply-lost": {"workers": 2, "pools": 2, "keys": 1, "rate": 40.0, "peers": 1, "session": 3.0,
                          "plan": [("create-reply-lost", 0.4 + 0.7 * i, 0.0) for i in range(8)]},
}

#: Scenarios run with --scenario only (none now: the held-aside stalls joined SCENARIOS once
#: their finding was fixed).
NOT_IN_CI: dict = {}


#: Virtual seconds of load, then of settling (faults healed) before the end checks.
LOAD = 6.0
SETTLE = 40.0


class _PerProcess:
    """A module-level table of the package, one per simulated process (it is per process in
    production): ``RecentPaths``' paths, and the keys ``Makers`` sees being made.  Shared, one
    agent's attempt waited for another agent's multi, and for good once that agent was killed
    with its multi in flight (held-aside-rabbitmq-cut, seed 83)."""

    def __init__(self, world: World) -> None:
        from collections import OrderedDict

        self.world = world
        self.tables: dict = {}
        self._new = OrderedDict

    def _table(self):
        proc = self.world.current
        key = proc.name if proc is not None else ""
        if key not in self.tables:
            self.tables[key] = self._new()
        return self.tables[key]

    def __contains__(self, path) -> bool:
        return path in self._table()

    def __setitem__(self, path, value) -> None:
        self._table()[path] = value

    def move_to_end(self, path) -> None:
        self._table().move_to_end(path)

    def __len__(self) -> int:
        return len(self._table())

    def popitem(self, last=True):
        return self._table().popitem(last=last)

    def pop(self, path, default=None):
        return self._table().pop(path, default)

    def get(self, path, default=None):
        return self._table().get(path, default)

    def setdefault(self, path, default=None):
        return self._table().setdefault(path, default)


def fresh_process_state(world: World) -> None:
    """What the package keeps per process, made new for each seed (a replay must not depend
    on the seeds run before it), and the ids it draws, made reproducible."""
    from celery_zklock.engine import attempt, clock, znodes

    clock.use(SimClocks(world))
    attempt.RECENT._paths = _PerProcess(world)
    attempt.MAKERS._waiting = _PerProcess(world)
    znodes._NO_CONTAINERS.clear()
    znodes._CONTAINERS_WORK.clear()
    rng = world.rng("uuid")
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)


def _fixed(shape: dict, name: str, drawn):
    """The shape's value if it fixes ``name``; the draw is made either way, so a shape
    changes nothing else the seed decides."""
    return shape.get(name, drawn)


class _Errors(logging.Handler):
    """An error the package logs (an agent event or a timer that raised) fails the run:
    production survives it, but it is a bug."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list = []

    def emit(self, record) -> None:
        self.records.append(record)


ERRORS = _Errors()
logging.getLogger("celery_zklock").addHandler(ERRORS)


class Run:
    """One seed's scenario, run to its end."""

    def __init__(self, seed: int, trace: bool = False, shape: dict | None = None) -> None:
        """``shape`` fixes parts of the scenario (workers, keys, pools, rate, faults: for
        bench/sim_scale.py); the seed draws the rest, and everything when it is None."""
        from .actors import Contender, RwContender, Worker
        from .checks import Checks

        self.seed = seed
        self.world = world = World(seed)
        if trace:
            world.full_trace = []
        fresh_process_state(world)
        rng = world.rng("scenario")
        self.server = Server(world, tick_time=rng.choice((0.5, 1.0)))
        shape = shape or {}
        if "cversion_start" in shape:
            self.server.cversion_start = world.rng("cversion").choice(shape["cversion_start"])
        self.checks = Checks(self)
        world.checks.append(self.checks.step)
        self.broker = None
        main_class = None
        if shape.get("broker"):  # the real main process against a broker model (held aside)
            from . import celery_main
            from .broker import RabbitBroker, RedisBroker

            celery_main.install(world)
            visibility_timeout = world.rng("broker").choice((10.0, 20.0))
            if shape["broker"] == "rabbitmq":
                self.broker = RabbitBroker(world)
            else:
                self.broker = RedisBroker(world, visibility_timeout)
            self.broker.keeps_results = shape.get("results", True)
            main_class = celery_main.CeleryMain
        ERRORS.records.clear()
        world.checks.append(self._no_errors)
        shape = self.shape = shape or {}
        self.keys = [f"/zklock/sim/k{i}" for i in range(_fixed(shape, "keys", rng.choice((1, 1, 2, 3))))]
        self.workers = []
        self.contenders = []
        for i in range(_fixed(shape, "workers", rng.choice((1, 2, 2, 3)))):
            settings = {
                "zklock_cohort_handoffs": rng.choice((1, 2, 3, 4)),
                "zklock_cohort_hold": rng.choice((0.05, 0.2, 0.5)),
                "_session": _fixed(shape, "session", rng.choice((1.0, 2.0, 3.0, 30.0))),
            }
            if main_class is not None:  # the lease of a held message is the session timeout
                settings["zklock_session_timeout"] = settings["_session"]
            self.workers.append(Worker(self, f"w{i + 1}", settings, pools=_fixed(shape, "pools", rng.choice((1, 2, 3))),
                                       main_class=main_class))
        for worker in self.workers:
            worker.long_share = shape.get("long", worker.long_share)
            worker.long_holds = shape.get("long_holds", worker.long_holds)
        for i in range(_fixed(shape, "peers", rng.choice((0, 0, 1, 2)))):
            self.contenders.append(Contender(self, f"peer{i + 1}", rng.choice(("curator", "kazoo")), self.keys))
        self.rw_keys: list[str] = []
        if shape.get("rw"):
            self._readers_and_writers(shape["rw"])
        self.checks.rw = [c for c in self.contenders if isinstance(c, RwContender)]
        self.fault_until = 0.0  # when the last fault drawn so far ends (the checks' "no fault active")
        self.faults = []
        self.load = shape.get("load", LOAD)
        self._plan_load(rng)
        self._plan_faults(rng)

    def _readers_and_writers(self, rw: dict) -> None:
        """Issue 62's readers and writers (sim/actors.RwContender): on keys of their own, or
        beside the workers' (``beside_workers``); each a style (``ours``: Curator's names,
        ``kazoo``: kazoo's, None: drawn) and a session of 1, 2 or 4 s (drawn)."""
        from .actors import RwContender

        rng = self.world.rng("rw")  # its own stream: nothing else the seed draws moves
        self.rw_keys = self.keys if rw.get("beside_workers") else [f"/zklock/sim/rw{i}" for i in range(rw["keys"])]
        for role, styles in (("reader", rw["readers"]), ("writer", rw["writers"])):
            for i, style in enumerate(styles):
                style = style or rng.choice(("ours", "kazoo"))
                session = rng.choice((1.0, 2.0, 4.0))
                self.contenders.append(RwContender(self, f"{role[0]}{i + 1}", role, style, self.rw_keys, session))

    # ------------------------------------------------------------------ the plan
    def _plan_load(self, rng) -> None:
        if self.broker is not None:
            return self._plan_published(rng)
        for worker in self.workers:
            t = rng.uniform(0.0, 0.3)
            rate = _fixed(self.shape, "rate", rng.choice((5.0, 20.0, 60.0)))
            while t < self.load:
                path = rng.choice(self.keys)
                timeout = rng.choice((None, None, 0.0, 0.05, 0.5, 3.0))
                self.world.at(t, f"{worker.name}.load", worker.main.submit, path, timeout, rng.random() < 0.5,
                              proc=worker.main.proc)
                if rng.random() < 0.03:
                    rid = f"{worker.name}-{int(t * rate) + 1}"
                    self.world.at(t + rng.uniform(0.0, 0.5), f"{worker.name}.revoke", worker.main.revoke, rid,
                                  proc=worker.main.proc)
                t += rng.expovariate(rate)

    def _plan_published(self, rng) -> None:
        """Tasks published to the broker's queue (any worker consumes them), a sweeper that is
        another worker's restore_visible at random moments, and the held-aside checks."""
        t = rng.uniform(0.0, 0.3)
        rate = _fixed(self.shape, "rate", 40.0)
        n = 0
        while t < self.load:
            n += 1
            self.world.at(t, "producer", self.broker.publish, f"t{n}", rng.choice(self.keys))
            t += rng.expovariate(rate)
        sweeper = self.world.rng("sweeper")

        def sweep() -> None:
            self.broker.restore_visible()
            self.world.at(self.world.now + sweeper.uniform(0.1, 1.0), "sweeper", sweep)

        if self.broker.kind == "redis":  # RabbitMQ has no visibility timeout
            self.world.at(sweeper.uniform(0.1, 1.0), "sweeper", sweep)

        def check() -> None:
            self.checks.held_step()
            self.world.at(self.world.now + 0.25, "checks.held", check)

        self.world.at(0.25, "checks.held", check)

    def _plan_faults(self, rng) -> None:
        """Random faults (or the shape's plan); a fault the shrinker dropped is still drawn,
        so everything else the seed decides stays the same."""
        kinds = ("partition", "pause", "suspend", "failover", "kill", "delete", "partition-peer")
        drop = self.shape.get("drop", ())
        plan = self.shape.get("plan")
        count = len(plan) if plan is not None else _fixed(self.shape, "faults", rng.choice((0, 1, 2, 3, 4, 6)))
        for index in range(count):
            kind = rng.choice(kinds)
            at = rng.uniform(0.2, LOAD)
            worker = rng.choice(self.workers) if self.workers else None
            timeout = worker.client.server.sessions[worker.client._session_id].timeout if worker else 4.0
            length = rng.choice((0.05, 0.3, timeout * 0.5, timeout * 0.8, timeout * 1.5))
            r = rng.random()
            if plan is not None:
                kind, at, share = plan[index][:3]
                length = share * timeout
                if kind.startswith("rw-"):  # a reader or writer (its index, else drawn), its own session
                    rw = self.checks.rw
                    worker = rw[plan[index][3] if len(plan[index]) > 3 else int(r * len(rw))]
                    length = share * self.server.sessions[worker.client._session_id].timeout
                elif len(plan[index]) > 3:
                    worker = self.workers[plan[index][3]]
            self.faults.append(kind)
            if index not in drop:
                self.world.at(at, "faults", self._fault, kind, worker, length, r)

    def _fault(self, kind: str, worker, length: float, r: float) -> None:
        world = self.world
        self.fault_until = max(self.fault_until, world.now + length)
        if kind == "rw-partition":  # a reader or writer cut off (past its session: it expires)
            worker.client.partition()
            world.at(world.now + length, "faults", worker.client.heal)
        elif kind == "rw-pause":  # a reader or writer stopped (SIGSTOP), holding or waiting
            world.log(f"fault: {worker.proc.name} stopped (SIGSTOP) for {length:.2f} s")
            worker.proc.pause(length)
        elif kind == "rw-drop":
            # Its connection drops right after its next create, watch or delete is sent: the
            # request may be applied with its reply lost (a ghost node, a lost watch, a delete
            # to resolve), and the connection comes back within the session.
            op = (("create", False), ("get", True), ("delete", -1))[int(r * 3)]
            world.log(f"fault: {worker.client.name}'s connection to drop at its next {op[0]}")
            worker.client.drop_on_send = (op,)
        elif kind == "partition":
            worker.client.partition()
            world.at(world.now + length, "faults", worker.client.heal)
        elif kind == "partition-peer" and self.contenders:
            c = self.contenders[int(r * len(self.contenders))]
            c.client.partition()
            world.at(world.now + length, "faults", c.client.heal)
        elif kind == "pause":
            if r < 0.5:
                world.log(f"fault: {worker.agent_proc.name} stopped (SIGSTOP) for {length:.2f} s")
                worker.agent_proc.pause(length)
            else:  # at its next reply: an instant weighted by activity, callbacks still queued
                world.log(f"fault: {worker.agent_proc.name} to stop at its next reply for {length:.2f} s")
                worker.client.pause_on_reply = (length, ("set", "delete", "multi", "children"))
        elif kind == "pause-after-write":
            world.log(f"fault: {worker.agent_proc.name} to stop after its next write's reply for {length:.2f} s")
            worker.client.pause_on_reply = (length, ("set",))
        elif kind == "drop-read":
            world.log(f"fault: {worker.client.name}'s connection to drop at its next read of a key's queue")
            worker.client.drop_on_send = (("children", True),)  # a read that sets a child watch
        elif kind == "create-reply-lost":
            # The server applies the worker's next create of a node (not a container) and the
            # connection breaks before its reply leaves; the client is connected again at once
            # (sim/zk.py:SimClient.broke): a ghost node, its create still in flight at CONNECTED.
            world.log(f"fault: {worker.client.name}'s connection to break once its next create is applied")
            worker.client.break_on_apply = (("create", False),)
        elif kind == "main-paused-cut-off":
            # The worker's main process stopped while its agent is cut off from ZooKeeper past
            # the session: a grant the agent made on its lease just before reaches a pool
            # process only when the main process thaws, its proof long aged.
            world.log(f"fault: {worker.main.proc.name} stopped for {length + 0.5:.2f} s, "
                      f"{worker.client.name} cut off for {length:.2f} s")
            worker.main.proc.pause(length + 0.5)
            worker.client.partition()
            world.at(world.now + length, "faults", worker.client.heal)
        elif kind == "main-killed":
            # The worker's main process killed (SIGKILL) right after it hands a pool process a
            # task with its grant, the pool processes living on: the task still reaches it.
            world.log(f"fault: {worker.main.proc.name} to be killed after its next carried handover")
            worker.main.die_after_carry = True
        elif kind == "main-stalled":
            # The worker's main process does not run (SIGSTOP, a swap storm): its agent and
            # pool processes do, and so does every other worker.
            world.log(f"fault: {worker.main.proc.name} stalled for {length:.2f} s")
            worker.main.proc.pause(length)
            worker.main.stalls.append((world.now, world.now + length))
        elif kind == "broker-cut":
            # The worker's broker connection drops and is made again ``length`` later
            # (celery_main.CeleryMain.cut_connection): Celery's on_close, the steps' stop and
            # start, the broker's own treatment of the lost connection's unacknowledged messages.
            if worker.killed_at is None:
                worker.main.cut_connection(length)
        elif kind == "broker-cut-waiting":
            # The same, at the next moment a granted request of the worker waits for a pool
            # process (Celery's on_close drops it: the agent must let go of its grant).
            world.log(f"fault: {worker.name}'s broker connection to drop when a granted request waits for a process")
            worker.main.cut_when_waiting = length
        elif kind == "pool-busy":
            # Every pool process of the worker runs its next body for ``length``: meanwhile its
            # agent's grants on other keys wait for a process in the pool's queue.
            world.log(f"fault: {worker.name}'s next {worker.pool_count} bodies run for {length:.2f} s")
            worker.busy_bodies, worker.busy_hold = worker.pool_count, length
        elif kind == "worker-stopped":
            # A warm shutdown of the worker, with its broker connection lost as it begins when
            # the plan's length is not 0 (celery_main.CeleryMain.stop_warm).
            if worker.killed_at is None and sum(1 for w in self.workers if w.killed_at is None
                                                and w.stopping_at is None) > 1:
                worker.main.stop_warm(cut=length > 0)
        elif kind == "worker-killed":
            from .celery_main import kill_worker

            if worker.killed_at is None and sum(1 for w in self.workers if w.killed_at is None) > 1:
                kill_worker(worker)
        elif kind == "suspend":
            world.log(f"fault: host {worker.host.name} suspended for {length:.2f} s")
            worker.host.suspend(length)
        elif kind == "failover":
            self.server.failover(min(length, 2.0))
        elif kind == "kill":
            live = [p for p in worker.pools if p.proc.alive]
            if live:
                live[int(r * len(live))].die()
        elif kind == "delete":
            # Mostly the key's holder (the operator's `celery zklock release`), now and then
            # any node queued for it (a stale node removed by hand).
            from celery_zklock.engine.znodes import sort_contenders

            anyone = r >= 0.7
            held = []
            for key in self.keys + [k for k in self.rw_keys if k not in self.keys]:
                parent = self.server.nodes.get(key)
                if parent is not None and parent.children:
                    ordered = sort_contenders(parent.children)
                    held += [f"{key}/{n}" for n in (ordered if anyone else ordered[:1])]
            r = (r - 0.7) / 0.3 if anyone else r / 0.7
            if held:
                self.server.force_delete(held[int(r * len(held))])

    def _no_errors(self) -> None:
        if ERRORS.records:
            record = ERRORS.records[0]
            detail = logging.Formatter().formatException(record.exc_info) if record.exc_info else ""
            self.checks.fail(f"the package logged an error: {record.getMessage()}\n{detail}")

    # ------------------------------------------------------------------ running
    def execute(self) -> None:
        world = self.world
        world.run_until(self.load + 0.5)
        for c in self.contenders:
            c.active = False
        # Faults stop: every partition heals (a heal scheduled later does nothing more).
        for worker in self.workers:
            if worker.client.partitioned:
                worker.client.heal()
        for c in self.contenders:
            if c.client.partitioned:
                c.client.heal()
        calm = max([self.load, self.server.down_until] + [h.suspended_until for h in world.hosts.values()]
                   + [w.agent_proc.paused_until for w in self.workers] + [c.proc.paused_until for c in self.contenders])
        world.run_until(calm)
        world.run_until(calm + SETTLE, stop=self._quiet)
        world.run_until(world.now + 5.0)  # containers swept, grace timers run out
        self.checks.at_end()
        # The workers exit: the main process goes, pool processes go once idle; now and then
        # with the agent cut off from ZooKeeper at that moment (it must exit all the same).
        exit_rng = world.rng("exit")
        cut = [w for w in self.workers if exit_rng.random() < 0.3]
        for worker in cut:
            worker.client.partition()
        world.run_until(world.now + 30.0, stop=lambda: all(not w.client.connected for w in cut))
        for worker in self.workers:
            worker.exiting_pools = True
            worker.main.die()
            for pool in worker.pools:
                pool.exit()
        world.run_until(world.now + 3.0)
        for worker in self.workers:
            worker.poll_stopped()
        self.checks.orphans()

    def _quiet(self) -> bool:
        if self.broker is not None and not self.broker.drained():
            return False
        for worker in self.workers:
            if worker.killed_at is not None:
                continue
            if worker.stopping_at is not None and not worker.main.alive:
                continue  # stopped warm: the pool finished, the main process exited
            if self.broker is not None and worker.main.step.holding():
                return False
            if worker.main.alive and any(not r["done"] for r in worker.main.requests.values()):
                return False
            if any(p.proc.alive and p.phase != "idle" for p in worker.pools):
                return False
            if worker.agent.requests.waits or worker.agent.requests.cohorts:
                return False
        return not any(c.holding or (c.attempt is not None and not c.attempt.result.ready()) for c in self.contenders)


def run_seed(seed: int, trace: bool = False, shape: dict | None = None, scenario: str | None = None):
    """Run one seed (of ``scenario``, if named); returns (violation or None, the run)."""
    if scenario is not None:
        shape = {**{**SCENARIOS, **NOT_IN_CI}[scenario], **(shape or {})}
    from .checks import Violation

    run = Run(seed, trace=trace, shape=shape)
    try:
        run.execute()
    except Violation as exc:
        return str(exc), run
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a blocking wait, or the code under test raised in a callback
        import traceback

        return f"the run crashed: {exc!r}\n{traceback.format_exc(limit=-6)}", run
    finally:
        if run.broker is not None:
            from .celery_main import uninstall

            uninstall()
    return None, run


def _reexec_with_fixed_hash() -> None:
    # String hashing must not vary between processes, or a replay could order sets differently.
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, "-m", "sim.run", *sys.argv[1:]])


def _schedules(args):
    """(seed, scenario) pairs: the random seeds, then each directed scenario's."""
    if args.budget is not None:
        seed = args.first
        while True:
            yield seed, None
            seed += 1
    if args.scenario is not None:  # one directed scenario's seeds only
        for seed in range(args.first, args.first + args.seeds):
            yield seed, args.scenario
        return
    for seed in range(args.first, args.first + args.seeds):
        yield seed, None
    for name in SCENARIOS if args.scenarios else ():
        for seed in range(1, SCENARIOS[name].get("seeds", SCENARIO_SEEDS) + 1):
            yield seed, name


def _own_counts() -> str:
    """The scenarios that run their own number of seeds, for the summary line."""
    own: dict[int, list[str]] = {}
    for name, shape in SCENARIOS.items():
        if "seeds" in shape:
            own.setdefault(shape["seeds"], []).append(name)
    return "".join(f" ({', '.join(names)} x {n})" for n, names in sorted(own.items()))


def _replay(seed: int, scenario: str | None, shape: dict | None = None) -> str:
    from .shrink import replay_line

    line = replay_line(seed, shape or {})
    return line + (f" SCENARIO={scenario}" if scenario else "")


def main(argv=None) -> int:
    _reexec_with_fixed_hash()
    parser = argparse.ArgumentParser(prog="python -m sim.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, help="replay one seed and print its trace")
    parser.add_argument("--scenario", choices=sorted({**SCENARIOS, **NOT_IN_CI}),
                        help="the directed scenario of --seed; without --seed, run --seeds seeds of it alone")
    parser.add_argument("--drop", default="", help="with --seed: faults to leave out (a shrunk replay), e.g. 0,2")
    parser.add_argument("--load", type=float, help="with --seed: seconds of load (a shrunk replay)")
    parser.add_argument("--seeds", type=int, help=f"how many random seeds to run (default {CI_SEEDS}, the CI budget)")
    parser.add_argument("--first", type=int, default=1, help="the first seed")
    parser.add_argument("--budget", type=float, help="seconds of wall time instead of a number of seeds")
    parser.add_argument("--no-scenarios", dest="scenarios", action="store_false",
                        help=f"skip the directed scenarios ({SCENARIO_SEEDS} seeds each, or the scenario's own count)")
    parser.add_argument("--no-shrink", dest="shrink", action="store_false", help="report a violation unshrunk")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--fingerprints", metavar="FILE",
                        help="write each schedule's seed, scenario, events and event digest to FILE, "
                             "to compare two versions of the code schedule by schedule")
    args = parser.parse_args(argv)
    if args.seeds is None and args.budget is None:
        args.seeds = CI_SEEDS
    logging.getLogger("celery_zklock").propagate = False
    if args.seed is not None:
        shape = {}
        if args.drop:
            shape["drop"] = frozenset(int(i) for i in args.drop.split(","))
        if args.load is not None:
            shape["load"] = args.load
        violation, run = run_seed(args.seed, trace=True, shape=shape, scenario=args.scenario)
        for line in run.world.full_trace:
            print(line)
        print(f"seed {args.seed}: {violation or 'ok'} ({run.world.events} events, faults {run.faults})")
        return 1 if violation else 0
    started = time.monotonic()
    done, events, faults = 0, 0, 0
    kinds: dict[str, int] = {}
    prints = open(args.fingerprints, "w") if args.fingerprints else None
    for seed, scenario in _schedules(args):
        if args.budget is not None and time.monotonic() - started > args.budget:
            break
        violation, run = run_seed(seed, scenario=scenario)
        if prints is not None:
            prints.write(f"{seed} {scenario or '-'} {run.world.events} {run.world.digest & 0xFFFFFFFFFFFF:012x}\n")
            prints.flush()
        done += 1
        events += run.world.events
        faults += len(run.faults)
        for kind in run.faults:
            kinds[kind] = kinds.get(kind, 0) + 1
        if violation:
            where = f"seed {seed}" + (f" (scenario {scenario})" if scenario else "")
            print(f"VIOLATION at {where}: {violation}")
            print("last events:")
            for line in run.world.trace:
                print("   ", line)
            print(f"faults drawn: {run.faults}")
            print(f"replay: {_replay(seed, scenario)}")
            if args.shrink:
                from .shrink import shrink

                shape, shrunk = shrink(seed, violation, functools.partial(run_seed, scenario=scenario))
                kept = [f for i, f in enumerate(run.faults) if i not in shape.get("drop", ())]
                print(f"shrunk: faults {kept}, {shape.get('load', run.load):g} s of load: {shrunk}")
                print(f"replay the shrunk run: {_replay(seed, scenario, shape)}")
            return 1
    elapsed = time.monotonic() - started
    if not args.quiet:
        what = (f"{args.seeds} seeds of scenario {args.scenario} from {args.first}" if args.scenario else
                f"{args.seeds} random seeds from {args.first}"
                f"{f', {len(SCENARIOS)} directed scenarios x {SCENARIO_SEEDS}' if args.scenarios else ''}"
                f"{_own_counts() if args.scenarios else ''}")
        print(f"sim: {done} schedules ({what}) in "
              f"{elapsed:.1f} s: {done / elapsed:.1f} schedules/s, {events / max(done, 1):.0f} events/schedule, "
              f"{faults / max(done, 1):.1f} faults/schedule; no violation")
        print("faults exercised: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
