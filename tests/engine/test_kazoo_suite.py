"""kazoo's own lock tests, taken from the installed kazoo package, against our locks (issues 41, 62).

``KazooLockTests`` (``kazoo/tests/test_lock.py``, shipped in kazoo's wheel) is what a kazoo
user switching libraries would trust.  Its mutex and read/write lock tests run here, on the
project's ZooKeeper (the ``zk_server`` fixture, not kazoo's cluster harness), four times;
each run gives the tests' ``client.Lock``, ``client.ReadLock`` and ``client.WriteLock``:

- ``KazooLock``, ``KazooReadLock``, ``KazooWriteLock``, as kazoo users get them (not re-entrant);
- the same with ``reentrant=True``: the many-threads tests with re-entry on, where a thread id
  the runtime recycled once let 12 of 20 threads "hold" one mutex;
- ``FairLock`` itself, default ``reentrant=True`` (and ``ReadWriteLock``'s sides), in the
  tests whose calls it answers as kazoo does (``acquire(blocking=False)``, ``with lock``,
  ``release``);
- kazoo's own ``Lock``, ``ReadLock`` and ``WriteLock``, the control.

Every test left out, and why, is in :data:`LEFT_OUT`; pytest reports each as skipped with
its reason.
"""

from __future__ import annotations

import unittest
from functools import partial

import pytest
from kazoo.recipe import lock as kazoo_recipe

# The module, not the class: pytest collects any unittest.TestCase a test module names,
# and kazoo's class would then run against kazoo's own cluster harness.
from kazoo.tests import test_lock as kazoo_lock_tests

from celery_zklock.engine import FairLock, KazooLock, KazooReadLock, KazooWriteLock, ReadWriteLock
from tests.versions import KAZOO

pytestmark = [
    pytest.mark.timeout(180),
    # kazoo's harness checks the cluster with a client chrooted to a namespace not made yet.
    pytest.mark.filterwarnings("ignore:No chroot path exists"),
]

ALL = ("KazooLock", "KazooLock(reentrant=True)", "FairLock", "kazoo Lock")
REENTRY = "asserts the holder's second acquire fails: re-entry, which this run turns on, makes it succeed"
KAZOO_ERRORS = ("kazoo's interface, not FairLock's: FairLock returns False where kazoo raises LockTimeout/"
                "CancelledError, has no is_acquired, and its contenders() are Contender tuples; KazooLock, "
                "KazooReadLock and KazooWriteLock (the runs above) map them")

#: (kazoo test, the runs it is left out of, why) — the one list of what is not run.  Names
#: ``Class.*`` are whole classes of kazoo's test_lock module that no run subclasses.
LEFT_OUT = [
    ("TestSemaphore.*", ALL, "kazoo's Semaphore tests: KazooLock has kazoo's Lock interface only "
                             "(FairLock(max_holders=N) is our semaphore, with its own tests)"),
    ("TestSequence.*", ALL, "unit tests of kazoo's Lock._get_predecessor on a MagicMock client: kazoo internals"),
    ("test_lock_ephemeral", ALL[:3], "no persistent locks: acquire(ephemeral=False) raises ValueError by design "
                                     "(a node outliving its session would hold the lock forever after a crash)"),
    *((name, ("KazooLock(reentrant=True)", "FairLock"), REENTRY) for name in (
        "test_lock_no_double_calls", "test_lock_same_thread_no_block")),
    *((name, ("KazooLock(reentrant=True)",), REENTRY) for name in ("test_read_lock", "test_write_lock")),
    *((name, ("FairLock",), KAZOO_ERRORS) for name in (
        "test_lock_one", "test_lock", "test_lock_reconnect", "test_lock_non_blocking", "test_lock_fail_first_call",
        "test_lock_cancel", "test_lock_timeout", "test_read_lock", "test_write_lock", "test_rw_lock")),
    # kazoo 2.9's starts the reader's and the writer's threads at once and asserts the reader
    # queued first; kazoo 2.10 waits for the reader before starting the writer (its PR 747).
    *([("test_rw_lock", ("KazooLock", "KazooLock(reentrant=True)", "kazoo Lock"),
        f"kazoo {'.'.join(map(str, KAZOO))}'s test races its reader and writer threads to queue (fixed in kazoo 2.10)")]
      if KAZOO < (2, 10) else []),
]


class _OnOurZooKeeper(kazoo_lock_tests.KazooLockTests):
    """kazoo's harness pointed at ``zk_server``; ``client.Lock``, ``client.ReadLock`` and
    ``client.WriteLock`` build the run's locks (:attr:`makers`)."""

    __test__ = False  # the runs below are the tests
    #: ``Lock``, ``ReadLock``, ``WriteLock`` -> ``(client, path, identifier, extra_lock_patterns) -> lock``
    makers: dict = {}

    @pytest.fixture(autouse=True)
    def _server(self, zk_server):
        self._zk_hosts = zk_server.hosts

    cluster = property(lambda self: [])  # kazoo's own cluster is never started
    servers = property(lambda self: self._zk_hosts)

    @classmethod
    def tearDownClass(cls) -> None:  # kazoo's stops its cluster
        pass

    def _get_client(self, **options):
        client = super()._get_client(**options)
        for name, make in self.makers.items():
            setattr(client, name, lambda path, identifier=None, extra_lock_patterns=(), make=make: make(
                client, path, identifier, extra_lock_patterns))
        return client


def _run(run: str, **makers) -> type:
    """A test class running kazoo's suite with ``makers``' locks, minus :data:`LEFT_OUT`'s tests."""
    assert set(makers) == {"Lock", "ReadLock", "WriteLock"}, makers  # none falls through to kazoo's own
    body = {"__test__": True, "makers": makers}
    for name, runs, why in LEFT_OUT:
        if run in runs and not name.endswith(".*"):
            body[name] = unittest.skip(why)(getattr(kazoo_lock_tests.KazooLockTests, name))
    return type(f"Kazoo suite on {run}", (_OnOurZooKeeper,), body)


TestKazooLock = _run("KazooLock", Lock=KazooLock, ReadLock=KazooReadLock, WriteLock=KazooWriteLock)
TestKazooLockReentrant = _run("KazooLock(reentrant=True)", Lock=partial(KazooLock, reentrant=True),
                              ReadLock=partial(KazooReadLock, reentrant=True),
                              WriteLock=partial(KazooWriteLock, reentrant=True))
TestFairLock = _run("FairLock", Lock=lambda c, p, i, x: FairLock(c, p, identifier=i),
                    ReadLock=lambda c, p, i, x: ReadWriteLock(c, p, identifier=i).read,
                    WriteLock=lambda c, p, i, x: ReadWriteLock(c, p, identifier=i).write)
TestKazooOwnLock = _run("kazoo Lock", Lock=kazoo_lock_tests.Lock, ReadLock=kazoo_recipe.ReadLock,
                        WriteLock=kazoo_recipe.WriteLock)


def test_every_left_out_test_exists_and_every_run_is_named():
    """A kazoo upgrade that renames a test must not leave a stale entry here (nor an entry
    for a run that does not exist)."""
    for name, runs, _ in LEFT_OUT:
        owner = kazoo_lock_tests if name.endswith(".*") else kazoo_lock_tests.KazooLockTests
        assert callable(getattr(owner, name.removesuffix(".*"), None)), name
        assert set(runs) <= set(ALL), runs
