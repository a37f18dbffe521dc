#!/usr/bin/env bash
# Docker for the `docker`-marked tests (tests/docker/) and the compose run, called by `make test`:
#
#   scripts/docker-setup.sh          engine running, base image, wheels, images: each step
#                                    skipped when done (images are keyed on a hash of what
#                                    goes into them)
#   scripts/docker-setup.sh stop     stop the Docker engine if (and only if) this script started it
#
# No public registry is assumed: the base is a Debian bookworm made with debootstrap, and the
# worker installs from wheels built here.  When Docker cannot run, it prints one line saying
# why, writes it to build/docker/unavailable (the docker tests skip with that line) and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
state=build/docker
mkdir -p "$state"
PY=${PY:-.venv/bin/python}
BASE_IMAGE=celery-zklock/debian:bookworm
REDIS_IMAGE=celery-zklock/redis:7
EXAMPLES_IMAGE=celery-zklock-examples:local
if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi

stop_engine() {
  [ -s "$state/dockerd.pid" ] || return 0
  pid=$(cat "$state/dockerd.pid")
  if kill -0 "$pid" 2>/dev/null && grep -q dockerd "/proc/$pid/comm" 2>/dev/null; then
    echo ">> docker: stopping the engine this script started (pid $pid)"
    $SUDO kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  fi
  rm -f "$state/dockerd.pid"
}
if [ "${1:-}" = stop ]; then stop_engine; exit 0; fi

rm -f "$state/unavailable"
unavailable() {
  echo "docker tests skipped: $*" | tee "$state/unavailable" >&2
  exit 0
}
[ "${ZKLOCK_DOCKER:-1}" = 0 ] && unavailable "switched off with ZKLOCK_DOCKER=0"
t0=$(date +%s)

# 1. The engine: Debian's docker.io when there is none; started when not running.
if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || unavailable "no Docker engine, and no apt-get to install Debian's docker.io"
    echo ">> docker: installing Debian's docker.io"
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends docker.io >/dev/null; } \
      || unavailable "installing Debian's docker.io failed"
  fi
  echo ">> docker: starting dockerd (log: $state/dockerd.log)"
  # --iptables=false: no NAT rules on the host; containers reach each other on their bridge
  # network, and published ports go through docker-proxy on 127.0.0.1.
  $SUDO dockerd --iptables=false >"$state/dockerd.log" 2>&1 &
  echo $! >"$state/dockerd.pid"
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || unavailable "dockerd did not start (last lines of $state/dockerd.log: $(tail -2 "$state/dockerd.log" | tr '\n' ' '))"
fi
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  command -v debootstrap >/dev/null 2>&1 || {
    echo ">> docker: installing debootstrap"
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  } || unavailable "debootstrap is needed for the base image and could not be installed"
  echo ">> docker: building the base image $BASE_IMAGE with debootstrap (about 30 s)"
  rootfs=$(mktemp -d /tmp/zklock-rootfs.XXXXXX)
  if ! $SUDO debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$state/debootstrap.log" 2>&1; then
    $SUDO rm -rf "$rootfs"; unavailable "debootstrap failed (see $state/debootstrap.log)"
  fi
  $SUDO tar -C "$rootfs" -c . | docker import - "$BASE_IMAGE" >/dev/null || unavailable "docker import of the base image failed"
  $SUDO rm -rf "$rootfs"
fi
# A throwaway container proves the engine can run one (not just answer `docker info`).
docker run --rm --network none "$BASE_IMAGE" true >/dev/null 2>&1 || unavailable "the engine cannot run a container (docker run $BASE_IMAGE true failed)"
# Compose for the docker-compose.yml run: the plugin, or Debian's docker-compose.
if ! docker compose version >/dev/null 2>&1 && ! command -v docker-compose >/dev/null 2>&1; then
  echo ">> docker: installing Debian's docker-compose"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends docker-compose >/dev/null \
    || echo ">> docker: docker-compose could not be installed: the compose run will be skipped" >&2
fi

