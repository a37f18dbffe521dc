"""docker-compose.yml, checked without a Docker engine: the ZooKeeper ensemble is consistent,
workers/beat/Flower point at every ZooKeeper member and at the Redis service, dependencies
exist, every long-running service has a healthcheck, host ports are unique and loopback-only.
``docker compose config`` validates the file too when the compose plugin is installed."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from urllib.parse import urlsplit

import pytest

from tests.compose_command import compose_cli

yaml = pytest.importorskip("yaml", reason="PyYAML is in the 'test' extra: pip install -e '.[test]'")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPOSE = os.path.join(ROOT, "docker-compose.yml")
APP = "examples.flash_sale.app"


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def env(service: dict) -> dict[str, str]:
    """A service's environment as a dict (compose allows a mapping or a KEY=VALUE list)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        return dict(item.split("=", 1) if "=" in item else (item, "") for item in raw)
    return {k: "" if v is None else str(v) for k, v in raw.items()}


def command(service: dict) -> list[str]:
    cmd = service.get("command") or []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def depends(service: dict) -> dict[str, str]:
    raw = service.get("depends_on") or {}
    if isinstance(raw, list):
        return {name: "service_started" for name in raw}
    return {name: (spec or {}).get("condition", "service_started") for name, spec in raw.items()}


def zk_services(services: dict) -> dict[str, dict]:
    return {n: s for n, s in services.items() if str(s.get("image", "")).split(":")[0] in ("zookeeper", "library/zookeeper")}


def celery_services(services: dict, role: str) -> dict[str, dict]:
    return {n: s for n, s in services.items() if "celery" in command(s)[:1] and role in command(s)}


def parse_ports(service: dict) -> list[tuple[str, int, int]]:
    """(host ip, host port, container port) for each published port."""
    out = []
    for p in service.get("ports") or []:
        if isinstance(p, dict):
            out.append((p.get("host_ip", ""), int(p["published"]), int(p["target"])))
            continue
        # "${ZK1_PORT:-2181}": the default, as compose reads it with the variable unset
        parts = re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", str(p)).split("/")[0].split(":")
        if len(parts) == 3:
            out.append((parts[0], int(parts[1]), int(parts[2])))
        elif len(parts) == 2:
            out.append(("", int(parts[0]), int(parts[1])))
        else:
            out.append(("", 0, int(parts[0])))
    return out


def test_expected_services(services):
    assert len(zk_services(services)) == 3, "a 3-node ZooKeeper ensemble"
    assert [n for n, s in services.items() if str(s.get("image", "")).startswith("redis")] == ["redis"]
    assert len(celery_services(services, "worker")) == 2, "two workers"
    assert len(celery_services(services, "beat")) == 1, "one beat"
    assert len(celery_services(services, "flower")) == 1, "Flower"


def test_zookeeper_ensemble_is_consistent(services):
    zks = zk_services(services)
    ids = {name: int(env(s)["ZOO_MY_ID"]) for name, s in zks.items()}
    assert sorted(ids.values()) == [1, 2, 3], f"ZOO_MY_ID must be unique: {ids}"
    server_lines = {env(s)["ZOO_SERVERS"] for s in zks.values()}
    assert len(server_lines) == 1, "every member must be given the same ZOO_SERVERS"
    entries = server_lines.pop().split()
    parsed = {}
    for entry in entries:
        m = re.fullmatch(r"server\.(\d+)=([\w.-]+):(\d+):(\d+)(?::(?:participant|observer))?;(?:[\w.]+:)?(\d+)", entry)
        assert m, f"bad ZOO_SERVERS entry {entry!r} (want server.N=host:2888:3888;2181)"
        parsed[int(m.group(1))] = (m.group(2), int(m.group(5)))
    assert set(parsed) == set(ids.values())
    for name, sid in ids.items():
        host, client_port = parsed[sid]
        # the entry for a member's id names that member's service (its DNS name on the network)
        assert host in (name, zks[name].get("hostname")), f"server.{sid} is {host}, but ZOO_MY_ID={sid} is {name}"
        assert client_port == 2181
    for s in zks.values():
        assert env(s).get("ZOO_STANDALONE_ENABLED", "false") == "false"
        assert "srvr" in env(s).get("ZOO_4LW_COMMANDS_WHITELIST", "srvr"), "the healthcheck uses srvr"


