"""The simulator itself (sim/, docs/simulation.md): it replays a seed exactly, its first CI
seeds pass on this code, every planted bug still applies, and planted bugs are found.

The full CI run of the simulator is `make sim` (its own step in .ci/run); these are the
quick checks that keep it honest inside `make test`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim.mutants import MUTANTS, apply

ROOT = Path(__file__).resolve().parent.parent


def _sim(*args: str, module: str = "sim.run") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_a_seed_replays_exactly_with_its_trace():
    first, second = _sim("--seed", "43"), _sim("--seed", "43")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert first.stdout == second.stdout
    lines = first.stdout.splitlines()
    assert len(lines) > 1000 and lines[-1].startswith("seed 43: ok")
    assert any("-> create" in line for line in lines) and any("<- watch" in line for line in lines)


def test_the_first_seeds_pass_on_this_code():
    done = _sim("--seeds", "25")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "25 random seeds" in done.stdout and "directed scenarios" in done.stdout and "no violation" in done.stdout


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_every_planted_bug_still_applies(mutant, tmp_path):
    """A mutant whose target text moved would silently test nothing: each applies once."""
    target = tmp_path / mutant.path
    target.parent.mkdir(parents=True, exist_ok=True)  # a module at the package top
    target.write_text((ROOT / "celery_zklock" / mutant.path).read_text())
    apply(mutant, tmp_path)
    assert target.read_text() != (ROOT / "celery_zklock" / mutant.path).read_text()


def test_planted_bugs_are_found_and_reported_with_their_seed():
    found = _sim("same-token", "delete-first", "--seeds", "10", module="sim.mutants")
    assert found.returncode == 0, found.stdout + found.stderr
    assert "found    same-token" in found.stdout and "found    delete-first" in found.stdout
    assert "2/2 found" in found.stdout


def test_a_planted_bug_outside_the_simulator_is_found_by_its_tests():
    """The enqueue guards are not simulated: their mutants name the real-ZooKeeper tests that
    must fail on the mutated copy (and check that the copy is what those tests import)."""
    found = _sim("misplaced-confirm", module="sim.mutants")
    assert found.returncode == 0, found.stdout + found.stderr
    assert "found    misplaced-confirm    by test_a_late_confirm" in found.stdout, found.stdout


def test_a_violation_fails_the_run_and_names_its_seed(tmp_path):
    """What CI sees: the mutated copy fails `python -m sim.run` with the seed and a replay line."""
    import shutil

    shutil.copytree(ROOT / "celery_zklock", tmp_path / "celery_zklock")
    apply(next(m for m in MUTANTS if m.name == "same-token"), tmp_path / "celery_zklock")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "PYTHONHASHSEED": "0"}
    done = subprocess.run([sys.executable, "-m", "sim.run", "--seeds", "3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "VIOLATION at seed 1" in done.stdout and "make sim SEED=1" in done.stdout
    assert "tokens must increase" in done.stdout


@pytest.mark.parametrize("name,scenario,says", [
    ("reconnect-keeps-held", "held-aside-rabbitmq-cut", "held aside when its connection was lost"),
    ("success-unknown", "held-aside-rabbitmq-cut", "from a redelivered copy, after its run"),
    ("rejects-counted", "held-aside-rabbitmq-cut", "as gone back to the broker, which took 0 back"),
    ("reconnect-keeps-grant", "held-aside-reconnect", "at quiescence"),
    ("reconnect-republishes-parked", "held-aside-reconnect", "lost: its body never ran"),
])
def test_broker_reconnection_bugs_are_found_in_their_scenario(name, scenario, says, tmp_path):
    """The main process's held-aside logic against a broker model that loses connections
    (issue 59 item 6): each planted bug fails a few seeds of its directed scenario alone."""
    done = _mutant_in_scenario(name, scenario, tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"(scenario {scenario})" in done.stdout and says in done.stdout, done.stdout[:3000]


def test_a_lease_that_ends_at_the_hand_over_is_found_in_its_scenario(tmp_path):
    """A granted request waiting for a busy pool keeps its Redis lease until a pool process
    takes it: with the lease ended at the hand-over (lease-ends-at-hand-over), the scenario
    held-aside-busy-pool, whose tasks keep no result, sees the swept-back message run twice
    (the random seeds' pools take a handed request within the lease)."""
    done = _mutant_in_scenario("lease-ends-at-hand-over", "held-aside-busy-pool", tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "(scenario held-aside-busy-pool)" in done.stdout and "body runs twice" in done.stdout, done.stdout[:3000]


def _mutant_in_scenario(name: str, scenario: str, tmp_path):
    """15 seeds of ``scenario`` alone on a copy of the package with the mutant ``name`` planted."""
    import shutil

    shutil.copytree(ROOT / "celery_zklock", tmp_path / "celery_zklock")
    apply(next(m for m in MUTANTS if m.name == name), tmp_path / "celery_zklock")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "PYTHONHASHSEED": "0"}
    return subprocess.run([sys.executable, "-m", "sim.run", "--scenario", scenario, "--seeds", "15", "--no-shrink"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_create_in_flight_at_a_reconnection_is_found_in_its_scenario(tmp_path):
    """A create whose reply is lost with its connection, the connection made again at once
    (kazoo's next server) before the completion thread reads the failure: random seeds seldom
    reach that window, the scenario create-reply-lost does at every seed.  The attempt must
    wait for the create's own failure, not send it again at CONNECTED (ghost-twice)."""
    done = _mutant_in_scenario("ghost-twice", "create-reply-lost", tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "VIOLATION at seed 1 (scenario create-reply-lost)" in done.stdout, done.stdout[:3000]


@pytest.mark.parametrize("name,scenario,says", [
    ("reader-ignores-writer", "readers-writers", "(exclusive) queues ahead of it|a write hold overlaps reads"),
    ("writer-watches-like-a-reader", "readers-writers", "after it became first in line|(a writer) starved"),
    ("rlock-exclusive", "readers-writers", "readers never wait for readers"),
    ("reader-digits", "readers-writers-wrap", "(exclusive) queues ahead of it|a write hold overlaps reads"),
])
def test_read_write_lock_bugs_are_found_in_their_scenario(name, scenario, says, tmp_path):
    """Readers and writers at the engine's level (issue 62): a reader beside a write, a writer
    that waits for good first in line, readers that wait for readers, a reader past the
    sequence's wrap: each planted bug fails a few seeds of its directed scenario alone (the
    random seeds have no readers)."""
    done = _mutant_in_scenario(name, scenario, tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"(scenario {scenario})" in done.stdout, done.stdout[:3000]
    assert any(one in done.stdout for one in says.split("|")), done.stdout[:3000]
