"""The lock's one decision (driver.gets_the_lock) and node identities: pure logic, from tables."""

from __future__ import annotations

import pytest

from celery_zklock.engine.driver import Decision, gets_the_lock
from celery_zklock.engine.identity import Identity
from celery_zklock.worker.next_in_line import Early, hand_over_early


def n(seq: int, kind: str = "ours") -> str:
    """A child name of the given kind with sequence ``seq``."""
    return {
        "ours": f"_c_{seq:04x}aaaa-lock-{seq:010d}",
        "curator": f"_c_{seq:04x}bbbb-lock-{seq:010d}",
        "kazoo": f"{seq:04x}cccc__lock__{seq:010d}",
    }[kind]


ME = n(5)


@pytest.mark.parametrize(
    "children, max_holders, expected",
    [
        # alone: we hold
        ([ME], 1, Decision(True, 0, (), False)),
        # first of several (children come unsorted from ZooKeeper)
        ([n(9), ME, n(7)], 1, Decision(True, 0, (), False)),
        # second in a mutex queue: watch the one ahead; it is everyone ahead -> handoff
        ([ME, n(3)], 1, Decision(False, 1, (n(3),), True)),
        # third: watch only the node directly ahead (no herd), no handoff; the holder's
        # departure would make us next in line
        ([n(1), n(3), ME, n(8)], 1, Decision(False, 2, (n(3),), False, (n(1),))),
        # fourth: the holder's successor leaving (after the holder) makes us next in line
        ([n(0), n(1), n(3), ME], 1, Decision(False, 3, (n(3),), False, (n(1),))),
        # semaphore of 2, we are second: we hold
        ([n(1), ME], 2, Decision(True, 1, (), False)),
        # semaphore of 2, we are third: watch the two ahead; they are everyone ahead
        ([n(1), n(3), ME], 2, Decision(False, 2, (n(1), n(3)), True)),
        # semaphore of 2, we are fourth: the window is the two directly ahead
        ([n(0), n(1), n(3), ME], 2, Decision(False, 3, (n(1), n(3)), False, (n(0),))),
        # semaphore of 2, fifth: two places behind next in line
        ([n(0), n(1), n(2), n(3), ME], 2, Decision(False, 4, (n(2), n(3)), False, (n(1),))),
        # our node is gone (deleted by an operator, or died with our session)
        ([n(1), n(3)], 1, Decision(False, None, (), False)),
        ([], 1, Decision(False, None, (), False)),
        # Curator and kazoo Lock nodes queue with ours, by sequence
        ([n(2, "curator"), ME], 1, Decision(False, 1, (n(2, "curator"),), True)),
        ([n(4, "kazoo"), n(2, "curator"), ME], 1, Decision(False, 2, (n(4, "kazoo"),), False, (n(2, "curator"),))),
        # children that are not lock nodes are ignored
        (["leader", "config", ME], 1, Decision(True, 0, (), False)),
        # the queue is ordered by sequence, not by name
        ([f"zzz-lock-{3:010d}", f"aaa-lock-{4:010d}", ME], 1,
         Decision(False, 2, (f"aaa-lock-{4:010d}",), False, (f"zzz-lock-{3:010d}",))),
        # max_holders larger than the queue: everyone holds
        ([n(1), n(3), ME], 5, Decision(True, 2, (), False)),
    ],
)
def test_gets_the_lock(children, max_holders, expected):
    assert gets_the_lock(children, ME, max_holders) == expected


@pytest.mark.parametrize(
    "data, expected",
    [
        (b'{"host":"h","pid":1,"task_id":"t","retries":2,"task":"x.y","worker":"w@h"}',
         Identity("h", 1, "t", 2, "x.y", "w@h")),
        (b'{"host":"h","pid":1,"thread":"MainThread"}', Identity("h", 1, thread="MainThread")),
        (b'{"host":"h","pid":1,"extra":"kept out"}', Identity("h", 1)),
        (b"10.0.0.1", None),  # Curator's default node data: an IP address
        (b"", None),
        (None, None),
        (b'["h", 1]', None),
        (b'{"host":"h"}', None),  # no pid: not ours
        (b'{"host":"h","pid":"1"}', None),
    ],
)
def test_identity_parse(data, expected):
    assert Identity.parse(data) == expected


