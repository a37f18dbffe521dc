"""New keys joined together: the multis that create a key's container and our node, group-committed.

Why: a burst of tasks on keys nobody locked lately (a new key per order, per user) costs
ZooKeeper one request per key even when each key's container and node go in one ``multi``
(:func:`~celery_zklock.engine.kazoo_compat.create_in_new_container_async`).  Here, while one
such multi is in flight, the next ones wait and then go together in one multi: a lone
acquire is sent at once (no added latency when idle), and under a burst a request waits
at most for the reply of the one before it, as a database's group commit does.

A multi is all or nothing: if one key's container exists after all (another process locked
it moments ago), every key of that batch is rolled back.  Each attempt then reads its own
replies: the key whose container existed takes the pipelined path, the others send again.
"""

from __future__ import annotations

import threading

from kazoo.exceptions import SessionExpiredError

from . import kazoo_compat

#: Keys per multi at most: each pair of creates is a few hundred bytes, and a request must
#: stay well below ZooKeeper's ``jute.maxbuffer`` (1 MB by default).
MAX_BATCH = 200


class NewKeys:
    """One per client (see :func:`~celery_zklock.engine.session.monitor_for`)."""

    def __init__(self, client) -> None:
        self.client = client
        self._guard = threading.Lock()
        self._in_flight = False
        self._waiting: list[tuple] = []

    def create(self, container: str, node: str, data: bytes, container_acl, node_acl, session):
        """Join ``container`` (new) with ``node`` in it; resolves to ``(container_reply, node_reply)``,
        each ``(path, stat)`` or the exception of that op, as one multi of its own would."""
        result = self.client.handler.async_result()
        entry = (container, node, data, container_acl, node_acl, session, result)
        with self._guard:
            if self._in_flight:
                self._waiting.append(entry)
                return result
            self._in_flight = True
        self._send([entry])
        return result

    def _send(self, entries: list[tuple]) -> None:
        current = kazoo_compat.session_id(self.client)
        live = []
        for entry in entries:
            if entry[5] != current:  # queued under a session that has ended: its attempt starts over
                entry[6].set_exception(SessionExpiredError())
            else:
                live.append(entry)
        if not live:
            return self._next()
        pairs = [(c, n, d, cacl, nacl) for c, n, d, cacl, nacl, _, _ in live]
        kazoo_compat.create_in_new_containers_async(self.client, pairs).rawlink(lambda r: self._replied(live, r))

    def _replied(self, entries: list[tuple], result) -> None:
        try:
            replies = result.get()
        except Exception as exc:
            for entry in entries:
                entry[6].set_exception(exc)
        else:
            for i, entry in enumerate(entries):
                entry[6].set((replies[2 * i], replies[2 * i + 1]))
        self._next()

    def _next(self) -> None:
        with self._guard:
            batch, self._waiting = self._waiting[:MAX_BATCH], self._waiting[MAX_BATCH:]
            if not batch:
                self._in_flight = False
                return
        self._send(batch)
