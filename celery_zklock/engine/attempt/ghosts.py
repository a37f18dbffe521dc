"""Ghosts: a create whose reply was lost may have succeeded.

After reconnecting we look for our prefix among the children and adopt a node only if
its ``ephemeralOwner`` is our session, deleting any other, so no ghost node blocks the
queue.  Once the attempt has given up, every such node is deleted and none adopted.
"""

from __future__ import annotations

from functools import partial

from kazoo.exceptions import NoNodeError

from .. import kazoo_compat, znodes
from ..session import RETRYABLE


class Ghosts:
    def _adopt_ghost(self) -> None:
        """After a lost create reply: adopt our node if our session owns it, else delete it."""
        self._pending = None
        look = self._next_look()
        listed = self.client.get_children_async(self.lk.path)
        kazoo_compat.on_ready(listed, partial(self._on_ghost_children, look, False))

    def _clean_ghosts(self) -> None:
        """Given up while a create's reply was lost: delete any node of ours, adopt none."""
        if kazoo_compat.session_id(self.client) != self._create_session:
            return self._settle_cleanup()
        listed = self.client.get_children_async(self.lk.path)
        kazoo_compat.on_ready(listed, partial(self._on_ghost_children, None, True))

    def _on_ghost_children(self, look, delete_only: bool, result) -> None:
        with self._guard:
            if self._finished:
                delete_only = True  # given up meanwhile: nothing may be adopted any more
            elif look != self._look:
                return
            try:
                children = result.get()
            except NoNodeError:
                children = []  # the container was reaped: no node of ours can exist
            except RETRYABLE:
                return self._await(Pending.CLEANUP if delete_only else Pending.GHOST)
            except Exception as exc:
                if delete_only:
                    return self._settle_cleanup()
                return self._give_up(exc)
            mine = [c for c in children if c.startswith(self.prefix)]
            if not mine:
                if delete_only:
                    return self._settle_cleanup()
                return self._send_create()
            replies = {name: self.client.exists_async(f"{self.lk.path}/{name}") for name in mine}
            kazoo_compat.on_all_ready(replies.values(),
                                      lambda: self._on_ghost_stats(look, delete_only, children, replies))

    def _on_ghost_stats(self, look, delete_only: bool, children, replies) -> None:
        with self._guard:
            session = self._create_session
            keep = None
            for name, r in replies.items():
                try:
                    stat = r.get()
                except RETRYABLE:
                    return self._await(Pending.CLEANUP if delete_only else Pending.GHOST)
                except Exception:
                    continue
                if stat is None:
                    continue
                adoptable = not delete_only and not self._finished and look == self._look
                if adoptable and keep is None and stat.ephemeralOwner == session == kazoo_compat.session_id(self.client):
                    keep = (name, stat)
                else:  # a stale twin of another session, or a ghost we may not keep
                    self._delete(name, kazoo_compat.session_id(self.client))
            if delete_only or self._finished:
                return self._settle_cleanup()
            if look != self._look:
                return
            if keep is None:
                return self._send_create()
            self.node, self.czxid, self.session = keep[0], keep[1].czxid, session
            try:
                self.token = znodes.fencing_token(self.czxid)
            except znodes.TokenOutOfRange as exc:  # never an inexact token: our node goes
                self._give_up(exc)
                return self._settle_cleanup()
            self._decide(children)
