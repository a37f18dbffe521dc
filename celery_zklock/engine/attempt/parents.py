"""The key's container znode: made with our node in one multi, beside our create, or again
after it was reaped.

Containers are reaped when empty, so on a key this process has not locked lately the
parent probably does not exist.  Once the server has shown it knows containers, one
``multi`` makes it and our node (new keys that arrive together share one:
:mod:`celery_zklock.engine.group_commit`); until then ``createContainer`` is pipelined
beside our create.  A create that finds no parent makes it and tries again, within the
same try.  The attempt is told how each making went (:class:`MultiAnswer`,
:class:`Remade`) and decides what follows.  Why: docs/design.md, "Creating our node".
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from kazoo.exceptions import (
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    RolledBackError,
    RuntimeInconsistency,
    UnimplementedError,
)

from .. import kazoo_compat, znodes
from .state import RECENT, Queue

#: A multi's replies for ops it did not run because another op failed (before it, after it).
_NOT_RUN = (RolledBackError, RuntimeInconsistency)


class Makers:
    """The keys whose container this process is making with a first node (a multi in flight),
    and the attempts that came for one meanwhile, in arrival order.

    Why they wait for its answer: each would send a multi of its own, and all but the first
    fail on the container the first made (or, committed in one group, roll it back); their
    retries then went after the create of an attempt that came later and found the key made
    (a writer passed five readers that had come before it)."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], list[Callable[[], None]]] = {}
        self._guard = threading.Lock()

    def begin(self, key: tuple[str, str]) -> None:
        with self._guard:
            self._waiting.setdefault(key, [])

    def wait(self, key: tuple[str, str], resume: Callable[[], None]) -> bool:
        """Queue ``resume`` behind the making of ``key``; False when none is in flight."""
        with self._guard:
            waiting = self._waiting.get(key)
            if waiting is None:
                return False
            waiting.append(resume)
            return True

    def end(self, key: tuple[str, str]) -> list[Callable[[], None]]:
        """The making answered: the attempts that waited, to resume in the order they came
        (after the maker's own create, if it sends one again: it came first)."""
        with self._guard:
            return self._waiting.pop(key, [])


MAKERS = Makers()


class Multi(enum.Enum):
    """How the multi that makes the key's container with our node was answered."""

    CREATED = "created"  # both made, or our create's own failure: an answer as a create's
    ROLLED_BACK = "rolled-back"  # another key's op failed the batch: send our create again
    KEY_EXISTS = "key-exists"  # another process made the key moments ago: create in it
    NO_AUTH = "no-auth"  # we may not create the key's container
    NO_ANCESTOR = "no-ancestor"  # an ancestor is missing: make it, then create again


@dataclass(frozen=True)
class MultiAnswer:
    """What the attempt is told of its multi: the step, and what that step needs."""

    step: Multi
    created: Any = None  # CREATED: the create's outcome, shaped as kazoo's async result
    listed: Queue | None = None  # CREATED: what is known of the queue (FRESH: ours is its first child)
    ancestor: str = ""  # NO_ANCESTOR: the parent to make


def multi_answered(container, ours, path: str) -> MultiAnswer:
    """The multi's replies (``container``'s, ``ours``: a tuple or an exception each).  Both
    made, or neither: a rollback by another key's op, or a container that existed after
    all, sends the create again (the pipelined path)."""
    if isinstance(ours, tuple):
        # ZooKeeper answers a create inside a multi with its path only, but every node a
        # multi creates shares the transaction's zxid: the container's czxid is ours.
        return MultiAnswer(Multi.CREATED, _Made((ours[0], ours[1] or container[1])), Queue.FRESH)
    if isinstance(container, _NOT_RUN) and isinstance(ours, _NOT_RUN):
        return MultiAnswer(Multi.ROLLED_BACK)
    if isinstance(container, NodeExistsError):
        return MultiAnswer(Multi.KEY_EXISTS)
    if isinstance(container, NoAuthError):
        return MultiAnswer(Multi.NO_AUTH)
    parent = path.rsplit("/", 1)[0] if isinstance(container, NoNodeError) else ""
    if parent:
        return MultiAnswer(Multi.NO_ANCESTOR, ancestor=parent)
    # Our node's own failure: as for a create.
    failed = container if isinstance(container, Exception) and not isinstance(container, _NOT_RUN) else ours
    return MultiAnswer(Multi.CREATED, _Made(failed))


class Remade(enum.Enum):
    """How the making of a key's parent that a create found missing ended."""

    KEY = "key"  # made (or there already, or a blip): create again
    ANCESTOR = "ancestor"  # an ancestor was missing and is made: make the key again
    NO_AUTH = "no-auth"  # we may not create it


