"""Build the images the pytest-celery vendor defaults to, from the Dockerfiles shipped here.

    python -m celery_zklock.contrib.pytest_celery.images                 # zookeeper + worker
    python -m celery_zklock.contrib.pytest_celery.images worker --packages "celery-zklock pytest-celery my-project"
    # no registry reachable: a local Debian base and a folder of wheels
    python -m celery_zklock.contrib.pytest_celery.images --base my/debian:bookworm --wheels ./wheels --network host

Why a command and not just ``docker build``: the Dockerfiles live inside the installed
package, and an offline build needs the wheels copied into the build context.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

from celery_zklock.contrib.pytest_celery import defaults

REDIS_IMAGE = "celery-zklock/redis:7"
IMAGES = {  # name: (folder under images/, default tag)
    "zookeeper": ("zookeeper", defaults.ZOOKEEPER_IMAGE),
    "worker": ("worker", defaults.WORKER_IMAGE),
    "redis": ("redis", REDIS_IMAGE),  # only for machines that cannot pull the official one
}
DEFAULT_PACKAGES = "celery-zklock[metrics] celery[redis] pytest-celery"


def build_command(name: str, context: str, tag: str, base: str | None, network: str | None,
                  packages: str | None) -> list[str]:
    """The ``docker build`` command line for one image (pure: what ``build`` runs)."""
    cmd = ["docker", "build", "-t", tag]
    if base:
        cmd += ["--build-arg", f"BASE={base}"]
    if network:
        cmd += ["--network", network]
    if name == "worker" and packages:
        cmd += ["--build-arg", f"PACKAGES={packages}"]
    return cmd + [context]


def build(name: str, tag: str | None = None, base: str | None = None, wheels: str | None = None,
          network: str | None = None, packages: str | None = None, quiet: bool = False) -> str:
    """Build one image; return its tag."""
    if name not in IMAGES:
        raise SystemExit(f"unknown image {name!r}: choose from {', '.join(IMAGES)}")
    folder, default_tag = IMAGES[name]
    tag = tag or default_tag
    with tempfile.TemporaryDirectory(prefix=f"zklock-{name}-") as context:
        shutil.copytree(os.path.join(defaults.IMAGES_DIR, folder), context, dirs_exist_ok=True)
        if wheels:
            found = glob.glob(os.path.join(wheels, "*.whl"))
            if not found:
                raise SystemExit(f"--wheels {wheels}: no *.whl files there")
            if name == "worker":
                for path in found:
                    shutil.copy(path, os.path.join(context, "wheels"))
        cmd = build_command(name, context, tag, base, network, packages)
        if not quiet:
            subprocess.run(cmd, check=True)
        else:  # the output only when it failed
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
                raise SystemExit(f"docker build of {name} failed ({done.returncode})")
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m celery_zklock.contrib.pytest_celery.images",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=["zookeeper", "worker"],
                        help=f"images to build, of {', '.join(IMAGES)} (default: zookeeper worker)")
    parser.add_argument("--base", help="base image with apt (default: each Dockerfile's, from Docker Hub)")
    parser.add_argument("--wheels", help="folder of wheels: the worker installs from it only (offline)")
    parser.add_argument("--network", help="build network, e.g. host")
    parser.add_argument("--packages", help=f"worker's pip requirements (default: {DEFAULT_PACKAGES!r})")
    parser.add_argument("--tag", action="append", default=[], metavar="NAME=TAG", help="tag other than the default")
    parser.add_argument("-q", "--quiet", action="store_true")
    args = parser.parse_args(argv)
    tags = dict(item.split("=", 1) for item in args.tag)
    for name in args.names:
        tag = build(name, tags.get(name), args.base, args.wheels, args.network, args.packages, args.quiet)
        print(f"built {name}: {tag}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
