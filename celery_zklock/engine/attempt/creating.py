"""Creating our node: one round trip for an uncontended key.

``create`` and ``get_children`` are pipelined (ZooKeeper answers one session's requests
in order).  On a key this process has not locked lately the container probably does not
exist (containers are reaped when empty): one ``multi`` creates it and our node, and our
node, the container's first child, holds without a read (new keys that arrive together
share one multi: :mod:`celery_zklock.engine.group_commit`).  If the container existed after
all, the multi fails whole and the pipelined create follows (one round trip more, on a
key another process locked moments ago).  Until the server has shown it knows
containers, the container's ``createContainer`` is pipelined beside our create instead,
and a node with sequence 0 holds (a sequence is the parent's child-change count, so 0
means no child ever existed before ours).  A create that finds no parent makes it and
tries again, within the same try.

Writes: ``node``, ``czxid``, ``session``, ``token``, ``_create_in_flight``, ``_create_session``.
"""

from __future__ import annotations

from functools import partial

from kazoo.exceptions import (
    NoAuthError, NodeExistsError, NoNodeError, RolledBackError, RuntimeInconsistency, SessionExpiredError,
    UnimplementedError,
)

from .. import kazoo_compat, znodes
from ..session import RETRYABLE
from .state import RECENT, Pending, State


#: A multi's replies for ops it did not run because another op failed (before it, after it).
_NOT_RUN = (RolledBackError, RuntimeInconsistency)


