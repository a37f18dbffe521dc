"""The internals of Celery, kombu, billiard and kazoo we touch are still there, and all listed.

1. Every entry of :data:`celery_zklock.internals_used.INTERNALS` exists in the installed
   libraries (one test per entry, named ``owner.name``): a release that drops or renames one
   fails here by name, not somewhere deep in a worker.
2. What we rely on beyond existence (a global looked up at each call, a signature, a tuple's
   shape) has a test of its own below.
3. The package is scanned: an underscore attribute of another object, an underscore name in
   ``getattr``/``hasattr``/``setattr``, a private name a subclass of theirs reads or overrides,
   and an attribute written on their objects must each be in the table, or in the short
   lists here of what is our own (with the reason).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import re
import types

import pytest

import celery_zklock
from celery_zklock.internals_used import CHECKED_ON, INTERNALS, Internal, Kind, On
from tests.versions import installed

#: The package as imported: the checkout's, or the installed wheel's in a ``make matrix`` cell
#: (whose tree has no celery_zklock/ of its own).
PACKAGE = pathlib.Path(celery_zklock.__file__).resolve().parent
FOREIGN = ("celery", "kombu", "billiard", "kazoo")


def _resolve(path: str):
    """The module or class at dotted ``path``."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(path)


def _app():
    from celery import Celery

    return Celery("internals-used", set_as_current=False)


def _probe(x):
    return x


def _function_task():
    app = _app()
    app.task(name="internals_used.probe", shared=False)(_probe)
    app.finalize()
    return app.tasks["internals_used.probe"]


def _kazoo_client():
    from kazoo.client import KazooClient

    return KazooClient()  # not started: no connection, no thread


def _threading_handler():
    from kazoo.handlers.threading import SequentialThreadingHandler

    return SequentialThreadingHandler()  # not started: no thread


#: Cheap instances of the owners of ``On.INSTANCE`` entries (nothing started or connected).
FACTORIES = {
    "kombu.common.QoS": lambda: _resolve("kombu.common.QoS")(lambda **kw: None, 1),
    "kombu.asynchronous.semaphore.LaxBoundedSemaphore":
        lambda: _resolve("kombu.asynchronous.semaphore.LaxBoundedSemaphore")(1),
    "kombu.message.Message": lambda: _resolve("kombu.message.Message")(body=b""),
    "kazoo.client.KazooClient": _kazoo_client,
    "kazoo.protocol.connection.ConnectionHandler": lambda: _kazoo_client()._connection,
    "kazoo.handlers.threading.SequentialThreadingHandler": _threading_handler,
    "kazoo.handlers.utils.AsyncResult": lambda: _threading_handler().async_result(),
    "celery.beat.Scheduler": lambda: _resolve("celery.beat.Scheduler")(_app(), lazy=True),
    "celery.bootsteps.Blueprint": lambda: _resolve("celery.bootsteps.Blueprint")(on_close=None),
    "celery.concurrency.base.BasePool": lambda: _resolve("celery.concurrency.base.BasePool")(limit=2),
    "celery.app.base.Celery": _app,
    "celery.app.task.Task": _function_task,  # __header__ is put on the class app.task makes
    "celery.utils.collections.ConfigurationView": lambda: _app().conf,
    "celery.utils.collections.ChainMap": lambda: _app().conf,
    "celery.schedules.BaseSchedule": lambda: _resolve("celery.schedules.crontab")(),
}

#: Owners too dear to construct here: their class's source must assign the attribute
#: (``self.<name> = ...``), in ``__init__`` or the method that makes it.
BY_SOURCE = {
    "celery.worker.consumer.Consumer": "needs a worker (its pool, timer, hub) and an app's broker connection",
    "celery.concurrency.prefork.TaskPool": "_pool is made by on_start, which forks the pool processes",
    "celery.concurrency.asynpool.AsynPool": "its __init__ forks the pool processes",
    "billiard.pool.Pool": "its __init__ forks the pool processes",
    "celery.worker.worker.WorkController": "its setup_defaults runs inside a worker's start (app, pool, loglevel)",
}


def _too_old(entry: Internal) -> str | None:
    dist, floor = entry.since.split()
    want = tuple(int(n) for n in floor.split("."))
    have = installed(dist)
    return f"{dist} {'.'.join(map(str, have))} predates {entry.since}" if have[: len(want)] < want else None


