# The two entry points a fresh machine needs are `make demo` and `make test` (see README.md).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: demo test lint typecheck unit engine-env fixture docs bench clean

$(VENV)/.agentic-lora-stamp: pyproject.toml scripts/dev-env.sh
	bash scripts/dev-env.sh

dev: $(VENV)/.agentic-lora-stamp

## demo: the main job (real engines, agents, a live publication and a reclaim)
demo: dev
	bash scripts/demo.sh

## test: lint, types, and the whole test suite (unit, Ray, gloo and real-engine tests) with coverage
test: dev
	bash scripts/test.sh

lint: dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: dev
	$(VENV)/bin/mypy

unit: dev
	$(PY) -m pytest -m "not engine" -q

bench: dev
	$(PY) bench/registry.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .coverage site
