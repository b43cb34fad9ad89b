# The two commands a new user needs: `make run` (the built-in demo) and `make test` (the suite).
# TORCH_SPEC picks the torch build; the default takes torch 2.13.0 from the package index (on Linux, a CUDA
# build). A CPU-only machine runs `make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"`
# (README: Quick start).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?= -m "not slow"
# pytest-xdist workers, one test file each at a time (module fixtures stay per file).
TEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: run test install install-dev lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Stamps make repeated runs fast; they are rebuilt when pyproject.toml changes.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

run: $(VENV)/.installed
	$(BIN)/verl train

# The default suite skips tests marked slow; `make test PYTEST_ARGS="-m slow"` runs those.
test: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# The speed targets on this host (benchmarks/targets.py; minutes on 2 cores); BENCH_ARGS=--write-docs writes their rows.
bench: $(VENV)/.installed-dev
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/targets.py $(BENCH_ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check verl tests benchmarks

clean:
	rm -rf $(VENV) runs .pytest_cache
