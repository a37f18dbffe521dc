"""What the framework owns once per client: connection state, timers, guaranteed deletes.

Why once per client (Curator's ``ConnectionStateManager`` and ``delete().guaranteed()``):
a process waiting on thousands of keys must not register thousands of kazoo state
listeners, nor keep a thread or a sleeping timer per lock, nor send one request per key
when many go together (:mod:`celery_zklock.engine.group_commit`).  One :class:`SessionMonitor`
per client listens to kazoo once and tells every registered contender; one
:class:`Timers` loop serves every deadline and suspension grace period; and one
:func:`guaranteed_delete` is the only way a lock node is deleted.

Rules kept here: no blocking ZooKeeper I/O inside kazoo's state listener (it runs on
kazoo's connection thread, kazoo #381) — subscribers only flip state and send async
requests; a delete is retried through connection loss until it succeeds or the session
that owned the node is gone (kazoo #732 leaks nodes on error).
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import threading
import weakref
from fractions import Fraction
from typing import Any, Callable

from kazoo.client import KazooClient
from kazoo.exceptions import (
    ConnectionClosedError,
    ConnectionLoss,
    NoAuthError,
    NoNodeError,
    OperationTimeoutError,
    RolledBackError,
    RuntimeInconsistency,
    SessionExpiredError,
    SessionMovedError,
)
from kazoo.protocol.states import KazooState

from . import clock, group_commit, kazoo_compat

#: Errors after which a request may be sent again on the same session.
RETRYABLE = (ConnectionLoss, OperationTimeoutError)

#: The timing margin, as a share of the session timeout, that every "trust it this long"
#: rule of the package counts: a holder's suspended grace, a write reply's worth as a
#: proof (the lease's "older proof", the elected beat's tick), a claimer's trust in a
#: silent lock agent, the bound on a beat's stuck tick and on each of its ledger requests.
#: Why a third: kazoo's and Curator's convention for a suspended connection (kazoo notices
#: a cut only after two thirds of the session timeout and cannot learn of an expiry while
#: cut off, so a holder must give up before the last third), and the lease argument of
#: docs/waiting.md ("The lease"): ZooKeeper cannot expire the session until a full session
#: timeout after it last heard from us, so a proof sent less than a third ago leaves two
#: thirds for acting on it.  Read it through :func:`session_margin`.
SESSION_MARGIN = Fraction(1, 3)


def session_margin(session_timeout: float) -> float:
    """:data:`SESSION_MARGIN` of ``session_timeout`` (seconds): how long a proof, a
    suspension or an agent's silence may last before it is no longer trusted.  Pass the
    session timeout the rule is about (the negotiated one, where known:
    :func:`celery_zklock.engine.kazoo_compat.session_timeout`).  Computed as
    ``session_timeout / 3``, exactly as every user did before it was named."""
    return session_timeout * SESSION_MARGIN.numerator / SESSION_MARGIN.denominator


#: A request unanswered for this fraction of the negotiated session timeout drops the
#: connection (:meth:`SessionMonitor._watch_replies`).  Why a third: the holder's grace
#: (another third, :data:`SESSION_MARGIN`) then runs out before ZooKeeper can expire the
#: session, with room left for the check's own period (a quarter of this): lost by 3/4 of
#: the session timeout.  Its own budget item, not :data:`SESSION_MARGIN`: a larger margin
#: must shrink this one (the two and the check's period add up to 3/4), not follow it.
UNANSWERED_FOR = 1 / 3

logger = logging.getLogger("celery_zklock.engine.session")

class ReleaseOutcome(str, enum.Enum):
    """What a release (a guaranteed delete, or a local handoff's write) says about the hold.

    Str-valued, so that the value is the stable encoding wherever an outcome is logged or sent."""

    DELETED = "deleted"  # our delete removed the node
    GONE = "gone"  # the node was not there at our first try: someone else deleted it
    EXPIRED = "expired"  # the owning session ended: the node went with it
    WRITTEN = "written"  # our check (or set) of the node was committed: it was still ours (a proof, like DELETED)
    #: A lease, not a reply: a check sent moments ago was committed, and ZooKeeper cannot
    #: have expired our session since (docs/waiting.md): a proof, like DELETED.
    LEASED = "leased"
    DEFERRED = "deferred"  # the release's delete still retries in the background
    NOT_HELD = "not held"  # nothing of ours to release (a cohort's slot without this holder)
    LOST = "lost"  # the hold was lost before the release


DELETED, GONE, EXPIRED, WRITTEN, LEASED = ReleaseOutcome.DELETED, ReleaseOutcome.GONE, ReleaseOutcome.EXPIRED, ReleaseOutcome.WRITTEN, ReleaseOutcome.LEASED
#: The outcomes that prove the lock was held to the end.
PROOFS = (ReleaseOutcome.DELETED, ReleaseOutcome.WRITTEN, ReleaseOutcome.LEASED)


class Timers:
    """One loop that runs callbacks at monotonic times, for every lock of a client.

    Runs on one thread (or greenlet) made by the client's handler the first time a timer
    is set; a cancelled timer is just skipped when due.
    """

    def __init__(self, handler) -> None:
        self._handler = handler
        self._heap: list = []
        self._guard = threading.Lock()
        self._wake = handler.event_object()
        self._started = False
        self._order = itertools.count()
        self._batch: list = []  # calls for the next soon() window, and whether it is armed
        self._batch_armed = False

    def call_at(self, when: float, fn: Callable, *args: Any) -> list:
        """Run ``fn(*args)`` at ``when`` (``clock.monotonic()`` clock); returns a handle."""
        handle = [True]
        with self._guard:
            earliest = not self._heap or when < self._heap[0][0]
            heapq.heappush(self._heap, (when, next(self._order), handle, fn, args))
            if not self._started:
                self._started = True
                self._handler.spawn(self._loop)
        if earliest:  # the loop sleeps until the earliest entry: wake it only to sleep less
            self._wake.set()
        return handle

    def soon(self, within: float, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` at most ``within`` seconds from now, batched with every call due
        in the same window: one wake of the loop per window, not one per call, so a lock taken
        and released a thousand times a second does not pay a thread switch each time."""
        with self._guard:
            self._batch.append((fn, args))
            if self._batch_armed:
                return
            self._batch_armed = True
        self.call_at(clock.monotonic() + within, self._run_batch)

    def _run_batch(self) -> None:
        with self._guard:
            batch, self._batch, self._batch_armed = self._batch, [], False
        for fn, args in batch:
            self._call(fn, args)

    @staticmethod
    def _call(fn: Callable, args: tuple) -> None:
        try:
            fn(*args)
        except Exception:  # pragma: no cover - a timer must not kill the loop
            import logging

            logging.getLogger("celery_zklock.engine.session").exception("timer callback failed")

    @staticmethod
    def cancel(handle: list | None) -> None:
        if handle is not None:
            handle[0] = False

    def run_due(self) -> float | None:
        """Run every callback due now; returns the time the next one is due (None: none).
        The loop below calls it; so does the simulator's clock, which owns time there."""
        due = []
        with self._guard:
            now = clock.monotonic()
            while self._heap and (self._heap[0][0] <= now or not self._heap[0][2][0]):
                when, _, handle, fn, args = heapq.heappop(self._heap)
                if handle[0]:
                    due.append((fn, args))
            nxt = self._heap[0][0] if self._heap else None
        for fn, args in due:
            self._call(fn, args)
        return nxt

    def _loop(self) -> None:
        while True:
            self._wake.clear()
            nxt = self.run_due()
            self._wake.wait(None if nxt is None else max(0.0, nxt - clock.monotonic()))


class SessionMonitor:
    """The client's connection state, told to every subscribed contender.

    ``epoch`` counts suspensions and losses: a verdict reached under an older epoch (a
    re-verification whose reply raced a new disconnection) is stale and is dropped.
    Subscribers implement ``on_connection(state, epoch)``; it runs on kazoo's connection
    thread and must neither block nor wait for a reply.
    """

    def __init__(self, client: KazooClient, timers: Timers | None = None) -> None:
        self.client = client
        self.timers = timers if timers is not None else Timers(client.handler)
        self.new_keys = group_commit.new_keys(client)  # new keys' creates, group-committed
        self.deletes = group_commit.deletes(client)  # our nodes' deletes, group-committed
        self.epoch = 0
        self._guard = threading.Lock()
        # A dict, not a set: subscribers resume in the order they subscribed, on every run.
        self._subscribers: dict = {}
        self._when_connected: list[Callable[[], None]] = []
        self._watching_replies = False  # the reply watch's timer is set (connected, locks subscribed)
        client.add_listener(self._on_state)

    def subscribe(self, subscriber) -> None:
        with self._guard:
            self._subscribers[subscriber] = None
            watching = self._watching_replies
        if not watching and self.client.connected:
            self._start_reply_watch()

    def unsubscribe(self, subscriber) -> None:
        with self._guard:
            self._subscribers.pop(subscriber, None)

    def when_connected(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now if connected, else at the next CONNECTED or LOST (once)."""
        with self._guard:
            if not self.client.connected:
                self._when_connected.append(fn)
                return
        fn()

    def grace_timer(self, seconds: float, fn: Callable[[int], None]) -> list:
        """Call ``fn(epoch)`` after ``seconds``, with the epoch current now."""
        return self.timers.call_at(clock.monotonic() + seconds, fn, self.epoch)

    def _on_state(self, state: str) -> bool:
        with self._guard:
            if state != KazooState.CONNECTED:
                self.epoch += 1
            epoch = self.epoch
            subscribers = list(self._subscribers)
            pending = []
            if state != KazooState.SUSPENDED:
                pending, self._when_connected = self._when_connected, []
        if state == KazooState.CONNECTED and subscribers:
            self._start_reply_watch()
        for subscriber in subscribers:
            subscriber.on_connection(state, epoch)
        for fn in pending:
            fn()
        return False  # keep listening

    # ------------------------------------------------------------------ silent partitions
    def _start_reply_watch(self) -> None:
        with self._guard:
            if self._watching_replies:
                return
            self._watching_replies = True
        self._watch_replies(None, 0.0)

    def _watch_replies(self, seen, since: float) -> None:
        """Drop the connection once the oldest request has gone unanswered for
        :data:`UNANSWERED_FOR` of the session timeout, so that a silent partition is seen.

        Why: kazoo drops a connection only for a ping left unanswered, and sends a ping only
        after a spell with nothing to send; a client that keeps sending (a lock agent renews
        its leases every 0.1 s) never pings, so a partition that drops packets without a
        socket error went unseen: no SUSPENDED, no grace, and a holder running on past the
        expiry of its session.  Reads kazoo's queue of sent requests on the timers' thread
        every quarter of that time: no request of its own.  Runs while connected and some
        lock waits or holds (is subscribed): kazoo's own reconnection takes over from there,
        and CONNECTED or the next subscriber starts it again."""
        client = self.client
        with self._guard:
            if kazoo_compat.is_stopped(client) or not client.connected or not self._subscribers:
                self._watching_replies = False
                return
        now = clock.monotonic()
        limit = kazoo_compat.session_timeout(client) * UNANSWERED_FOR
        head = kazoo_compat.oldest_unanswered(client)
        if head is None or head is not seen:
            seen, since = head, now
        elif now - since >= limit:
            logger.warning("celery-zklock: ZooKeeper has not answered a request for %.1f s (a silent partition?): "
                           "dropping the connection, so that its locks count as suspended", now - since)
            kazoo_compat.drop_connection(client)
            seen, since = None, now
        self.timers.call_at(now + limit / 4, self._watch_replies, seen, since)


_monitors: "weakref.WeakKeyDictionary[KazooClient, SessionMonitor]" = weakref.WeakKeyDictionary()
_monitors_guard = threading.Lock()


def monitor_for(client: KazooClient, timers: Timers | None = None) -> SessionMonitor:
    """The one :class:`SessionMonitor` of ``client``, created on first use (with ``timers``,
    if given: the simulator's, driven by its clock)."""
    with _monitors_guard:
        monitor = _monitors.get(client)
        if monitor is None:
            monitor = _monitors[client] = SessionMonitor(client, timers)
        return monitor


def guaranteed_delete(monitor: SessionMonitor, path: str, session: int | None, on_no_auth: Callable[[], Exception] | None = None):
    """Delete ``path`` (a node of ``session``) however often the connection drops.

    Returns an async result that resolves to :data:`DELETED`, :data:`GONE` or
    :data:`EXPIRED`, or fails with ``on_no_auth()`` when the ACL forbids the delete.
    Callers may wait for it (proof at release) or not; the delete goes on either way,
    resent at each reconnection of the same session, and stops when that session ends.
    """
    client = monitor.client
    outcome = client.handler.async_result()
    retried = [False]

    def send() -> None:
        if kazoo_compat.session_id(client) != session:
            outcome.set(EXPIRED)  # ephemeral nodes die with their session
            return
        kazoo_compat.on_ready(monitor.deletes.submit(path, session), reply)

    def reply(result) -> None:
        try:
            result.get()
            outcome.set(DELETED)
        except (RolledBackError, RuntimeInconsistency):
            send()  # not run: another delete of its group commit failed the multi
        except NoNodeError:
            # On a retry in the same session, only our own earlier delete (whose reply the
            # connection loss swallowed) can have removed it.
            outcome.set(DELETED if retried[0] else GONE)
        except (SessionExpiredError, ConnectionClosedError):
            outcome.set(EXPIRED)
        except NoAuthError as exc:
            outcome.set_exception(on_no_auth() if on_no_auth else exc)
        except RETRYABLE:
            retried[0] = True
            monitor.when_connected(send)
        except Exception as exc:  # pragma: no cover - unexpected server error
            outcome.set_exception(exc)

    send()
    return outcome


def guaranteed_proof(monitor: SessionMonitor, path: str, session: int | None, rename: bytes | None = None):
    """Prove ``path`` (a node of ``session``) ours through the leader, however often the
    connection drops: a ``check`` of it, or with ``rename``, a write of that data.

    Why: a request committed by the leader succeeds only while the node (and so our session)
    lives, so its success proves it ours as of the send, the way a release's delete does; the
    agent uses it when it passes a held lock to its next task without letting go (lock
    cohorting).  A check changes nothing and wakes no watcher; a write renames the node's
    owner (a node queued for a task that left before its grant).  Resolves to
    :data:`WRITTEN`, :data:`GONE` or :data:`EXPIRED`.
    """
    client = monitor.client
    outcome = client.handler.async_result()

    def send() -> None:
        if kazoo_compat.session_id(client) != session:
            outcome.set(EXPIRED)
            return
        sent = kazoo_compat.check_async(client, path) if rename is None else client.set_async(path, rename)
        kazoo_compat.on_ready(sent, reply)

    def reply(result) -> None:
        try:
            result.get()
            outcome.set(WRITTEN)
        except NoNodeError:
            outcome.set(GONE)
        except (SessionExpiredError, ConnectionClosedError):
            outcome.set(EXPIRED)
        except RETRYABLE:
            monitor.when_connected(send)
        except SessionMovedError:
            # A server the session moved away from (a reconnection elsewhere) answers a check
            # inside a multi with this error and keeps the connection (ZooKeeper 3.5; it closes
            # it for a plain request, which kazoo then reports as a lost connection): not a
            # loss, so drop the connection as the server would, and prove again once connected.
            kazoo_compat.drop_connection(client)
            monitor.when_connected(send)
        except Exception as exc:  # NoAuth and the like: not a proof
            outcome.set_exception(exc)

    send()
    return outcome
