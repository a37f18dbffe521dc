"""A cohort driven by the test: the agent as a cohort sees it (:class:`Host`), with its event
thread in the test's hands, against a real ZooKeeper.  ``Host.run`` runs the callbacks kazoo
posted, in order, only when the test says so: a race between a reply and the agent's next
step is then made certain, not hoped for."""

from __future__ import annotations

import time
import uuid
from types import SimpleNamespace

from celery_zklock.config import ZkSettings
from celery_zklock.engine.session import LEASED
from celery_zklock.worker.cohort import Cohort


class Host:
    """The agent as a cohort sees it, with its event thread in the test's hands."""

    def __init__(self, client) -> None:
        self.client = client
        self.settings = ZkSettings()
        self.events: list = []  # posted from kazoo's completion thread (list.append is atomic)
        self.grants: list = []
        self.ran: list[str] = []  # the names of the callbacks run, in order

    def post(self, fn, *args) -> None:
        self.events.append((fn, args))

    def run(self, until, timeout: float = 10.0) -> None:
        """Run posted callbacks, in order, until ``until()`` holds and none is left."""
        deadline = time.monotonic() + timeout
        while not (until() and not self.events):
            assert time.monotonic() < deadline, "the cohort did not get there"
            if self.events:
                fn, args = self.events.pop(0)
                self.ran.append(getattr(fn, "__name__", repr(fn)))
                fn(*args)
            else:
                time.sleep(0.001)  # the event loop's idle turn: a reply is on its way

    def on_granted(self, wait, cohort, slot, token) -> None:
        wait.current = None
        self.grants.append((wait.id, slot.attempt.node, token))

    def on_queued(self, wait, position) -> None:
        pass

    def on_next(self, wait, ours=True, streak_left=None) -> None:
        pass

    def earliest_elsewhere(self, cohort) -> float | None:
        return None

    def on_slot_lost(self, wait) -> None:
        wait.lost = True

    def on_failed(self, wait, exc) -> None:
        raise AssertionError(f"{wait.id} failed: {exc!r}")

    def on_timed_out(self, wait, path) -> None:
        raise AssertionError(f"{wait.id} timed out")


class TimesOutHost(Host):
    """A Host that records timeouts (the request's verdict) instead of failing on them."""

    def __init__(self, client) -> None:
        super().__init__(client)
        self.timed_out: list = []

    def on_timed_out(self, wait, path) -> None:
        wait.current = None
        self.timed_out.append(wait.id)


def waiter(cohort: Cohort, name: str):
    """A request waiting in ``cohort``, as the agent's requests look to it."""
    return SimpleNamespace(id=name, identity=name.encode(), current=cohort, expired=False, lost=False)


def first_granted(client, root: str, *names: str):
    """A cohort on a new key under ``root``, a wait per name, the first one granted:
    ``(host, cohort, waits, slot)``, ``slot`` the node it holds."""
    host = Host(client)
    client.ensure_path(root)
    cohort = Cohort(host, f"{root}/{uuid.uuid4().hex[:8]}", 1)
    waits = [waiter(cohort, name) for name in names]
    cohort.join(waits[0])
    host.run(lambda: host.grants)
    [slot] = cohort.slots
    return host, cohort, waits, slot


class LeaseClock:
    """A lease clock the test moves: time passes only when told (a suspend is one jump)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def held_with_a_young_proof(client, clock: LeaseClock):
    """A cohort whose node has a proof written at ``clock.now`` (the first one, written when
    one of ours queued behind its holder) and passed once on it, held by ``second``, with
    ``third`` waiting behind it: ``(host, cohort, second, third)``."""
    host = Host(client)
    client.ensure_path("/lease-clock")
    cohort = Cohort(host, f"/lease-clock/{uuid.uuid4().hex[:8]}", 1, clock=clock)
    first, second, third = (waiter(cohort, n) for n in ("first", "second", "third"))
    cohort.join(first)
    host.run(lambda: host.grants)
    cohort.join(second)
    # The first proof's reply, before the release: else the release waits for it (CI: a
    # reply that came within one turn made the handoff a leased one, on a loaded machine).
    host.run(lambda: cohort.slots[0].confirmed is not None)
    assert cohort.release(first) is LEASED
    host.run(lambda: len(host.grants) == 2)
    [slot] = cohort.slots
    assert slot.confirmed == clock.now and slot.holder is second
    cohort.join(third)
    host.run(lambda: True)
    return host, cohort, second, third
