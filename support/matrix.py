"""``make matrix``: the versions pyproject.toml claims, each in at least one cell, tested.

Usage: ``python -m support.matrix [--cells oldest,newest] [--list] [--jobs N] [--skip-tests]
[--skip-smoke]``

Each cell is a virtualenv in ``.matrix/<cell>/venv`` (git-ignored) of the cell's Python,
with the cell's Celery, kombu, kazoo and redis pinned by exact version from the package
index, the test tools the subset needs (:data:`TEST_DEPS`), and celery-zklock itself as users
get it: a wheel built from the checkout's sdist (``python -m build``, cached in
``.matrix/dist/<hash of the sources>``), installed non-editable.  The venv is reused while
its pins are unchanged (a stamp file names their hash); the wheel is reinstalled whenever the
sources change.

The cell runs from ``.matrix/<cell>/tree``: a copy of the checkout's ``tests/``,
``support/``, ``examples/`` and ``pyproject.toml`` (pytest's settings) *without*
``celery_zklock/``.  Run from the checkout root, the checkout's package would shadow the
installed one (the root is first on ``sys.path`` for pytest, ``python -m`` and every worker
the tests start), and a cell would test the source, not the package (a file missing from
the wheel, or a wrong dependency bound, would go unseen).  Each cell checks that
``celery_zklock`` imports from its site-packages before anything runs.

In each cell:

a. the subset of the suite in :data:`SUBSET` (real ZooKeeper servers and real prefork
   workers, started by the tests), on 2 pytest-xdist workers, ``--dist loadfile``;
b. ``python -m examples.demo --only flash_sale --orders 200``: real prefork ``celery
   worker`` processes on the cell's broker (``BROKER_URL``; Redis stays the result
   backend); fails on a broken invariant (about 40 s);
c. ``python -m examples.demo --only beat_elected``: three real ``celery beat -S
   celery_zklock.beat:ZkScheduler`` processes, the leader SIGKILLed then SIGSTOPped (about
   60 s).

The subset (about 3 minutes a cell on 2 cores; the whole suite takes about 20): every fast
module that exercises a different seam with the versioned libraries, measured on the
newest cell.

* ``tests/engine`` minus ``test_lock_faults.py`` and ``test_lock_interop.py``: the lock
  recipe on kazoo (its API is the one the kazoo pin changes: retry, session events,
  transactions) and kazoo's own lock tests (``test_kazoo_suite.py``);
* ``tests/worker`` minus ``test_wait_outside_pool.py``, ``test_cohort.py`` and
  ``test_held_aside.py`` (the long ones: 60 s, 50 s and 130 s; requests held aside by real
  workers are the flash-sale smoke's daily bread): the agent and cohort, the consumer step
  on Celery's and kombu's internals (the prefetch window, ``QoS``, the consumer's restore),
  the wait queue;
* ``tests/test_options.py``: the task options derived from the installed Celery's;
* ``tests/test_internals_used.py``: every Celery, kombu, billiard and kazoo internal the
  package touches (``celery_zklock/internals_used.py``) still there (seconds);
* ``tests/test_security.py``: kazoo's ACLs, digest auth and TLS;
* ``tests/beat/test_rules.py`` and ``tests/beat/test_scheduler.py``: the elected
  scheduler on Celery's beat internals (the beat itself runs in smoke c);
* ``tests/beat/test_beats.py``: three real beats, the leader SIGKILLed, SIGSTOPped and cut
  off by a TCP proxy;
* ``tests/test_celery_workers.py``, ``test_prerun.py``, ``test_reentrant.py``: real prefork
  workers on the tests' own Redis: exclusion, retries, revokes, worker loss, the task
  signals and re-entry in every place a task waits;
* ``test_celery_inprocess.py``, ``test_by_config.py``, ``test_namespace.py`` (seconds).

Left out, by time: the fault suites (``tests/faults``, ``test_lock_faults.py``), the pool
and docker tests, packaging, the bench smoke; they run in ``make test`` on the newest
versions.

A RabbitMQ cell uses ``amqp://guest:guest@127.0.0.1:5672//`` (``$MATRIX_AMQP_URL``) for
the examples, purging the examples' queues first; when nothing answers there the cell falls
back to Redis and its broker column says so (``redis (no rabbitmq)``), unless
``--strict-broker``.

At the end a table (cell, versions, tests passed/skipped/failed, smoke, beat, time) is
printed and written to ``.matrix/last.md``; the exit status is 1 if any cell failed.
Logs: ``.matrix/<cell>/logs/``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
MATRIX = ROOT / ".matrix"
AMQP_URL = os.environ.get("MATRIX_AMQP_URL") or "amqp://guest:guest@127.0.0.1:5672//"


@dataclass(frozen=True)
class Cell:
    name: str
    python: str
    celery: str
    kombu: str
    kazoo: str
    redis: str
    broker: str  # "redis" or "rabbitmq"
    note: str = ""

    def pins(self) -> list[str]:
        # celery[redis]: the resolver checks the redis pin against the cell's kombu bounds
        return [f"celery[redis]=={self.celery}", f"kombu=={self.kombu}", f"kazoo=={self.kazoo}", f"redis=={self.redis}"]


#: Every version pyproject.toml claims is in at least one cell: Python 3.10-3.13, Celery
#: 5.3-5.7, kazoo 2.9-2.11, kombu 5.3-5.7 and both brokers.  Celery 5.3 and 5.4 take kombu <
#: 5.7 and redis < 5.3 (kombu 5.7 needs a newer Celery's transport code; kombu 5.3/5.4's
#: Redis transport predates redis-py 5.3); ``oldest`` is what a user pinned to the oldest
#: Celery runs.
CELLS = [
    Cell("oldest", "3.10", "5.3.6", "5.3.7", "2.9.0", "4.6.0", "redis", "the floors: Celery 5.3, kazoo 2.9, Python 3.10"),
    Cell("celery54", "3.11", "5.4.0", "5.4.2", "2.10.0", "5.0.8", "rabbitmq"),
    Cell("celery55", "3.12", "5.5.3", "5.5.4", "2.11.0", "5.2.1", "redis"),
    Cell("celery56", "3.13", "5.6.3", "5.6.2", "2.9.0", "6.4.0", "rabbitmq", "the newest Python on the oldest kazoo"),
    Cell("newest", "3.13", "5.7.0", "5.7.0", "2.11.0", "8.1.0", "rabbitmq", "what a new install gets today"),
]

#: The test tools the subset needs (unpinned: the cells differ in the libraries under test,
#: not in these).  pytest-celery: tests/conftest.py loads ``celery_zklock.contrib.pytest_celery``
#: (it needs pytest-celery, which pins no Celery version).  pyjks and pyOpenSSL: kazoo.testing,
#: which tests/engine/test_kazoo_suite.py imports with kazoo's lock tests; mock: kazoo < 2.10's
#: own tests import it.  gevent: the lock under kazoo's gevent handler (tests/engine).
TEST_DEPS = ["pytest>=7", "pytest-xdist>=3.6", "pytest-timeout>=2", "pytest-celery[redis]>=1.1", "pyyaml>=6",
             "pure-sasl>=0.6", "prometheus_client>=0.17", "pyjks>=20", "pyOpenSSL>=23", "mock>=4", "gevent>=22"]

SUBSET = [
    "tests/engine",
    "--deselect", "tests/engine/test_lock_faults.py",
    "--deselect", "tests/engine/test_lock_interop.py",
    "tests/worker",
    "--deselect", "tests/worker/test_wait_outside_pool.py",
    "--deselect", "tests/worker/test_cohort.py",
    "--deselect", "tests/worker/test_held_aside.py",
    "tests/test_options.py",
    "tests/test_internals_used.py",
    "tests/test_security.py",
    "tests/beat/test_rules.py",
    "tests/beat/test_scheduler.py",
    "tests/beat/test_beats.py",
    "tests/test_celery_workers.py",
    "tests/test_prerun.py",
    "tests/test_reentrant.py",
    "tests/test_celery_inprocess.py",
    "tests/test_by_config.py",
    "tests/test_namespace.py",
]

#: What the cell's tree holds (copied from the checkout at each run): everything the subset
#: and the examples import, but not the package.
TREE = ["tests", "support", "examples", "pyproject.toml"]
#: The examples' queues on a shared RabbitMQ: purged before a cell's smoke, so that no
#: message an interrupted run left behind reaches this run's workers.
EXAMPLE_QUEUES = ["flash_sale", "beat_elected"]


def say(msg: str) -> None:
    print(f"matrix: {msg}", flush=True)


# ----------------------------------------------------------------------------- preparation
def find_python(version: str) -> str | None:
    """An interpreter of ``version`` (``3.10``): on PATH, or installed by pyenv."""
    candidates = [shutil.which(f"python{version}")]
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    candidates += sorted(glob.glob(os.path.join(pyenv, "versions", f"{version}.*", "bin", "python")), reverse=True)
    candidates += [f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            try:
                out = subprocess.run([c, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                                     capture_output=True, text=True, timeout=30).stdout.strip()
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out == version:
                return c
    return None


def source_hash() -> str:
    """A hash of everything the wheel is built from."""
    h = hashlib.sha256()
    files = sorted(p for p in (ROOT / "celery_zklock").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    files += [ROOT / n for n in ("pyproject.toml", "MANIFEST.in", "README.md", "LICENSE") if (ROOT / n).exists()]
    for p in files:
        h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def build_wheel(log: Path) -> Path:
    """The project's wheel, built from its sdist as ``python -m build`` does for a release."""
    digest = source_hash()
    out = MATRIX / "dist" / digest
    wheels = sorted(out.glob("celery_zklock-*.whl"))
    if wheels:
        return wheels[0]
    for old in (MATRIX / "dist").glob("*"):
        shutil.rmtree(old, ignore_errors=True)
    tmp = MATRIX / "dist" / f".tmp-{os.getpid()}"
    say(f"building celery-zklock's sdist and wheel (sources {digest}); log {log.relative_to(ROOT)}")
    with open(log, "wb") as f:
        rc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(tmp), str(ROOT)], stdout=f,
                            stderr=subprocess.STDOUT).returncode
    wheels = sorted(tmp.glob("celery_zklock-*.whl"))
    if rc != 0 or not wheels:
        raise SystemExit(f"matrix: building the wheel failed (see {log})")
    tmp.rename(out)
    return out / wheels[0].name


