"""Shared fixtures.  ZooKeeper fixtures (zk_server, zk_ensemble, zk_client) come from the
celery_zklock.testing pytest plugin, opted into below exactly as a user of the library
does; Redis is a throwaway server on a free port (support.redis_server)."""

import pytest

# Opt-in (the package registers no pytest11 entry point).  pytest accepts
# ``pytest_plugins`` only in a top-level conftest: this file, not tests/faults/conftest.py.
pytest_plugins = ["celery_zklock.testing", "celery_zklock.contrib.pytest_celery"]


@pytest.fixture(scope="session")
def redis_server():
    # Imported here, not at the top: support.redis_server imports celery_zklock.testing, and
    # importing the plugin before pytest registers it above defeats its assert rewriting.
    from support.redis_server import RedisServer

    with RedisServer() as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    import redis

    r = redis.Redis(port=redis_server.port)
    r.flushall()
    yield r
    r.close()



# ---------------------------------------------------------------------------------------
# Parallel runs: pytest-xdist, ``make test`` runs ``pytest -n 3 --dist loadfile``
# ---------------------------------------------------------------------------------------
# Each xdist worker is a pytest session of its own: its own zk_server and redis_server on
# free loopback ports, its own module fixtures, its own celery workers (log files named by
# its pid).  Under ``--dist loadfile`` a module's tests run on one xdist worker, in order,
# sharing its module-scoped servers and workers.  Here, in addition, a folder in WHOLE_DIRS
# is one unit: tests/faults/ shares one cluster across its modules (a package fixture, and
# its Celery app keeps the cluster's addresses: the package's tests must run together, on
# one worker); tests/docker/ runs its containers one test after another (two tests'
# containers at once would only compete for the cores).  Long units are handed out first,
# longest first, so that no worker starts a 2-minute unit when the others are done.
# LONG_FIRST is a matter of speed only: a unit missing from it changes no result.
WHOLE_DIRS = ("tests/docker", "tests/faults")
LONG_FIRST = [
    "tests/faults",
    "tests/worker/test_held_aside.py",
    "tests/beat/test_beat_broker.py",
    "tests/test_bench_smoke.py",
    "tests/docker",
    "tests/test_celery_pools.py",
    "tests/worker/test_wait_outside_pool.py",
    "tests/test_enqueue.py",
    "tests/test_security.py",
    "tests/test_prerun.py",
    "tests/test_packaging.py",
    "tests/test_celery_workers.py",
    "tests/test_cli.py",
    "tests/worker/test_cohort.py",
    "tests/test_enqueue_no_loss.py",
    "tests/beat/test_beats.py",
    "tests/engine/test_lock_faults.py",
    "tests/test_reentrant.py",
]


def _unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, or its folder if in WHOLE_DIRS."""
    path = nodeid.split("::", 1)[0]
    return next((d for d in WHOLE_DIRS if path.startswith(d + "/")), path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    # Units in collection order (sorted below), not xdist's most-tests-first.
    config.option.loadscopereorder = False
    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike
        return
    rank = {unit: i for i, unit in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(_unit(item.nodeid), len(LONG_FIRST)))  # stable: module order kept


@pytest.fixture(scope="session")
def curator_classpath(tmp_path_factory):
    """CuratorHolder compiled once per session (skips without a JDK or Curator's jars)."""
    from tests.curator import compile_holder

    return compile_holder(str(tmp_path_factory.mktemp("curator-classes")))


@pytest.fixture
def curators(curator_classpath, zk_server):
    """Starts Curator JVMs on the test's ZooKeeper: ``curators(path, lock="mutex"|"rw")``;
    all told to quit at the test's end (their ephemeral nodes go with their sessions)."""
    from tests.curator import Curator

    started = []

    def start(path: str, lock: str = "mutex") -> Curator:
        started.append(Curator(curator_classpath, zk_server.hosts, path, lock))
        return started[-1]

    yield start
    for cur in started:
        cur.close()


# ---------------------------------------------------------------------------------------
# The locked-task app (tests/apps/locked.py) and its real workers, per test module
# ---------------------------------------------------------------------------------------
# Module-scoped: each module using them gets a root of its own, the app reloaded with it,
# and (``workers``) two ``-c 2`` workers.  A module with an app of its own defines its own
# ``env``/``mod``, which take precedence over these.
@pytest.fixture(scope="module")
def env(redis_server, zk_server):
    from tests.lockutil import worker_env

    yield worker_env(redis_server, zk_server)


@pytest.fixture(scope="module")
def mod(env):
    import importlib

    import tests.apps.locked as m

    return importlib.reload(m)


@pytest.fixture(scope="module")
def workers(mod, env):
    from support.workers import Worker

    ws = [Worker(env, f"w{i}") for i in (1, 2)]
    for w in ws:
        w.start()
    for w in ws:
        w.wait_ready(mod.app)
    yield ws
    for w in ws:
        w.stop()


@pytest.fixture(scope="module")
def short_session_server():
    """A server that grants at most 400 ms sessions (tickTime 200: the least it may grant too)."""
    from celery_zklock.testing_servers import ZooKeeperServer

    server = ZooKeeperServer(extra_config={"maxSessionTimeout": "400"}).start()
    yield server
    server.close()


@pytest.fixture
def sends():
    """(scheduler id, tick seq, when) of every publish of the in-process beat's task
    (tests/beat/running.py) by a ZkScheduler in this process."""
    import threading
    import time

    from celery import signals

    from tests.beat.running import TASK

    found: list[tuple[int, int, float]] = []

    def count(sender=None, headers=None, **_):
        tick = (headers or {}).get("zklock_beat")
        if sender == TASK and tick:
            found.append((threading.get_ident(), tick["seq"], time.monotonic()))

    signals.before_task_publish.connect(count, weak=False)
    yield found
    signals.before_task_publish.disconnect(count)
