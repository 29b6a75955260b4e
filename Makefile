# One command sets up and tests (`make test`); one runs the demo pipeline (`make demo`).
# Everything installs into .venv from PyPI; the Kafka jars come from Maven Central on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# The tests run in this many pytest-xdist processes: most of the suite waits (on brokers, worker
# subprocesses, fault timers), so on 2 cores four processes keep both busy. Each process is a
# test session of its own with its own local broker (tests/integration/conftest.py);
# `--dist loadgroup` keeps the tests that share a module's broker or cluster (their xdist_group
# mark) in one process. PYTEST_WORKERS=0 runs serially.
PYTEST_WORKERS ?= 4
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup

.PHONY: setup prometheus test test-fast lint demo clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# The Prometheus server of tests/integration/test_prometheus.py (Debian's package; needs root or
# sudo). Skipped when already installed. Outside CI a failed install only skips that test; in CI
# (CI=true) it fails the build, as the test itself would.
prometheus:
	@deploy/install-prometheus.sh || { [ "$${CI:-}" != "true" ] && \
		echo "make: Prometheus not installed; tests/integration/test_prometheus.py will skip" >&2; }

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint prometheus
	$(BIN)/python -m pytest $(XDIST)

# Everything but the slow fault tests: a few minutes, for the edit-test loop.
test-fast: lint
	$(BIN)/python -m pytest $(XDIST) -m "not slow"

demo: setup
	$(BIN)/detok demo

clean:
	rm -rf $(VENV) .kafka-local deploy/kafka-local/lib
