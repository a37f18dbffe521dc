"""Bad input, end to end: malformed, huge and non-text lock keys, bad settings, wrong hosts
strings and an unauthorised client (digest ACL on zklock_root).

Why through real workers: the promise is not only "an exception is raised" (the unit tests
in tests/test_options.py check the messages) but "a clear error where the operator looks —
the task's result or the worker's start-up — and nothing behind": no task body run, no
znode created (the root's child version, ``cversion``, must not move), no worker started.
Keys that are odd but valid must work, with a bounded znode name.
"""

from __future__ import annotations

import json
import re

import pytest
from kazoo.client import KazooClient
from kazoo.security import make_digest_acl

from celery_zklock import ConfigurationError
from celery_zklock.engine.client import close_clients
from celery_zklock.keys import encode_key
from tests.faults import app as A
from tests.faults.checker import runs_of
from tests.faults.harness import FaultWorker, Scenario, wait_until

# (task, argument, expected): a regex the ConfigurationError must match, or None = runs.
KEY_ROWS = [
    ("step", None, r"got None"),
    ("step", [1, 2], r"got a list"),
    ("step", {"a": 1}, r"got a dict"),
    ("step", "order:\ud800", r"not valid Unicode text"),
    ("step", "", r"lock key is empty"),
    ("bad_key", "none", r"callable '_bad_key'.*got None"),
    ("bad_key", "object", r"_NoText object has no stable text"),
    ("bad_key", "nested-list", r"got a list"),
    ("bad_key", "dict", r"got a dict"),
    ("bad_key", "lone-surrogate", r"not valid Unicode text"),
    ("bad_key", "empty-str", r"lock key is empty"),
    ("bad_key", "empty-list", r"returned no key"),
    ("step", "a/b c", None),
    ("step", "..", None),
    ("step", "_c_looks-like-a-lock-node", None),
    ("step", "ключ/🔑", None),
    ("step", "nul\x00and\nnewline", None),
    ("step", 12, None),
    ("step", "x" * 1_000_000, None),
]


def _row_id(row) -> str:
    task, arg, expected = row
    text = repr(arg) if not isinstance(arg, str) or len(arg) < 30 else f"{len(arg)}-chars"
    return f"{task}-{text}-{'error' if expected else 'ok'}"


@pytest.fixture(scope="module")
def keyed(cluster):
    """One worker for the whole key table (rows only submit tasks)."""
    cluster.heal()
    s = Scenario(cluster, "bad-keys")
    s.worker("w", concurrency=2)
    cluster.zk().ensure_path(s.root)  # the znode whose child version (cversion) the rows watch
    yield s
    s.close()


def _cversion(scenario) -> int:
    return scenario.cluster.zk().exists(scenario.root).cversion


@pytest.mark.parametrize("task_name, arg, expected", KEY_ROWS, ids=[_row_id(r) for r in KEY_ROWS])
def test_lock_keys(keyed, task_name, arg, expected):
    zk = keyed.cluster.zk()
    wait_until(lambda: zk.get_children(keyed.root) == [], 10, what="earlier rows' key containers to be reaped")
    before = _cversion(keyed)
    args = (arg, 5, 0) if task_name == "step" else (arg,)
    result = getattr(A, task_name).apply_async(args)
    result.get(timeout=60, propagate=False)
    if expected:
        assert result.state == "FAILURE" and isinstance(result.result, ConfigurationError), (result.state, result.result)
        assert re.search(expected, str(result.result)), str(result.result)
        assert keyed.events(result.id) == [], "the task body ran"
        assert _cversion(keyed) == before, f"znodes were created under {keyed.root}"
    else:
        assert result.state == "SUCCESS", (result.state, result.result)
        assert [e["key"] for e in keyed.events(result.id, "begin")] == [str(arg)]
        assert len(encode_key(str(arg))) <= 200
        assert keyed.leftovers(5) == []
        wait_until(lambda: zk.get_children(keyed.root) == [], 10, what="the key container to be reaped")


# Settings a worker must refuse to start with: (FAULTS_* env, text its log must show).
SETTING_ROWS = [
    ({"FAULTS_CONF": json.dumps({"zklock_host": "127.0.0.1:2181"})}, r"unknown setting 'zklock_host'.*zklock_hosts"),
    ({"FAULTS_CONF": json.dumps({"zklock_on_lost": "explode"})}, r"zklock_on_lost.*must be one of"),
    ({"FAULTS_CONF": json.dumps({"zklock_session_timeout": -1})}, r"zklock_session_timeout.*> 0"),
    ({"FAULTS_CONF": json.dumps({"zklock_auth_secret": "user:hunter2"})}, r"zklock_auth_secret.*\(scheme, credential\) pairs"),
    ({"FAULTS_ZK_ROOT": "/a//b"}, r"zklock_root.*empty component"),
    ({"FAULTS_ZK_HOSTS": "127.0.0.1:99999"}, r"zklock_hosts.*out of range"),
    ({"FAULTS_ZK_HOSTS": "zk://127.0.0.1:2181"}, r"zklock_hosts.*not host\[:port\]"),
    ({"FAULTS_ZK_HOSTS": "127.0.0.1:2181,,127.0.0.1:2182"}, r"zklock_hosts.*not host\[:port\]"),
    ({"FAULTS_ZK_HOSTS": "zk.invalid:2181"}, r"cannot reach ZooKeeper at zklock_hosts='zk.invalid:2181'"),
    ({"FAULTS_ZK_HOSTS": "BROKER"}, r"cannot reach ZooKeeper at zklock_hosts="),  # a Redis, not a ZooKeeper
    ({"FAULTS_CONF": json.dumps({"zklock_use_ssl": {"ca": "/nonexistent/zk-ca.pem"}})},
     r"zklock_use_ssl.*'ca' file '/nonexistent/zk-ca.pem' does not exist"),
    ({"FAULTS_CONF": json.dumps({"zklock_use_ssl": {"ca_certs": "/etc/hostname"}})},
     r"zklock_use_ssl.*unknown TLS option 'ca_certs'. Did you mean 'ca'"),
    ({"FAULTS_CONF": json.dumps({"zklock_use_ssl": True})},  # TLS to a plaintext ensemble
     r"does not speak TLS: point zklock_hosts at its secureClientPort, or unset zklock_use_ssl"),
    ({"FAULTS_CONF": json.dumps({"zklock_sasl_options": {"mechanism": "PLAIN", "password": "hunter2"}})},
     r"zklock_sasl_options.*'mechanism' must be one of DIGEST-MD5, GSSAPI"),
    ({"FAULTS_CONF": json.dumps({"zklock_acl": [[99, "world", "anyone"]]})}, r"zklock_acl.*is not an ACL"),
]


