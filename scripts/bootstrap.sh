#!/usr/bin/env bash
# Set up everything `make test`, `make demo` and `make bench` need on a fresh Debian machine:
# Java + ZooKeeper jars (Debian packages), Curator jars for the interop test, a Redis server
# binary, and the project's virtualenv (with pyproject's lint extra: `make lint`'s mypy and
# ruff).  Idempotent: each step is skipped when done.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v java >/dev/null 2>&1 || need_apt+=(default-jre-headless)
[ -e /usr/share/java/zookeeper.jar ] || [ -n "${ZOOKEEPER_HOME:-}" ] || need_apt+=(zookeeper)
[ -e /usr/share/java/curator-recipes.jar ] || need_apt+=(libcurator-recipes-java)
command -v javac >/dev/null 2>&1 || need_apt+=(default-jdk-headless)
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  echo ">> installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo ">> creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml | md5sum | cut -c1-12)
if [ ! -e "$stamp" ]; then
  echo ">> installing celery-zklock and its test/bench/lint dependencies into .venv"
  .venv/bin/pip install -q --disable-pip-version-check -U pip >/dev/null 2>&1 || true
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test,bench,lint]" 2>&1 | grep -v -E "^\s*WARNING: Location" || true
  .venv/bin/python -c "import celery_zklock, kazoo, celery, redis, mypy"
  .venv/bin/ruff --version >/dev/null
  rm -f .venv/.installed-*; touch "$stamp"
fi
