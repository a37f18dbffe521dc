"""Settings read through a Celery namespace (Django's ``config_from_object(...,
namespace="CELERY")``) are validated as strictly as plain ones, and errors name the key as
the user wrote it (issue 36, friction item 1)."""

from __future__ import annotations

import json
import types
import uuid

import pytest
from celery import Celery

from celery_zklock import ConfigurationError
from celery_zklock.config import SETTINGS, load_settings, written_name
from tests.lockutil import worker_refuses


def namespaced_app(namespace: str = "CELERY", **attrs) -> Celery:
    settings = types.SimpleNamespace(**{f"{namespace}_BROKER_URL": "memory://", **attrs})
    app = Celery("ns")
    app.config_from_object(settings, namespace=namespace)
    return app


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"CELERY_ZKLOCK_HOST": "zk:2181"}, "unknown setting 'CELERY_ZKLOCK_HOST'. Did you mean 'CELERY_ZKLOCK_HOSTS'?"),
        ({"CELERY_ZKLOCK_TIMEOT": 5}, "unknown setting 'CELERY_ZKLOCK_TIMEOT'. Did you mean 'CELERY_ZKLOCK_TIMEOUT'?"),
        ({"CELERY_ZKLOCK_SOMETHING": 1}, "unknown setting 'CELERY_ZKLOCK_SOMETHING'."),
        # Celery upper-cases the whole key under an upper-case namespace: this one is never read
        ({"CELERY_zklock_hosts": "zk:2181"}, "unknown setting 'CELERY_zklock_hosts'. Did you mean 'CELERY_ZKLOCK_HOSTS'?"),
        ({"CELERY_ZKLOCK_HOSTS": "zk 1:2181"}, "setting CELERY_ZKLOCK_HOSTS (zklock_hosts): 'zk 1:2181' is invalid"),
        ({"CELERY_ZKLOCK_ON_TIMEOUT": "wait"}, "setting CELERY_ZKLOCK_ON_TIMEOUT (zklock_on_timeout): 'wait' is invalid"),
        ({"CELERY_ZKLOCK_SESSION_TIMEOUT": 0}, "setting CELERY_ZKLOCK_SESSION_TIMEOUT (zklock_session_timeout): 0 is invalid"),
    ],
)
def test_a_namespaced_setting_is_checked_and_named_as_written(attrs, message):
    with pytest.raises(ConfigurationError) as info:
        load_settings(namespaced_app(**attrs).conf)
    assert message in str(info.value)


def test_a_lower_case_namespace_suggests_its_own_spelling():
    with pytest.raises(ConfigurationError) as info:
        load_settings(namespaced_app("celery", celery_zklock_hots="zk:2181").conf)
    assert "unknown setting 'celery_zklock_hots'. Did you mean 'celery_zklock_hosts'?" in str(info.value)


def test_every_setting_is_read_through_the_namespace():
    good = {name: SETTINGS[name].default for name in SETTINGS}
    good.update(zklock_hosts="zk1:2181,zk2:2181", zklock_timeout=5.0, zklock_wait_in="pool")
    settings = load_settings(namespaced_app(**{written_name(n, "CELERY_"): v for n, v in good.items()}).conf)
    assert (settings.hosts, settings.timeout, settings.wait_in) == ("zk1:2181,zk2:2181", 5.0, "pool")


def test_plain_errors_still_name_the_plain_key():
    app = Celery("plain", broker="memory://")
    app.conf.zklock_timeout = -1
    with pytest.raises(ConfigurationError) as info:
        load_settings(app.conf)
    assert "setting zklock_timeout: -1 is invalid" in str(info.value)


def test_a_worker_with_a_typod_namespaced_setting_refuses_to_start(redis_server, zk_server):
    env = {"TEST_REDIS_URL": redis_server.url, "TEST_ZK_HOSTS": zk_server.hosts,
           "TEST_ZK_ROOT": f"/ns-{uuid.uuid4().hex[:8]}",
           "TEST_NS_SETTINGS": json.dumps({"CELERY_ZKLOCK_HOST": "127.0.0.1:2181"})}
    log = worker_refuses(env, "ns-typo", app="tests.apps.namespaced")
    assert "unknown setting 'CELERY_ZKLOCK_HOST'. Did you mean 'CELERY_ZKLOCK_HOSTS'?" in log, log