@pytest.mark.parametrize("entry", INTERNALS, ids=[e.label for e in INTERNALS])
def test_each_internal_still_exists(entry: Internal):
    if (why := _too_old(entry)) is not None:
        pytest.skip(why)
    owner = _resolve(entry.owner)
    if entry.on is On.MODULE:
        assert isinstance(owner, types.ModuleType), f"{entry.owner} is not a module"
        assert hasattr(owner, entry.name), f"{entry.label} is gone: {entry.breaks}"
    elif entry.on is On.CLASS:
        assert isinstance(owner, type), f"{entry.owner} is not a class"
        try:
            inspect.getattr_static(owner, entry.name)
        except AttributeError:
            pytest.fail(f"{entry.label} is gone: {entry.breaks}")
    elif entry.owner in FACTORIES:
        obj = FACTORIES[entry.owner]()
        assert isinstance(obj, owner), (entry.owner, type(obj))
        assert hasattr(obj, entry.name), f"{entry.label} is gone: {entry.breaks}"
    else:
        assert entry.owner in BY_SOURCE, f"{entry.owner}: add a factory to FACTORIES or a reason to BY_SOURCE"
        source = inspect.getsource(owner)
        assert re.search(rf"\bself\.{re.escape(entry.name)}\s*=", source), f"{entry.label} is gone: {entry.breaks}"


def test_the_table_is_well_formed():
    labels = [e.label for e in INTERNALS]
    assert len(labels) == len(set(labels)), "an internal listed twice"
    for e in INTERNALS:
        assert e.owner.split(".")[0] in FOREIGN, e.label
        dist, floor = e.since.split()
        assert dist == e.owner.split(".")[0] and re.fullmatch(r"\d+\.\d+", floor), (e.label, e.since)
        assert isinstance(e.kind, Kind) and isinstance(e.on, On), e.label
        assert e.why and e.breaks and "\n" not in e.why, e.label
        assert e.used_in, e.label
    assert set(CHECKED_ON) == set(FOREIGN)


def _source(module: str) -> str:
    path = PACKAGE.joinpath(*module.split("."))
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def test_the_table_names_only_what_the_code_uses():
    """No stale entry: each name appears in every module said to use it."""
    stale = [(e.label, m) for e in INTERNALS for m in e.used_in
             if not re.search(rf"(?<![\w]){re.escape(e.name)}(?![\w])", _source(m))]
    assert stale == []


