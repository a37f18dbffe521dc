"""The pytest-celery example of docs/testing.md (moved there from the README), copied into an
empty folder and run with pytest, as a user would.  Only this machine's differences are
appended to its conftest.py: no registry (the Redis image built here) and the sandbox's
/.dockerenv (see conftest.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.docker.conftest import REDIS_IMAGE, ROOT

pytestmark = pytest.mark.docker

SECTION = "## Testing your own locked tasks with pytest-celery"
LOCAL = f'''

# --- this machine only (tests/docker/test_readme_example.py) ---
import pytest_docker_tools.wrappers.container as _ptd_container

_ptd_container.tests_inside_container = lambda: False


@pytest.fixture
def default_redis_broker_image():
    return "{REDIS_IMAGE}"


@pytest.fixture
def default_redis_backend_image():
    return "{REDIS_IMAGE}"
'''


def readme_files() -> dict[str, str]:
    """{file name: source} of the section's python blocks that start with ``# <name>.py``."""
    with open(os.path.join(ROOT, "docs", "testing.md")) as f:
        text = f.read()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    files = {}
    for block in re.findall(r"```python\n(.*?)```", section, re.S):
        first, _, rest = block.partition("\n")
        if re.fullmatch(r"# \w+\.py", first.strip()):
            files[first.strip()[2:]] = rest
    return files


def test_readme_example_runs_as_written(tmp_path):
    files = readme_files()
    assert set(files) == {"tasks.py", "conftest.py", "test_billing.py"}, set(files)
    for name, source in files.items():
        (tmp_path / name).write_text(source + (LOCAL if name == "conftest.py" else ""))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    tail = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert re.search(r"\b2 passed\b", done.stdout), tail
