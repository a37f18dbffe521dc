"""The attempt's collaborators' decisions, from tables: a re-verified hold
(HoldWatch's verified), a look for ghosts (Ghosts' resolve), the multi that makes a new key
with our node (KeyParent's multi_answered).  Pure logic: no ZooKeeper."""

from __future__ import annotations

import pytest
from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    OperationTimeoutError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
)
from kazoo.protocol.states import ZnodeStat

from celery_zklock.engine.attempt import (
    Found,
    Ghost,
    HoldVerdict,
    Multi,
    Queue,
    Then,
    multi_answered,
    resolve,
    verified,
)

S, OLD = 0x51, 0x0D  # our session, and an ended one


def stat(owner: int, czxid: int = 100) -> ZnodeStat:
    return ZnodeStat(czxid, czxid, 0, 0, 0, 0, 0, owner, 0, 0, czxid)


# ------------------------------------------------------------------ verified (HoldWatch)
@pytest.mark.parametrize(
    "outcome, session_now, same_suspension, expected",
    [
        (stat(S), S, True, HoldVerdict.HELD),  # ours, still: held again
        (stat(S), S, False, None),  # a newer suspension began meanwhile: its own verify decides
        (stat(OLD), S, True, HoldVerdict.NODE_GONE),  # a node of an ended session
        (stat(S), OLD, True, HoldVerdict.NODE_GONE),  # our session ended: it is not ours any more
        (None, S, True, HoldVerdict.NODE_GONE),  # deleted while we were cut off
        (None, S, False, HoldVerdict.NODE_GONE),
        (ConnectionLoss(), S, True, None),  # cut off again: the next CONNECTED re-verifies
        (OperationTimeoutError(), S, True, None),
        (SessionExpiredError(), S, True, HoldVerdict.SESSION_EXPIRED),
        (ConnectionClosedError(), S, True, HoldVerdict.SESSION_EXPIRED),  # the client was stopped
        (NoAuthError(), S, True, None),  # settles nothing: the grace decides
    ],
)
def test_a_reverification_verdict(outcome, session_now, same_suspension, expected):
    assert verified(outcome, session_now, S, same_suspension) is expected


def test_a_lost_holds_reason_is_its_verdicts_value():
    assert HoldVerdict.GRACE_OVER.value == "disconnected from ZooKeeper past the session-expiry safety margin"
    assert HoldVerdict.SESSION_EXPIRED.value == "ZooKeeper session expired"


# ------------------------------------------------------------------ resolve (Ghosts)
QUEUE = ["n-01", "a-02", "n-03", "n-04"]


@pytest.mark.parametrize(
    "stats, session_now, cleanup, current, expected",
    [
        # our session's node is adopted; a second one of ours is deleted
        ([("n-01", stat(S, 7)), ("n-03", stat(S))], S, False, True,
         Found(Then.ADOPT, False, ("n-03",), ghost=Ghost("n-01", 7, S, QUEUE))),
        # a stale twin of an ended session is deleted, ours adopted
        ([("n-01", stat(OLD)), ("n-03", stat(S, 9))], S, False, True,
         Found(Then.ADOPT, False, ("n-01",), ghost=Ghost("n-03", 9, S, QUEUE))),
        # none ours: delete them, create
        ([("n-01", stat(OLD)), ("n-03", stat(OLD))], S, False, True, Found(Then.CREATE, False, ("n-01", "n-03"))),
        # gone meanwhile, or unreadable: nothing to delete
        ([("n-01", None), ("n-03", NoNodeError())], S, False, True, Found(Then.CREATE, False)),
        # the create's session has ended since: its node is not ours to adopt
        ([("n-01", stat(S))], OLD, False, True, Found(Then.CREATE, False, ("n-01",))),
        # given up: every node of ours is deleted (the cleanup's), none adopted
        ([("n-01", stat(S)), ("n-03", stat(OLD))], S, True, False, Found(Then.SETTLE, True, ("n-01", "n-03"))),
        # a newer look answers: delete, adopt none, do nothing more
        ([("n-01", stat(S)), ("n-03", stat(OLD))], S, False, False, Found(Then.STALE, False, ("n-01", "n-03"))),
        # cut off on the way: the deletes so far, then look again once connected
        ([("n-01", stat(OLD)), ("n-03", ConnectionLoss()), ("n-04", stat(S))], S, False, True,
         Found(Then.RECONNECT, False, ("n-01",))),
        ([("n-01", OperationTimeoutError()), ("n-03", stat(OLD))], S, True, False, Found(Then.RECONNECT, True)),
    ],
)
def test_what_a_look_for_ghosts_found(stats, session_now, cleanup, current, expected):
    assert resolve(QUEUE, stats, S, session_now, cleanup, current) == expected


# ------------------------------------------------------------------ multi_answered (KeyParent)
NODE = "/k/_c_ab-lock-0000000000"


def _raises(answer):
    with pytest.raises(Exception) as caught:
        answer.created.get()
    return type(caught.value)


@pytest.mark.parametrize(
    "container, ours, path, step, detail",
    [
        # both made: our czxid is the container's (a create in a multi answers with its path)
        (("/k", 7), (NODE, None), "/k", Multi.CREATED, (NODE, 7)),
        (("/k", 7), (NODE, 9), "/k", Multi.CREATED, (NODE, 9)),
        # rolled back by another key's op in the same group commit: sent again
        (RolledBackError(), RuntimeInconsistency(), "/k", Multi.ROLLED_BACK, None),
        (RuntimeInconsistency(), RolledBackError(), "/k", Multi.ROLLED_BACK, None),
        # made by another process moments ago: a plain create in it
        (NodeExistsError(), RuntimeInconsistency(), "/k", Multi.KEY_EXISTS, None),
        (NoAuthError(), RuntimeInconsistency(), "/k", Multi.NO_AUTH, None),
        # an ancestor is missing: made first
        (NoNodeError(), RuntimeInconsistency(), "/a/b/k", Multi.NO_ANCESTOR, "/a/b"),
        # no ancestor to make: as a create that failed
        (NoNodeError(), RuntimeInconsistency(), "/k", Multi.CREATED, NoNodeError),
        # our node's own failure: as a create's
        (RolledBackError(), NoAuthError(), "/k", Multi.CREATED, NoAuthError),
        (("/k", 7), ConnectionLoss(), "/k", Multi.CREATED, ConnectionLoss),
    ],
)
def test_the_answer_of_a_new_keys_multi(container, ours, path, step, detail):
    answer = multi_answered(container, ours, path)
    assert answer.step is step
    if step is Multi.NO_ANCESTOR:
        assert answer.ancestor == detail
    elif step is Multi.CREATED and isinstance(detail, tuple):
        assert answer.listed is Queue.FRESH and answer.created.get() == detail
    elif step is Multi.CREATED:
        assert answer.listed is None and _raises(answer) is detail
    else:
        assert answer.created is None and answer.ancestor == ""
