# Each target does all of its own set-up on a fresh machine: it creates .venv and installs the
# pinned dependencies (requirements.lock) before acting.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# One environment for everything, torch-xla included: torch-xla 2.9 (its last release) needs
# torch 2.9, so the whole project is pinned to torch 2.9.1. (Two environments, one per torch, took
# about 15 GB of disk; one takes about 8.) pip installs uv (below), and the whole environment where
# uv cannot: no pip cache then (the wheels are not kept twice), and pip holds every downloaded wheel
# (about 4 GB) until the install ends; where /dev/shm is writable they wait there, in memory, so
# that the disk's peak is the environment alone.
PIP_TMPDIR := $(shell [ -d /dev/shm ] && [ -w /dev/shm ] && echo /dev/shm || echo $${TMPDIR:-/tmp})
PIP_INSTALL := TMPDIR=$(PIP_TMPDIR) $(BIN)/python -m pip install --no-cache-dir --progress-bar off
# The XLA tests run the backend for real on PJRT's CPU client, with 4 devices standing in for a
# TPU host's chips. PJRT's client is made once per process: every test process gets the same setting.
XLA_TEST_ENV := PJRT_DEVICE=CPU CPU_NUM_DEVICES=4

.PHONY: demo test test-xla lint format docs gpu-kit install clean

install: $(STAMP)

# uv (pinned, put in the environment by pip) installs the locked packages: about 1 minute on CI's
# two cores, where pip took 2.5 (it downloads and unpacks on one core). Its cache lives in .venv for
# the install only, hardlinked into the environment (so the disk's peak is the environment alone),
# and goes at the end; the bytecode is compiled at install, as pip does, not by the first imports of
# the tests' processes. Where uv cannot reach the index (a mirror set up for pip alone), pip installs.
# setup.py builds the one C extension (data/_jpeg_region.c) into data/ at install.
UV_INSTALL := UV_CACHE_DIR=$(VENV)/.uv-cache $(BIN)/uv pip install --python $(BIN)/python --link-mode=hardlink \
	--compile-bytecode
$(STAMP): pyproject.toml requirements.lock setup.py data/_jpeg_region.c
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --quiet --upgrade "pip==26.3" "uv==0.13.9"
	$(UV_INSTALL) -c requirements.lock -e '.[dev,xla]' || $(PIP_INSTALL) -c requirements.lock -e '.[dev,xla]'
	rm -rf $(VENV)/.uv-cache
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/vitray demo

# The whole suite on two pytest-xdist workers, a test module to each at a time (module-wide fixtures
# stay shared): the end-to-end runs spend much of their time waiting (on Ray's start-up and polls,
# on held steps), and on CI's two cores the suite took ~16% less time so (session 13: 26:42 against
# ~32 min). The `xla` tests run in the same workers: each worker is a process of its own, and both
# start PJRT's CPU client with the same 4 devices (XLA_TEST_ENV) if they start it at all; run
# after the rest, they left a CPU idle a third of their 3-4 minutes (session 15). Modules are
# handed out costliest first (tests/conftest.py's COSTLIEST_FIRST; --no-loadscope-reorder keeps
# that order): ordered by their number of tests instead, the longest modules came last and one
# worker ran alone for the suite's last minutes.
test: $(STAMP)
	$(XLA_TEST_ENV) $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-xla: $(STAMP)
	$(XLA_TEST_ENV) $(BIN)/python -m pytest -q -m xla

# The formatter and the linter (ruff, configured in pyproject.toml); CI runs `lint` before the tests.
lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

# Rewrites the tree in the house format and applies the linter's safe fixes.
format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# docs/configuration.md from the config models (tests/test_docs.py fails when it is out of date).
docs: $(STAMP)
	$(BIN)/python -m vitray.cli.config_reference > docs/configuration.md.tmp
	mv docs/configuration.md.tmp docs/configuration.md

# .gpu-kit/ for a device call (carry [".gpu-kit"], then `source .gpu-kit/env.sh || exit 1;`): the shared
# kit made to fit this project's layout, with torchao for the device's torch and pytest
# (benchmarks/gpu_kit.sh says what and why).
gpu-kit: $(STAMP)
	bash benchmarks/gpu_kit.sh

clean:
	rm -rf $(VENV) .pytest_cache demo-output