def test_identity_round_trip_and_delivery():
    ident = Identity.of_this_process(task_id="abc", retries=0, task="t", worker="w")
    assert Identity.parse(ident.to_bytes()) == ident
    assert ident.delivery == ("abc", 0)
    assert Identity.of_this_thread().delivery is None
    assert b"null" not in Identity.of_this_thread().to_bytes()  # unset fields are left out


@pytest.mark.parametrize(
    "expected_wait, early, slots, idle, expected, why",
    [
        (0.03, 0, 1, True, Early.NOW, "a short hold, a free handoff slot, nothing else waits for a process"),
        (0.03, 0, 1, False, Early.LATER, "other requests wait for a process: they run first (issue 39: beside a "
                                     "hot chain, the parked process was one the other keys lacked)"),
        (0.03, 1, 1, True, Early.LATER, "the slot is taken: when it frees, if still undecided"),
        (0.03, 0, 0, True, Early.NO, "no handoff slots (zklock_handoff_slots=0, solo, -c 1)"),
        (None, 0, 2, True, Early.NO, "holds not known yet: never park a process on a guess"),
        (0.5, 0, 1, True, Early.NOW, "the bound itself is short enough"),
        (0.51, 0, 1, True, Early.NO, "a long hold: its process would idle that long"),
        (5.0, 3, 4, True, Early.NO, "a long hold, whatever the slots"),
    ],
)
def test_hand_over_early(expected_wait, early, slots, idle, expected, why):
    assert hand_over_early(expected_wait, early, slots, idle) is expected, why


class _Semaphore:
    def __init__(self, value, waiting=()):
        self.value, self._waiting = value, list(waiting)


def _consumer(semaphore, buffer=()):
    from types import SimpleNamespace

    return SimpleNamespace(controller=SimpleNamespace(semaphore=semaphore),
                           pool=SimpleNamespace(_pool=SimpleNamespace(outbound_buffer=list(buffer))))


@pytest.mark.parametrize(
    "free, waiting, buffered, ours, parks, why",
    [
        (1, 0, 0, True, True, "behind our own holder: the one free process may park"),
        (2, 0, 0, False, True, "behind another worker's streak, two free: one parks, one stays"),
        (0, 0, 0, True, True, "behind our own holder, none free yet: the holder's frees as it ends"),
        (1, 0, 0, False, False, "behind another worker's streak, one free: it stays free"),
        (3, 1, 0, True, False, "a request waits for a process (the semaphore's queue): it goes first"),
        (3, 0, 1, True, False, "a request waits in the pool's outbound buffer: it goes first"),
    ],
)
def test_may_park_only_while_nothing_else_waits_for_a_process(free, waiting, buffered, ours, parks, why):
    from celery_zklock.worker.next_in_line import may_park

    c = _consumer(_Semaphore(free, [object()] * waiting), [object()] * buffered)
    assert may_park(c, ours) is parks, why


def test_may_park_is_no_without_the_pools_internals():
    from types import SimpleNamespace

    from celery_zklock.worker.next_in_line import may_park

    assert may_park(SimpleNamespace(controller=SimpleNamespace(), pool=SimpleNamespace()), True) is False


TOP = 2**31 - 1  # ZooKeeper's sequence is the parent's cversion, a signed 32-bit int: after it, -2**31