def run_logged(argv: list[str], log: Path, cwd: Path | None = None, env: dict | None = None,
               timeout: float | None = None) -> int:
    with open(log, "ab") as f:
        f.write(("$ " + " ".join(argv) + "\n").encode())
        f.flush()
        try:
            return subprocess.run(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  stdin=subprocess.DEVNULL).returncode
        except subprocess.TimeoutExpired:
            f.write(f"\nmatrix: timed out after {timeout:.0f}s\n".encode())
            return 124


def tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def reachable(url: str) -> bool:
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 5672), timeout=1).close()
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------- one cell
@dataclass
class Result:
    cell: Cell
    python: str = "-"
    broker: str = "-"
    passed: int = 0
    skipped: int = 0
    failed: int = 0
    tests: str = "-"
    smoke: str = "-"
    beat: str = "-"
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class CellRun:
    def __init__(self, cell: Cell, wheel: Path, args: argparse.Namespace) -> None:
        self.cell, self.wheel, self.args = cell, wheel, args
        self.dir = MATRIX / cell.name
        self.venv = self.dir / "venv"
        self.py = self.venv / "bin" / "python"
        self.tree = self.dir / "tree"
        self.logs = self.dir / "logs"
        self.result = Result(cell)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["VIRTUAL_ENV"] = str(self.venv)
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        return env

    def problem(self, what: str, log: Path | None = None) -> None:
        self.result.problems.append(what)
        say(f"{self.cell.name}: FAILED {what}" + (f" (log {log.relative_to(ROOT)})" if log else ""))
        if log is not None:
            print("\n".join("    " + line for line in tail(log).splitlines()), flush=True)

    def run(self) -> Result:
        started = time.monotonic()
        try:
            self._run()
        finally:
            self.result.seconds = time.monotonic() - started
        return self.result

    def _run(self) -> None:
        c, r = self.cell, self.result
        if self.logs.exists():
            shutil.rmtree(self.logs)
        self.logs.mkdir(parents=True)
        if not self.prepare_venv():
            return
        if not self.install_wheel():
            return
        self.copy_tree()
        if not self.check_install():
            return
        if not self.args.skip_tests:
            self.run_tests()
        if not self.args.skip_smoke:
            r.broker = self.choose_broker()
            if r.broker is not None:
                r.smoke = self.run_demo("smoke", ["--only", "flash_sale", "--orders", "200"], timeout=600)
                r.beat = self.run_demo("beat", ["--only", "beat_elected"], timeout=600)
            else:
                r.broker = c.broker + " (unreachable)"

    # -- the virtualenv
    def pins_stamp(self, python: str) -> str:
        spec = json.dumps({"python": python, "pins": self.cell.pins(), "test": TEST_DEPS}, sort_keys=True)
        return ".pins-" + hashlib.sha256(spec.encode()).hexdigest()[:12]

    def prepare_venv(self) -> bool:
        c = self.cell
        base = find_python(c.python)
        if base is None:
            self.problem(f"no Python {c.python} on this machine (PATH, pyenv): install it, e.g. `pyenv install {c.python}`")
            return False
        version = subprocess.run([base, "-c", "import platform; print(platform.python_version())"],
                                 capture_output=True, text=True).stdout.strip()
        self.result.python = version
        stamp = self.venv / self.pins_stamp(version)
        if stamp.exists() and self.py.exists():
            return True
        log = self.logs / "install.log"
        say(f"{c.name}: creating the venv (Python {version}) and installing {' '.join(c.pins())}")
        if self.venv.exists():
            shutil.rmtree(self.venv)
        if run_logged([base, "-m", "venv", str(self.venv)], log) != 0:
            self.problem("creating the venv", log)
            return False
        # The project's wheel with the pins and the test tools in one resolution: the
        # resolver checks the pins against celery-zklock's own bounds too.
        argv = [str(self.py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(self.wheel), *c.pins(),
                *TEST_DEPS]
        if run_logged(argv, log, env=self.env(), timeout=900) != 0:
            self.problem("pip install of the pins", log)
            return False
        (self.venv / ".wheel").write_text(self.wheel.name + " " + self.wheel.parent.name)
        stamp.touch()
        return True

    def install_wheel(self) -> bool:
        """Reinstall the project (without touching the pins) when its sources changed."""
        marker = self.venv / ".wheel"
        want = self.wheel.name + " " + self.wheel.parent.name
        if marker.exists() and marker.read_text() == want:
            return True
        log = self.logs / "install.log"
        argv = [str(self.py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                "--force-reinstall", str(self.wheel)]
        if run_logged(argv, log, env=self.env()) != 0:
            self.problem("pip install of the project's wheel", log)
            return False
        marker.write_text(want)
        return True

    def copy_tree(self) -> None:
        if self.tree.exists():
            shutil.rmtree(self.tree)
        self.tree.mkdir(parents=True)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
        for name in TREE:
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, self.tree / name, ignore=ignore)
            else:
                shutil.copy2(src, self.tree / name)

    def check_install(self) -> bool:
        """The versions are the pins, ``pip check`` is clean and the package is the installed one."""
        log = self.logs / "install.log"
        code = ("import json, sys, importlib.metadata as m, celery_zklock;"
                "print(json.dumps({'file': celery_zklock.__file__, **{d: m.version(d) for d in "
                "('celery', 'kombu', 'kazoo', 'redis', 'celery-zklock')}}))")
        out = subprocess.run([str(self.py), "-c", code], cwd=self.tree, env=self.env(), capture_output=True, text=True)
        if out.returncode != 0:
            with open(log, "a") as f:
                f.write(out.stdout + out.stderr)
            self.problem("importing celery_zklock", log)
            return False
        got = json.loads(out.stdout.strip().splitlines()[-1])
        c = self.cell
        want = {"celery": c.celery, "kombu": c.kombu, "kazoo": c.kazoo, "redis": c.redis}
        wrong = {d: got[d] for d, v in want.items() if got[d] != v}
        if wrong:
            self.problem(f"installed versions differ from the pins: {wrong}")
            return False
        if "site-packages" not in got["file"]:
            self.problem(f"celery_zklock imports from {got['file']}, not the venv's site-packages")
            return False
        if run_logged([str(self.py), "-m", "pip", "check"], log, env=self.env()) != 0:
            self.problem("pip check (a dependency's bounds are broken)", log)
            return False
        return True

    # -- (a) the subset
    def run_tests(self) -> None:
        log = self.logs / "pytest.log"
        xml = self.logs / "pytest.xml"
        say(f"{self.cell.name}: the test subset (log {log.relative_to(ROOT)})")
        argv = [str(self.py), "-m", "pytest", "-n", str(self.args.jobs), "--dist", "loadfile", "-q",
                f"--junitxml={xml}", "-o", "junit_family=xunit2", *SUBSET]
        rc = run_logged(argv, log, cwd=self.tree, env=self.env(), timeout=self.args.test_timeout)
        r = self.result
        try:
            root = ET.parse(xml).getroot()
            suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
            total = sum(int(s.get("tests", 0)) for s in suites)
            r.skipped = sum(int(s.get("skipped", 0)) for s in suites)
            r.failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
            r.passed = total - r.skipped - r.failed
        except (OSError, ET.ParseError):
            r.failed = max(r.failed, 1)
        r.tests = f"{r.passed}/{r.skipped}/{r.failed}"
        if rc != 0 or r.failed or r.passed == 0:
            self.problem(f"tests (pytest exit {rc}, {r.failed} failed)", log)
        else:
            say(f"{self.cell.name}: tests {r.passed} passed, {r.skipped} skipped")

    # -- (b), (c) the examples
    def choose_broker(self) -> str | None:
        if self.cell.broker == "redis":
            return "redis"
        if reachable(AMQP_URL):
            return "rabbitmq"
        if self.args.strict_broker:
            self.problem(f"no RabbitMQ answers at {AMQP_URL} (--strict-broker)")
            return None
        say(f"{self.cell.name}: no RabbitMQ answers at {AMQP_URL}: the examples run on Redis")
        return "redis (no rabbitmq)"

    def purge_example_queues(self, log: Path) -> None:
        code = ("import sys\nfrom kombu import Connection\n"
                "with Connection(sys.argv[1], connect_timeout=5) as conn:\n"
                "    for q in sys.argv[2:]:\n"
                "        ch = conn.channel()\n"
                "        try:\n"
                "            print(f'matrix: queue {q}: {ch.queue_purge(q)} message(s) purged')\n"
                "        except Exception as exc:\n"
                "            print(f'matrix: queue {q}: not purged ({type(exc).__name__})')\n"
                "        try:\n"
                "            ch.close()\n"
                "        except Exception:\n"
                "            pass\n")
        with open(log, "ab") as f:
            f.write(f"$ (purging {', '.join(EXAMPLE_QUEUES)} on {AMQP_URL})\n".encode())
            f.flush()
            subprocess.run([str(self.py), "-c", code, AMQP_URL, *EXAMPLE_QUEUES], env=self.env(), stdout=f,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, timeout=60)

    def run_demo(self, what: str, demo_args: list[str], timeout: float) -> str:
        """One example; its workers' banners must name the cell's broker (``--keep-logs``
        keeps their logs to be read; removed here when all is well)."""
        log = self.logs / f"{what}.log"
        env = self.env()
        env.pop("BROKER_URL", None)
        scheme = "redis://"
        if self.result.broker == "rabbitmq":
            env["BROKER_URL"], scheme = AMQP_URL, "amqp://"
            self.purge_example_queues(log)
        say(f"{self.cell.name}: {what} (python -m examples.demo {' '.join(demo_args)}; log {log.relative_to(ROOT)})")
        started = time.monotonic()
        rc = run_logged([str(self.py), "-m", "examples.demo", *demo_args, "--keep-logs"], log, cwd=self.tree, env=env,
                        timeout=timeout)
        took = time.monotonic() - started
        if rc != 0:
            self.problem(f"{what} (exit {rc})", log)
            return f"FAIL ({took:.0f}s)"
        text = log.read_text(errors="replace")
        found = re.findall(r"^Logs: (\S+)$", text, re.M)
        logdir = Path(found[-1]) if found else None
        transports = set()
        for worker_log in (logdir.glob("*.log") if logdir and logdir.is_dir() else []):
            transports |= set(re.findall(r"\.> transport:\s+(\w+://)", worker_log.read_text(errors="replace")))
        if transports != {scheme}:
            self.problem(f"{what}: the workers' broker was {sorted(transports) or 'not found in their logs'}, "
                         f"not {scheme} (logs in {logdir})")
            return f"FAIL ({took:.0f}s)"
        shutil.rmtree(logdir, ignore_errors=True)
        return f"ok ({took:.0f}s)"


# ----------------------------------------------------------------------------- the table
def table(results: list[Result], total: float) -> str:
    head = ["cell", "python", "celery", "kombu", "kazoo", "redis-py", "broker", "tests pass/skip/fail", "smoke", "beat",
            "time", "result"]
    rows = []
    for r in results:
        c = r.cell
        rows.append([c.name, r.python, c.celery, c.kombu, c.kazoo, c.redis, r.broker, r.tests, r.smoke, r.beat,
                     f"{r.seconds / 60:.1f} min", "ok" if r.ok else "FAILED"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    failed = [r for r in results if not r.ok]
    lines.append("")
    lines.append(f"{len(results)} cell(s), {len(failed)} failed, {total / 60:.1f} min in all.")
    for r in failed:
        lines.append(f"- {r.cell.name}: " + "; ".join(r.problems))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m support.matrix", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", help="comma-separated cell names (default: all; see --list)")
    parser.add_argument("--list", action="store_true", help="list the cells and exit")
    parser.add_argument("--jobs", type=int, default=2, help="pytest-xdist workers for the subset (default 2)")
    parser.add_argument("--test-timeout", type=float, default=900, help="seconds before the subset is stopped (900)")
    parser.add_argument("--skip-tests", action="store_true", help="only the examples (b, c)")
    parser.add_argument("--skip-smoke", action="store_true", help="only the test subset (a)")
    parser.add_argument("--strict-broker", action="store_true",
                        help="fail a RabbitMQ cell when no RabbitMQ answers, instead of using Redis")
    args = parser.parse_args(argv)

    if args.list:
        for c in CELLS:
            print(f"{c.name:10} Python {c.python:5} celery {c.celery:6} kombu {c.kombu:6} kazoo {c.kazoo:7} "
                  f"redis {c.redis:6} {c.broker:9} {c.note}")
        return 0
    by_name = {c.name: c for c in CELLS}
    names = [n.strip() for n in args.cells.split(",") if n.strip()] if args.cells else list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        parser.error(f"unknown cell(s) {', '.join(unknown) or '(none)'}; cells: {', '.join(by_name)}")

    started = time.monotonic()
    MATRIX.mkdir(exist_ok=True)
    wheel = build_wheel(MATRIX / "build.log")
    say(f"cells: {', '.join(names)}; wheel {wheel.name} ({wheel.parent.name})")
    results = []
    try:
        for name in names:
            say(f"--- {name}")
            results.append(CellRun(by_name[name], wheel, args).run())
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    text = table(results, time.monotonic() - started)
    print()
    print(text, flush=True)
    (MATRIX / "last.md").write_text(f"# make matrix, {time.strftime('%Y-%m-%d %H:%M')}\n\n{text}\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