# ------------------------------------------------------------------ what we rely on beyond existence
def _code_objects(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def test_the_tracer_looks_up_send_prerun_at_each_call():
    """decision.install_prerun replaces the module global: the tracer must read it as a global at each
    call (a local or closure bound at build time would keep Celery's)."""
    from celery.app import trace

    assert any("send_prerun" in code.co_names for code in _code_objects(trace.build_tracer.__code__))


def test_the_consumer_strategy_reads_on_task_request_when_built():
    """WaitOutsidePool replaces it in its __init__, before the consumer's start builds the
    strategies, which bind it."""
    from celery.worker import strategy

    assert "consumer.on_task_request" in inspect.getsource(strategy.default)


def test_beat_ticks_through_reserve_and_apply_entry():
    """ZkScheduler replaces the wrapped scheduler's reserve and apply_entry on the instance:
    Scheduler.tick must call them through self, and keep its heap in _heap."""
    from celery.beat import Scheduler

    assert {"reserve", "apply_entry", "_heap", "_when"} <= set(Scheduler.tick.__code__.co_names)
    assert "advance" in inspect.signature(Scheduler.apply_async).parameters


def test_the_semaphore_queues_a_request_as_its_first_argument():
    """next_in_line.run_next finds a request in the semaphore as (callback, (request,), {})."""
    from celery.worker.worker import WorkController
    from kombu.asynchronous.semaphore import LaxBoundedSemaphore

    semaphore = LaxBoundedSemaphore(1)
    semaphore.acquire(lambda: None)
    semaphore.acquire(print, "request")
    assert semaphore._waiting[-1] == (print, ("request",), {})
    assert "self._quick_acquire(self._process_task, req)" in inspect.getsource(WorkController._process_task_sem)


def test_asynloop_sends_the_window_when_prev_differs():
    from celery.worker import loops

    assert "qos.prev != qos.value" in inspect.getsource(loops.asynloop)


def test_a_request_sends_its_delivery_info_to_the_pool():
    """The grant carried to a pool process rides in Request.delivery_info: it must be the dict
    inside request_dict, which execute_using_pool sends."""
    from celery.contrib.testing.mocks import TaskMessage
    from celery.worker.request import Request

    task = _function_task()
    req = Request(TaskMessage(task.name, id="1", args=(1,)), app=task.app, task=task)
    assert req.request_dict["delivery_info"] is req.delivery_info
    assert req._apply_result is None and req.acknowledged is False
    assert list(inspect.signature(Request._announce_revoked).parameters) == [
        "self", "reason", "terminated", "signum", "expired"]


def test_the_app_registry_is_its_tasks():
    app = _app()
    app.finalize()
    assert app._tasks is app.tasks


def test_a_function_task_checks_its_arguments():
    task = _function_task()
    with pytest.raises(TypeError):
        task.__header__(1, 2)


def test_a_rejected_message_counts_as_acknowledged():
    from kombu.message import Message

    message = Message(body=b"")
    message._state = "REJECTED"
    assert message.acknowledged


def test_the_redis_sweep_takes_start_num_interval():
    from kombu.transport.redis import QoS

    assert {"start", "num", "interval"} <= set(inspect.signature(QoS.restore_visible).parameters)


def test_a_schedule_reads_its_clock_through_nowfun():
    from celery.schedules import crontab

    schedule = crontab()
    schedule.nowfun = lambda: "now"
    assert schedule.now() == "now"


def test_kazoo_connect_returns_two_thirds_of_the_negotiated_timeout():
    """kazoo_compat recovers the negotiated session timeout from _connect's read_timeout."""
    from kazoo.protocol.connection import ConnectionHandler

    original = ConnectionHandler._connect
    if getattr(original, "_zklock_records", False):  # kazoo_compat's wrapper, installed at its import
        original = inspect.getclosurevars(original).nonlocals["original"]
    assert list(inspect.signature(original).parameters) == ["self", "host", "hostip", "port"]
    source = inspect.getsource(original)
    assert "negotiated_session_timeout * 2.0 / 3.0" in source and "return read_timeout, connect_timeout" in source


def test_kazoo_sends_a_requests_type_and_reads_its_reply_with_its_deserialize():
    """CreateContainer is sent by its type alone; MultiCreate's replies are read by its own
    deserialize, then passed through Transaction.unchroot, which must leave tuples alone."""
    from kazoo.protocol.connection import ConnectionHandler
    from kazoo.protocol.serialization import Transaction

    assert "int_struct.pack(request.type)" in inspect.getsource(ConnectionHandler._submit)
    assert "request.deserialize(buffer, offset)" in inspect.getsource(ConnectionHandler._read_response)
    assert Transaction.unchroot(None, [("/a", None)]) == [("/a", None)]


def test_kazoo_dispatches_callbacks_through_the_handler_queues():
    """EventLoopHandler replaces both queues: kazoo must put every callback there."""
    from kazoo.handlers.threading import SequentialThreadingHandler
    from kazoo.handlers.utils import AsyncResult

    assert "self.callback_queue.put" in inspect.getsource(SequentialThreadingHandler.dispatch_callback)
    assert "self._handler.completion_queue.put" in inspect.getsource(AsyncResult._do_callbacks)


# ------------------------------------------------------------------ the scan of the package
#: Python's own dunders (and a module's): never a library's internal.
STANDARD_DUNDERS = set(dir(type)) | set(dir(object)) | set(dir(types.FunctionType)) | {
    "__dict__", "__qualname__", "__module__", "__doc__", "__func__", "__wrapped__", "__name__", "__weakref__"}

#: Our own marks on their objects: names we add (``app._zklock_settings``, ``req.zklock_seq``...).
OUR_PREFIXES = ("_zklock", "_zk_", "zklock_")

#: Underscore names of our own, used on another object of ours: (module, name) -> what it is.
OURS = {
    ("held", "_lock"): "HeldLock's lock, read by held.holding_of beside it (users see HeldLock)",
}

#: Underscore names of other libraries than the four (internals_used's docstring lists them).
OTHER_LIBRARIES = {
    ("engine.owner", "_local"): "CPython's _thread._local",
    ("contrib.pytest_celery.api", "_container"): "pytest-docker-tools' Container._container (the docker-py container)",
    ("contrib.pytest_celery.api", "_set_nodes"): "pytest-celery's CeleryTestCluster._set_nodes, overridden to make "
                                                 "ZooKeeper nodes",
}

#: Attributes written on objects that are ours (the patch scan): (module, receiver) -> what it is.
OWN_RECEIVERS = {
    ("engine.kazoo_compat", "_connect"): "our wrapper of kazoo's _connect",
    ("engine.owner", "_per_thread"): "our thread-local",
    ("engine.rwlock", "self.write"): "the WriteLock", ("task", "run_state"): "held.RunState",
    ("worker.agent", "handler"): "our EventLoopHandler",
    ("worker.agent", "events"): "the agent's EventQueue",
    ("worker.agent_requests", "wait"): "the agent's WaitRequest", ("worker.agent_requests", "cohort"): "a Cohort",
    ("worker.cohort", "wait"): "the cohort's Waiter", ("worker.cohort", "slot"): "the cohort's Slot",
    ("by_config", "locked"): "the locked task class by_config made",
    ("security", "context"): "an ssl.SSLContext (the standard library's documented API)",
    ("testing_probes", "context"): "an ssl.SSLContext (the standard library's documented API)",
}

#: Attributes written on their objects through documented API: (module, receiver, name) -> why.
DOCUMENTED_WRITES = {
    ("beat.scheduler", "entry", "last_run_at"): "ScheduleEntry's documented fields",
    ("beat.scheduler", "entry", "total_run_count"): "ScheduleEntry's documented fields",
    ("beat.scheduler", "entry", "options"): "ScheduleEntry's documented fields",
    ("beat.scheduler", "self.inner", "schedule"): "Scheduler.schedule, a documented property",
    ("worker.worker_hooks", "app.conf", "worker_send_task_events"): "a documented setting",
    ("contrib.pytest_celery.worker_app", "app.conf", "zklock_hosts"): "our own setting",
}

#: ``"module:Name"`` paths of theirs that are documented: (module, path) -> where.
DOCUMENTED_PATHS = {
    ("config", "celery.beat:PersistentScheduler"): "beat's default scheduler, named so in Celery's beat docs",
}


def _private(name: str) -> bool:
    return name.startswith("_") and name not in STANDARD_DUNDERS and not name.startswith(OUR_PREFIXES)


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def private_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of each underscore attribute of another object than self/cls, each
    underscore name given as a string to getattr/hasattr/setattr/delattr, and each underscore
    name imported from Celery, kombu, billiard or kazoo."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _is_self(node.value):
            found.append((node.lineno, node.attr))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and not _is_self(node.args[0])):
            found.append((node.lineno, node.args[1].value))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FOREIGN and not node.level:
            found.extend((node.lineno, a.name) for a in node.names if _private(a.name))
    return sorted(found)


