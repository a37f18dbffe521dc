"""Settings: the ``zklock_*`` keys of ``app.conf``, their defaults and their validation.

Why a module: every setting is declared once here, as a typed field of :class:`ZkSettings`
with its default, checker and help, so the README table, the worker-start validation, the
error messages and what a type checker reads cannot drift apart.
Settings are read with ``app.conf.get`` (Celery's lowercase convention) and a task may
override the per-task ones through ``task_annotations`` or decorator options.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .errors import ConfigurationError
from .security import censored, check_acl, check_sasl_options, check_use_ssl

TIMEOUT_POLICIES = ("retry", "skip", "fail")
LOST_POLICIES = ("fail", "interrupt")
UNAVAILABLE_POLICIES = ("retry", "fail")
WAIT_PLACES = ("worker", "pool")
ENQUEUE_MODES = ("dedupe", "reject")
ENQUEUE_UNTIL = ("start", "finish")
ENQUEUE_UNRUN = ("report", "republish")
#: How a task takes its keys: "write" (alone: today's mutex) or "read" (shared with readers).
LOCK_MODES = ("write", "read")
#: Which of Curator's recipes a task's exclusive nodes are named for (zklock_curator_interop).
CURATOR_RECIPES = ("mutex", "read-write")

_HOST_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+)(:\d{1,5})?$")


def _hosts(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError("must be a non-empty string like '127.0.0.1:2181' or 'zk1:2181,zk2:2181/chroot'")
    servers, _, chroot = value.partition("/")
    for hp in servers.split(","):
        hp = hp.strip()
        if not _HOST_RE.match(hp):
            raise ValueError(f"{hp!r} is not host[:port]; expected e.g. 'zk1:2181,zk2:2181'")
        if ":" in hp and not hp.endswith("]"):
            port = int(hp.rsplit(":", 1)[1])
            if not 0 < port < 65536:
                raise ValueError(f"port {port} out of range in {hp!r}")
    if chroot:
        from .engine.znodes import validate_path

        validate_path("/" + chroot)
    return value


def _root(value: Any) -> str:
    from .engine.znodes import validate_path

    return validate_path(value)


def _positive(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError("must be a number of seconds > 0")
    return float(value)


def _wait(value: Any) -> float | None:
    """A lock wait: seconds >= 0, or ``math.inf`` for no limit (the one documented spelling: a
    task option's None means "the setting applies").  No limit is None from here on; the
    setting also takes None for it, as it always did."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError("must be a number of seconds >= 0, or math.inf for no limit")
    return None if value == math.inf else float(value)


def _non_negative(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError("must be a number >= 0")
    return float(value)


def _int_or_none(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("must be an int >= 0, or None for the task's max_retries")
    return value


def _slots_or_none(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError("must be an int >= 0 (0 = never), or None for half the pool")
    return value


def _handoffs(value: Any) -> int:
    from .engine.znodes import MAX_GRANTS_PER_NODE

    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GRANTS_PER_NODE:
        raise ValueError(f"must be an int from 1 (no local handoff while others wait) to {MAX_GRANTS_PER_NODE}")
    return value


def _tasks(value: Any) -> tuple[tuple[str, dict[str, Any]], ...]:
    """{task name or fnmatch glob: {lock option: value}}; normal form: a tuple of pairs
    (the options themselves are checked at worker start, against the tasks they lock)."""
    if not value:
        return ()
    if isinstance(value, (list, tuple)):
        value = dict(value)
    if not isinstance(value, dict):
        raise ValueError("must be a dict like {'proj.billing.tasks.sync_account': {'lock_key': 'acct:{account_id}'}}")
    for pattern, options in value.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"{pattern!r} is not a task name or pattern")
        if not isinstance(options, dict):
            raise ValueError(f"the options of {pattern!r} must be a dict of lock options, got {options!r}")
    return tuple((pattern, dict(options)) for pattern, options in value.items())


def _metrics_port(value: Any) -> int | str | None:
    if value is None:
        return None
    if isinstance(value, str) and ":" in value:
        host, _, port = value.rpartition(":")
        if host and port.isdigit() and 0 < int(port) < 65536:
            return value
    elif isinstance(value, int) and not isinstance(value, bool) and 0 < value < 65536:
        return value
    raise ValueError("must be None, a port (9808) or 'host:port' ('0.0.0.0:9808')")


def _scheduler(value: Any) -> str | type:
    """A scheduler class or its ``module:Class`` name (imported when beat starts)."""
    if isinstance(value, type) or (isinstance(value, str) and value.strip()):
        return value
    raise ValueError("must be a celery.beat.Scheduler subclass or its name, e.g. 'celery.beat:PersistentScheduler'")


def _name(value: Any) -> str:
    if isinstance(value, str) and value.strip():
        return value
    raise ValueError("must be a non-empty string")


def check_lock_mode(value: Any) -> str | dict[Any, str]:
    """``lock_mode``: "write" or "read" for every key, or ``{lock_key template: mode}`` (the
    templates not named write)."""
    if isinstance(value, dict):
        if not value:
            raise ValueError("is an empty dict: name at least one lock_key template, or give 'read' or 'write'")
        for template, mode in value.items():
            if not (isinstance(template, str) or callable(template)):
                raise ValueError(f"keys must be lock_key templates (or callables), got {template!r}")
            if mode not in LOCK_MODES:
                raise ValueError(f"{template!r}: must be one of {', '.join(map(repr, LOCK_MODES))}, got {mode!r}")
        return value
    if value not in LOCK_MODES:
        raise ValueError(f"must be one of {', '.join(map(repr, LOCK_MODES))}, or a dict {{lock_key template: mode}}")
    return value


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options:
            raise ValueError(f"must be one of {', '.join(map(repr, options))}")
        return value

    return check


def _enqueue_mode(value: Any) -> str | None:
    if value is None or value is False:
        return None
    if value not in ENQUEUE_MODES:
        raise ValueError(f"must be None (no enqueue-time check), {', '.join(map(repr, ENQUEUE_MODES))}")
    return value


def _auth(value: Any) -> tuple[tuple[str, str], ...] | None:
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise ValueError("must be None or a list of (scheme, credential) pairs, e.g. [('digest', 'user:password')]")
    pairs = []
    for item in value:
        if (not isinstance(item, (list, tuple)) or len(item) != 2
                or not all(isinstance(x, str) and x for x in item)):
            raise ValueError("each item is not a (scheme, credential) pair of non-empty strings, e.g. ('digest', 'user:password')")
        pairs.append((item[0], item[1]))
    return tuple(pairs)


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("must be True or False")
    return value


_T = TypeVar("_T")


@dataclass(frozen=True)
class Setting:
    """One ``zklock_*`` setting as :data:`SETTINGS` lists it: its name, default, checker and
    help, read from the metadata of its :class:`ZkSettings` field (the one declaration).

    ``option`` names the task option that overrides it per task (``lock_timeout=``), if any.
    """

    name: str
    default: Any
    check: Callable[[Any], Any]
    help: str
    option: str | None = None
    wire: bool = True  # sent to the worker's helper processes (the lock agent, the reaper)

    @property
    def field(self) -> str:
        """Its attribute on :class:`ZkSettings` (``zklock_timeout`` -> ``timeout``)."""
        return self.name.removeprefix("zklock_")


_SPEC = "zklock_setting"  # the metadata key of a ZkSettings field: the Setting's other fields


def setting(default: Any, check: Callable[[Any], _T], help: str, option: str | None = None,
            wire: bool = True) -> _T:
    """A :class:`ZkSettings` field: its value is ``check(default)`` unless set, its type the
    one ``check`` returns (mypy holds the field's annotation to it, tests/test_config_errors.py
    to equality), and its metadata the rest of its :class:`Setting`."""
    spec = {"default": default, "check": check, "help": help, "option": option, "wire": wire}
    return dataclasses.field(default=check(default), metadata={_SPEC: spec})


@dataclass(frozen=True, repr=False)
class ZkSettings:
    """The validated ``zklock_*`` settings of an app (with a task's overrides applied): one
    field per setting (``settings.timeout`` for ``zklock_timeout``), each declared once here
    with its default, checker and help; :data:`SETTINGS` and the README table follow it."""

    hosts: str = setting("127.0.0.1:2181", _hosts, "ZooKeeper connect string (kazoo/ZooKeeper syntax, optional /chroot).")
    root: str = setting("/celery-zklock", _root, "Znode under which lock keys live.")
    session_timeout: float = setting(10.0, _positive, "ZooKeeper session timeout (s): bound on how long a dead worker's lock survives.")
    connect_timeout: float = setting(10.0, _positive, "How long a worker process waits for ZooKeeper before the task follows zklock_on_unavailable.")
    timeout: float | None = setting(60.0, _wait, "Default seconds a task waits in the lock queue (0 = try once, math.inf = no limit).", "lock_timeout")
    on_timeout: str = setting("retry", _choice(TIMEOUT_POLICIES), "Default policy when the lock is not had in time.", "on_lock_timeout")
    on_lost: str = setting("fail", _choice(LOST_POLICIES), "Default policy when a held lock is lost mid-run.", "on_lock_lost")
    on_unavailable: str = setting("retry", _choice(UNAVAILABLE_POLICIES), "What a task does when ZooKeeper is unreachable (it never runs unprotected).", "on_lock_unavailable")
    retry_countdown: float = setting(1.0, _non_negative, "First retry delay (s) for the retry policy.", "lock_retry_countdown")
    retry_backoff: float = setting(2.0, _non_negative, "Multiplier applied to the countdown on each further retry (1 = constant).", "lock_retry_backoff")
    retry_backoff_max: float = setting(60.0, _non_negative, "Cap on the retry countdown (s).", "lock_retry_backoff_max")
    max_retries: int | None = setting(None, _int_or_none, "Max lock retries (None = the task's max_retries).", "lock_max_retries")
    lock_mode: str | dict[Any, str] = setting("write", check_lock_mode, "How a task takes its keys: 'write' (alone, the mutex), 'read' (shared with readers, exclusive of writers), or per key {lock_key template: mode} (the rest write).", "lock_mode")
    curator_interop: str = setting("mutex", _choice(CURATOR_RECIPES), "Which Curator recipe shares the keys: 'mutex' (InterProcessMutex; writers' nodes are named -lock-) or 'read-write' (InterProcessReadWriteLock; __WRIT__). Each recipe orders only its own names; ours order both.")
    reentrant: bool = setting(True, _bool, "A locked call (direct, apply(), eager) inside a running locked task, on keys that task holds, runs at once under its hold; False = such a call raises LockReentered.", "lock_reentrant")
    release_on_worker_loss: bool = setting(True, _bool, "Waiting in the pool: the worker parent deletes a killed child's lock nodes at once (the agent always does, for waits in the worker).")
    auth_secret: tuple[tuple[str, str], ...] | None = setting(None, _auth, "ZooKeeper credentials for an ACL-protected zklock_root: [('digest', 'user:password')].")
    use_ssl: tuple | None = setting(False, check_use_ssl, "TLS to ZooKeeper: True (system CAs) or a dict of kazoo's TLS options (ca, certfile, keyfile, keyfile_password, verify_certs, check_hostname), like broker_use_ssl.")
    sasl_options: tuple | None = setting(None, check_sasl_options, "SASL authentication (kazoo sasl_options): {'mechanism': 'DIGEST-MD5', 'username': ..., 'password': ...} or GSSAPI.")
    acl: tuple | str | None = setting(None, check_acl, "ACL of every node we create: None = with credentials, our identity all rights and anyone READ (without, open); a list of kazoo ACLs; or a callable path -> list of ACLs.")
    tasks: tuple[tuple[str, dict[str, Any]], ...] = setting({}, _tasks, "Lock tasks without changing their code: {task name or fnmatch glob: {lock option: value}}, applied at worker start.", wire=False)
    metrics_port: int | str | None = setting(None, _metrics_port, "Serve Prometheus metrics of the worker's locks on this port (127.0.0.1) or 'host:port'; needs the [metrics] extra.")
    wait_in: str = setting("worker", _choice(WAIT_PLACES), "Where prefork/solo tasks wait for their lock: 'worker' (the worker's lock agent; no pool slot taken) or 'pool' (inside the pool process).")
    cohort_handoffs: int = setting(32, _handoffs, "Waiting in the worker: while another worker (or a Curator/kazoo peer) queues for a key, how many of this worker's tasks in a row may hold it before it passes on (lock cohorting; the fairness bound).")
    cohort_hold: float = setting(0.5, _positive, "Waiting in the worker: while another contender queues for a key, how long (s) this worker's tasks may keep passing it among themselves before it passes on.")
    enqueue: str | None = setting(None, _enqueue_mode, "Enqueue-time singletons: None (no check at publish), 'dedupe' (a publish while a task of the same key is queued returns that task's AsyncResult and sends nothing) or 'reject' (raises AlreadyQueued).", "lock_enqueue")
    enqueue_until: str = setting("start", _choice(ENQUEUE_UNTIL), "How long a guarded task keeps its key from new publishes: 'start' (while queued; work arriving during a run is queued once) or 'finish' (queued or running: at most one in flight).", "lock_enqueue_until")
    enqueue_unrun: str = setting("republish", _choice(ENQUEUE_UNRUN), "A guarded task that ends unrun (skipped or failed on its lock) after publishes were deduped into it: 'republish' (publish it once more, as a new task with the same arguments and queue, so the deduped work runs) or 'report' (only say so). Both log a WARNING, send the event task-lock-unrun and count zklock_enqueue_unrun_deduped_total.", "lock_enqueue_unrun")
    enqueue_expires: float = setting(3600.0, _positive, "How long after its message's ETA (or publish) a queued enqueue guard is trusted (s): past it, the next publish queues again (a guard whose message the broker lost ends then). Never added to the message as an expires.")
    handoff_slots: int | None = setting(None, _slots_or_none, "Waiting in the worker (prefork): how many pool processes may take a task that is next in line for its lock, so it starts the moment the holder releases; used only for tasks whose next-in-line wait has averaged <= 0.5 s (None = half the pool, rounded down; 0 = only granted tasks reach the pool).")
    beat_scheduler: str | type = setting("celery.beat:PersistentScheduler", _scheduler, "celery beat -S celery_zklock.beat:ZkScheduler: the scheduler it wraps (keeps the schedule, decides what is due), e.g. django_celery_beat.schedulers:DatabaseScheduler.", wire=False)
    beat_group: str = setting("default", _name, "The beats that elect one active scheduler among them: those of one app, sharing one schedule.", wire=False)
    beat_fence: bool = setting(True, _bool, "Worker: run each tick of the elected beat at most once (a tick already run, or older than one run, is acknowledged unrun and counted); False for idempotent tasks, or a task attribute zklock_beat_fence = False. Two ZooKeeper requests per tick.", wire=False)
    beat_metrics_port: int | str | None = setting(None, _metrics_port, "Serve the elected beat's Prometheus metrics (zklock_beat_leader, zklock_beat_ticks_total) on this port (127.0.0.1) or 'host:port'.", wire=False)

    def __repr__(self) -> str:  # never print credentials in logs or errors
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if shown["auth_secret"]:
            shown["auth_secret"] = tuple((scheme, "***") for scheme, _ in shown["auth_secret"])
        for name in ("use_ssl", "sasl_options"):
            shown[name] = censored(shown[name])
        return "ZkSettings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"


#: Every setting by its ``zklock_*`` name, in :class:`ZkSettings`' order (the README table's).
SETTINGS: dict[str, Setting] = {
    f"zklock_{f.name}": Setting(f"zklock_{f.name}", **f.metadata[_SPEC]) for f in dataclasses.fields(ZkSettings)
}

#: Settings a task may override by option (``lock_timeout=``) or ``task_annotations``.
TASK_OPTIONS: dict[str, str] = {s.option: s.name for s in SETTINGS.values() if s.option}


def suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_setting(name: str, value: Any, where: str) -> Any:
    try:
        return SETTINGS[name].check(value)
    except ValueError as exc:
        shown = "the value" if name in _SECRET_SETTINGS else repr(value)  # never echo credentials
        raise ConfigurationError(f"{where}: {shown} is invalid: {exc}. ({SETTINGS[name].help})") from None


#: Settings whose values may hold credentials: never echoed in errors.
_SECRET_SETTINGS = ("zklock_auth_secret", "zklock_sasl_options", "zklock_use_ssl")


def _namespace(conf: Any) -> str | None:
    """The prefix Celery reads settings under (``"CELERY_"`` after
    ``config_from_object("django.conf:settings", namespace="CELERY")``), or None."""
    prefix = vars(conf).get("prefix") if hasattr(conf, "__dict__") else None
    return prefix if isinstance(prefix, str) and prefix else None


def written_name(name: str, prefix: str | None) -> str:
    """How a user writes setting ``name`` under Celery's namespace ``prefix``:
    ``CELERY_ZKLOCK_HOSTS`` for ``zklock_hosts`` under ``CELERY_`` (Celery's own
    ``match_case``: the whole key takes the namespace's case)."""
    if not prefix:
        return name
    key = prefix + name
    return key.upper() if prefix.isupper() else key.lower()


def _suggest_key(key: str, known: list[str]) -> str:
    """A suggestion among ``known`` spellings, case-insensitively (``CELERY_zklock_hosts``
    -> ``CELERY_ZKLOCK_HOSTS``)."""
    by_lower = {k.lower(): k for k in known}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean {by_lower[close[0]]!r}?" if close else ""


def _source_key(conf: Any, name: str, prefix: str | None) -> str:
    """The key, as the user wrote it, that Celery reads setting ``name`` from
    (the namespaced spelling wins where Celery's lookup gives it precedence)."""
    candidates = [written_name(name, prefix), name] if prefix else [name]
    for mapping in getattr(conf, "maps", None) or [conf]:
        for key in candidates:
            try:
                if key in mapping:
                    return key
            except TypeError:
                continue
    return name


def retry_delay(settings: ZkSettings, failures: int) -> float:
    """The retry policy's countdown after ``failures`` earlier tries: ``zklock_retry_countdown``
    times ``zklock_retry_backoff`` per try, capped at ``zklock_retry_backoff_max``."""
    return min(settings.retry_backoff_max, settings.retry_countdown * (settings.retry_backoff ** failures))


def load_settings(conf: Any) -> ZkSettings:
    """Read and validate every ``zklock_*`` setting of ``conf`` (``app.conf``).

    Unknown ``zklock_*`` keys are errors with a suggestion: a typo must not silently fall
    back to a default (e.g. ``zklock_host`` leaving the lock on the wrong ensemble).  The
    same holds under a Celery namespace (``config_from_object(..., namespace="CELERY")``,
    as Django projects do): ``CELERY_ZKLOCK_HOST`` is refused, suggesting
    ``CELERY_ZKLOCK_HOSTS``, and every error names the key as the user wrote it.
    """
    keys = [k for k in list(getattr(conf, "keys", lambda: [])()) if isinstance(k, str)]
    prefix = _namespace(conf)  # read after keys(): that finalizes a pending app.conf
    spaced = f"{prefix}zklock_".lower() if prefix else None
    known = {written_name(name, prefix) for name in SETTINGS} | set(SETTINGS)
    for key in keys:
        lowered = key.lower()
        if key in known:
            continue
        if spaced and lowered.startswith(spaced):
            names = [written_name(name, prefix) for name in SETTINGS]
        elif lowered.startswith("zklock_"):
            names = list(SETTINGS)
        else:
            continue
        raise ConfigurationError(f"unknown setting {key!r}.{_suggest_key(key, names)} Known: {', '.join(names)}")
    values = {}
    for name, s in SETTINGS.items():
        shown = _source_key(conf, name, prefix)
        where = f"setting {name}" if shown == name else f"setting {shown} ({name})"
        values[s.field] = check_setting(name, conf.get(name, s.default), where)
    return ZkSettings(**values)


def to_wire(settings: ZkSettings) -> dict:
    """The settings as JSON for the worker's helper processes (the lock agent, the reaper):
    sent on their stdin, never argv — they may hold credentials."""
    return {s.field: getattr(settings, s.field) for s in SETTINGS.values() if s.wire}


def from_wire(raw: dict) -> ZkSettings:
    """Back from :func:`to_wire`, through the same checks (JSON turned tuples into lists)."""
    return ZkSettings(**{s.field: s.check(raw.get(s.field, s.default)) for s in SETTINGS.values()})


def cached_settings(app: Any) -> ZkSettings:
    """``load_settings(app.conf)`` computed once per app (validated at worker start).

    Call :func:`reset_settings` after changing ``zklock_*`` settings at run time.
    """
    cached = getattr(app, "_zklock_settings", None)
    if cached is None:
        cached = load_settings(app.conf)
        app._zklock_settings = cached
    return cached


def reset_settings(app: Any) -> None:
    app._zklock_settings = None
