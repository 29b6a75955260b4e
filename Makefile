# One command sets up and tests (`make test`); one runs the demo pipeline (`make demo`).
# Everything installs into .venv from PyPI; the Kafka jars come from Maven Central on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

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
	$(BIN)/python -m pytest

# Everything but the slow fault tests: a few minutes, for the edit-test loop.
test-fast: lint
	$(BIN)/python -m pytest -m "not slow"

demo: setup
	$(BIN)/detok demo

clean:
	rm -rf $(VENV) .kafka-local deploy/kafka-local/lib