# 2. Wheels for the worker image: the project as built from this tree, and its dependencies
# at the versions of the test virtualenv.  Python 3.11 of bookworm needs async-timeout for redis.
key_of() { md5sum | cut -c1-12; }  # a short hash of stdin: an image's or the wheels' key
src_key=$( (find celery_zklock -name '*.py' -o -name Dockerfile -o -name '*.sh' | sort | xargs cat; cat pyproject.toml) | key_of)
wheels="$state/wheels-$src_key"
if [ ! -e "$wheels/.done" ]; then
  echo ">> docker: building wheels for the worker image"
  rm -rf "$state"/wheels-*; mkdir -p "$wheels"
  # packaging is left free: kombu[redis] 5.7 pins its own (packaging==26.3), often older than the venv's.
  "$PY" -m pip freeze --exclude-editable | grep -v -e '^-e' -e '@ file' -e '^celery-zklock' -e '^packaging==' >"$state/constraints.txt"
  "$PY" -m pip wheel -q --disable-pip-version-check -w "$wheels" -c "$state/constraints.txt" \
      ".[metrics,sasl]" "celery[redis]" "pytest-celery[redis]" flower "async-timeout>=4.0.3" "setuptools>=77" wheel \
      2>&1 | grep -v -e "WARNING: Location" -e "^\s*$" >&2
  ls "$wheels"/celery_zklock-*.whl >/dev/null 2>&1 || unavailable "pip wheel failed for the worker image"
  touch "$wheels/.done"
fi

# 3. Images, each tagged with the hash of its inputs and re-tagged with the name tests use.
image_for() {  # name default_tag key
  local name=$1 tag=$2 key=$3
  if ! docker image inspect "celery-zklock/$name:k-$key" >/dev/null 2>&1; then
    echo ">> docker: building image $tag"
    local extra=()
    [ "$name" = worker ] && extra=(--wheels "$wheels" --packages "celery-zklock[metrics,sasl] celery[redis] pytest-celery[redis] flower")
    "$PY" -m celery_zklock.contrib.pytest_celery.images "$name" --quiet --base "$BASE_IMAGE" --network host \
        --tag "$name=celery-zklock/$name:k-$key" "${extra[@]}" >/dev/null || unavailable "building the $name image failed"
  fi
  docker tag "celery-zklock/$name:k-$key" "$tag"
}
images=celery_zklock/contrib/pytest_celery/images
base_id=$(docker image inspect -f '{{.Id}}' "$BASE_IMAGE")
zk_tag=$("$PY" -c "from celery_zklock.contrib.pytest_celery import defaults as d; print(d.ZOOKEEPER_IMAGE)")
worker_tag=$("$PY" -c "from celery_zklock.contrib.pytest_celery import defaults as d; print(d.WORKER_IMAGE)")
image_for zookeeper "$zk_tag" "$( (echo "$base_id"; cat $images/zookeeper/*) | key_of)"
image_for redis "$REDIS_IMAGE" "$( (echo "$base_id"; cat $images/redis/*) | key_of)"
image_for worker "$worker_tag" "$( (echo "$base_id $src_key"; cat $images/worker/Dockerfile) | key_of)"

# 4. The examples image of docker-compose.yml, on top of the worker image (its pip installs
# from the worker's wheels).  The build context is a tar of what the Dockerfile copies: the
# classic builder would otherwise send the whole checkout, .venv included.
ex_key=$( (docker image inspect -f '{{.Id}}' "$worker_tag"; find examples support -name '*.py' | sort | xargs cat; cat examples/Dockerfile) | key_of)
if ! docker image inspect "celery-zklock-examples:k-$ex_key" >/dev/null 2>&1; then
  echo ">> docker: building image $EXAMPLES_IMAGE"
  tar -c --exclude=__pycache__ pyproject.toml README.md celery_zklock examples support \
    | docker build -q -f examples/Dockerfile --build-arg "BASE=$worker_tag" -t "celery-zklock-examples:k-$ex_key" - >"$state/examples-build.log" 2>&1 \
    || unavailable "building the examples image failed"
fi
docker tag "celery-zklock-examples:k-$ex_key" "$EXAMPLES_IMAGE"
echo ">> docker: ready in $(( $(date +%s) - t0 )) s (images: $zk_tag $worker_tag $REDIS_IMAGE $EXAMPLES_IMAGE)"
