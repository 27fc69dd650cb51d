# Two commands work on a fresh machine with nothing but Python and pip:
#   make demo   sets up .venv and trains the reference GPT on the synthetic task in 4 local CPU processes
#   make test   sets up .venv and runs the whole test suite
# make lint: ruff (lint + format check) and the type checker; CI runs it before the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1)

DEMO_ARGS := --set layout.tp=2

.PHONY: setup demo test lint format bench clean

setup: $(STAMP)

$(STAMP):
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(BIN)/plait train $(DEMO_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check plait tests benchmarks
	$(BIN)/ruff format --check plait tests benchmarks

format: $(STAMP)
	$(BIN)/ruff check --fix plait tests benchmarks
	$(BIN)/ruff format plait tests benchmarks

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) runs .pytest_cache
