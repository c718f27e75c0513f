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
	@echo "make bench         settlement throughput and latency vs a raw API baseline"

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

# Not a test: figures and ratios against a raw-API baseline measured in the same run.
bench: venv cluster-up
	$(BIN)/python bench/settlement.py

clean: cluster-down
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