@pytest.mark.parametrize(
    "children, me, max_holders, expected, why",
    [
        ([n(TOP), n(-(2**31))], n(-(2**31)), 1, Decision(False, 1, (n(TOP),), True),
         "the first node past the wrap queues behind the last one before it"),
        ([n(TOP - 1), n(TOP), n(-(2**31))], n(TOP), 1, Decision(False, 1, (n(TOP - 1),), True),
         "a node past the wrap is behind ours, not ahead"),
        ([n(TOP - 1), n(TOP), n(-(2**31)), n(-(2**31) + 1)], n(-(2**31) + 1), 1,
         Decision(False, 3, (n(-(2**31)),), False, (n(TOP),)), "the nearest ahead across the wrap"),
        ([n(TOP), n(-(2**31))], n(TOP), 1, Decision(True, 0, (), False), "the last before the wrap holds"),
        ([n(-2), n(-1), n(0)], n(0), 1, Decision(False, 2, (n(-1),), False, (n(-2),)),
         "a second wrap, from -1 to 0"),
        ([n(-1), n(0), n(1)], n(-1), 2, Decision(True, 0, (), False), "-1 first"),
    ],
)
def test_gets_the_lock_across_the_sequence_wrap(children, me, max_holders, expected, why):
    """ZooKeeper names a sequential child after its parent's cversion, formatted %010d: after
    2**31 - 1 child changes under one parent it counts on from -2147483648 ("-lock--2147483648",
    "-lock--000000001").  A queue that never empties (a hot key, waiting in the pool) gets there
    in days.  Before, such a node was not a lock node to us: our own was missing from the queue
    and we created another, without end."""
    assert gets_the_lock(children, me, max_holders) == expected, why


def rw(seq: int, kind: str) -> str:
    """A child of a read/write path: ours or Curator's (``r``/``w``), kazoo's (``kr``/``kw``),
    a mutex's (``m``)."""
    return {
        "r": f"_c_{seq:04x}aaaa-__READ__{seq:010d}",
        "w": f"_c_{seq:04x}aaaa-__WRIT__{seq:010d}",
        "kr": f"{seq:04x}cccc__rlock__{seq:010d}",
        "kw": f"{seq:04x}cccc__lock__{seq:010d}",
        "m": f"_c_{seq:04x}aaaa-lock-{seq:010d}",
    }[kind]


READER = rw(5, "r")


@pytest.mark.parametrize(
    "children, expected",
    [
        # alone, or behind readers only: readers share
        ([READER], Decision(True, 0, (), False)),
        ([rw(1, "r"), rw(2, "kr"), READER, rw(7, "w")], Decision(True, 2, (), False)),
        # a writer ahead (ours, Curator's, kazoo's, or a mutex's node): wait for it
        ([rw(3, "w"), READER], Decision(False, 1, (rw(3, "w"),), True)),
        ([rw(3, "kw"), READER], Decision(False, 1, (rw(3, "kw"),), True)),
        ([rw(3, "m"), READER], Decision(False, 1, (rw(3, "m"),), True)),
        # readers ahead of the writer: it does not hold yet, so no handoff
        ([rw(1, "r"), rw(3, "w"), READER], Decision(False, 2, (rw(3, "w"),), False)),
        # several writers ahead: watch the nearest (it holds only after the others)
        ([rw(1, "w"), rw(2, "r"), rw(3, "kw"), rw(4, "r"), READER], Decision(False, 4, (rw(3, "kw"),), False)),
        # writers behind us never matter
        ([READER, rw(6, "w"), rw(9, "kw")], Decision(True, 0, (), False)),
        # our node is gone
        ([rw(1, "w")], Decision(False, None, (), False)),
        # past the sequence's wrap: a writer at the top of the range is ahead of us at -2**31
        ([rw(2**31 - 1, "w"), "_c_x-__READ__-2147483648"], Decision(False, 1, (rw(2**31 - 1, "w"),), True)),
    ],
)
def test_reader_gets_the_lock(children, expected):
    from celery_zklock.engine.driver import reader_gets_the_lock

    me = next((c for c in children if c.endswith("-2147483648")), READER)
    assert reader_gets_the_lock(children, me) == expected


@pytest.mark.parametrize(
    "children, expected",
    [
        # a writer waits for every node ahead, readers included, and watches the nearest
        ([rw(1, "r"), rw(2, "kr"), rw(5, "w")], Decision(False, 2, (rw(2, "kr"),), False, (rw(1, "r"),))),
        ([rw(1, "r"), rw(5, "w")], Decision(False, 1, (rw(1, "r"),), True)),
        ([rw(5, "w"), rw(6, "r")], Decision(True, 0, (), False)),
    ],
)
def test_a_writer_is_the_mutex_rule_over_every_kind(children, expected):
    assert gets_the_lock(children, rw(5, "w"), 1) == expected
