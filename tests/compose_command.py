"""The Docker Compose command installed here, if any: the ``docker compose`` plugin, else the
legacy ``docker-compose``; None without either (the tests that need it skip)."""

from __future__ import annotations

import shutil
import subprocess


def compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    if legacy and subprocess.run([legacy, "version"], capture_output=True).returncode == 0:
        return [legacy]
    return None
