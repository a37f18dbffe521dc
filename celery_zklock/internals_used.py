"""Every internal of Celery, kombu, billiard and kazoo this package patches, reads or calls.

Why a list: a lock around a Celery task reaches into places Celery has no public hook for
(the consumer's request callback, the prefork pool's queues, beat's heap, kazoo's session
bookkeeping), and a Celery or kazoo release may rename any of them without notice.  They
are used across a dozen modules; here they are one table, each with why we touch it and
what breaks without it.  ``tests/test_internals_used.py`` imports every
owner and checks that each attribute is still there (a release that drops one fails that
test *by name*), and scans the package so that an internal used anywhere but listed here
fails it too.

In the table: every underscore name of those four libraries we touch (read, write, call or
override in a subclass), every attribute of theirs we write on their objects (a patch), and
the undocumented public names our behaviour depends on (``Consumer.on_task_request``,
``QoS.prev``, beat's ``reserve``...).  Not in it: their documented API (``Task``,
``Request.on_failure``, bootsteps, signals, ``app.control``, kazoo's client calls), and
the internals of other libraries: CPython's ``_thread._local`` and
``ctypes.pythonapi.PyThreadState_SetAsyncExc`` (``engine/owner.py``, ``held.py``),
gevent's ``get_hub().loop.run_callback`` (``held.py``), prometheus_client's
``values.ValueClass`` (``metrics.py``), and pytest-celery's and pytest-docker-tools' in the
opt-in ``contrib/pytest_celery`` (the test's scan names those it meets).

Base layer, data only: importing it loads neither Celery nor kazoo.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What we do to it."""

    PATCHED = "patched"  # we write it (replace, wrap, set, or mutate the object it holds)
    READ = "read"  # we read it
    CALLED = "called"  # we call it (or build with it)
    OVERRIDDEN = "overridden"  # a subclass of ours defines it, and the library calls ours


class On(str, enum.Enum):
    """Where the attribute lives, which is where the test looks for it."""

    MODULE = "module"  # a module global of ``owner`` (a module)
    CLASS = "class"  # defined on the class ``owner`` (method, property, class attribute)
    INSTANCE = "instance"  # set on instances of ``owner`` by its ``__init__`` or a method


@dataclass(frozen=True)
class Internal:
    """One internal we touch.

    ``since`` is the oldest version of the owner's distribution (``celery``, ``kombu``,
    ``billiard``, ``kazoo``) that has it as we use it: the floor we support (celery 5.3,
    kombu 5.3, billiard 4.2, kazoo 2.9) for most, i.e. "at least since"; the test skips an
    entry on an installed version older than its ``since``.  :data:`CHECKED_ON` says which
    releases the whole table was checked against."""

    owner: str  # dotted path of the module or class that holds it
    name: str
    kind: Kind
    on: On
    why: str  # why we touch it, one line
    used_in: tuple[str, ...]  # our modules, dotted below the package ("worker.wait_outside_pool")
    since: str  # "<distribution> <major>.<minor>"
    breaks: str  # what breaks if it disappears

    @property
    def label(self) -> str:
        return f"{self.owner}.{self.name}"


#: The releases the table was checked against: tests/test_internals_used.py run with each
#: combination's wheels first on sys.path (5.3.6/5.3.7/4.2.0/2.9.0, 5.4.0/5.4.2/4.2.1/2.10.0,
#: 5.5.3/5.5.4/4.2.1/2.11.0, 5.6.3/5.6.2/4.2.1/2.9.0 and 5.7.0/5.7.0/4.3.2/2.11.0: the
#: cells of ``make matrix``).
CHECKED_ON = {
    "celery": ("5.3.6", "5.4.0", "5.5.3", "5.6.3", "5.7.0"),
    "kombu": ("5.3.7", "5.4.2", "5.5.4", "5.6.2", "5.7.0"),
    "billiard": ("4.2.0", "4.2.1", "4.3.2"),
    "kazoo": ("2.9.0", "2.10.0", "2.11.0"),
}

_PAT, _REA, _CAL, _OVR = Kind.PATCHED, Kind.READ, Kind.CALLED, Kind.OVERRIDDEN
_MOD, _CLS, _INS = On.MODULE, On.CLASS, On.INSTANCE

