"""Ghosts: a create whose reply was lost may have succeeded.

Once connected again, our prefix is looked for among the children: a node is adopted only
if our session owns it, any other is deleted, so no ghost blocks the queue.  Once the
attempt has given up, every such node is deleted and none adopted.
"""

from __future__ import annotations

from functools import partial
from kazoo.exceptions import NoNodeError

from .. import kazoo_compat
from ..session import RETRYABLE
from .state import AttemptPath, Pending


class Ghosts:
    """Resolves the attempt's lost create replies; its own state is the session the last
    create was sent in (a ghost can only be ours if that session still lives)."""

    def __init__(self, attempt: AttemptPath) -> None:
        self.attempt = attempt
        self.session: int | None = None  # the session of the last create sent

    def adopt(self) -> None:
        """After a lost create reply: adopt our node if our session owns it, else delete it.
        ``pending`` stays GHOST until the look is answered: a give-up meanwhile must still
        clean up (and keep listening to the session for it), and a reconnection meanwhile
        looks again rather than create a second node behind the ghost."""
        at = self.attempt
        at.pending = Pending.GHOST
        look = at.next_look()
        listed = at.client.get_children_async(at.lk.path)
        kazoo_compat.on_ready(listed, partial(self._on_children, look, False))

    def clean(self) -> None:
        """Given up while a create's reply was lost: delete any node of ours, adopt none."""
        at = self.attempt
        if kazoo_compat.session_id(at.client) != self.session:
            return at.settle_cleanup()
        listed = at.client.get_children_async(at.lk.path)
        kazoo_compat.on_ready(listed, partial(self._on_children, None, True))

    def _on_children(self, look, delete_only: bool, result) -> None:
        at = self.attempt
        with at.mutex:
            if at.finished:
                delete_only = True  # given up meanwhile: nothing may be adopted any more
            elif look != at.look:
                return
            try:
                children = result.get()
            except NoNodeError:
                children = []  # the container was reaped: no node of ours can exist
            except RETRYABLE:
                return at.await_connection(Pending.CLEANUP if delete_only else Pending.GHOST)
            except Exception as exc:
                if delete_only:
                    return at.settle_cleanup()
                at.pending = None  # nothing more can be learnt of the ghost: given up
                return at.give_up(exc)
            mine = [c for c in children if c.startswith(at.prefix)]
            if not mine:
                if delete_only:
                    return at.settle_cleanup()
                return at.send_create()
            replies = {name: at.client.exists_async(f"{at.lk.path}/{name}") for name in mine}
            kazoo_compat.on_all_ready(replies.values(),
                                      lambda: self._on_stats(look, delete_only, children, replies))

    def _on_stats(self, look, delete_only: bool, children, replies) -> None:
        at = self.attempt
        with at.mutex:
            session = self.session
            keep = None
            for name, r in replies.items():
                try:
                    stat = r.get()
                except RETRYABLE:
                    return at.await_connection(Pending.CLEANUP if delete_only else Pending.GHOST)
                except Exception:
                    continue
                if stat is None:
                    continue
                adoptable = not delete_only and not at.finished and look == at.look
                if adoptable and keep is None and stat.ephemeralOwner == session == kazoo_compat.session_id(at.client):
                    keep = (name, stat)
                elif delete_only or at.finished:  # given up: cleanup waits for it
                    at.delete_given_up(name, kazoo_compat.session_id(at.client))
                else:  # a stale twin of another session, or a ghost we may not keep
                    at.delete(name, kazoo_compat.session_id(at.client))
            if delete_only or at.finished:
                return at.settle_cleanup()
            if look != at.look:
                return
            if keep is None:
                return at.send_create()
            at.pending = None
            if at.adopt(keep[0], keep[1].czxid, session):
                at.act_on_queue(children)
