"""kazoo's own lock tests, taken from the installed kazoo package, against our locks (issue 41).

``KazooLockTests`` (``kazoo/tests/test_lock.py``, shipped in kazoo's wheel) is what a kazoo
user switching libraries would trust.  Its mutex tests run here, on the project's ZooKeeper
(the ``zk_server`` fixture, not kazoo's cluster harness), four times:

- ``KazooLock``, as kazoo users get it (not re-entrant);
- ``KazooLock(reentrant=True)``: the many-threads tests with re-entry on, where a thread id
  the runtime recycled once let 12 of 20 threads "hold" one mutex;
- ``FairLock`` itself, default ``reentrant=True``, in the tests whose calls it answers as
  kazoo does (``acquire(blocking=False)``, ``with lock``, ``release``);
- kazoo's own ``Lock``, the control.

Every test left out, and why, is in :data:`LEFT_OUT`; pytest reports each as skipped with
its reason.
"""

from __future__ import annotations

import unittest

import pytest
# The module, not the class: pytest collects any unittest.TestCase a test module names,
# and kazoo's class would then run against kazoo's own cluster harness.
from kazoo.tests import test_lock as kazoo_lock_tests

from celery_zklock.engine import FairLock, KazooLock

pytestmark = [
    pytest.mark.timeout(180),
    # kazoo's harness checks the cluster with a client chrooted to a namespace not made yet.
    pytest.mark.filterwarnings("ignore:No chroot path exists"),
]

ALL = ("KazooLock", "KazooLock(reentrant=True)", "FairLock", "kazoo Lock")
READ_WRITE = "a read/write lock test (kazoo's ReadLock/WriteLock), not a mutex test: nothing of ours is under test"
KAZOO_ERRORS = ("kazoo's interface, not FairLock's: FairLock returns False where kazoo raises LockTimeout/"
                "CancelledError, and its contenders() are Contender tuples; KazooLock (the runs above) maps them")

#: (kazoo test, the runs it is left out of, why) — the one list of what is not run.  Names
#: ``Class.*`` are whole classes of kazoo's test_lock module that no run subclasses.
LEFT_OUT = [
    ("TestSemaphore.*", ALL, "kazoo's Semaphore tests: KazooLock has kazoo's Lock interface only "
                             "(FairLock(max_holders=N) is our semaphore, with its own tests)"),
    ("TestSequence.*", ALL, "unit tests of kazoo's Lock._get_predecessor on a MagicMock client: kazoo internals"),
    ("test_lock_ephemeral", ALL[:3], "no persistent locks: acquire(ephemeral=False) raises ValueError by design "
                                     "(a node outliving its session would hold the lock forever after a crash)"),
    ("test_read_lock", ALL, READ_WRITE),
    ("test_write_lock", ALL, READ_WRITE),
    ("test_rw_lock", ALL, READ_WRITE),
    ("test_lock_no_double_calls", ("KazooLock(reentrant=True)", "FairLock"),
     "asserts the holder's second acquire fails: re-entry, which this run turns on, makes it succeed"),
    ("test_lock_same_thread_no_block", ("KazooLock(reentrant=True)", "FairLock"),
     "asserts the holder's second acquire fails: re-entry, which this run turns on, makes it succeed"),
    *((name, ("FairLock",), KAZOO_ERRORS) for name in (
        "test_lock_one", "test_lock", "test_lock_reconnect", "test_lock_non_blocking", "test_lock_fail_first_call",
        "test_lock_cancel", "test_lock_timeout")),
]


class _OnOurZooKeeper(kazoo_lock_tests.KazooLockTests):
    """kazoo's harness pointed at ``zk_server``; ``client.Lock`` builds :meth:`make_lock`'s lock."""

    __test__ = False  # the runs below are the tests

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
        client.Lock = lambda path, identifier=None, extra_lock_patterns=(): self.make_lock(
            client, path, identifier, extra_lock_patterns)
        return client

    def make_lock(self, client, path, identifier, extra_lock_patterns):
        raise NotImplementedError


def _run(run: str, make_lock) -> type:
    """A test class running kazoo's suite with ``make_lock``, minus :data:`LEFT_OUT`'s tests."""
    body = {"__test__": True, "make_lock": lambda self, *args: make_lock(*args)}
    for name, runs, why in LEFT_OUT:
        if run in runs and not name.endswith(".*"):
            body[name] = unittest.skip(why)(getattr(kazoo_lock_tests.KazooLockTests, name))
    return type(f"Kazoo suite on {run}", (_OnOurZooKeeper,), body)


TestKazooLock = _run("KazooLock", lambda c, p, i, x: KazooLock(c, p, i, x))
TestKazooLockReentrant = _run("KazooLock(reentrant=True)", lambda c, p, i, x: KazooLock(c, p, i, x, reentrant=True))
TestFairLock = _run("FairLock", lambda c, p, i, x: FairLock(c, p, identifier=i))
TestKazooOwnLock = _run("kazoo Lock", lambda c, p, i, x: kazoo_lock_tests.Lock(c, p, i, x))


def test_every_left_out_test_exists_and_every_run_is_named():
    """A kazoo upgrade that renames a test must not leave a stale entry here (nor an entry
    for a run that does not exist)."""
    for name, runs, _ in LEFT_OUT:
        owner = kazoo_lock_tests if name.endswith(".*") else kazoo_lock_tests.KazooLockTests
        assert callable(getattr(owner, name.removesuffix(".*"), None)), name
        assert set(runs) <= set(ALL), runs
