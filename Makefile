# The two set-up commands of the README. Each creates .venv on first use.
#   make demo   - the main job: train a small GPT-2 on a local 4-node simulation (embedded etcd,
#                 one torchrun per node), SIGKILL one node mid-run, keep training, print a summary;
#                 each run starts clean (its checkpoint dir, DEMO_CKPT, is removed first)
#   make test   - the test suite (what CI runs, after make lint)
#   make test-all - the suite and the extended multi-process tests
#   make lint   - ruff check, ruff format --check and mypy on oobleck_elastic/ (settings in pyproject.toml)
# On a CPU machine torch is pinned to the local CPU build; on a GPU machine use e.g.
#   make TORCH=torch test
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_CKPT ?= checkpoints/demo
PY := $(VENV)/bin/python

.PHONY: demo test test-all lint chaos bench clean

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
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-all: $(VENV)/.installed
	$(PY) -m pytest -q -m "not chaos" $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

chaos: $(VENV)/.installed
	$(PY) -m pytest -q -m chaos -s tests/test_chaos.py

bench: $(VENV)/.installed
	$(PY) -m bench planner

clean:
	rm -rf $(VENV) .oobleck-cache .pytest_cache
