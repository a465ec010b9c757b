# The two set-up commands of the README. Each creates .venv on first use.
#   make demo   - the main job (today: plan a tiny GPT-2 on 4 nodes and GPT-3 175B on 1,024 nodes)
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
	$(VENV)/bin/oobleck plan --config configs/gpt2-tiny.yaml --nodes 4
	@echo
	$(VENV)/bin/oobleck plan --config configs/gpt3-175b.yaml --nodes 1024

test: $(VENV)/.installed
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed
	$(PY) bench/planner.py

clean:
	rm -rf $(VENV) .oobleck-cache .pytest_cache
