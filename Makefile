# The two set-up commands of the README. Each creates .venv on first use.
#   make demo   - the main job (today: plan GPT-3 175B on 1,024 nodes, then a local 3-node job with
#                 the probe worker: a 4th node joins, one node is SIGKILLed, the job re-plans)
#   make test   - the test suite (what CI runs)
# On a CPU machine torch is pinned to the local CPU build; on a GPU machine use e.g.
#   make TORCH=torch test
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
PY := $(VENV)/bin/python

.PHONY: demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/oobleck plan --config configs/gpt3-175b.yaml --nodes 1024
	@echo
	$(PY) -m launcher.local --nodes 3 --join 5 --kill 1@40 --rdzv-conf lease_ttl=2,settle=0.2,last_call_timeout=0.5 \
		-- examples/probe.py --config configs/gpt2-tiny.yaml --steps 60 --step-time 0.2

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) bench/planner.py

clean:
	rm -rf $(VENV) .oobleck-cache .pytest_cache
