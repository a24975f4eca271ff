# Entry points, all safe on a fresh machine: they create .venv and install what they need first.
#   make run        - the main job (configs/tiny_cpu.yaml); installs the runtime packages only; ARGS="key=value ..."
#   make test       - the whole test suite (what CI runs); adds the test extras, torch and the target compilers
#   make test-quick - a small, fast subset of the tests (losses, masks, config, model), verbose; not what CI runs
#   make setup-targets - the TPU / GPU compilers of `stapo-jax plan --target` (libtpu, CUDA plugin; .venv/targets)
#   make soak       - the randomized multi-process soak (tests/soak.py: 8 configs x 2x2, 4x1 vs 1x4; docs/multiprocess.md)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
QUICK_TESTS := tests/algo/test_advantages.py tests/algo/test_masks.py tests/algo/test_objectives.py \
	tests/algo/test_logprobs.py tests/algo/test_diagnostics.py tests/tools/test_passk.py tests/config/test_config.py \
	tests/models/test_qwen3.py

.PHONY: run test test-quick soak setup setup-test setup-targets
setup: $(VENV)/.runtime
setup-test: $(VENV)/.test
setup-targets: $(VENV)/.targets

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

# kept out of the venv's site-packages: only `stapo-jax plan --target`'s compile subprocess puts it on its path
$(VENV)/.targets: $(VENV)/.runtime requirements-targets.txt
	$(BIN)/pip install -q --no-deps --upgrade --target $(VENV)/targets -r requirements-targets.txt
	touch $@

# ARGS: config overrides, e.g. make run ARGS="trainer.resume=false"
run: setup
	$(BIN)/stapo-jax train --config configs/tiny_cpu.yaml $(ARGS)

# two pytest-xdist workers (the CI machine's 2 cores; XLA:CPU compiles on one thread); a file stays on one worker
TEST_WORKERS ?= 2
# the whole suite also compiles for TPU / GPU targets (tests/tools/test_plan_target.py): the target compilers too
test: setup-test setup-targets
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

test-quick: setup-test
	$(BIN)/python -m pytest -v $(QUICK_TESTS)

SOAK_ARGS ?= --configs 8 --seed 0
soak: setup-test
	$(BIN)/python tests/soak.py $(SOAK_ARGS)