_WQ = ("worker.wait_outside_pool",)
_PW = ("worker.prefetch_window",)
_HL = ("worker.held_lease",)
_DC = ("worker.dead_channel",)
_PH = ("worker.next_in_line",)
_KC = ("engine.kazoo_compat",)
_EC = ("engine.client",)
_BS = ("beat.scheduler",)
_SER = "kazoo.protocol.serialization"

#: Field order: owner, name, kind, on, why, used_in, since, breaks.
INTERNALS: tuple[Internal, ...] = (
    # ---------------------------------------------------------------- Celery: the tracer
    Internal("celery.app.trace", "send_prerun", _PAT, _MOD,
             "hold the tracer's task_prerun back until the lock is decided (build_tracer looks the global up at "
             "each call)", ("decision",), "celery 5.3",
             "decision.install_prerun() returns False: task_prerun fires before the lock wait again, so a timing "
             "dashboard counts the wait as run time; nothing else changes"),
    # ---------------------------------------------------------------- Celery: the worker's consumer
    Internal("celery.worker.consumer.Consumer", "on_task_request", _PAT, _INS,
             "route every request through WaitOutsidePool.on_request, which holds a locked one aside while the "
             "lock agent queues for it (celery.worker.strategy.default binds it when the strategies are built)",
             _WQ, "celery 5.3",
             "WaitOutsidePool raises AttributeError: a worker with a lock agent does not start; if the strategies "
             "stop reading it, locked requests go straight to the pool and wait for their locks there"),
    Internal("celery.worker.consumer.Consumer", "on_close", _PAT, _CLS,
             "learn which requests Celery drops unrun at a broker reconnection or a shutdown, to free their "
             "grants", _WQ, "celery 5.3",
             "WaitOutsidePool raises AttributeError (a worker with a lock agent does not start); no longer called, "
             "a grant of a dropped request holds its key for nobody until the agent sees the worker go"),
    Internal("celery.bootsteps.Blueprint", "on_close", _PAT, _INS,
             "the blueprint keeps its own reference to Consumer.on_close and calls it at shutdown", _WQ,
             "celery 5.3", "at a shutdown the agent is not told of dropped requests: their grants hold their keys "
             "until it sees the worker go"),
    Internal("celery.bootsteps.Blueprint", "state", _REA, _CLS,
             "tell a broker reconnection (the consumer's blueprint still RUN) from a shutdown in "
             "WaitOutsidePool.stop", _WQ, "celery 5.3",
             "getattr default None: every reconnection is handled as a shutdown, rejecting waiting requests on "
             "a dead connection"),
    Internal("celery.bootsteps", "RUN", _REA, _MOD, "the blueprint state a reconnection keeps", _WQ, "celery 5.3",
             "ImportError: wait_outside_pool (and so every worker with locked tasks) cannot load"),
    Internal("celery.worker.consumer.Consumer", "on_connection_error_after_connected", _PAT, _CLS,
             "turn kombu's restore off on the lost Redis channel before Celery closes the connection, and keep "
             "the channel to move its running tasks' messages from at the reconnection", _WQ,
             "celery 5.3",
             "getattr default: no patch, and on Celery 5.7 a Redis outage with messages held aside ends the "
             "worker ('Unrecoverable error': kombu restores on a closed transport)"),
    Internal("celery.worker.consumer.tasks", "Tasks", _REA, _MOD,
             "FastChildLossStep and WaitOutsidePool require the consumer's Tasks step, named by its path (the pool, "
             "the new connection and its QoS are known then)", ("worker.worker_hooks", "worker.wait_outside_pool"),
             "celery 5.3",
             "the consumer's blueprint cannot resolve the requirement: no worker starts"),
    Internal("celery.worker.state", "reserved_requests", _PAT, _MOD,
             "which requests no pool process has taken (Consumer.on_close drops them); a request we hold or "
             "forget is discarded from it", (*_WQ, *_HL), "celery 5.3",
             "AttributeError at a reconnection or shutdown (WaitOutsidePool.on_close) and when a held request "
             "goes back to its queue"),
    Internal("celery.worker.state", "active_requests", _REA, _MOD,
             "requests a pool process took are never reported dropped", _WQ, "celery 5.3",
             "AttributeError at a broker reconnection or shutdown in WaitOutsidePool.on_close"),
    Internal("celery.worker.state", "revoked", _REA, _MOD,
             "revoked ids, checked every 0.1 s for requests held aside", _WQ, "celery 5.3",
             "AttributeError in the 0.1 s timer: a revoked request held aside would still run"),
    # ---------------------------------------------------------------- Celery: the request
    Internal("celery.worker.request.Request", "_announce_revoked", _OVR, _CLS,
             "every unrun drop of a request (revoked, expired at the pool) passes here: free the grant it got",
             ("worker.worker_hooks",), "celery 5.3",
             "our override is never called: a granted request revoked or expired at the pool leaves its key held "
             "by nobody until the worker stops"),
    Internal("celery.worker.request.Request", "_apply_result", _REA, _CLS,
             "the weakref to the request's job, to move a granted request to the head of the outbound buffer",
             _PH, "celery 5.3",
             "getattr default: a granted request keeps its place behind others (a hot key's chain slows, nothing "
             "runs wrongly)"),
    Internal("celery.worker.request.Request", "request_dict", _REA, _CLS,
             "the message's headers in the main process (zklock_beat, zklock_copy, retries)",
             (*_WQ, "redelivery"), "celery 5.3",
             "AttributeError in WaitOutsidePool.on_request: locked requests fail at the worker"),
    Internal("celery.worker.request.Request", "delivery_info", _PAT, _CLS,
             "read 'redelivered'; write the carried grant and the bypass mark into it: the same dict is sent to "
             "the pool process inside request_dict", (*_WQ, "redelivery"), "celery 5.3",
             "a pool process never sees its carried grant (it asks the agent again) nor a bypass (it waits in "
             "the agent for a lock it should take itself)"),
    Internal("celery.worker.request.Request", "maybe_expire", _CAL, _CLS,
             "expire a held request as Celery does (revoked, expired)", _WQ, "celery 5.3",
             "AttributeError in the 0.1 s timer of WaitOutsidePool"),
    Internal("celery.worker.request.Request", "revoked", _CAL, _CLS,
             "record a revoked held request as Celery does (ack, REVOKED, event, signal)", _WQ, "celery 5.3",
             "AttributeError in the 0.1 s timer of WaitOutsidePool"),
    Internal("celery.worker.request.Request", "acknowledged", _PAT, _CLS,
             "mark a request we rejected with requeue at shutdown: Celery never acks or rejects it again",
             _WQ, "celery 5.3", "Celery may ack a message we already gave back to the broker"),
    Internal("celery.worker.request.Request", "eventer", _REA, _CLS,
             "Celery's own test for sending task events (is the task-lock-waiting event read?)", _WQ,
             "celery 5.3", "AttributeError as a request is queued in the agent"),
    # ---------------------------------------------------------------- Celery, billiard, kombu: the pool
    Internal("celery.concurrency.prefork.TaskPool", "_pool", _REA, _INS,
             "the billiard pool (AsynPool) behind Celery's prefork TaskPool", (*_PH, "worker.worker_hooks"),
             "celery 5.3",
             "getattr default: no reordering of the outbound buffer, pool size from limit, and FastChildLossStep "
             "does nothing (a dead child's lock waits for the pool's 5 s maintenance)"),
    Internal("celery.concurrency.asynpool.AsynPool", "outbound_buffer", _PAT, _INS,
             "jobs waiting for a pool process: a granted one moves to the head; non-empty means the pool is busy",
             _PH, "celery 5.3",
             "getattr default None: granted requests keep their place, and the pool may be taken for idle"),
    Internal("billiard.pool.Pool", "_processes", _REA, _INS,
             "the pool's current size, which --autoscale changes (handoff slots, readers of a read lock)", _PH,
             "billiard 4.2", "falls back to the pool's limit: wrong under --autoscale"),
    Internal("billiard.pool.Pool", "maintain_pool", _CAL, _CLS,
             "run the pool's maintenance every 0.2 s: a dead child (and its lock) is noticed at once",
             ("worker.worker_hooks",), "billiard 4.2",
             "FastChildLossStep does nothing: a dead child's lock blocks its key until the 5 s maintenance"),
    Internal("celery.concurrency.base.BasePool", "limit", _REA, _INS,
             "the pool's size when the billiard pool cannot be read", _PH, "celery 5.3",
             "getattr default: a pool of 1 assumed, so no handoff slots"),
    Internal("kombu.asynchronous.semaphore.LaxBoundedSemaphore", "_waiting", _PAT, _INS,
             "requests waiting for a pool process, each (callback, (request,), {}) as "
             "WorkController._process_task_sem queues it: a granted one moves to the head", _PH, "kombu 5.3",
             "getattr default True: the pool never counts as idle (no early handoff) and granted requests keep "
             "their place"),
    Internal("kombu.asynchronous.semaphore.LaxBoundedSemaphore", "value", _REA, _INS,
             "free pool processes (one permit each)", _PH, "kombu 5.3",
             "idle_processes says None: no early handoff"),
    Internal("celery.worker.worker.WorkController", "pool_cls", _REA, _INS,
             "the pool's class at worker_init: the lock agent serves prefork and solo only",
             ("worker.agent_supervisor",), "celery 5.3",
             "getattr default: no lock agent, every locked task waits in its pool process"),
    Internal("celery.worker.worker.WorkController", "task_events", _REA, _INS,
             "-E reaches the WorkController, not app.conf, which pool processes read",
             ("worker.worker_hooks",), "celery 5.3", "getattr default: task-lock-* events need the setting"),
    # ---------------------------------------------------------------- Celery: beat
    Internal("celery.beat.Scheduler", "apply_entry", _PAT, _CLS,
             "every tick of the wrapped scheduler goes through ZkScheduler._apply_entry (record, then publish): "
             "Scheduler.tick calls self.apply_entry", _BS, "celery 5.3",
             "if tick stops calling it, every beat of the group sends every tick: the election is bypassed"),
    Internal("celery.beat.Scheduler", "reserve", _PAT, _CLS,
             "the wrapped scheduler's reserve (advance an entry) is held back until a send is decided", _BS,
             "celery 5.3", "AttributeError at beat start; renamed, entries advance before the send is decided"),
    Internal("celery.beat.Scheduler", "_heap", _PAT, _INS,
             "replace the events of the entries a tick decided on; None makes the heap rebuilt", _BS,
             "celery 5.3",
             "ticks already sent come due again after a handover (a database scheduler's stale copies)"),
    Internal("celery.beat.Scheduler", "_when", _CAL, _CLS, "an entry's heap time, as tick computes it", _BS,
             "celery 5.3", "AttributeError after each tick of the leader that sent or kept an entry"),
    Internal("celery.beat.Scheduler", "_do_sync", _OVR, _CLS,
             "ZkScheduler passes a sync on to the wrapped scheduler", _BS, "celery 5.3",
             "the wrapped scheduler's schedule file or database rows are not synced when Celery asks"),
    Internal("celery.beat.Scheduler", "apply_async", _CAL, _CLS,
             "publish with advance=False: the entry is advanced only after the send is decided", _BS,
             "celery 5.3", "TypeError without the advance keyword: no tick is sent"),
    Internal("celery.beat", "event_t", _CAL, _MOD, "the heap's (time, priority, entry) events", _BS, "celery 5.3",
             "ImportError: the elected beat cannot load"),
    Internal("celery.schedules.BaseSchedule", "nowfun", _PAT, _INS,
             "a copy of a crontab/solar schedule whose clock reads a given time, to count missed due times",
             ("beat.rules",), "celery 5.3", "missed ticks at a handover miscounted (only a log line and metric)"),
    # ---------------------------------------------------------------- Celery: the app and tasks
    Internal("celery.app.base.Celery", "_tasks", _PAT, _INS,
             "swap a task for its locked subclass in the registry (zklock_tasks) under the same name "
             "(register_task warns of a replaced name from Celery 5.7)",
             ("by_config",), "celery 5.3", "AttributeError: zklock_tasks cannot lock a task"),
    Internal("celery.app.base.Celery", "_task_from_fun", _REA, _CLS,
             "the decorator's own parameters (bind, base, pydantic...), so a misspelt lock option is caught",
             ("options",), "celery 5.3", "AttributeError when a ZkLockedTask subclass checks its option names"),
    Internal("celery.app.task.Task", "__header__", _CAL, _INS,
             "Celery's argument check of a function task, run before the enqueue guard dedupes a publish",
             ("enqueue",), "celery 5.3", "getattr default: a deduped publish no longer raises TypeError on bad "
             "arguments"),
    Internal("celery.app.autoretry", "add_autoretry_behaviour", _CAL, _MOD,
             "run on a recorder to learn which task attributes autoretry reads", ("options",), "celery 5.3",
             "ImportError when task options are checked"),
    Internal("celery.app.task", "extract_exec_options", _CAL, _MOD,
             "run on a recorder to learn which publishing defaults a task may carry", ("options",), "celery 5.3",
             "ImportError when task options are checked"),
    Internal("celery.utils.collections.ConfigurationView", "prefix", _REA, _INS,
             "the namespace settings are read under (CELERY_ for Django), to name keys as the user wrote them",
             ("config",), "celery 5.3", "errors name zklock_* keys without the user's namespace"),
    Internal("celery.utils.collections.ChainMap", "maps", _REA, _INS,
             "which of the configuration's mappings holds a key", ("config",), "celery 5.3",
             "getattr default: a namespaced key is named in its plain spelling in errors"),
    Internal("celery.backends.base", "DisabledBackend", _REA, _MOD,
             "no result backend: a redelivered copy cannot learn whether its original ran", ("redelivery",),
             "celery 5.3", "ImportError: the task module cannot load"),
    Internal("celery.utils.time", "maybe_iso8601", _CAL, _MOD, "read a retry's ISO eta/expires as Celery does",
             ("enqueue",), "celery 5.3", "ImportError in a guarded publish with an ISO eta"),
    Internal("celery.utils.time", "maybe_make_aware", _CAL, _MOD, "read a naive eta/expires as the worker does",
             ("enqueue",), "celery 5.3", "ImportError in a guarded publish with a datetime eta"),
    Internal("celery.utils", "uuid", _CAL, _MOD, "a task id made before the publish, for the enqueue guard",
             ("enqueue",), "celery 5.3", "ImportError in every guarded publish"),
    Internal("celery.utils.imports", "symbol_by_name", _CAL, _MOD, "import zklock_beat_scheduler as Celery does",
             _BS, "celery 5.3", "ImportError: the elected beat cannot load"),
    Internal("celery.utils.dispatch", "Signal", _CAL, _MOD, "our lock_* signals are Celery signals", ("signals",),
             "celery 5.3", "ImportError: the package cannot load"),
    # ---------------------------------------------------------------- kombu
    Internal("kombu.common.QoS", "prev", _PAT, _CLS,
             "set to None so that asynloop sends the window at its next turn (it compares prev with value)", _PW,
             "kombu 5.3", "the raised window is sent only at Celery's own next change"),
    Internal("kombu.common.QoS", "callback", _PAT, _INS,
             "wrapped: the window sent to the broker adds the band for requests held aside", _PW, "kombu 5.3",
             "AttributeError as the first request is held aside"),
    Internal("kombu.common.QoS", "max_prefetch", _REA, _INS,
             "worker_eta_task_limit caps the band too", _PW, "kombu 5.6",
             "getattr default None: the band is capped by AMQP's maximum only (as before kombu 5.6)"),
    Internal("kombu.common", "PREFETCH_COUNT_MAX", _REA, _MOD, "the largest window AMQP can say", _PW, "kombu 5.3",
             "ImportError: prefetch_window (and so wait_outside_pool) cannot load"),
    Internal("kombu.connection.Connection", "_default_channel", _REA, _CLS,
             "the lost connection's Redis channel, whose restore we turn off (default_channel would open one)", _DC,
             "kombu 5.3", "getattr default: no patch (see on_connection_error_after_connected)"),
    Internal("kombu.transport.virtual.Channel", "do_restore", _PAT, _CLS,
             "False: kombu must not restore unacked messages on a dead Redis connection as it closes", _DC,
             "kombu 5.3", "the flag is set for nothing: Redis outages end the worker on Celery 5.7"),
    Internal("kombu.message.Message", "channel", _PAT, _INS,
             "a running task's message moves from the lost Redis channel to the live one at the reconnection, so "
             "that Celery's acknowledgement reaches Redis", _DC, "kombu 5.3",
             "AttributeError: the worker exits when a task that ran across a Redis outage is acknowledged"),
    Internal("kombu.transport.virtual.QoS", "ack", _CAL, _CLS,
             "forget a delivery in this worker only (the virtual QoS's ack), not Redis's unacked copy, which may be "
             "another worker's now", _HL, "kombu 5.3",
             "caught: the channel's prefetch count keeps a message that went back to its queue"),
    Internal("kombu.transport.redis.QoS", "restore_visible", _CAL, _CLS,
             "kombu's own sweep, run each second with start=0, num, interval=1 to return lapsed leases", _HL,
             "kombu 5.3", "caught and logged: held messages of a dead worker wait for kombu's own sweep (100 s)"),
    Internal("kombu.transport.redis.Channel", "unacked_index_key", _REA, _CLS,
             "the sorted set whose scores are the held messages' leases", _HL, "kombu 5.3",
             "redis_channel() says None: held Redis messages get no lease (delivered twice after the visibility "
             "timeout, stranded an hour by a dead worker)"),
    Internal("kombu.transport.redis.Channel", "visibility_timeout", _REA, _CLS,
             "a lease's score is now - visibility_timeout + lease", _HL, "kombu 5.3",
             "AttributeError in the renewal: caught, every lease lapses"),
    Internal("kombu.transport.redis.Channel", "unacked_restore_limit", _REA, _CLS,
             "the sweep restores as many as kombu's own would", _HL, "kombu 5.3",
             "getattr default None: the sweep restores everything lapsed at once"),
    Internal("kombu.transport.redis.Channel", "conn_or_acquire", _CAL, _CLS,
             "a Redis client for the lease renewal pipeline", _HL, "kombu 5.3",
             "redis_channel() says None: held Redis messages get no lease"),
    Internal("kombu.message.Message", "_state", _PAT, _INS,
             "REJECTED: nothing may acknowledge a forgotten delivery later (Message.acknowledged reads it)", _HL,
             "kombu 5.3", "Celery may ack a message that went back to its queue, deleting another worker's "
             "delivery from Redis's unacked hash"),
    # ---------------------------------------------------------------- kazoo: the client
    Internal("kazoo.client.KazooClient", "_session_id", _REA, _INS,
             "the session a node belongs to, kept across SUSPENDED (client_id reads None then)", _KC, "kazoo 2.9",
             "AttributeError: locks cannot tell their session"),
    Internal("kazoo.client.KazooClient", "_session_timeout", _REA, _INS,
             "the session timeout asked for, until the negotiated one is known", _KC, "kazoo 2.9",
             "AttributeError: leases and the beat's proof cannot be sized"),
    Internal("kazoo.client.KazooClient", "_pending", _REA, _INS,
             "the oldest unanswered request (ZooKeeper answers in order): how long the server has been silent",
             _KC, "kazoo 2.9", "getattr default: a silent partition is seen only by kazoo's own ping"),
    Internal("kazoo.client.KazooClient", "_connection", _REA, _INS,
             "its ConnectionHandler: whether its loop has stopped, its socket", _KC, "kazoo 2.9",
             "AttributeError in closed_for_good; drop_connection does nothing"),
    Internal("kazoo.client.KazooClient", "_stopped", _REA, _INS, "set once the client is stopped (or never started)",
             _KC, "kazoo 2.9", "AttributeError: a lock cannot tell a stopped client"),
    Internal("kazoo.client.KazooClient", "_state", _REA, _INS,
             "AUTH_FAILED / CLOSED: a client that stopped connecting for good needs replacing", _KC, "kazoo 2.9",
             "AttributeError: a lock could wait for good on a client that never reconnects"),
    Internal("kazoo.client.KazooClient", "_call", _CAL, _CLS,
             "send a request kazoo has no call for (createContainer, a multi of creates with stats, a check) "
             "through kazoo's own queue", _KC, "kazoo 2.9", "no lock can be taken"),
    Internal("kazoo.protocol.connection.ConnectionHandler", "_connect", _PAT, _CLS,
             "wrapped: the negotiated session timeout comes back from its read_timeout (negotiated * 2 / 3)", _KC,
             "kazoo 2.9", "AttributeError at import; if its return changes, leases are sized on a wrong session "
             "timeout"),
    Internal("kazoo.protocol.connection.ConnectionHandler", "_socket", _REA, _INS,
             "shut down to make kazoo see a silent connection broken now", _KC, "kazoo 2.9",
             "getattr default: a silent partition is seen only by kazoo's own ping"),
    Internal("kazoo.protocol.connection.ConnectionHandler", "connection_stopped", _REA, _INS,
             "set once its connection loop has ended", _KC, "kazoo 2.9",
             "AttributeError in closed_for_good"),
    Internal(_SER, "Create2", _CAL, _MOD, "createContainer is Create2 with opcode 19, sent alone or in a multi", _KC,
             "kazoo 2.9", "ImportError: no lock can be taken"),
    Internal(_SER, "Transaction", _CAL, _MOD, "a multi, sent as kazoo sends it", _KC, "kazoo 2.9",
             "ImportError: no lock can be taken"),
    Internal(f"{_SER}.Create2", "type", _OVR, _CLS,
             "CreateContainer is Create2 with type 19 (the opcode kazoo's _submit writes in the header)", _KC,
             "kazoo 2.9", "containers are created as plain nodes: keys' parents are never reaped"),
    Internal(f"{_SER}.Transaction", "deserialize", _OVR, _CLS,
             "MultiCreate reads a create's reply with its stat, the fencing token (kazoo's Transaction.unchroot "
             "then leaves those tuples alone: we unchroot them)", _KC, "kazoo 2.9",
             "multi replies misread: no token, no lock"),
    Internal(_SER, "CheckVersion", _CAL, _MOD, "a multi of one check proves a node alive without a watch firing", _KC,
             "kazoo 2.9", "ImportError: no lock can be taken"),
    Internal(_SER, "MultiHeader", _CAL, _MOD, "each op's header in a multi reply", _KC, "kazoo 2.9",
             "ImportError: no lock can be taken"),
    Internal(_SER, "int_struct", _REA, _MOD, "an op's error code in a multi reply", _KC, "kazoo 2.9",
             "ImportError: no lock can be taken"),
    Internal(_SER, "stat_struct", _REA, _MOD, "a create's stat in a multi reply", _KC, "kazoo 2.9",
             "ImportError: no lock can be taken"),
    Internal(_SER, "read_string", _CAL, _MOD, "a create's path in a multi reply", _KC, "kazoo 2.9",
             "ImportError: no lock can be taken"),
    Internal("kazoo.protocol.states.ZnodeStat", "_make", _CAL, _CLS, "a stat from the struct's fields (namedtuple)",
             _KC, "kazoo 2.9", "multi replies misread: tokens lost"),
    Internal("kazoo.exceptions", "EXCEPTIONS", _REA, _MOD, "an error code of a multi reply to kazoo's exception", _KC,
             "kazoo 2.9", "ImportError: no lock can be taken"),
    Internal("kazoo.exceptions", "SessionClosedRequireSaslError", _REA, _MOD,
             "name the server's 'SASL required' reply in a worker's start error", ("security",), "kazoo 2.11",
             "getattr default None: the error says the server *may* require SASL"),
    # ---------------------------------------------------------------- kazoo: the handler (the agent's event loop)
    Internal("kazoo.handlers.threading.SequentialThreadingHandler", "callback_queue", _PAT, _INS,
             "replaced: watch callbacks (dispatch_callback puts them there) run on the agent's event thread", _EC,
             "kazoo 2.9", "the agent's watches run on kazoo's thread, racing its event thread"),
    Internal("kazoo.handlers.threading.SequentialThreadingHandler", "completion_queue", _PAT, _INS,
             "replaced: completions (AsyncResult._do_callbacks puts them there) run on the agent's event thread",
             _EC, "kazoo 2.9", "the agent's replies run on kazoo's thread, racing its event thread"),
    Internal("kazoo.handlers.threading.SequentialThreadingHandler", "_running", _PAT, _INS,
             "EventLoopHandler starts and stops without kazoo's two callback threads", _EC, "kazoo 2.9",
             "kazoo's running property reads it: the handler seems never started, and the guard against a "
             "blocking wait on the event thread is off"),
    Internal("kazoo.handlers.threading.SequentialThreadingHandler", "_state_change", _REA, _INS,
             "the lock kazoo's own start and stop take", _EC, "kazoo 2.9",
             "AttributeError: the lock agent cannot start"),
    Internal("kazoo.handlers.utils.AsyncResult", "_handler", _REA, _INS,
             "refuse a blocking wait on the agent's event thread (it would wait for itself)", _EC, "kazoo 2.9",
             "AttributeError in every get() of the agent's results"),
)