def symbol_paths(source: str) -> list[tuple[int, str, str]]:
    """(line, module, name) of each ``"celery.x.y:Name"`` string: a bootstep's ``requires``,
    anything Celery imports by path for us."""
    pattern = re.compile(rf"({'|'.join(FOREIGN)})(\.\w+)*:\w+")
    return sorted((node.lineno, *node.value.split(":")) for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.fullmatch(node.value))


def patches(source: str) -> list[tuple[int, str, str]]:
    """(line, receiver, name) of each attribute written on another object than self/cls (an
    assignment, or setattr with a literal name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) and not _is_self(sub.value):
                    found.append((node.lineno, ast.unparse(sub.value), sub.attr))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and not _is_self(node.args[0])):
            found.append((node.lineno, ast.unparse(node.args[0]), node.args[1].value))
    return sorted(found)


def test_the_scans_themselves():
    code = ("import x\nfrom kazoo.client import _hidden\nclient._session_id\nself._mine\ncls._ours\n"
            "getattr(pool, '_processes', None)\ngetattr(self, '_x')\nt.__dict__\napp._zklock_settings\n"
            "task.__header__\n")
    assert private_uses(code) == [(2, "_hidden"), (3, "_session_id"), (6, "_processes"), (10, "__header__")]
    assert symbol_paths("requires = ('celery.worker.consumer.tasks:Tasks', 'celery_zklock.x:Y', 'a:b')\n") == [
        (1, "celery.worker.consumer.tasks", "Tasks")]
    code = "trace.send_prerun = f\nself.x = 1\nc.on_close = c.blueprint.on_close = g\nsetattr(q, 'prev', None)\n"
    assert patches(code) == [(1, "trace", "send_prerun"), (3, "c", "on_close"), (3, "c.blueprint", "on_close"),
                             (4, "q", "prev")]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts) or "__init__"] = path
    return out


def _listed(module: str, name: str) -> bool:
    return any(e.name == name and module in e.used_in for e in INTERNALS)


def test_every_private_use_is_listed():
    unlisted = [f"{module}:{line} {name}" for module, path in _modules().items()
                for line, name in private_uses(path.read_text())
                if not _listed(module, name) and (module, name) not in {**OURS, **OTHER_LIBRARIES}]
    assert unlisted == [], "add each to celery_zklock/internals_used.py (or, if it is ours, to OURS here)"


def test_every_path_to_their_objects_is_listed():
    unlisted = [f"{module}:{line} {owner}:{name}" for module, path in _modules().items()
                for line, owner, name in symbol_paths(path.read_text())
                if not any(e.owner == owner and e.name == name and module in e.used_in for e in INTERNALS)
                and (module, f"{owner}:{name}") not in DOCUMENTED_PATHS]
    assert unlisted == [], "add each to celery_zklock/internals_used.py"


def test_our_own_lists_name_only_what_the_code_does():
    """No stale entry in OURS or OWN_RECEIVERS: a stale one would let a new use through unasked."""
    uses = {(module, name) for module, path in _modules().items() for _, name in private_uses(path.read_text())}
    writes = {(module, receiver) for module, path in _modules().items()
              for _, receiver, _ in patches(path.read_text())}
    assert [k for k in OURS if k not in uses] == []
    assert [k for k in OWN_RECEIVERS if k not in writes] == []


def test_every_attribute_written_on_another_object_is_listed():
    unlisted = [f"{module}:{line} {receiver}.{name}" for module, path in _modules().items()
                for line, receiver, name in patches(path.read_text())
                if not (_listed(module, name) or name.startswith(OUR_PREFIXES) or name in STANDARD_DUNDERS
                        or (module, receiver) in OWN_RECEIVERS or (module, receiver, name) in DOCUMENTED_WRITES)]
    assert unlisted == [], "a patch of Celery/kombu/billiard/kazoo goes in celery_zklock/internals_used.py"


def _foreign_bases(cls: type) -> list[type]:
    return [k for k in cls.__mro__ if (k.__module__ or "").split(".")[0] in FOREIGN]


def _theirs(bases: list[type], name: str) -> bool:
    """Do Celery's (or kazoo's...) classes define or use ``name`` on their instances?"""
    for base in bases:
        if name in vars(base):
            return True
        try:
            source = inspect.getsource(base)
        except (OSError, TypeError):
            continue
        if re.search(rf"\bself\.{re.escape(name)}\b", source):
            return True
    return False


def test_our_subclasses_of_theirs_touch_only_listed_internals():
    """In a class of ours built on one of theirs, ``self._x`` may be their private state and a
    ``def _x`` may override their private method: each such name the library also has must be
    listed (a release that adds a private name one of our subclasses already uses fails here
    too).  So must a public attribute of theirs we assign on self."""
    unlisted = []
    for module, path in _modules().items():
        if module.startswith("contrib"):
            continue  # the pytest-celery vendor: builds on pytest-celery only
        tree = ast.parse(path.read_text())
        imported = None
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            imported = imported or importlib.import_module(f"celery_zklock.{module}" if module != "__init__" else
                                                           "celery_zklock")
            bases = _foreign_bases(getattr(imported, node.name))
            if not bases:
                continue
            names = {(n.attr, isinstance(n.ctx, ast.Store)) for n in ast.walk(node)
                     if isinstance(n, ast.Attribute) and _is_self(n.value)}
            names |= {(n.name, False) for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for name, stored in sorted(names):
                if not (_private(name) or (stored and not name.startswith("__"))):
                    continue
                if _theirs(bases, name) and not _listed(module, name):
                    unlisted.append(f"{module}:{node.name}.{name}")
    assert unlisted == [], "add each to celery_zklock/internals_used.py"