@pytest.mark.parametrize("env, expected", SETTING_ROWS, ids=[
    "typo-setting", "bad-policy", "negative-session", "auth-as-string", "root-double-slash", "port-out-of-range",
    "url-scheme", "empty-host", "unresolvable-host", "not-zookeeper", "tls-missing-ca", "tls-broker-use-ssl-name",
    "tls-to-plaintext", "sasl-mechanism", "acl-not-an-acl"])
def test_worker_refuses_bad_settings(scenario, env, expected):
    env = {k: v.replace("BROKER", f"127.0.0.1:{scenario.cluster.broker.port}") for k, v in env.items()}
    queued = scenario.send(A.step, "never", 5, queue=f"{scenario.name}-refused")
    _refused(scenario, env, expected)
    assert scenario.events(queued.id) == [] and queued.state == "PENDING"
    assert scenario.cluster.zk().exists(scenario.root) is None, "the refused worker created znodes"
    assert "hunter2" not in scenario.workers[-1].log(), "credentials were echoed"


def _refused(scenario, env: dict, expected: str) -> str:
    worker = FaultWorker({**scenario.env, **env}, f"{scenario.name}-refused")
    scenario.workers.append(worker)
    worker.start()
    assert worker.proc.wait(60) != 0, worker.log()
    log = worker.log()
    assert re.search(expected, log), log
    return log


@pytest.fixture
def acl_root(scenario):
    """``scenario.root`` owned by ``owner:secret`` with a digest ACL: nobody else may touch it."""
    owner = KazooClient(hosts=scenario.cluster.ensemble.hosts, auth_data=[("digest", "owner:secret")])
    owner.start(timeout=30)
    owner.create(scenario.root, b"", acl=[make_digest_acl("owner", "secret", all=True)])
    yield owner
    owner.delete(scenario.root, recursive=True)
    owner.stop()
    owner.close()


@pytest.mark.parametrize("auth, root_suffix", [(None, ""), ([["digest", "owner:wrong"]], ""), (None, "/sub")],
                         ids=["no-credentials", "wrong-password", "missing-root-under-acl"])
def test_unauthorised_worker_refuses_to_start_and_leaves_nothing(scenario, acl_root, auth, root_suffix):
    """Known bug (f): the error names the znode and zklock_auth_secret; no probe or key node stays."""
    root = scenario.root + root_suffix
    env = {"FAULTS_ZK_ROOT": root, "FAULTS_CONF": json.dumps({"zklock_auth_secret": auth})}
    log = _refused(scenario, env, r"NoAuth")
    assert root in log and "zklock_auth_secret" in log, log
    assert "owner:wrong" not in log, "credentials were echoed"
    assert acl_root.get_children(scenario.root) == []


def test_unauthorised_task_call_fails_clearly_and_leaves_nothing(scenario, acl_root):
    """The same at acquire time (an ACL changed after the worker started, or no worker
    check at all: an eager call): ConfigurationError naming zklock_auth_secret, body not run."""
    try:
        result = A.step.apply(("acl-key", 5, 0))
    finally:
        close_clients()  # the eager call's ZooKeeper client lives in this (test) process
    assert result.state == "FAILURE" and isinstance(result.result, ConfigurationError), result.result
    assert "NoAuth" in str(result.result) and "zklock_auth_secret" in str(result.result)
    assert scenario.store.events() == []
    assert acl_root.get_children(scenario.root) == []


def test_authorised_worker_runs_under_the_acl(scenario, acl_root):
    """Control: with the right credentials the same root works and is left clean."""
    conf = json.dumps({"zklock_auth_secret": [["digest", "owner:secret"]]})
    worker = scenario.worker("authed", FAULTS_CONF=conf)
    done = [scenario.send(A.step, "acl-key", 20, queue=worker.queue) for _ in range(4)]
    assert [r.get(timeout=60) for r in done] and all(r.state == "SUCCESS" for r in done)
    runs = [r for r in runs_of(scenario.store.events()) if r.complete and r.fenced]
    assert sorted(r.task for r in runs) == sorted(r.id for r in done)
    wait_until(lambda: acl_root.get_children(scenario.root) == [], 10, what="the key container to be reaped")
