"""Group commit: requests that arrive together go to ZooKeeper as one ``multi``.

Why: a worker's lock agent joins and releases many keys at once under a burst (a new key
per order, per user), and each create or delete is a request ZooKeeper must log and
answer.  Here, while one request of a kind is in flight, the next ones wait for its reply
and then go together in one multi, as a database's group commit does: a lone request is
sent at once (no added latency when idle), and under a burst a request waits at most for
the reply of the one before it.  Two kinds use it, one instance each per client (see
:class:`~celery_zklock.engine.session.SessionMonitor`):

* :func:`new_keys`: a key's new container and our node in it
  (:func:`~celery_zklock.engine.kazoo_compat.create_in_new_containers_async`);
* :func:`deletes`: our nodes' deletes at release (the proof that each was still ours).

A multi is all or nothing: when one op fails, the others are not run, and each submitter
reads its own reply (``RolledBackError`` or ``RuntimeInconsistency`` for an op not run)
and decides for itself, usually to send again.
"""

from __future__ import annotations

import threading
from typing import Callable

from kazoo.exceptions import SessionExpiredError

from . import kazoo_compat

#: Items per multi at most: a request must stay well below ZooKeeper's ``jute.maxbuffer``
#: (1 MB by default), and a create pair or a delete is at most a few hundred bytes.
MAX_BATCH = 200


class GroupCommit:
    """Send one item at once, or several as one request while one is in flight.

    ``send_many(items)`` returns an async result resolving to one reply per item; a reply
    that is an exception instance fails that item's own result.  ``send_one(item)``
    (optional) sends a lone item as its plain request, whose async result is the item's.
    """

    def __init__(self, client, send_many: Callable, send_one: Callable | None = None) -> None:
        self.client = client
        self._send_many = send_many
        self._send_one = send_one
        self._guard = threading.Lock()
        self._in_flight = False
        self._waiting: list[tuple] = []

    def submit(self, item, session):
        """Send ``item`` for the session ``session``; returns the async result of its reply."""
        result = self.client.handler.async_result()
        with self._guard:
            if self._in_flight:
                self._waiting.append((item, session, result))
                return result
            self._in_flight = True
        self._send([(item, session, result)])
        return result

    def _send(self, entries: list[tuple]) -> None:
        current = kazoo_compat.session_id(self.client)
        live = []
        for entry in entries:
            if entry[1] != current:  # queued under a session that has ended: its owner starts over
                entry[2].set_exception(SessionExpiredError())
            else:
                live.append(entry)
        if not live:
            return self._next()
        if len(live) == 1 and self._send_one is not None:
            kazoo_compat.on_ready(self._send_one(live[0][0]), lambda r: self._replied_one(live[0][2], r))
        else:
            kazoo_compat.on_ready(self._send_many([item for item, _, _ in live]), lambda r: self._replied(live, r))

    def _replied_one(self, result, reply) -> None:
        try:
            result.set(reply.get())
        except Exception as exc:
            result.set_exception(exc)
        self._next()

    def _replied(self, entries: list[tuple], reply) -> None:
        try:
            replies = reply.get()
        except Exception as exc:
            for _, _, result in entries:
                result.set_exception(exc)
        else:
            for (_, _, result), value in zip(entries, replies, strict=True):  # one reply per op
                if isinstance(value, Exception):
                    result.set_exception(value)
                else:
                    result.set(value)
        self._next()

    def _next(self) -> None:
        with self._guard:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            if not batch:
                self._in_flight = False
                return
        self._send(batch)


def new_keys(client) -> GroupCommit:
    """Items ``(container, node, data, container_acl, node_acl)``; each reply is the pair
    ``(container_reply, node_reply)``, each ``(path, stat)`` or an exception instance."""

    def send_many(items):
        return kazoo_compat.create_in_new_containers_async(client, items)

    return GroupCommit(client, send_many)


def deletes(client) -> GroupCommit:
    """Items are node paths; each reply is True (deleted) or the delete's exception."""

    def send_many(paths):
        transaction = client.transaction()
        for path in paths:
            transaction.delete(path)
        return transaction.commit_async()

    return GroupCommit(client, send_many, send_one=client.delete_async)
