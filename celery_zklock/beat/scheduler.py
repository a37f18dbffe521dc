"""``celery beat -S celery_zklock.beat:ZkScheduler``: many beats, one elected to send.

The scheduler wraps another (``zklock_beat_scheduler``, Celery's ``PersistentScheduler`` by
default) and leaves it every schedule decision; it adds who may send and what was sent.
Every send goes through :meth:`ZkScheduler._apply_entry`: record the tick in ZooKeeper with
a conditional write that also proves leadership, then publish within a third of the session
timeout of sending that write, or not at all.  See docs/beat.md.
"""

from __future__ import annotations

import heapq
import json
import os
import socket
import threading
import uuid
from dataclasses import replace
from urllib.parse import unquote

from celery.beat import Scheduler, event_t
from celery.utils.imports import symbol_by_name
from celery.utils.log import get_logger

from .. import metrics
from ..config import cached_settings, retry_delay
from ..engine import clock, kazoo_compat
from ..engine.client import connect
from ..engine.identity import Identity
from ..engine.session import session_margin
from ..errors import ConfigurationError, LockUnavailable
from ..keys import encode_key
from ..worker import worker_hooks
from .election import Election, Role
from .ledger import Ledger
from .rules import (
    TickRecord,
    TickState,
    TickVerdict,
    Written,
    already_sent,
    handover,
    on_own_clock,
    skew_to_say,
    verdict,
)

logger = get_logger("celery.beat.zklock")

FOLDER = ".beat"  # under zklock_root; no encoded lock key starts with "."
RETRY = 0.2  # seconds before a tick that could not be recorded is tried again
WATCH_EVERY = 0.25  # seconds between the watchdog's looks at the tick loop
LOOK_EVERY = 60.0  # seconds between a standby's word of its schedule, and the leader's look at them


def folder(root: str) -> str:
    return f"{root.rstrip('/')}/{FOLDER}"


def group_path(root: str, group: str) -> str:
    return f"{folder(root)}/{encode_key(group)}"


def _period(entry) -> float:
    """An entry's period in seconds, for "more than a period" (a crontab's: a minute)."""
    every = getattr(entry.schedule, "run_every", None)
    try:
        return float(every.total_seconds()) if every is not None else 60.0
    except AttributeError:
        return 60.0


