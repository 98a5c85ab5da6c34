# The README's two commands: `make demo` and `make test`. Both build .venv/ when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test soak demo bench docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,examples]'
	touch $(STAMP)

# Lint and type-check first (seconds), then the tests. mypy runs from the repo root so that
# `spotrun` resolves to this checkout (spotrun/trainer and spotrun/orchestrator are links).
test: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy spotrun/trainer spotrun/orchestrator
	$(PY) -m pytest -q -ra --durations=15 -m "not soak" tests

# The soaks: long versions of tests that `make test` runs short (the same assertions, more repetitions).
soak: venv
	$(PY) -m pytest -q -ra -m soak tests

demo: venv
	$(PY) -m spotrun.orchestrator.cli.demo

# Every benchmark, each printing its table; together they write bench/RESULTS.md and the README's
# figures (~9 min on a quiet 2-core machine).
bench: venv
	$(PY) -m bench

docs: venv
	$(VENV)/bin/spotrun inventory --markdown --write docs/STATE.md
	$(VENV)/bin/spotrun spec --markdown --write docs/SPEC.md

clean:
	rm -rf $(VENV) runs-demo .pytest_cache .mypy_cache .ruff_cache