class KeyParent:
    """Makes the attempt's key exist, and tells the attempt how that went: the multi's
    answer to ``on_multi`` (a :class:`MultiAnswer`), a remade parent to ``on_remade`` (a
    :class:`Remade`).  No state of its own: which keys are being made is :data:`MAKERS`'."""

    def __init__(self, client, path: str, prefix: str, identifier: bytes, new_keys,
                 on_multi: Callable[[Any, MultiAnswer], None], on_remade: Callable[[Remade], None]) -> None:
        self._client = client
        self._path = path
        self._prefix = prefix
        self._identifier = identifier
        self._new_keys = new_keys  # the client's group commit of new keys' creates
        self._on_multi_answered = on_multi
        self._on_remade = on_remade

    def waits_for_maker(self, resume: Callable[[], None]) -> bool:
        """Is another attempt of this process making our key with its node?  Then ``resume``
        runs once that answers (:class:`Makers`), and this says so."""
        return MAKERS.wait(self._key(), resume)

    def _key(self) -> tuple[str, str]:
        return (znodes.client_key(self._client), self._path)

    def create_with_node(self, session) -> None:
        """The container and our node in one multi (group-committed with other new keys)."""
        MAKERS.begin(self._key())
        path, node = self._path, f"{self._path}/{self._prefix}"
        item = (path, node, self._identifier, kazoo_compat.acl_for(self._client, path),
                kazoo_compat.acl_for(self._client, node))
        kazoo_compat.on_ready(self._new_keys.submit(item, session), partial(self._on_multi, session))

    def create_beside(self) -> None:
        """``createContainer`` pipelined ahead of our create (containers not yet proven)."""
        container = kazoo_compat.create_container_async(self._client, self._path,
                                                        kazoo_compat.acl_for(self._client, self._path))
        kazoo_compat.on_ready(container, self._on_parent)

    def _on_parent(self, result) -> None:
        client = self._client
        try:
            result.get()
        except UnimplementedError:
            # A server without containers (< 3.5.3): persistent parents from now on,
            # deleted best-effort after release so they do not accumulate.
            znodes.mark_no_containers(client)
            return
        except NodeExistsError:
            pass  # answered all the same: the server knows containers
        except Exception:
            return  # its ancestors do not exist, or a connection blip: the create tells
        znodes.mark_containers_work(client)

    def _on_multi(self, session, result) -> None:
        """The multi answered: ours first (made, or sent again), then the attempts that waited
        for it (:class:`Makers`), in the order they came."""
        try:
            container, ours = result.get()
        except Exception:
            container = ours = None
            answer = MultiAnswer(Multi.CREATED, result)  # connection trouble: as for a create
        else:
            answer = multi_answered(container, ours, self._path)
        if isinstance(ours, tuple) or isinstance(container, NodeExistsError):
            RECENT.add(self._path)  # the key is there: the waiting attempts' creates are plain ones
        waiting = MAKERS.end(self._key())
        try:
            self._on_multi_answered(session, answer)
        finally:
            for resume in waiting:
                resume()

    def make_ancestor(self, parent: str) -> None:
        """The multi found an ancestor missing: make it (persistent), then create again."""
        acl = kazoo_compat.acl_for(self._client, parent)
        kazoo_compat.on_ready(self._client.ensure_path_async(parent, acl), self._made)

    def remake(self) -> None:
        """Our create found no parent: make it (a container; ancestors persistent), create again."""
        client, path = self._client, self._path

        def made(result) -> None:
            try:
                result.get()
            except NoNodeError:  # an ancestor is missing too
                parent = path.rsplit("/", 1)[0]
                if parent:
                    made_parent = client.ensure_path_async(parent, kazoo_compat.acl_for(client, parent))
                    return kazoo_compat.on_ready(made_parent, lambda r: self._made(r, ancestor=True))
            except UnimplementedError:
                znodes.mark_no_containers(client)
                created = client.create_async(path, b"", acl=acl, makepath=True)
                return kazoo_compat.on_ready(created, self._made)
            except Exception:
                pass
            self._made(result)

        acl = kazoo_compat.acl_for(client, path)
        if znodes.uses_containers(client):
            kazoo_compat.on_ready(kazoo_compat.create_container_async(client, path, acl), made)
        else:
            kazoo_compat.on_ready(client.create_async(path, b"", acl=acl, makepath=True), self._made)

    def _made(self, result, ancestor: bool = False) -> None:
        try:
            result.get()
        except NoAuthError:
            return self._on_remade(Remade.NO_AUTH)
        except Exception:
            pass  # exists already, or a connection blip: the next create tells
        self._on_remade(Remade.ANCESTOR if ancestor else Remade.KEY)


class _Made:
    """A create's outcome read out of a multi's reply, shaped as kazoo's async result."""

    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value
