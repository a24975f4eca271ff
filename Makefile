# Two entry points, both safe on a fresh machine: they create .venv and install everything first.
#   make run   - the main job (configs/tiny_cpu.yaml)
#   make test  - the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: run test setup setup-test
setup: $(VENV)/.runtime
setup-test: $(VENV)/.test

$(VENV)/.runtime: requirements.txt requirements-jetstream.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -r requirements-jetstream.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements-test.txt requirements-peers.txt
	$(BIN)/pip install -q -r requirements-test.txt
	$(BIN)/pip install -q --no-deps -r requirements-peers.txt
	touch $@

run: setup
	$(BIN)/stapo-jax train --config configs/tiny_cpu.yaml

test: setup-test
	$(BIN)/python -m pytest -q tests
