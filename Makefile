# The set-up commands of the README's quick start. Each creates .venv on first use.
#   make demo   - the main job: train a small GPT-2 on a local 4-node simulation (embedded etcd,
#                 one torchrun per node), SIGKILL one node mid-run, keep training, print a summary;
#                 each run starts clean (its checkpoint dir, DEMO_CKPT, is removed first)
#   make test   - the test suite (what CI runs, after make lint): the lanes unit, control, worlds
#                 and jobs (tests/README.md), each in its own pytest with its time printed; of the
#                 jobs lane only the tests marked core, and one rotating shard of the rest and of
#                 the extended tests in every lane, chaos seeds included (EXTENDED_SHARD, from the
#                 commit count)
#   make test-fast - the unit and control lanes: a few minutes, for the edit loop
#   make test-all - every lane, with every extended test (the chaos seeds too)
#   make chaos  - the seeded chaos lane
#   make stress - the kill, leader-kill, drain and kill-in-reconfiguration jobs, 20 runs each beside
#                 2 busy loops per core (STRESS_ARGS=--quick: 3 runs each, as CI runs it)
#   make lint   - ruff check, ruff format --check and mypy on oobleck_elastic/ (settings in pyproject.toml)
# On a CPU machine torch is pinned to the local CPU build; on a GPU machine use e.g.
#   make TORCH="torch==2.13.*" test   (the engine checks torch 2.13's internals at start)
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
STRESS_ARGS ?=
# chaos: only its extended seeds of the shard (the chaos-marked test runs by hand: make chaos)
LANES ?= unit control worlds jobs chaos
# the extended tests run in CI in EXTENDED_SHARDS turns: shard (commits on HEAD) mod EXTENDED_SHARDS
EXTENDED_SHARDS ?= 12
EXTENDED_SHARD ?= $(shell n=$$(git rev-list --count HEAD 2>/dev/null || date +%j); echo $$((n % $(EXTENDED_SHARDS)))/$(EXTENDED_SHARDS))
DEMO_CKPT ?= checkpoints/demo
PY := $(VENV)/bin/python

.PHONY: demo test test-fast test-all lint chaos stress bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

# each demo starts clean: it trains from step 0 into its own checkpoint dir, removed first (a resumed
# run with no step left would stop at once with "nothing to do")
demo: $(VENV)/.installed
	rm -rf $(DEMO_CKPT)
	$(PY) -m launcher.local --nodes 4 --kill 1@8 --rdzv-conf lease_ttl=2,settle=0.2,last_call_timeout=1 \
		-- examples/train.py --config configs/gpt2-demo.yaml checkpoint.dir=$(DEMO_CKPT)

test: $(VENV)/.installed
	$(PY) tests/run_lanes.py --shard $(EXTENDED_SHARD) $(LANES) -- $(PYTEST_ARGS)

test-fast: $(VENV)/.installed
	$(PY) tests/run_lanes.py unit control -- $(PYTEST_ARGS)

test-all: $(VENV)/.installed
	$(PY) tests/run_lanes.py --all-extended $(LANES) -- $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

chaos: $(VENV)/.installed
	$(PY) -m pytest -q -m chaos -s tests/chaos

stress: $(VENV)/.installed
	$(PY) -m bench stress $(STRESS_ARGS)

bench: $(VENV)/.installed
	$(PY) -m bench planner

clean:
	rm -rf $(VENV) .oobleck-cache .pytest_cache