def inner_class(name_or_class) -> type:
    """The scheduler class to wrap, or a :class:`ConfigurationError` saying what to fix."""
    try:
        cls = symbol_by_name(name_or_class, aliases={})
    except Exception as exc:
        raise ConfigurationError(f"zklock_beat_scheduler={name_or_class!r} cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        raise ConfigurationError(f"zklock_beat_scheduler={name_or_class!r} is not a celery.beat.Scheduler subclass")
    if issubclass(cls, ZkScheduler):
        raise ConfigurationError("zklock_beat_scheduler names ZkScheduler itself; name the scheduler it wraps "
                                 "(e.g. 'celery.beat:PersistentScheduler')")
    return cls


def _unadvanced(entry):
    """The inner scheduler's reserve while wrapped: Celery's tick pushes what it returns back
    into the heap, and :meth:`ZkScheduler._reheap` replaces it with the entry as decided."""
    return entry


class ZkScheduler(Scheduler):
    """Beat's scheduler for a group of beats: the elected one sends each tick once."""

    def __init__(self, app, *args, lazy: bool = False, **kwargs) -> None:
        # A beat that is starting stops on a configuration error with the worker's one line
        # ("celery-zklock: configuration error: ...") and a non-zero exit, not a traceback:
        # Celery builds the scheduler for its banner, outside any handler of its own.
        with worker_hooks.configuration_exits():
            self._setup(app, *args, lazy=lazy, **kwargs)

    def _setup(self, app, *args, lazy: bool = False, **kwargs) -> None:
        settings = cached_settings(app)
        self.inner = inner_class(settings.beat_scheduler)(app, *args, lazy=lazy, **kwargs)
        super().__init__(app, max_interval=self.inner.max_interval, lazy=True)
        self.settings = settings
        self.group = settings.beat_group
        self.path = group_path(settings.root, self.group)
        self.me = f"{socket.gethostname()}:{os.getpid()}"
        self.election: Election | None = None
        self.ledger: Ledger | None = None
        self._adopted: int | None = None  # the election term whose records the inner scheduler holds
        self._unsure: dict[str, str] = {}  # entry: nonce of a recorded (or maybe recorded) tick not yet published
        self._requeued: dict = {}  # entry name: the entry to put in the inner heap after this tick (see _reheap)
        self._retry = False
        self._adopt_failures = 0
        self._send = self.inner.apply_async
        self._busy_since: float | None = None  # boottime a leader's tick began, while it runs
        self._skew_said = float("-inf")  # monotonic time of the last clock-skew warning
        self._next_look = float("-inf")  # monotonic time of the next schedule announcement or comparison
        self._standby_ledger: Ledger | None = None  # a standby's, for its presence node only
        self._watchdog: threading.Thread | None = None
        self._advance = self.inner.reserve  # the inner scheduler's own reserve, called after a send
        if not lazy:
            self._start()

    # The election is made by _start, the ledger by a leader's _adopt: whatever uses them
    # below runs after (a lazy ZkScheduler, never started, ticks nothing).
    @property
    def _started_election(self) -> Election:
        if self.election is None:
            raise RuntimeError("celery-zklock beat: the election was never started")
        return self.election

    @property
    def _adopted_ledger(self) -> Ledger:
        if self.ledger is None:
            raise RuntimeError("celery-zklock beat: no tick records were adopted")
        return self.ledger

    # ------------------------------------------------------------------ start and stop
    def _start(self) -> None:
        s = self.settings
        identity = Identity.of_this_process(worker=f"beat@{socket.gethostname()}", task=f"celery beat ({self.group})")
        self.election = Election(lambda: connect(s, summarize_retries=True), f"{self.path}/leader",
                                 identity.to_bytes(), self._on_role, self._backoff)
        client = None
        try:
            client = connect(s, summarize_retries=True)
        except LockUnavailable as exc:
            if s.on_unavailable == "fail":
                raise LockUnavailable(f"celery beat cannot start: {exc} (zklock_on_unavailable='fail')") from None
            logger.error("beat: zklock: %s; this beat stands by, sending nothing, until ZooKeeper answers "
                         "(zklock_on_unavailable='retry')", exc)
        metrics.start_beat(s.beat_metrics_port, self.group)
        # Every tick of the inner scheduler is sent through here: Celery's Scheduler.tick calls
        # self.apply_entry, and an instance attribute is found before the class's method.  Its
        # reserve (called just before) is held back until the send is decided: see _publish.
        self.inner.apply_entry = self._apply_entry
        self.inner.reserve = _unadvanced
        self.election.start(client)
        self._watchdog = threading.Thread(target=self._watch, name="zklock-beat-watchdog", daemon=True)
        self._watchdog.start()
        logger.info("beat: zklock: joined the election of group %r at %s (%s)", self.group, self.path, self.me)

    def _backoff(self, failures: int) -> float:
        return retry_delay(self.settings, failures) or 1.0  # a zero countdown must not spin

    def _on_role(self, role: Role, why: str) -> None:
        metrics.beat_role(self.group, role is Role.LEADER)
        if role is Role.LEADER:
            logger.info("beat: zklock: this beat (%s) is now the active scheduler of group %r (%s)", self.me, self.group, why)
        else:
            log = logger.info if role is Role.LEFT else logger.warning
            log("beat: zklock: this beat (%s) stepped down in group %r: %s", self.me, self.group, why)

    def close(self) -> None:
        try:
            self.inner.close()
        finally:
            if self.election is not None:
                self.election.close()

    # ------------------------------------------------------------------ beat's loop
    def tick(self, *args, **kwargs) -> float:
        """Standby: wait for leadership (beat's sleep).  Leader: adopt the shared records once
        per term, then let the inner scheduler tick while the connection is sound."""
        election = self.election
        if election is None:  # lazy: never ticks
            return self.max_interval
        term = election.term()
        if term is None:
            self._adopted = None
            self._announce_standby()
            election.wait(self.max_interval)
            return 0
        if self._adopted != term:
            if not self._adopt():
                self._adopt_failures += 1
                return min(5.0, RETRY * 2 ** self._adopt_failures)
            self._adopted, self._adopt_failures = term, 0
        if clock.monotonic() >= self._next_look:
            self._next_look = clock.monotonic() + LOOK_EVERY
            self._compare_schedules()
        if not election.held():
            return RETRY  # suspended: doubt, send nothing, keep every due tick due
        self._retry = False
        self._busy_since = clock.boottime()
        try:
            interval = self.inner.tick(*args, **kwargs)
        finally:
            self._busy_since = None
            self._reheap()
        return RETRY if self._retry and not interval else interval

    def _watch(self) -> None:
        """Step down when this leader's tick has run longer than its proof lasts (a third of the
        session): a publish blocked on a stalled broker path, or anything else that stops the
        loop.  Why: the election lives on kazoo's thread, which keeps the session (and so the
        leadership) alive while beat's own thread is stuck, and no standby would take over for
        as long as the stall lasts.  The stuck publish may still land later: the workers' tick
        fence keeps it from running after the next leader's tick."""
        told = None
        while self.election is not None and not self.election.wait_closed(WATCH_EVERY):
            since = self._busy_since
            if since is None or since == told or self.election.term() is None:
                continue
            stuck = clock.boottime() - since
            if stuck > session_margin(self._session_timeout()):
                told = since
                logger.error("beat: zklock: this beat's tick has been stuck for %.1fs (a publish to a stalled broker?): "
                             "stepping down so that another beat leads", stuck)
                self.election.step_down(f"its tick was stuck for {stuck:.1f}s", node=self.election.node)

    def _session_timeout(self) -> float:
        """The session ZooKeeper keeps for this beat: the smaller of the one asked for and the one
        the server granted (its maxSessionTimeout may cut the wish short), as the election's lock
        and the worker's lease count it.  A proof trusted for a third of the wish could outlive
        the session itself."""
        return min(self.settings.session_timeout, kazoo_compat.session_timeout(self._started_election.client))

    def _adopt(self) -> bool:
        """A new leader's first step: every entry continues from the group's records.

        Except a tick this beat recorded (or maybe recorded: the reply was lost) and never
        published, in an earlier term, when the record is still ours: nobody recorded, so nobody
        sent, a tick since.  That entry is still kept due as it was before the send, and its
        next tick writes the same record again and publishes it."""
        self.ledger = Ledger(self._started_election.client, self.path, session_margin(self._session_timeout()))
        try:
            self.ledger.load()
        except Exception as exc:
            logger.warning("beat: zklock: cannot read the tick records at %s yet (sending nothing): %s",
                           self.ledger.path, exc)
            return False
        unsure, self._unsure = self._unsure, {}
        now = self.app.now()
        self.ledger.announce(self.me, self._presence(leading=True), self._now_s, fresh=True)
        own = self.ledger.last_skew
        self._next_look = clock.monotonic()  # compare the schedules at once
        if skew_to_say(own, 0):
            logger.warning("beat: zklock: this beat's clock differs from ZooKeeper's by %+.1fs; records of other "
                           "beats are read on ZooKeeper's clock", own)
        for name, entry in list(self.inner.schedule.items()):
            record = self.ledger.read(name)
            if record is None:
                continue
            moved = on_own_clock(record.last_run_at, self.ledger.written(name), own)
            if moved != record.last_run_at and skew_to_say((record.last_run_at - moved).total_seconds(),
                                                            _period(entry)):
                logger.warning("beat: zklock: %s: the clock of %s, which wrote its last record, differed from this "
                               "beat's by %+.1fs: its last run is taken at %s on this beat's clock", name, record.by,
                               (record.last_run_at - moved).total_seconds(), moved)
            record = replace(record, last_run_at=moved)
            self.ledger.adjust(name, record)
            found = handover(record, entry.schedule, now)
            if record.nonce == unsure.get(name):
                self._unsure[name] = record.nonce
                logger.warning("beat: zklock: %s: tick %d (due %s), recorded by this beat before its reply was lost, "
                               "is published now", name, record.seq, record.due)
            else:
                self._take_record(name, entry, record)
                if found.unconfirmed:
                    logger.warning("beat: zklock: %s: tick %d (due %s) was recorded by %s but not confirmed sent: it "
                                   "was lost if that beat died before publishing it", name, record.seq, record.due,
                                   record.by)
            if found.skipped:
                metrics.beat_tick(self.group, "skipped", found.skipped)
                logger.warning("beat: zklock: %s: %d due times passed during the handover; sending one now, "
                               "skipping %d", name, found.missed, found.skipped)
        self.inner._heap = None  # re-read every entry's due time: the schedule holds each one's latest
        self._requeued.clear()
        return True

    def _take_record(self, name: str, entry, record: TickRecord) -> None:
        entry.last_run_at = record.last_run_at
        entry.total_run_count = record.runs
        self._requeue(entry)

    def _requeue(self, entry) -> None:
        """Make ``entry`` the inner scheduler's view of its name: in its schedule now, in its heap
        once this tick is over (:meth:`_reheap`).  The schedule too, because django-celery-beat's
        reserve does not write its advanced entry back: a heap it rebuilds must not find an old one."""
        self.inner.schedule[entry.name] = entry
        self._requeued[entry.name] = entry

    def _reheap(self) -> None:
        """Put each entry this tick decided on (sent and advanced, kept due, or taken from another
        beat's record) in the inner heap, in place of the event Celery pushed for it.

        Why not drop the heap and let the inner scheduler rebuild it: it rebuilds from its
        schedule, where a database scheduler keeps stale copies of the other entries (its
        reserve advances the shared row, not the dict), so ticks already sent came due again."""
        requeued, self._requeued = self._requeued, {}
        heap = self.inner._heap
        if not requeued or heap is None:  # None: rebuilt from the schedule, which holds them
            return
        events = [event for event in heap if event[2].name not in requeued]
        for entry in requeued.values():
            try:
                due, delay = self.inner.is_due(entry)
            except Exception as exc:
                logger.error("beat: zklock: %s: cannot compute its next run (%s); trying again in %ss", entry.name,
                             exc, self.inner.max_interval)
                due, delay = False, self.inner.max_interval
            events.append(event_t(self.inner._when(entry, 0 if due else delay), 5, entry))
        heapq.heapify(events)
        heap[:] = events

    # ------------------------------------------------------------------ one send
    def _apply_entry(self, entry, producer=None) -> None:
        """Record the tick (proving leadership), then publish it; or keep it due and send nothing."""
        name = entry.name
        try:
            tick, written, sent_at, node = self._record(entry)
        except Exception as exc:  # a read timed out, an ACL refused: nothing recorded, nothing sent
            logger.warning("beat: zklock: %s: tick not recorded (%s: %s); kept due", name, type(exc).__name__, exc)
            return self._keep_due(entry)
        if tick is None:  # another leader sent it: continue from its record
            self._unsure.pop(name, None)
            record = self._adopted_ledger.read(name)
            assert record is not None  # already_sent() saw it: read() answers from the same load
            return self._take_record(name, entry, record)
        if written is Written.DEPOSED:
            self._started_election.step_down("the election node was gone at a tick's write", node=node)
            return self._keep_due(entry)
        if written is not Written.RECORDED:  # UNKNOWN, or CONFLICT twice: the next tick looks again
            return self._keep_due(entry)
        why = verdict(clock.boottime() - sent_at, self._session_timeout(), self._started_election.held())
        self._say_skew(entry)
        if why is not TickVerdict.PUBLISH:
            metrics.beat_tick(self.group, "withheld")
            logger.warning("beat: zklock: %s: tick %d not sent (%s); kept due", name, tick.seq, why.value)
            return self._keep_due(entry)
        self._publish(entry, tick, producer)

    def _record(self, entry) -> tuple[TickRecord | None, Written, float, str | None]:
        """Write this tick's record: (the tick, what became of the write, when it was sent, the
        election node it proved), or (None, ...) when the record shows another leader sent this
        due time."""
        name = entry.name
        unsure = self._unsure.get(name)  # a tick of ours recorded (or maybe recorded), not published
        ledger = self._adopted_ledger
        record = ledger.refresh(name) if unsure else ledger.read(name)
        written, sent_at, tick, node = Written.CONFLICT, 0.0, None, None
        for _ in range(2):  # a conflict is read again once: it may be our own unanswered write
            pending = record is not None and record.nonce == unsure  # ours, never published: publish it now
            # Else the ledger decides, for our own records too: an entry whose last_run_at is older
            # than the record's came back stale (its send advanced it only after the record).
            if not pending and already_sent(record, entry.last_run_at):
                return None, written, sent_at, node
            tick = record if record is not None and pending else self._new_tick(entry, record)
            node = self._started_election.node_if_held()
            if node is None:
                return tick, Written.UNKNOWN, sent_at, node
            sent_at = clock.boottime()
            written = ledger.write(name, tick, node, now=self._now_s)
            if written is not Written.CONFLICT:
                break
            record = ledger.refresh(name)
        if tick is not None and written in (Written.RECORDED, Written.UNKNOWN):
            self._unsure[name] = tick.nonce
        return tick, written, sent_at, node

    def _new_tick(self, entry, record: TickRecord | None) -> TickRecord:
        """The tick for ``entry`` (as it was before this send), sent now: the base of its next
        due time is now, as Celery's ``next(entry)`` makes it (read from the clock: the inner
        scheduler advances the entry only after the publish, a little later)."""
        now = self.app.now()
        try:
            due = min(now, now + entry.schedule.remaining_estimate(entry.last_run_at))
        except Exception:
            due = now
        return TickRecord(last_run_at=now, due=due, seq=(record.seq + 1) if record else 1,
                          runs=(entry.total_run_count or 0) + 1, state=TickState.SENDING, by=self.me,
                          token=self._started_election.token, nonce=uuid.uuid4().hex)

    def _publish(self, entry, tick: TickRecord, producer) -> None:
        """Send the recorded tick, then advance the entry (the inner scheduler's reserve, held
        back until now): its last_run_at is then later than the record's, so the ledger tells
        its next tick from a stale copy of this one.  A database scheduler's reserve also
        advances the stored row (run count, last run; a one-off is disabled by it), which must
        not happen to a tick kept due."""
        options = entry.options  # the header rides on the entry for this one send (entries of a
        headers = dict(options.get("headers") or {})  # database scheduler do not copy)
        headers["zklock_beat"] = {"entry": entry.name, "seq": tick.seq, "due": tick.due.isoformat(), "token": tick.token,
                                  "fence": self.fence_path(entry.name)}
        logger.info("Scheduler: Sending due task %s (%s) [zklock tick %d]", entry.name, entry.task, tick.seq)
        entry.options = {**options, "headers": headers}
        try:
            result = self._send(entry, producer=producer, advance=False)
        except Exception as exc:  # as Celery's own apply_entry: said, not retried (a retry could send it twice)
            logger.error("Message Error: %s (tick %d of %s not sent; its record stays unconfirmed)", exc, tick.seq,
                         entry.name, exc_info=True)
            return
        finally:
            entry.options = options
            self._unsure.pop(entry.name, None)
            self._requeue(self._advance(entry))
        metrics.beat_tick(self.group, "sent")
        logger.debug("%s sent. id->%s", entry.task, getattr(result, "id", None))
        node = self._started_election.node
        if node is None:  # stepped down meanwhile: its write would be refused
            return
        try:
            self._adopted_ledger.write(entry.name, tick.sent(), node)  # for the next leader's report only
        except Exception:
            pass

    def _presence(self, leading: bool) -> bytes:
        return json.dumps({"entries": sorted(self.inner.schedule), "leading": leading}).encode()

    def _announce_standby(self) -> None:
        """A standby says which entries it has (once a minute): the leader compares them with its
        own (:meth:`_compare_schedules`).  ZooKeeper unreachable: said at the next turn."""
        client = self._started_election.client
        if client is None or clock.monotonic() < self._next_look:
            return
        self._next_look = clock.monotonic() + LOOK_EVERY
        if self._standby_ledger is None or self._standby_ledger.client is not client:
            self._standby_ledger = Ledger(client, self.path, session_margin(self._session_timeout()))
        self._standby_ledger.announce(self.me, self._presence(leading=False), self._now_s)

    def _look_soon(self, _event=None) -> None:
        """A beat joined or left the group (a watch): compare the schedules at the next tick."""
        self._next_look = float("-inf")

    def _compare_schedules(self) -> None:
        """Warn of entries a standby has and this leader does not (a rolling deploy that added
        one): nobody sends them until a beat that has them leads.  Counted in
        ``zklock_beat_entries_unknown_to_leader``."""
        try:
            others = self._adopted_ledger.others(self.me, watch=self._look_soon)
        except Exception as exc:
            logger.debug("beat: zklock: cannot read the other beats' schedules: %r", exc)
            return
        mine = set(self.inner.schedule)
        missing: dict[str, list[str]] = {}
        for beat, data in others.items():
            try:
                entries = json.loads(data or b"{}").get("entries") or []
            except (ValueError, AttributeError):
                continue
            for name in set(entries) - mine:
                missing.setdefault(name, []).append(unquote(beat))
        metrics.beat_unknown_entries(self.group, len(missing))
        for name, beats in sorted(missing.items()):
            logger.warning("beat: zklock: entry %r is in the schedule of %s but not in this leader's (%s): it is not "
                           "sent while this beat leads", name, ", ".join(sorted(beats)), self.me)

    def _now_s(self) -> float:
        """This beat's clock as its schedule reads it (``app.now()``), in seconds."""
        return self.app.now().timestamp()

    def _say_skew(self, entry) -> None:
        """Warn (once a minute at most) while this leader's clock differs from ZooKeeper's by more
        than a period of ``entry``: its records are the next leader's base, and the skew moves due times."""
        skew = self._adopted_ledger.last_skew
        metrics.beat_clock_skew(self.group, skew)
        now = clock.monotonic()
        if skew_to_say(skew, _period(entry)) and now - self._skew_said > 60.0:
            self._skew_said = now
            logger.warning("beat: zklock: this beat's clock differs from ZooKeeper's by %+.1fs (more than a period of "
                           "%s): check its time sync; the next leader reads its records on ZooKeeper's clock", skew,
                           entry.name)

    def fence_path(self, name: str) -> str:
        """The znode where workers record the last tick of entry ``name`` that ran
        (:mod:`celery_zklock.engine.tick_fence`)."""
        return f"{self.path}/ran/{encode_key(name)}"

    def _keep_due(self, entry) -> None:
        """Put the entry back as it was before this send (not advanced: see _publish), so it is
        still due next tick; only this entry, the others stay as the heap has them."""
        self._requeue(entry)
        self._retry = True

    # ------------------------------------------------------------------ the rest is the inner scheduler's
    def get_schedule(self):
        return self.inner.schedule

    def set_schedule(self, schedule) -> None:
        self.inner.schedule = schedule

    schedule = property(get_schedule, set_schedule)

    def setup_schedule(self) -> None:
        pass

    def should_sync(self) -> bool:
        return self.inner.should_sync()

    def _do_sync(self) -> None:
        self.inner._do_sync()

    def sync(self) -> None:
        self.inner.sync()

    @property
    def info(self) -> str:
        return (f"{self.inner.info}\n    . zklock -> one active beat of group {self.group!r} "
                f"({self.settings.hosts}{self.path})")
