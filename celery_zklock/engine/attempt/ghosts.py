"""Ghosts: a create whose reply was lost may have succeeded.

Once connected again, our prefix is looked for among the children: a node is adopted only
if our session owns it, any other is deleted, so no ghost blocks the queue.  Once the
attempt has given up, every such node is deleted and none adopted.  What a look finds is a
:class:`Found` (:func:`resolve`), which the attempt applies.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

from kazoo.exceptions import NoNodeError

from .. import kazoo_compat
from ..session import RETRYABLE
from .state import AttemptView


class Then(enum.Enum):
    """What the attempt does once a look for ghosts is answered (after its deletes)."""

    RECONNECT = "reconnect"  # the connection went meanwhile: look again once connected
    SETTLE = "settle"  # given up, and no node of ours is left to appear
    GIVE_UP = "give-up"  # the queue could not be read: nothing more can be learnt of the ghost
    CREATE = "create"  # no node of ours: create one
    ADOPT = "adopt"  # our session made our node: it is ours
    STALE = "stale"  # a newer look answers instead


@dataclass(frozen=True)
class Ghost:
    """Our node, made by a create whose reply was lost, and the queue it was found in."""

    name: str
    czxid: int
    session: int | None
    queue: Sequence[str]


@dataclass(frozen=True)
class Found:
    """A look for ghosts, answered: delete ``deletes`` (nodes of our prefix not ours to
    keep), as the cleanup's deletes if ``cleanup`` (the attempt has given up), then ``then``."""

    then: Then
    cleanup: bool
    deletes: tuple[str, ...] = ()
    ghost: Ghost | None = None  # ADOPT
    error: BaseException | None = None  # GIVE_UP


def resolve(queue: Sequence[str], stats, session: int | None, session_now: int | None, cleanup: bool,
            current: bool) -> Found:
    """What the ``exists`` replies on the nodes of our prefix say (``stats``: (name, stat,
    None or the exception raised), in the order sent).  Ours to adopt: the first node owned
    by ``session`` (the create's, still the live one), while the attempt still wants one
    (not ``cleanup``, the look ``current``); every other is deleted, so no ghost blocks
    the queue.  A connection lost on the way stops there: the nodes after it are looked at
    again."""
    adoptable = not cleanup and current
    keep: Ghost | None = None
    deletes: list[str] = []
    for name, stat in stats:
        if isinstance(stat, RETRYABLE):
            return Found(Then.RECONNECT, cleanup, tuple(deletes))
        if stat is None or isinstance(stat, Exception):
            continue
        if adoptable and keep is None and stat.ephemeralOwner == session == session_now:
            keep = Ghost(name, stat.czxid, session, queue)
        else:  # a stale twin of another session, or a ghost we may not keep
            deletes.append(name)
    if cleanup:
        return Found(Then.SETTLE, cleanup, tuple(deletes))
    if not current:
        return Found(Then.STALE, cleanup, tuple(deletes))
    if keep is None:
        return Found(Then.CREATE, cleanup, tuple(deletes))
    return Found(Then.ADOPT, cleanup, tuple(deletes), ghost=keep)


class Ghosts:
    """Looks for the attempt's lost creates.  Its own state: the session the last create was
    sent in (a ghost can only be ours if that session still lives).  It reads whether the
    attempt still wants the answer (``finished``, ``look``) and tells ``tell`` what it
    found, under the attempt's ``mutex``."""

    def __init__(self, client, path: str, prefix: str, mutex: threading.RLock, attempt: AttemptView,
                 tell: Callable[[Found], None]) -> None:
        self._client = client
        self._path = path
        self._prefix = prefix
        self._mutex = mutex
        self._attempt = attempt
        self._tell = tell
        self._session: int | None = None  # the session of the last create sent

    def create_sent(self, session: int | None) -> None:
        """A create went out in ``session``: its node, if its reply is lost, is a ghost of it."""
        self._session = session

    def may_be_ours(self, session_now: int | None) -> bool:
        """Could a lost create have made a node of ours that still lives?  Not once the
        session it was sent in has ended: its node went with it."""
        return session_now == self._session

    def look(self, look: int | None) -> None:
        """Read the queue for nodes of our prefix; ``look`` None: given up, delete every
        one of them and adopt none."""
        listed = self._client.get_children_async(self._path)
        kazoo_compat.on_ready(listed, partial(self._on_children, look, look is None))

    def _on_children(self, look, delete_only: bool, result) -> None:
        at = self._attempt
        with self._mutex:
            if at.finished:
                delete_only = True  # given up meanwhile: nothing may be adopted any more
            elif look != at.look:
                return
            try:
                children = result.get()
            except NoNodeError:
                children = []  # the container was reaped: no node of ours can exist
            except RETRYABLE:
                return self._tell(Found(Then.RECONNECT, delete_only))
            except Exception as exc:
                if delete_only:
                    return self._tell(Found(Then.SETTLE, delete_only))
                return self._tell(Found(Then.GIVE_UP, delete_only, error=exc))
            mine = [c for c in children if c.startswith(self._prefix)]
            if not mine:
                return self._tell(Found(Then.SETTLE if delete_only else Then.CREATE, delete_only))
            replies = {name: self._client.exists_async(f"{self._path}/{name}") for name in mine}
            kazoo_compat.on_all_ready(replies.values(),
                                      lambda: self._on_stats(look, delete_only, children, replies))

    def _on_stats(self, look, delete_only: bool, children, replies) -> None:
        at = self._attempt
        with self._mutex:
            stats = [(name, _outcome(reply)) for name, reply in replies.items()]
            found = resolve(children, stats, self._session, kazoo_compat.session_id(self._client),
                            cleanup=delete_only or at.finished, current=look == at.look)
            self._tell(found)


def _outcome(result):
    """An answered request's value, or the exception it raised."""
    try:
        return result.get()
    except Exception as exc:
        return exc
