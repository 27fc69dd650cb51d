# Two commands work on a fresh machine with nothing but Python and pip:
#   make demo   sets up .venv and trains the reference GPT on the synthetic task in 4 local CPU processes
#   make test   sets up .venv and runs the whole test suite
# make lint: ruff (lint + format check) and the type checker; CI runs it before the tests.
# make test-long: the long sweeps (marker long: randomised parity, the slow adversarial cases) that CI leaves out;
#   make parity-fuzz and make test-adversarial run one family each (docs/testing.md).
# make test-ft: per-step fault tolerance (tests/test_ft*.py), its long fault scenarios included (docs/fault_tolerance.md).
# make test-docs: every block of README.md and docs/ run page by page (tests/test_docs.py, marker docs), scaled down
#   (PLAIT_DOCS_SCALE=ci, the default; PLAIT_DOCS_SCALE=full runs them as written); CI runs their checks and quick blocks.
# make test-gpu: the GPU tests (tests/gpu, marker cuda) on a machine with CUDA; skipped with the reason elsewhere.
# make test-min-torch: a fast subset on the lowest supported torch (MIN_TORCH) in its own venv, where that torch
#   installs (PyPI has no CPU build of it: its CUDA wheel and nvidia-* dependencies, 3.4 GB, run on CPU too; docs/testing.md).
# make test-max-torch: the same subset on the newest torch the pin allows (MAX_TORCH: what `pip install plait` picks)
#   in .venv-max-torch (its CUDA 13 build and nvidia-* dependencies, 6.2 GB installed, run on CPU too; docs/testing.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml 2>/dev/null | cksum | cut -d' ' -f1)

DEMO_ARGS := --set layout.tp=2
MIN_TORCH := 2.11.0
MIN_VENV := .venv-min-torch
MAX_TORCH := 2.14.1
MAX_VENV := .venv-max-torch
MIN_TORCH_TESTS := tests/test_layout.py tests/test_comm.py tests/test_engine.py tests/test_hot_path.py \
	tests/test_backend.py tests/test_compile.py tests/test_checkpoint.py tests/test_pipeline_schedule.py

.PHONY: setup demo test test-long test-ft test-docs parity-fuzz test-adversarial test-gpu test-min-torch test-max-torch lint format bench clean

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
	$(BIN)/python -m pytest -q -m "not long"

test-long: $(STAMP)
	$(BIN)/python -m pytest -q -m "long and not docs"

test-ft: $(STAMP)
	$(BIN)/python -m pytest -q -m "long or not long" $(wildcard tests/test_ft*.py)

PLAIT_DOCS_SCALE ?= ci
test-docs: $(STAMP)
	PLAIT_DOCS_SCALE=$(PLAIT_DOCS_SCALE) $(BIN)/python -m pytest -q -m docs tests/test_docs.py

parity-fuzz: $(STAMP)
	$(BIN)/python -m pytest -q -m long tests/test_parity_fuzz.py

test-adversarial: $(STAMP)
	$(BIN)/python -m pytest -q -m adversarial

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m cuda tests/gpu

# A venv with one torch version and the subset run on it: $(1) the venv, $(2) torch's version, $(3) the target.
define torch_subset
$(1)/.installed-$(2):
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet torch==$(2)
	$(1)/bin/python -m pip install --quiet -e '.[test]'
	touch $$@

$(3): $(1)/.installed-$(2)
	$(1)/bin/python -c "import torch; assert torch.__version__.startswith('$(2)'), torch.__version__"
	$(1)/bin/python -m pytest -q -x $(MIN_TORCH_TESTS)
endef
$(eval $(call torch_subset,$(MIN_VENV),$(MIN_TORCH),test-min-torch))
$(eval $(call torch_subset,$(MAX_VENV),$(MAX_TORCH),test-max-torch))

lint: $(STAMP)
	$(BIN)/ruff check plait tests benchmarks
	$(BIN)/ruff format --check plait tests benchmarks
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff check --fix plait tests benchmarks
	$(BIN)/ruff format plait tests benchmarks

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run

clean:
	rm -rf $(VENV) $(MIN_VENV) $(MAX_VENV) runs .pytest_cache
