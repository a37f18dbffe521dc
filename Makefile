# The two commands of the README: `make demo` and `make test`.  `.ci/run` calls `make test`.
PY := .venv/bin/python
PYTEST_ARGS ?=
# `make test` runs the suite on 3 pytest-xdist workers (the tests mostly wait on real
# processes, so 3 pay on 2 cores): a module's tests stay on one worker, tests/faults/ and
# tests/docker/ each stay whole (tests/conftest.py).  `make test PARALLEL=` runs it serially.
PARALLEL ?= -n 3 --dist loadfile

.PHONY: setup lint test test-all demo bench clean sim sim-mutants matrix

setup:
	@bash scripts/bootstrap.sh

# mypy (strict on the public API) on the package and ruff (pyflakes, bugbear, import order)
# on the package, tests/, sim/, bench/, examples/, compat/ and support/, as pyproject.toml
# configures them; both run, and either failing fails the target.
lint: setup
	@$(PY) -m mypy; m=$$?; $(PY) -m ruff check celery_zklock tests sim bench examples compat support; r=$$?; \
	  [ $$m = 0 ] && [ $$r = 0 ]

# scripts/docker-setup.sh: the engine, images for tests/docker/ (or one line saying why they
# are skipped); `stop` stops the engine only if that script started it.  ZKLOCK_DOCKER_READY
# tells tests/docker/ it need not run the script again.
test: setup
	@bash scripts/docker-setup.sh; \
	  ZKLOCK_DOCKER_READY=1 $(PY) -m pytest $(PARALLEL) $(PYTEST_ARGS); rc=$$?; \
	  bash scripts/docker-setup.sh stop; \
	  if [ $$rc = 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

test-all: setup
	@bash scripts/docker-setup.sh; \
	  ZKLOCK_DOCKER_READY=1 $(PY) -m pytest -m "" $(PYTEST_ARGS); rc=$$?; \
	  bash scripts/docker-setup.sh stop; exit $$rc

demo: setup
	$(PY) -m examples.demo

bench: setup
	$(PY) -m bench.run $(if $(QUICK),--quick,) $(if $(BURST),--burst $(BURST),)

clean:
	rm -rf .venv build *.egg-info .pytest_cache

# Celery's own integration tests (a subset, compat/subset.txt), stock and with every task a
# ZkLockedTask; fails on a test that passes stock but fails locked.  See compat/run.py.
.PHONY: compat
compat: setup
	$(PY) -m compat.run $(COMPAT_ARGS)

# The deterministic simulator (sim/, docs/simulation.md): the real agent, cohort and engine
# against a simulated ZooKeeper, with faults, on virtual time.  `make sim` runs the CI seeds
# (about 6 min); `make sim SEEDS=100000` the long run; `make sim SEED=n` replays one seed with
# its trace.  `make sim-mutants` checks that every planted bug (sim/mutants.py) is found.
sim: setup
	$(PY) -m sim.run $(if $(SEED),--seed $(SEED),) $(if $(SEEDS),--seeds $(SEEDS),) $(if $(FIRST),--first $(FIRST),) \
	  $(if $(SCENARIO),--scenario $(SCENARIO),) $(if $(DROP),--drop $(DROP),) $(if $(LOAD),--load $(LOAD),)

sim-mutants: setup
	$(PY) -m sim.mutants $(MUTANTS)

# The version matrix (support/matrix.py): one venv per cell in .matrix/ (git-ignored; reused
# while its pins are unchanged), the cell's Python, Celery, kombu, kazoo and redis-py pinned,
# celery-zklock installed from its wheel; in each, a subset of the suite, the flash-sale smoke
# and the elected-beat smoke.  `make matrix MATRIX_ARGS="--cells oldest,newest"`; `--list`.
matrix: setup
	$(PY) -m support.matrix $(MATRIX_ARGS)

# The soak (bench/soak.py; not run by CI): 2 workers, 40 tasks/s over 50 keys, a fault every
# 20-60 s for 40 minutes (pool process, lock agent and whole-worker SIGKILLs, SIGSTOPs,
# ZooKeeper restarts, a paused ZooKeeper proxy); fails on a task run twice, an unexplained
# loss or a stall.  `make soak SOAK_ARGS="--minutes 3 --seed 1 --broker rabbitmq"`.
.PHONY: soak
SOAK_ARGS ?=
soak: setup
	$(PY) -m bench.soak $(SOAK_ARGS)