class Creating:
    def _send_create(self, same_try: bool = False) -> None:
        # same_try: the create is being resent because the key's container had been
        # reaped; the remake and the resend belong to the one try that timeout=0 allows.
        if self._deadline_passed and not same_try:
            return self._give_up(False)
        if not self.client.connected:
            return self._await(Pending.CREATE)
        self._pending = None
        session = kazoo_compat.session_id(self.client)
        self._create_session = session
        self._create_in_flight = True
        new_key = self.lk.path not in RECENT and znodes.uses_containers(self.client)
        node = f"{self.lk.path}/{self.prefix}"
        if new_key and znodes.containers_known_to_work(self.client):
            item = (self.lk.path, node, self.lk.identifier, kazoo_compat.acl_for(self.client, self.lk.path),
                    kazoo_compat.acl_for(self.client, node))
            kazoo_compat.on_ready(self.monitor.new_keys.submit(item, session), partial(self._on_multi, session))
            return
        if new_key:
            container = kazoo_compat.create_container_async(
                self.client, self.lk.path, kazoo_compat.acl_for(self.client, self.lk.path))
            kazoo_compat.on_ready(container, self._on_parent)
        created = self.client.create_async(
            node, self.lk.identifier, acl=kazoo_compat.acl_for(self.client, node), ephemeral=True, sequence=True,
            include_data=True,
        )
        listed = None if new_key else self.client.get_children_async(self.lk.path)
        kazoo_compat.on_ready(created, partial(self._on_created, session, listed))

    def _on_parent(self, result) -> None:
        try:
            result.get()
        except UnimplementedError:
            # A server without containers (< 3.5.3): persistent parents from now on,
            # deleted best-effort after release so they do not accumulate.
            znodes.mark_no_containers(self.client)
            return
        except NodeExistsError:
            pass  # answered all the same: the server knows containers
        except Exception:
            return  # its ancestors do not exist, or a connection blip: the create tells
        znodes.mark_containers_work(self.client)

    def _on_multi(self, session, result) -> None:
        """The container and our node in one multi: both made, or neither (see above)."""
        try:
            container, ours = result.get()
        except Exception:
            return self._on_created(session, None, result)  # connection trouble: as for a create
        if isinstance(ours, tuple):
            # ZooKeeper answers a create inside a multi with its path only, but every node a
            # multi creates shares the transaction's zxid: the container's czxid is ours.
            return self._on_created(session, None, _Made((ours[0], ours[1] or container[1])))
        rolled_back = isinstance(container, _NOT_RUN) and isinstance(ours, _NOT_RUN)  # by another key's op
        if rolled_back or isinstance(container, NodeExistsError):
            with self._guard:
                self._create_in_flight = False
                if not rolled_back:
                    RECENT.add(self.lk.path)  # locked by another process moments ago: the pipelined path
                if not self._finished and self.state is State.CREATING:
                    self._send_create(same_try=True)
                return self._settle_cleanup()
        if isinstance(container, NoAuthError):
            with self._guard:
                self._create_in_flight = False
                if not self._finished:
                    self._give_up(znodes.no_auth_error(self.lk.path, "creating the lock's parent znode"))
                return self._settle_cleanup()
        parent = self.lk.path.rsplit("/", 1)[0] if isinstance(container, NoNodeError) else ""
        if parent:  # an ancestor is missing: make it, multi again
            with self._guard:
                self._create_in_flight = False
                if self._finished:
                    return self._settle_cleanup()
            acl = kazoo_compat.acl_for(self.client, parent)
            return kazoo_compat.on_ready(self.client.ensure_path_async(parent, acl), self._parent_made)
        # Our node's own failure: as for a create.
        failed = container if isinstance(container, Exception) and not isinstance(container, _NOT_RUN) else ours
        self._on_created(session, None, _Made(failed))

    def _on_created(self, session, listed, result) -> None:
        with self._guard:
            self._create_in_flight = False
            try:
                path, stat = result.get()
            except NoNodeError:
                RECENT.discard(self.lk.path)
                if not self._finished:
                    self._make_parent_then_create()
                return self._settle_cleanup()
            except RETRYABLE:
                # The create may have run with its reply lost: resolve it once connected.
                return self._await(Pending.GHOST)
            except SessionExpiredError:
                return self._await(Pending.CREATE)
            except NoAuthError:
                if not self._finished:
                    self._give_up(znodes.no_auth_error(self.lk.path, "joining the lock queue"))
                return self._settle_cleanup()
            except Exception as exc:  # ConnectionClosedError: the client was stopped
                if not self._finished:
                    self._give_up(exc)
                return self._settle_cleanup()
            RECENT.add(self.lk.path)
            name = path.rsplit("/", 1)[1]
            if self._finished:  # given up while the create was in flight
                self.cleanup = self._delete(name, session)
                return self._settle_cleanup()
            self.node, self.czxid, self.session = name, stat.czxid, session
            try:
                self.token = znodes.fencing_token(stat.czxid)
            except znodes.TokenOutOfRange as exc:  # never an inexact token: our node goes
                self._give_up(exc)
                return self._settle_cleanup()
            if listed is None and znodes.sequence_of(name) == 0:
                return self._decide([name])
            if listed is not None:
                look = self._next_look()
                kazoo_compat.on_ready(listed, partial(self._on_children, look))
            else:
                self._read_children()

    def _make_parent_then_create(self) -> None:
        """Our create found no parent: make it (a container; ancestors persistent), create again."""
        path = self.lk.path

        def made(result) -> None:
            try:
                result.get()
            except NoNodeError:  # an ancestor is missing too
                parent = path.rsplit("/", 1)[0]
                if parent:
                    made_parent = self.client.ensure_path_async(parent, kazoo_compat.acl_for(self.client, parent))
                    return kazoo_compat.on_ready(made_parent, lambda r: self._parent_made(r, retry=True))
            except UnimplementedError:
                znodes.mark_no_containers(self.client)
                created = self.client.create_async(path, b"", acl=acl, makepath=True)
                return kazoo_compat.on_ready(created, self._parent_made)
            except Exception:
                pass
            self._parent_made(result)

        acl = kazoo_compat.acl_for(self.client, path)
        if znodes.uses_containers(self.client):
            kazoo_compat.on_ready(kazoo_compat.create_container_async(self.client, path, acl), made)
        else:
            kazoo_compat.on_ready(self.client.create_async(path, b"", acl=acl, makepath=True), self._parent_made)

    def _parent_made(self, result, retry: bool = False) -> None:
        with self._guard:
            if self._finished or self.state is not State.CREATING or self._create_in_flight:
                return
            try:
                result.get()
            except NoAuthError:
                return self._give_up(znodes.no_auth_error(self.lk.path, "creating the lock's parent znode"))
            except Exception:
                pass  # exists already, or a connection blip: the next create tells
            if retry:
                return self._make_parent_then_create()
            self._send_create(same_try=True)

    def _requeue(self) -> None:
        """Our node is gone (session expired, deleted by an operator or the reaper): queue again."""
        self.node = self.token = self.session = None
        self.state = State.CREATING
        self._send_create()


class _Made:
    """A create's outcome read out of a multi's reply, shaped as kazoo's async result."""

    def __init__(self, value) -> None:
        self.value = value

    def get(self):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value
