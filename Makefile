# Entry points, each doing its own set-up in .venv on a fresh machine:
#   make serve      serve the bundled example models (HTTP 8000, gRPC 8001, metrics 8002)
#   make test       run the test suite (.ci/run calls this)
#   make examples   run the example clients through the in-process API
# FRAMEWORKS=0 skips installing torch, jax and tensorflow (their tests then skip, and
# make serve's framework examples fail to load).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
FRAMEWORKS ?= 1
# torch 2.13.0 is a CPU wheel on these machines' local disk; an unpinned torch is a
# multi-GB CUDA download.
TORCH_PIN ?= torch==2.13.0

.PHONY: serve examples test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e .
	touch $@

# Each stamp names what it installed, so that a run with the other FRAMEWORKS setting
# installs what it needs rather than finding a stamp made without it.
ifeq ($(FRAMEWORKS),1)
SERVE_NEEDS := $(VENV)/.installed-frameworks
TEST_NEEDS := $(VENV)/.installed-test
else
SERVE_NEEDS := $(VENV)/.installed
TEST_NEEDS := $(VENV)/.installed-test-noframeworks
endif

$(VENV)/.installed-test: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[test,torch,jax,tensorflow]'
	touch $@

$(VENV)/.installed-test-noframeworks: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

# What the bundled framework examples import, for make serve (make test installs them
# together with the test extra, in one resolution).
$(VENV)/.installed-frameworks: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e '.[torch,jax,tensorflow]'
	touch $@

$(VENV)/.installed-examples: pyproject.toml $(VENV)/.installed
	$(BIN)/python -m pip install -q -e '.[examples]'
	touch $@

serve: $(SERVE_NEEDS)
	$(BIN)/dlserve serve $(ARGS)

examples: $(VENV)/.installed-examples
	$(BIN)/python examples/run_examples.py

test: $(TEST_NEEDS)
	VENV=$(abspath $(VENV)) scripts/setup_perf_analyzer.sh
	VENV=$(abspath $(VENV)) scripts/setup_azurite.sh
	$(BIN)/python -m pytest
