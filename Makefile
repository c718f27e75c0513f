# Reservoir developer entry points. `make demo` and `make test` install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CLUSTER_DIR ?= .cluster
export RESERVOIR_CLUSTER_DIR := $(abspath $(CLUSTER_DIR))

.PHONY: help venv tools cluster-up cluster-down lint test test-unit test-integration crds dashboard demo bench clean

help:
	@echo "make demo          local cluster + operator + example branching workflow + ledger"
	@echo "make test          ruff, mypy and the whole pytest suite (starts its own cluster)"
	@echo "make cluster-up    start the local control plane (idempotent), prints KUBECONFIG"
	@echo "make cluster-down  stop it, leaving no process behind"
	@echo "make crds          regenerate crds/ from the pydantic models"
	@echo "make dashboard     regenerate the Grafana dashboard from reservoir/dashboard.py"
	@echo "make bench         benchmarks vs a raw API baseline and Kueue (BENCH=full: long)"

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

tools:
	bash hack/tools/build.sh >/dev/null

cluster-up: tools
	$(PYTHON) hack/localcluster.py up --dir $(CLUSTER_DIR)

cluster-down:
	$(PYTHON) hack/localcluster.py down --dir $(CLUSTER_DIR)

lint: venv
	$(BIN)/ruff check operator tests hack examples bench
	$(BIN)/ruff format --check operator tests hack examples bench
	$(BIN)/mypy

crds: venv
	$(BIN)/python -m reservoir.crdgen crds

dashboard: venv
	$(BIN)/python -m reservoir.dashboard > charts/reservoir/files/grafana-dashboard.json

# The integration tests start (and stop) their own cluster in .cluster/test.
test: venv tools lint
	$(BIN)/pytest

test-unit: venv
	$(BIN)/pytest tests/unit

test-integration: venv tools
	$(BIN)/pytest tests/integration

demo: venv cluster-up
	bash examples/demo.sh

# Not a test: figures and ratios against a raw-API baseline (and Kueue) measured in the
# same run, on a control plane of its own (.cluster/bench, audit log on), stopped at the end.
# `make bench` is the quick run (minutes); `make bench BENCH=full` the issue's sizes (long).
# Results: bench/results/ (JSON, PNG, the operator's profile, summary.md).
BENCH ?= quick
bench: venv tools
	@$(BIN)/python -c 'import pyinstrument, matplotlib' 2>/dev/null || $(BIN)/pip install -q -e '.[dev,bench]'
	$(BIN)/python bench/run.py $(if $(filter full,$(BENCH)),--full) $(BENCH_ARGS)

clean: cluster-down
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
