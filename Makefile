# Two commands do all the set-up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
BASE   := $(VENV)/.installed-base
STAMP  := $(VENV)/.installed
PRESET ?= cartpole
ARGS   ?=
# Test workers (pytest-xdist): 2 take 0.63x the suite's serial time on 2 cores; 0: one process.
JOBS   ?= 2
# torch first: pip's default index gives Linux a CUDA build (GBs). Where torch==2.13.0 is not
# a local CPU build, choose PyTorch's CPU index, e.g.
#   make train TORCH="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH  ?= torch==2.13.0

.PHONY: venv train test test-all lint format bench clean

# What training CartPole needs: torch and the package alone.
$(BASE): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e .
	touch $(BASE)

# The full set for the suite: every env family's extra, Ray, pytest and the linters.
$(STAMP): $(BASE)
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

## Train the CartPole preset until solved (evaluation mean >= 475), with live progress.
train: $(BASE)
	$(BIN)/impala train $(PRESET) $(ARGS)

## The test suite (slow tests excluded; `make test-all` runs them too).
test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n $(JOBS) --dist worksteal $(ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n $(JOBS) --dist worksteal $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts
	PYTHONPATH=src $(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

bench: $(STAMP)
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/time_to_solve.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
