"""The key's container znode: made with our node in one multi, beside our create, or again
after it was reaped.

Containers are reaped when empty, so on a key this process has not locked lately the
parent probably does not exist.  Once the server has shown it knows containers, one
``multi`` makes it and our node (new keys that arrive together share one:
:mod:`celery_zklock.engine.group_commit`); until then ``createContainer`` is pipelined
beside our create.  A create that finds no parent makes it and tries again, within the
same try.  Why: docs/design.md, "Creating our node".
"""

from __future__ import annotations

import threading
from functools import partial
from typing import Callable

from kazoo.exceptions import NoAuthError, NodeExistsError, NoNodeError, RolledBackError, RuntimeInconsistency, UnimplementedError

from .. import kazoo_compat, znodes
from .state import RECENT, AttemptPath, Queue, State

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


class KeyParent:
    """Makes the attempt's key exist; hands every create's outcome back to
    :meth:`Attempt.on_created <celery_zklock.engine.attempt.machine.Attempt.on_created>`.
    No state of its own beyond the attempt it serves."""

    def __init__(self, attempt: AttemptPath) -> None:
        self.attempt = attempt

    def waits_for_maker(self) -> bool:
        """Is another attempt of this process making our key with its node?  Then ours is
        created once that answers (:class:`Makers`), and this says so."""
        at = self.attempt

        def resume() -> None:
            with at.mutex:
                if not at.finished and at.state is State.CREATING and not at.create_in_flight:
                    at.send_create(same_try=True)  # the try it was waiting to make

        return MAKERS.wait(self._key(), resume)

    def _key(self) -> tuple[str, str]:
        return (znodes.client_key(self.attempt.client), self.attempt.lk.path)

    def create_with_node(self, session) -> None:
        """The container and our node in one multi (group-committed with other new keys)."""
        at = self.attempt
        MAKERS.begin(self._key())
        path, node = at.lk.path, f"{at.lk.path}/{at.prefix}"
        item = (path, node, at.lk.identifier, kazoo_compat.acl_for(at.client, path), kazoo_compat.acl_for(at.client, node))
        kazoo_compat.on_ready(at.monitor.new_keys.submit(item, session), partial(self._on_multi, session))

    def create_beside(self) -> None:
        """``createContainer`` pipelined ahead of our create (containers not yet proven)."""
        at = self.attempt
        container = kazoo_compat.create_container_async(at.client, at.lk.path, kazoo_compat.acl_for(at.client, at.lk.path))
        kazoo_compat.on_ready(container, self._on_parent)

    def _on_parent(self, result) -> None:
        client = self.attempt.client
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
        at = self.attempt
        try:
            container, ours = result.get()
        except Exception:
            container = ours = None
        if isinstance(ours, tuple) or isinstance(container, NodeExistsError):
            RECENT.add(at.lk.path)  # the key is there: the waiting attempts' creates are plain ones
        waiting = MAKERS.end(self._key())
        try:
            self._answered(session, result)
        finally:
            for resume in waiting:
                resume()

    def _answered(self, session, result) -> None:
        """Both made, or neither: a rollback by another key's op, or a container that existed
        after all, sends the create again (the pipelined path)."""
        at = self.attempt
        try:
            container, ours = result.get()
        except Exception:
            return at.on_created(session, None, result)  # connection trouble: as for a create
        if isinstance(ours, tuple):
            # ZooKeeper answers a create inside a multi with its path only, but every node a
            # multi creates shares the transaction's zxid: the container's czxid is ours.
            return at.on_created(session, Queue.FRESH, _Made((ours[0], ours[1] or container[1])))
        rolled_back = isinstance(container, _NOT_RUN) and isinstance(ours, _NOT_RUN)  # by another key's op
        if rolled_back or isinstance(container, NodeExistsError):
            with at.mutex:
                at.create_in_flight = False
                if not rolled_back:
                    RECENT.add(at.lk.path)  # locked by another process moments ago: the pipelined path
                if not at.finished and at.state is State.CREATING:
                    at.send_create(same_try=True)
                return at.settle_cleanup()
        if isinstance(container, NoAuthError):
            with at.mutex:
                at.create_in_flight = False
                if not at.finished:
                    at.give_up(znodes.no_auth_error(at.lk.path, "creating the lock's parent znode"))
                return at.settle_cleanup()
        parent = at.lk.path.rsplit("/", 1)[0] if isinstance(container, NoNodeError) else ""
        if parent:  # an ancestor is missing: make it, multi again
            with at.mutex:
                at.create_in_flight = False
                if at.finished:
                    return at.settle_cleanup()
            acl = kazoo_compat.acl_for(at.client, parent)
            return kazoo_compat.on_ready(at.client.ensure_path_async(parent, acl), self._made)
        # Our node's own failure: as for a create.
        failed = container if isinstance(container, Exception) and not isinstance(container, _NOT_RUN) else ours
        at.on_created(session, None, _Made(failed))

    def remake_then_create(self) -> None:
        """Our create found no parent: make it (a container; ancestors persistent), create again."""
        at = self.attempt
        path = at.lk.path

        def made(result) -> None:
            try:
                result.get()
            except NoNodeError:  # an ancestor is missing too
                parent = path.rsplit("/", 1)[0]
                if parent:
                    made_parent = at.client.ensure_path_async(parent, kazoo_compat.acl_for(at.client, parent))
                    return kazoo_compat.on_ready(made_parent, lambda r: self._made(r, retry=True))
            except UnimplementedError:
                znodes.mark_no_containers(at.client)
                created = at.client.create_async(path, b"", acl=acl, makepath=True)
                return kazoo_compat.on_ready(created, self._made)
            except Exception:
                pass
            self._made(result)

        acl = kazoo_compat.acl_for(at.client, path)
        if znodes.uses_containers(at.client):
            kazoo_compat.on_ready(kazoo_compat.create_container_async(at.client, path, acl), made)
        else:
            kazoo_compat.on_ready(at.client.create_async(path, b"", acl=acl, makepath=True), self._made)

    def _made(self, result, retry: bool = False) -> None:
        at = self.attempt
        with at.mutex:
            if at.finished or at.state is not State.CREATING or at.create_in_flight:
                return
            try:
                result.get()
            except NoAuthError:
                return at.give_up(znodes.no_auth_error(at.lk.path, "creating the lock's parent znode"))
            except Exception:
                pass  # exists already, or a connection blip: the next create tells
            if retry:
                return self.remake_then_create()
            at.send_create(same_try=True)


class _Made:
    """A create's outcome read out of a multi's reply, shaped as kazoo's async result."""

    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value
