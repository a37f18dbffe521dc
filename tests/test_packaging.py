"""The package as a user gets it (issue 36, item 1): ``python -m build`` makes an sdist and a
wheel (the wheel built from the sdist, so a file the sdist leaves out is missed here too), and
the wheel installed into a fresh virtualenv gives ``celery zklock`` and the public API.

Building fetches the build backend (setuptools) and installing fetches Celery and kazoo: pip's
cache is reused, but the index must answer.  A step that fails while PyPI is unreachable is
skipped with that reason; a step that fails while PyPI answers fails the test.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib
import urllib.request
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
#: What a user imports: the README's examples and the issue's list.
PUBLIC = ["ZkLockedTask", "FairLock", "MultiLock", "KazooLock", "current_lock", "AlreadyQueued", "LockUnavailable"]


def _pypi_unreachable() -> str | None:
    """Why PyPI cannot be reached, or None when it answers."""
    try:
        with urllib.request.urlopen("https://pypi.org/simple/kazoo/", timeout=10) as reply:
            reply.read(1)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _run(args: list[str], cwd: pathlib.Path, what: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run a step with the user's environment minus anything that would let the checkout
    shadow the installed package; on failure, skip if PyPI is unreachable, else fail."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        output = f"{what} failed (rc {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if (why := _pypi_unreachable()) is not None:
            pytest.skip(f"PyPI is unreachable ({why}), needed to {what}: {output[:300]}")
        pytest.fail(output)
    return done


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, pathlib.Path]:
    """An sdist and a wheel of this checkout, built into a temporary directory."""
    pytest.importorskip("build", reason="the 'build' package is needed (pip install build)")
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], cwd=out, what="build the sdist and wheel")
    found = {"sdist": sorted(out.glob("*.tar.gz")), "wheel": sorted(out.glob("*.whl"))}
    assert all(len(v) == 1 for v in found.values()), found
    return {kind: paths[0] for kind, paths in found.items()}


@pytest.fixture(scope="module")
def venv(dists, tmp_path_factory) -> pathlib.Path:
    """A fresh virtualenv (no system site-packages) with the wheel installed and its
    dependencies from the index (pip's cache reused)."""
    home = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", str(home / "env")], cwd=home, what="create a virtualenv")
    python = home / "env" / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", str(dists["wheel"])], cwd=home,
         what="install the wheel with its dependencies", timeout=300)
    return home


def test_the_dists_are_named_by_the_one_declared_version(dists):
    assert dists["wheel"].name == f"celery_zklock-{VERSION}-py3-none-any.whl"
    assert dists["sdist"].name == f"celery_zklock-{VERSION}.tar.gz"
    init = (ROOT / "celery_zklock" / "__init__.py").read_text()
    assert VERSION not in init, "the version is declared in pyproject.toml only"


def test_version_is_read_from_the_installed_metadata(monkeypatch):
    import importlib.metadata

    import celery_zklock

    monkeypatch.delitem(vars(celery_zklock), "__version__", raising=False)
    assert celery_zklock.__version__ == importlib.metadata.version("celery-zklock")
    assert "__version__" in dir(celery_zklock)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.delitem(vars(celery_zklock), "__version__")
    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert getattr(celery_zklock, "__version__", None) is None  # an AttributeError, as for any missing name


@pytest.mark.parametrize("package", ["celery_zklock", "celery_zklock.engine"])
def test_the_lazy_exports_are_the_names_a_type_checker_reads(package):
    """A package's public names are imported on first use (``_EXPORTS``: name -> module), and
    spelled out twice for tools that do not run code: ``__all__`` and the imports under
    ``TYPE_CHECKING`` (what mypy and the user's editor read).  The three must agree."""
    import ast
    import importlib

    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._EXPORTS)
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    guarded = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    typed = {alias.name: node.module for node in guarded.body if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert typed == module._EXPORTS
    for name in module.__all__:
        assert getattr(module, name) is getattr(importlib.import_module(f"{package}.{typed[name]}"), name)


def test_the_wheel_ships_the_library_and_its_type_marker_only(dists):
    names = zipfile.ZipFile(dists["wheel"]).namelist()
    assert "celery_zklock/py.typed" in names
    assert "celery_zklock/cli.py" in names and "celery_zklock/engine/lock.py" in names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"celery_zklock", f"celery_zklock-{VERSION}.dist-info"}, tops
    entry_points = zipfile.ZipFile(dists["wheel"]).read(f"celery_zklock-{VERSION}.dist-info/entry_points.txt").decode()
    assert "[celery.commands]" in entry_points and "zklock = celery_zklock.cli:zklock" in entry_points


def test_the_sdist_carries_the_changelog_and_no_partial_test_suite(dists):
    import tarfile

    with tarfile.open(dists["sdist"]) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md", "celery_zklock/py.typed"} <= names
    assert not any(n.startswith("tests/") for n in names), "tests/ needs the repository's harnesses"


def test_the_dists_pass_twine_check(dists):
    pytest.importorskip("twine", reason="the 'twine' package is needed (pip install twine)")
    done = _run([sys.executable, "-m", "twine", "check", "--strict", str(dists["sdist"]), str(dists["wheel"])],
                cwd=dists["wheel"].parent, what="run twine check")
    assert done.stdout.count("PASSED") == 2, done.stdout


def test_the_installed_wheel_gives_the_celery_command(venv):
    done = _run([str(venv / "env" / "bin" / "celery"), "zklock", "--help"], cwd=venv, what="run celery zklock --help")
    for command in ("status", "watch", "path", "release"):
        assert command in done.stdout, done.stdout


def test_the_installed_wheel_gives_the_public_api(venv):
    code = (
        "import pathlib, celery_zklock as c\n"
        f"from celery_zklock import {', '.join(PUBLIC)}\n"
        "from celery_zklock import *\n"
        "print(c.__version__)\n"
        "print(pathlib.Path(c.__file__).parent)\n"
        "print((pathlib.Path(c.__file__).parent / 'py.typed').is_file())\n"
        "print(all(getattr(c, n) is not None for n in c.__all__))\n"
    )
    done = _run([str(venv / "env" / "bin" / "python"), "-c", code], cwd=venv, what="import the public API")
    version, where, typed, everything = done.stdout.split()
    assert version == VERSION
    assert pathlib.Path(where).is_relative_to(venv / "env"), f"imported from {where}, not the fresh virtualenv"
    assert typed == "True" and everything == "True"


def test_the_installed_wheel_runs_the_readme_quickstart(venv, tmp_path, zk_server, redis_server):
    """The README's quickstart as a new user runs it: the worker and the ``celery zklock``
    commands from the fresh virtualenv, nothing of this checkout on their path."""
    from tests.quickstart import run_readme_quickstart

    python = str(venv / "env" / "bin" / "python")
    # What the quickstart's first line asks for (its broker is Redis): kombu's Redis transport.
    _run([python, "-m", "pip", "install", "--quiet", "celery[redis]"], cwd=venv, what="install celery[redis]",
         timeout=300)
    run_readme_quickstart(tmp_path, zk_server, redis_server, python=python, path="")
