# Each target does all of its own set-up on a fresh machine: it creates .venv and installs the
# pinned dependencies (requirements.lock) before acting.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# torch-xla 2.9 needs torch 2.9: the TPU stack lives in a second environment with its own pins.
VENV_XLA := .venv-xla
BIN_XLA := $(VENV_XLA)/bin
STAMP_XLA := $(VENV_XLA)/.installed
# The XLA tests run the backend for real on PJRT's CPU client, with 4 devices standing in for a
# TPU host's chips.
XLA_TEST_ENV := PJRT_DEVICE=CPU CPU_NUM_DEVICES=4

.PHONY: demo test test-xla install install-xla clean

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip==26.3"
	$(BIN)/python -m pip install --progress-bar off -c requirements.lock -e '.[dev]'
	touch $(STAMP)

install-xla: $(STAMP_XLA)

$(STAMP_XLA): pyproject.toml requirements-xla.lock
	$(PYTHON) -m venv $(VENV_XLA)
	$(BIN_XLA)/python -m pip install --quiet --upgrade "pip==26.3"
	$(BIN_XLA)/python -m pip install --progress-bar off -c requirements-xla.lock -e '.[tpu,dev]'
	touch $(STAMP_XLA)

demo: $(STAMP)
	$(BIN)/vitray demo

# The main suite (its `xla` tests are skipped there), then the `xla` tests in .venv-xla.
test: $(STAMP) $(STAMP_XLA)
	$(BIN)/python -m pytest -q
	$(MAKE) test-xla

test-xla: $(STAMP_XLA)
	$(XLA_TEST_ENV) $(BIN_XLA)/python -m pytest -q -m xla

clean:
	rm -rf $(VENV) $(VENV_XLA) .pytest_cache demo-output