def test_app_services_point_at_every_zookeeper_member_and_redis(services):
    zks = zk_services(services)
    apps = {**celery_services(services, "worker"), **celery_services(services, "beat"),
            **celery_services(services, "flower")}
    for name, s in apps.items():
        e = env(s)
        hosts = e["ZKLOCK_HOSTS"]
        assert "/" not in hosts or hosts.index("/") > 0
        members = [hp.strip() for hp in hosts.split("/")[0].split(",")]
        assert sorted(h.rsplit(":", 1)[0] for h in members) == sorted(zks), f"{name}: {hosts}"
        assert all(h.rsplit(":", 1)[1] == "2181" for h in members), f"{name}: {hosts}"
        broker = urlsplit(e["REDIS_URL"])
        assert broker.scheme == "redis" and broker.hostname == "redis" and (broker.port or 6379) == 6379, name
        assert command(s)[1:3] == ["-A", APP], f"{name} runs {command(s)}"


def test_workers_send_events_for_flower_and_have_distinct_names(services):
    workers = celery_services(services, "worker")
    names = []
    for name, s in workers.items():
        cmd = command(s)
        assert "-E" in cmd or "--events" in cmd, f"{name}: Flower needs task events (-E)"
        assert "-c" in cmd and int(cmd[cmd.index("-c") + 1]) >= 2, f"{name}: several prefork processes"
        names.append(cmd[cmd.index("-n") + 1])
    assert len(set(names)) == len(names), names


def test_depends_on_targets_exist_and_healthy_conditions_have_healthchecks(services):
    for name, s in services.items():
        for target, condition in depends(s).items():
            assert target in services, f"{name} depends on unknown service {target!r}"
            assert condition in ("service_started", "service_healthy", "service_completed_successfully")
            if condition == "service_healthy":
                assert services[target].get("healthcheck"), f"{name} waits for {target} to be healthy: no healthcheck"
    for name, s in celery_services(services, "worker").items():
        assert set(zk_services(services)) | {"redis"} <= set(depends(s)), f"{name} must wait for ZooKeeper and Redis"


def test_long_running_services_have_healthchecks(services):
    for name, s in services.items():
        if s.get("profiles"):
            continue  # one-shot tools (`docker compose run`)
        hc = s.get("healthcheck")
        assert hc and not hc.get("disable"), f"{name} has no healthcheck"
        test = hc["test"]
        assert (isinstance(test, str) and test) or (isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL")), name


def test_ports_are_loopback_only_and_unique(services):
    published = []
    for name, s in services.items():
        for ip, host_port, _container_port in parse_ports(s):
            assert ip == "127.0.0.1", f"{name} publishes {host_port} on {ip or 'all interfaces'}"
            published.append(host_port)
    assert len(published) == len(set(published)), f"host ports clash: {published}"
    expected = {name: port for name, port in [("redis", 6379), *((n, 2181) for n in zk_services(services))]}
    for name, port in expected.items():
        assert port in [c for _, _, c in parse_ports(services[name])], f"{name} should publish {port}"
    flower = next(iter(celery_services(services, "flower").values()))
    assert 5555 in [c for _, _, c in parse_ports(flower)]


def test_build_context_and_app_exist(services):
    built = [s for s in services.values() if s.get("build")]
    assert built
    for s in built:
        b = s["build"]
        context = os.path.join(ROOT, b["context"] if isinstance(b, dict) else b)
        dockerfile = os.path.join(context, b.get("dockerfile", "Dockerfile") if isinstance(b, dict) else "Dockerfile")
        assert os.path.isfile(dockerfile), dockerfile
        with open(dockerfile) as f:
            for line in f:
                if line.startswith("COPY "):
                    for src in line.split()[1:-1]:
                        assert os.path.exists(os.path.join(context, src)), f"{dockerfile}: COPY {src} missing"
    assert os.path.isfile(os.path.join(ROOT, *APP.split(".")) + ".py")


def test_beat_has_a_schedule():
    """The beat service has something to send: every schedule entry names a task of the app."""
    import json
    import sys

    probe = ("import json, examples.flash_sale.app as m; "
             "print(json.dumps({k: [v['task'], v['task'] in m.app.tasks] for k, v in m.app.conf.beat_schedule.items()}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": ROOT})  # a fresh process: no app state shared with tests
    assert out.returncode == 0, out.stderr
    schedule = json.loads(out.stdout.strip().splitlines()[-1])
    assert schedule and all(registered for _, registered in schedule.values()), schedule


def test_docker_compose_config_accepts_the_file():
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker compose plugin (or docker-compose) installed")
    out = subprocess.run([*cli, "-f", COMPOSE, "config", "--quiet"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    profiles = subprocess.run([*cli, "-f", COMPOSE, "--profile", "sale", "config", "--services"], capture_output=True,
                              text=True, cwd=ROOT, timeout=60)
    assert profiles.returncode == 0, profiles.stderr
    assert "sale" in profiles.stdout.split()
