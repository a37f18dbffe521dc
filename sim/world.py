"""Virtual time, processes and threads: the simulator's scheduler.

Every event has a time and a deterministic key (its source's name and that source's own
count), so the order of two events never depends on set iteration or memory addresses,
and a run replays exactly from its seed.  A *thread* is a FIFO of callbacks run one at a
time, with a small random gap between them: the agent's event thread, kazoo's connection
and completion threads, the timers, each simulated peer.  A *process* can be paused
(SIGSTOP) and a *host* suspended: their threads' events wait until they thaw, and a
host's suspend stops its processes' monotonic clocks but not their boot clocks, nor the
server's.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import deque
from typing import Callable


def stable_rng(seed: int, name: str) -> random.Random:
    """A random source per name: one stream per thread or link, so draws of one never shift
    another's (the order in which sources draw is then irrelevant)."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "big"))


class Host:
    def __init__(self, world: "World", name: str) -> None:
        self.world = world
        self.name = name
        self.suspended_until = -1.0
        self.suspended_total = 0.0  # seconds suspended so far (monotonic clocks skip them)

    def suspend(self, seconds: float) -> None:
        now = self.world.now
        end = max(self.suspended_until, now) + seconds
        self.suspended_total += end - max(self.suspended_until, now)
        self.suspended_until = end


class Proc:
    """A process: its threads' events run only while neither it nor its host is frozen."""

    def __init__(self, world: "World", host: Host, name: str) -> None:
        self.world = world
        self.host = host
        self.name = name
        self.paused_until = -1.0
        self.alive = True

    def pause(self, seconds: float) -> None:
        now = self.world.now
        self.paused_until = max(self.paused_until, now) + seconds

    def thaw_time(self) -> float:
        return max(self.paused_until, self.host.suspended_until)

    def frozen(self) -> bool:
        return self.thaw_time() > self.world.now

    def monotonic(self) -> float:
        """This process's ``time.monotonic()``: stops while its host is suspended."""
        return self.world.now - self.host.suspended_total + _future_suspend(self.host, self.world.now)

    def boottime(self) -> float:
        return self.world.now


def _future_suspend(host: Host, now: float) -> float:
    # suspended_total counts a suspend that is still under way in full; give back the part
    # still to come, so the clock reads the moment the suspend began until it ends.
    return max(0.0, host.suspended_until - now) if host.suspended_until > now else 0.0


class Thread:
    """A FIFO of callbacks on one process, run one at a time with small random gaps."""

    def __init__(self, proc: Proc, name: str, gap: tuple[float, float] = (0.0, 0.0005)) -> None:
        self.proc = proc
        self.world = proc.world
        self.name = f"{proc.name}.{name}"
        self.items: deque = deque()
        self.scheduled = False
        self.gap = gap
        self.rng = self.world.rng(self.name)
        self.not_before = 0.0  # descheduled until then (a fault: another thread has the CPU or the GIL)

    def late(self, seconds: float) -> None:
        """The thread gets no CPU for ``seconds`` from now (its process's other threads run)."""
        self.not_before = max(self.not_before, self.world.now + seconds)

    def put(self, fn: Callable, *args) -> None:
        if not self.proc.alive:
            return
        self.items.append((fn, args))
        if not self.scheduled:
            self.scheduled = True
            self.world.at(self.world.now + self.rng.uniform(*self.gap), self.name, self._run_one, proc=self.proc)

    def _run_one(self) -> None:
        self.scheduled = False
        if not self.items or not self.proc.alive:
            return
        if self.world.now < self.not_before:
            self.scheduled = True
            self.world.at(self.not_before, self.name, self._run_one, proc=self.proc)
            return
        fn, args = self.items.popleft()
        if self.items:
            self.scheduled = True
            self.world.at(self.world.now + self.rng.uniform(*self.gap), self.name, self._run_one, proc=self.proc)
        fn(*args)


class World:
    def __init__(self, seed: int, trace_limit: int = 400) -> None:
        self.seed = seed
        self.now = 0.0
        self._heap: list = []
        self._counts: dict[str, int] = {}
        self.events = 0
        #: Folds every event's (time, source, count): two runs of a seed that give the same
        #: digest ran the same schedule (a restructure's check that it changed no behaviour).
        self.digest = 0
        self.current: Proc | None = None
        self.trace: deque = deque(maxlen=trace_limit)
        self.full_trace: list | None = None  # every line, when replaying one seed
        self.hosts: dict[str, Host] = {}
        self.checks: list[Callable[[], None]] = []

    def rng(self, name: str) -> random.Random:
        return stable_rng(self.seed, name)

    def host(self, name: str) -> Host:
        if name not in self.hosts:
            self.hosts[name] = Host(self, name)
        return self.hosts[name]

    def at(self, when: float, source: str, fn: Callable, *args, proc: Proc | None = None) -> None:
        n = self._counts.get(source, 0)
        self._counts[source] = n + 1
        heapq.heappush(self._heap, (max(when, self.now), source, n, fn, args, proc))

    def log(self, text: str) -> None:
        line = f"{self.now:10.4f}  {text}"
        self.trace.append(line)
        if self.full_trace is not None:
            self.full_trace.append(line)

    def step(self) -> bool:
        if not self._heap:
            return False
        when, source, n, fn, args, proc = heapq.heappop(self._heap)
        if proc is not None:
            if not proc.alive:
                return True
            thaw = proc.thaw_time()
            if thaw > when:  # frozen: the event waits for the thaw, in its order
                heapq.heappush(self._heap, (thaw, source, n, fn, args, proc))
                return True
        self.now = max(self.now, when)
        previous, self.current = self.current, proc
        try:
            fn(*args)
        finally:
            self.current = previous
        self.events += 1
        self.digest = hash((self.digest, when, source, n))
        for check in self.checks:
            check()
        return True

    def run_until(self, until: float, stop: Callable[[], bool] | None = None) -> None:
        while self._heap and self._heap[0][0] <= until:
            if stop is not None and stop():
                return
            self.step()
        self.now = max(self.now, until)
